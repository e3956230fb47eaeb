"""The default job's providers: the reference model (and the check of a source checkpoint's config) and the corpus."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9dfn._types import PathPredicate
from d9dfn.data import ByteTokenizer, Tokenizer
from d9dfn.jobs._config import CorpusConfig, DataConfig, ModelConfig, MoEConfig
from d9dfn.jobs._corpus import ByteWindowDataset, TokenWindowDataset, stdlib_corpus, token_stream
from d9dfn.jobs._files import FilesConfig, FilesProvider
from d9dfn.loop import (
    InitializeDatasetContext,
    InitializeDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    PrepareLoadModelStageResult,
)
from d9dfn.models import (
    FAMILIES,
    HF_FAMILIES,
    HF_FIELDS,
    PeftMethod,
    Qwen3Config,
    adapter_plan,
    apply_peft,
    check_hf_config,
    logical_dims,
    num_parameters,
    peft_trainable,
    summed_dims,
)
from d9dfn.pipeline import PipelineStageInfo

__all__ = ["CorpusProvider", "Qwen3Provider", "check_source_config", "data_provider"]


class Qwen3Provider(ModelProvider):
    """Builds the model of ``family`` (a name in ``d9dfn.models.FAMILIES``, ``model.family``) from its config; a
    Hugging Face source checkpoint must be of that family, and its tensor names are mapped by it. With ``peft``
    (``trainer.peft``) the model carries their adapters (``d9dfn.models.apply_peft``), the source need not hold them,
    and only what they train trains (:meth:`parameters_to_train`)."""

    def __init__(
        self,
        config: Qwen3Config,
        family: str = "qwen3",
        *,
        source: Path | None = None,
        peft: Sequence[PeftMethod] = (),
    ) -> None:
        self.config = config
        self.family = family
        self.source = source
        """The Hugging Face folder the model comes from (``model.source``), for messages; ``None``: the job's sizes."""
        self.peft = tuple(peft)
        """The fine-tuning methods (``trainer.peft``), checked against the whole model by the job first."""

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        """The whole model, or stage ``context.stage_index`` of ``context.num_stages`` (full param names)."""
        if context.num_stages > 1 and self.config.tie_word_embeddings:
            raise ValueError(
                f"Qwen3Provider: trainer.pipelining splits the model into {context.num_stages} stages, but "
                "model.tie_word_embeddings=true shares the embedding (first stage) with the LM head (last stage); "
                "set model.tie_word_embeddings=false (--set model.tie_word_embeddings=false)"
            )
        stage = PipelineStageInfo(current_stage=context.stage_index, num_stages=context.num_stages)
        model = FAMILIES[self.family].model(self.config, stage)
        if self.peft:  # a stage holds part of the model: the job checked the targets on the whole one
            model = apply_peft(model, self.peft, check=False)
        return InitializeModelStageResult(model=model)

    def logical_dims(self, context: InitializeModelStageContext, model: nn.Module) -> dict[str, tuple[str, ...]] | None:
        """The family's plan's logical dimensions of every param (``d9dfn.models.logical_dims``): what the parallel
        plan's rules split (expert parallelism: the ``experts`` dimension; tensor parallelism: heads, kv-heads, the MLP
        width). With ``trainer.peft`` the adapters' dims are their bases' (``d9dfn.models.adapter_plan``): split with
        their base over ``tp``, replicated beside experts split over ``ep``."""
        plan = FAMILIES[self.family].plan
        return logical_dims({**plan, **adapter_plan(plan)[0]} if self.peft else plan, dict(model.named_parameters()))

    def summed_dims(self, context: InitializeModelStageContext, model: nn.Module) -> dict[str, tuple[str, ...]] | None:
        """The family's ``sums_over`` for the model's params (``d9dfn.models.summed_dims``: the per-head norms), and
        with ``trainer.peft`` the adapters' (``d9dfn.models.adapter_plan``: a factor kept whole beside its split
        partner sums over the partner's split)."""
        family = FAMILIES[self.family]
        sums = {**family.sums_over, **adapter_plan(family.plan)[1]} if self.peft else family.sums_over
        return summed_dims(sums, dict(model.named_parameters()))

    def parameters_to_train(self, context: InitializeModelStageContext) -> PathPredicate | None:
        """With ``trainer.peft``, the adapters and the ``full`` targets (``d9dfn.models.peft_trainable``); else every
        param."""
        return peft_trainable(self.peft) if self.peft else None

    def prepare_load_model_stage(self, context: InitializeModelStageContext) -> PrepareLoadModelStageResult:
        """Reads ``d9dfn export`` folders (either format) and Hugging Face folders of the family, checking their
        config."""
        config, family = self.config, self.family
        from_hf_state = FAMILIES[family].from_hf_state
        return PrepareLoadModelStageResult(
            state_mapper=lambda state: from_hf_state(state, config),
            check_config=lambda found: check_source_config(config, found, family=family),
            # The adapters and the experts' balancing bias start from their own init: a Hugging Face folder (or a
            # base checkpoint) does not hold them.
            not_in_source=_is_adapter_or_bias if self.peft else _is_balancing_bias,
        )

    def dump_hparams(self) -> dict[str, Any]:
        peft = {"peft": [dataclasses.asdict(m) | {"method": type(m).__name__} for m in self.peft]} if self.peft else {}
        return {"family": self.family, **dataclasses.asdict(self.config), **peft}

    def num_params(self) -> int | None:
        """The model's parameters, from its config's arithmetic (``d9dfn.models.num_parameters``): the memory check
        runs before any module is built. ``None`` with ``trainer.peft``: that early check counts every parameter as
        trainable (gradients, optimizer state) and would refuse a LoRA run that fits; the check on the skeleton, over
        the params the state trains, follows before anything is allocated."""
        return None if self.peft else num_parameters(self.config)

    def memory_hint(self, model: torch.nn.Module | None) -> str:
        """The ``model.*`` setting whose default would shrink the model most, with the size it would have then."""
        if self.source is not None:  # the sizes are the folder's: no model.* setting changes them
            return (
                f"the model of model.source {self.source} has {num_parameters(self.config):.3g} parameters: point "
                "model.source at a smaller model, or shard it (mesh)"
            )
        defaults = ModelConfig()
        smaller: dict[str, int] = {}  # setting -> parameters with it at its default
        for name in _SIZE_FIELDS:
            if getattr(self.config, name) > getattr(defaults, name):
                try:  # arithmetic, not a meta model: a model of 100,000 layers takes minutes to build even there
                    smaller[name] = num_parameters(dataclasses.replace(self.config, **{name: getattr(defaults, name)}))
                except ValueError:  # e.g. num_heads back at 4 with num_kv_heads=3: not a model
                    continue
        if not smaller:
            return f"lower {', '.join(f'model.{name}' for name in _SIZE_FIELDS)} (--set), or shard the model (mesh)"
        name = min(smaller, key=smaller.__getitem__)
        return (
            f"lower model.{name} (it is {getattr(self.config, name)}; with the default {getattr(defaults, name)} the "
            f"model has {smaller[name]:.3g} parameters), e.g. --set model.{name}={getattr(defaults, name)}"
        )


def _is_adapter(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B")


def _is_balancing_bias(name: str) -> bool:
    """An MoE layer's ``expert_bias`` (``model.moe.load_balance_bias_rate``): zeros at first; HF's format has none."""
    return name.endswith(".expert_bias")


def _is_adapter_or_bias(name: str) -> bool:
    return _is_adapter(name) or _is_balancing_bias(name)


_SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
"""The ``model.*`` settings that size the model's tensors."""


class CorpusProvider:
    """The stdlib corpus as windows of ``seq_len + 1`` tokens (inputs and next-token labels): bytes (the default), or
    the ids of ``tokenizer`` (a ``model.source`` folder's) over the corpus's text."""

    def __init__(self, config: CorpusConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer: Tokenizer = ByteTokenizer() if tokenizer is None else tokenizer

    def __call__(self, context: InitializeDatasetContext) -> InitializeDatasetResult:
        corpus = stdlib_corpus(max_bytes=self.config.max_bytes, validation_every=self.config.validation_every)
        data = corpus.train if context.split == "train" else corpus.validation
        if isinstance(self.tokenizer, ByteTokenizer):  # the bytes are the ids: no decoding, no encoding
            return InitializeDatasetResult(dataset=ByteWindowDataset(data, self.config.seq_len), collator=_collate)
        ids = token_stream(self.tokenizer, [data.decode("utf-8", errors="replace")])  # a file cut mid-character: U+FFFD
        what = f"the {context.split} split ({len(data)} bytes) through {self.tokenizer.name}"
        dataset = TokenWindowDataset(ids, self.config.seq_len, what=what)
        return InitializeDatasetResult(dataset=dataset, collator=_collate)


def data_provider(
    data: DataConfig, model: Qwen3Config, tokenizer: Tokenizer | None = None
) -> CorpusProvider | FilesProvider:
    """The job's dataset provider: the stdlib corpus, or your files (``data.files``), prepared at once (read,
    tokenized or read from the cache, packed) against ``model``'s vocabulary and positions, so that bad data is
    refused before anything is built. ``tokenizer``: the text's (default: UTF-8 bytes; the job passes
    ``model.source``'s)."""
    match data:
        case FilesConfig():
            return FilesProvider(data, tokenizer, vocab_size=model.vocab_size, max_positions=model.max_seq_len)
        case CorpusConfig():
            return CorpusProvider(data, tokenizer)


def _collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def check_source_config(config: Qwen3Config, found: dict[str, Any], *, family: str = "qwen3") -> None:
    """Raise unless a source checkpoint's ``config.json`` describes the model ``config`` builds; every message
    names the job's ``--set`` path that fixes it.

    An HF folder (``model_type`` present) must be of ``family`` (the job's ``model.family``) and is checked by
    :func:`d9dfn.models.check_hf_config`; d9dfn's own format (``Qwen3Config`` fields) field by field, on the
    fields that change what the model computes.

    >>> check_source_config(Qwen3Config(), {"model_type": "llama"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the HF config.json is a LlamaForCausalLM (...) but this job's ...; set --set model.family=llama
    """
    if "model_type" in found:
        model_type = found["model_type"]
        if model_type != family and model_type in HF_FAMILIES:
            raise ValueError(
                f"the HF config.json is a {HF_FAMILIES[model_type].architecture} (model_type {model_type!r}) but this "
                f"job's model.family is {family!r}; set --set model.family={model_type}"
            )
        check_hf_config(config, found, fix=_job_fix)
        return
    for name in (*HF_FIELDS, *FAMILIES[family].hf.fields):  # the family's own too (an MoE model's experts)
        value = tuple(found[name]) if isinstance(found.get(name), list) else found.get(name)
        if name in found and value != getattr(config, name):
            raise ValueError(
                f"the checkpoint's model has {name}={found[name]!r} but this job's has {getattr(config, name)!r}; "
                f"{_job_fix(name, found[name])}, or load a checkpoint of this model"
            )
    # Exports before model.family carry no switches: their names and shapes still have to fit (q_norm, biases).
    switches = {name: found[name] for name in HF_FAMILIES[family].switches() if name in found}
    ours = {name: getattr(config, name) for name in switches}
    if switches != ours:
        families = [name for name, spec in HF_FAMILIES.items() if switches.items() <= spec.switches().items()]
        fix = (
            f"set --set model.family={' or '.join(families)}"
            if families
            else "no model.family builds that: load it in Python (d9dfn.models.Qwen3LM with its config.json's fields)"
        )
        raise ValueError(
            f"the checkpoint's model has {_fields(switches)} but this job's has {_fields(ours)}; {fix}, or load a "
            "checkpoint of this model"
        )


def _fields(values: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in values.items())


def _job_fix(name: str, value: Any) -> str:
    """How the job sets ``Qwen3Config`` field ``name`` to ``value``: its ``--set`` path, or why it cannot."""
    if name == "max_seq_len":
        return f"set --set data.seq_len={value}"
    if name in ModelConfig.model_fields:
        return f"set --set model.{name}={json.dumps(value)}"
    if name in MoEConfig.model_fields:
        return f"set --set model.moe.{name}={json.dumps(list(value) if isinstance(value, tuple) else value)}"
    reason = "its vocabulary is the 256 byte values" if name == "vocab_size" else "it has no setting for it"
    return (
        f"this job cannot build {name}={value!r} ({reason}): load the folder in Python instead "
        "(d9dfn.models.from_hf_config builds the matching Qwen3Config)"
    )
