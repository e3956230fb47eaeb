"""The job's ``model.source``: a Hugging Face folder's model settings put into the job, and its tokenizer.

:func:`resolve_source` runs first in every command (train, infer, export, ``load_model``): it reads the folder's
``config.json``, refuses a ``model.*`` setting given explicitly with another value than the folder's and a tokenizer
whose ids do not fit the embedding, and returns the job with the folder's family and sizes in ``model.*`` (what the
run's ``job.json`` then records) and the tokenizer its text goes through (:meth:`d9dfn.data.HFTokenizer.from_folder`).
Each refusal is one line naming the file and the fix, raised before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

from d9dfn.data import ByteTokenizer, HFTokenizer, Tokenizer
from d9dfn.jobs._config import ModelConfig, MoEConfig

__all__ = ["FROM_SOURCE", "resolve_source"]

FROM_SOURCE = (
    "family",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
)
"""The ``model.*`` settings a ``model.source`` folder decides (``dropout`` stays the job's)."""


def _experts(model: ModelConfig, config: Any) -> MoEConfig:
    """The folder's experts, with the training settings (:attr:`MoEConfig.TRAINING`) the job sets; any other
    ``model.moe.*`` the job sets must be the folder's."""
    folder = MoEConfig(**{name: getattr(config, name) for name in MoEConfig.model_fields})
    if model.moe is None:
        return folder
    for name in sorted(model.moe.model_fields_set - set(MoEConfig.TRAINING)):
        if getattr(model.moe, name) != getattr(folder, name):
            raise _contradicts(model, f"model.moe.{name}", getattr(model.moe, name), getattr(folder, name))
    training = {name: getattr(model.moe, name) for name in MoEConfig.TRAINING if name in model.moe.model_fields_set}
    return folder.model_copy(update=training)


def _contradicts(model: ModelConfig, path: str, ours: Any, theirs: Any) -> ValueError:
    name, source = path.rsplit(".", 1)[1], Path(str(model.source))
    ours, theirs = (list(v) if isinstance(v, tuple) else v for v in (ours, theirs))
    return ValueError(
        f"{path}={json.dumps(ours)} contradicts model.source: {source / 'config.json'} describes "
        f"{name}={json.dumps(theirs)}; drop {path} from the job (--set, config file): with model.source the "
        "model's family and sizes are the folder's"
    )


class _SeqLen(Protocol):
    @property
    def seq_len(self) -> int: ...


class _Job(Protocol):
    """What :func:`resolve_source` reads of a job: the language model's or the classification job's config."""

    @property
    def model(self) -> ModelConfig: ...

    @property
    def data(self) -> _SeqLen: ...

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Self: ...


Job = TypeVar("Job", bound=_Job)


def resolve_source(job: Job) -> tuple[Job, Tokenizer]:
    """``job`` with ``model.*`` set from its ``model.source`` folder, and the tokenizer of its text (the folder's;
    without a source the job unchanged and a :class:`~d9dfn.data.ByteTokenizer`). Any job with ``model`` (a
    :class:`~d9dfn.jobs.ModelConfig`) and ``data.seq_len``: the language model's and the classification job's.

    A setting in :data:`FROM_SOURCE` that the job gives explicitly (``--set``, a config file, a run's ``job.json``;
    pydantic's ``model_fields_set``) must equal the folder's.

    Raises:
        FileNotFoundError: no folder, no ``config.json`` or no tokenizer there.
        ValueError: a setting contradicts the folder; ``data.seq_len`` exceeds its positions; the tokenizer's ids do
            not fit its ``vocab_size``; a feature ``Qwen3LM`` lacks; ``tokenizers`` / ``transformers`` missing.
    """
    model = job.model
    if model.source is None:
        return job, ByteTokenizer()
    config = model.to_qwen3(job.data.seq_len)  # reads and checks config.json, naming it
    family = str(json.loads((model.source / "config.json").read_text())["model_type"])
    folder: dict[str, Any] = {"family": family, **{name: getattr(config, name) for name in FROM_SOURCE[1:]}}
    if hasattr(config, "num_experts"):  # an MoE family: the experts are the folder's, how they train the job's
        folder["moe"] = _experts(model, config)
    elif model.moe is not None:
        raise ValueError(
            f"model.moe is set but model.source {model.source} is a {family} model, which has no experts; drop "
            "model.moe, or name a mixture-of-experts folder (model_type qwen3_moe)"
        )
    for name in FROM_SOURCE:
        if name in model.model_fields_set and getattr(model, name) != folder[name]:
            raise _contradicts(model, f"model.{name}", getattr(model, name), folder[name])
    tokenizer = HFTokenizer.from_folder(model.source, context="model.source")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"model.source: the tokenizer {tokenizer.name} gives ids up to {tokenizer.vocab_size - 1}, but the model's "
            f"embedding has vocab_size={config.vocab_size} rows ({model.source / 'config.json'}); use the tokenizer "
            f"the model was trained with, or a model whose vocab_size is at least {tokenizer.vocab_size}"
        )
    return job.model_copy(update={"model": model.model_copy(update=folder)}), tokenizer
