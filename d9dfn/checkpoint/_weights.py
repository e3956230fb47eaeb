"""Weights from files: initial weights from a safetensors directory (``model_stage_factory.source_checkpoint``),
and a training run's weights from its checkpoints (what inference and export load).

The directory is what ``d9dfn export`` writes, or a Hugging Face-style model directory: one or more
``*.safetensors`` files whose tensor names are the model's ``state_dict`` names (after an optional
mapping, e.g. stripping a ``model.`` prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from d9dfn.checkpoint._base import BASE_KEY, check_base, fingerprint, left_out
from d9dfn.checkpoint._integrity import CheckpointCorruptedError
from d9dfn.checkpoint._layout import CheckpointMismatchError
from d9dfn.checkpoint._store import CheckpointStore
from d9dfn.step import split_module_state

__all__ = ["export_safetensors", "load_initial_weights", "load_weights"]


def load_initial_weights(
    model: nn.Module,
    directory: str | Path,
    mapper: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    check_config: Callable[[dict[str, Any]], None] | None = None,
    *,
    not_in_source: Callable[[str], bool] | None = None,
    whole: Collection[str] | None = None,
) -> None:
    """Copy the tensors of every ``*.safetensors`` file under ``directory`` into ``model`` (in place).

    Loading is strict: every persistent tensor of the model must be in the files, with its shape, and no
    file tensor may be left over. Dtypes are converted to the model's. A tied tensor (one ``Parameter`` under
    several names: a Hugging Face model's ``lm_head.weight`` and ``model.embed_tokens.weight``) needs one of its
    names in the files, as ``save_pretrained`` writes a tied model; where several are there they must be equal.
    A sharded folder is read through its ``model.safetensors.index.json``: the shards its ``weight_map`` names.

    Args:
        model: a materialized module (the loop calls this right after ``reset_parameters``).
        directory: the safetensors directory.
        mapper: renames the file's tensors to the model's names before loading.
        check_config: called first with ``directory/config.json`` (parsed) when the directory has one; it
            raises ``ValueError`` when the file describes another model (e.g. ``d9dfn.models.check_hf_config``).
        not_in_source: names of the model's tensors the files need not hold; those they lack keep the model's
            values (LoRA adapters on a pretrained base).
        whole: when ``model`` is one pipeline stage, the names of the whole model's tensors: the files' tensors the
            stage lacks must be among them (another stage's), the stage's own must all be there.

    Raises:
        FileNotFoundError: the directory is missing or holds no ``*.safetensors`` file.
        ValueError: the config check failed, or names or shapes do not match; the message names the
            directory and says how to fix it.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    files = _safetensors_files(directory)
    if not files:
        raise FileNotFoundError(
            f"load_initial_weights: no *.safetensors file in {directory}; point "
            "model_stage_factory.source_checkpoint at a directory written by `d9dfn export` (or an HF model dir)"
        )
    config_file = directory / "config.json"
    if check_config is not None and config_file.is_file():
        try:
            check_config(json.loads(config_file.read_text()))
        except ValueError as error:
            raise ValueError(f"load_initial_weights: {config_file}: {error}") from error
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    if mapper is not None:
        tensors = mapper(tensors)
    expected = model.state_dict()
    tensors = _fill_tied(model, tensors, directory)
    kept = {name for name in expected if name not in tensors and not_in_source is not None and not_in_source(name)}
    expected = {name: tensor for name, tensor in expected.items() if name not in kept}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected if whole is None else whole))
    wrong_shape = [
        f"{name}: file {tuple(tensors[name].shape)} vs model {tuple(expected[name].shape)}"
        for name in expected
        if name in tensors and tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"load_initial_weights: {directory} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, wrong shapes {wrong_shape[:5]}; export from the same model config, or give the "
            "model provider a state mapper that renames the file's tensors"
        )
    with torch.no_grad():
        model.load_state_dict({name: tensors[name] for name in expected}, strict=not kept)


_INDEX = "model.safetensors.index.json"


def _safetensors_files(directory: Path) -> list[Path]:
    """The folder's weight files: the shards its ``model.safetensors.index.json`` names (each must be there), else
    every ``*.safetensors`` file in it."""
    if not directory.is_dir():
        return []
    index = directory / _INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({directory / name for name in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"load_initial_weights: {index} is not a safetensors index ({type(error).__name__}: {error}); it must "
            'be JSON with a "weight_map" of tensor name -> shard file: restore it, or remove it to read every '
            "*.safetensors file in the folder"
        ) from None
    absent = [shard.name for shard in shards if not shard.is_file()]
    if absent:
        raise FileNotFoundError(
            f"load_initial_weights: {index} names shard(s) {absent[:5]} that are not in {directory}; download the "
            "missing shards (or the whole folder) again"
        )
    return shards


def _fill_tied(model: nn.Module, tensors: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """``tensors`` with every name of a tied parameter the files lack filled from another of its names; refuses
    tied names that the files hold with different values (loading would keep one of them silently)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out = dict(tensors)
    for names in (names for names in groups.values() if len(names) > 1):
        present = [name for name in names if name in tensors]
        if not present:
            continue  # reported as missing, under every name
        for name in present[1:]:
            if not torch.equal(tensors[name], tensors[present[0]]):
                raise ValueError(
                    f"load_initial_weights: {directory} holds {present[0]} and {name}, which the model ties (one "
                    "parameter), with different values; load it into a model that does not tie them "
                    "(tie_word_embeddings=false), or drop one of them from the files"
                )
        out.update({name: tensors[present[0]] for name in names if name not in tensors})
    return out


def load_weights(
    run_dir: Path,
    model: nn.Module,
    step: int | Literal["latest", "newest-intact"] | None = None,
    *,
    load_base: Callable[[nn.Module, Path], None] | None = None,
) -> tuple[dict, dict, int]:
    """A training run's params and buffers at ``step``, shaped like ``model``'s, in the dtypes the run saved them in;
    and the step loaded.

    Names and shapes are ``model``'s; a floating tensor comes back in the step's own dtype, whatever ``model``'s (a
    pure-bf16 run, ``precision.param_dtype=bfloat16``, gives bfloat16 weights to a float32 model: the caller casts
    them to what it runs in). The step is checked whole, as a resume checks it (``CheckpointStore.restore``): a
    damaged file anywhere in it, the optimizer state's included, refuses it, although only the weights are read. A
    step that leaves its frozen base out (a LoRA run on a ``model.source``: ``checkpoint/_base.py``) gets it from the
    folder it records, through ``load_base(model, folder)`` (which loads the folder into ``model`` in place, as the
    run's start did), cast to the dtype of the step's trained params (a run keeps every floating param in its
    ``param_dtype``, the base it hashed included), and the base's fingerprint must be the one the step recorded.

    Args:
        run_dir: the training run's directory (its ``checkpoints`` folder is read).
        model: a module whose ``state_dict`` names and shapes the weights take.
        step: a saved step; ``None`` or ``"latest"`` for the newest, ``"newest-intact"`` for the newest that
            is not corrupted (each step skipped is logged as a warning).
        load_base: reads a base folder into ``model`` (e.g. the model provider's ``load_source_checkpoint``);
            needed for a step that left its base out.

    Raises:
        FileNotFoundError: the run has no checkpoints, or not that step; the base's folder is gone.
        CheckpointCorruptedError: the step is corrupted (``"newest-intact"``: every step is).
        CheckpointMismatchError: the step holds another model than ``model`` (other names, shapes or kinds).
        ValueError: the base read from its folder is not the one the step was trained on; no ``load_base`` for a
            step that needs one.
    """
    params, buffers = split_module_state(model)
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"load_weights: no checkpoints under {run_dir}; train first, or point checkpointing.load_dir at a "
            "training run directory (runs/<name>)"
        )
    fallback = step == "newest-intact"
    with CheckpointStore(run_dir / "checkpoints", create=False) as store:
        if store.latest_step() is None:
            raise FileNotFoundError(
                f"load_weights: {run_dir / 'checkpoints'} holds no finished checkpoint; train first"
            )
        peeked = step if isinstance(step, int) else None
        source, base = left_out(store.peek_metadata(peeked))
        like = _saved_dtypes(
            {"params": {name: p for name, p in params.items() if name not in base}, "buffers": buffers},
            store.peek_dtypes(peeked),
        )
        try:
            restored, metadata, loaded = store.restore_with_step(
                peeked,
                like=like,
                strict=("params", "buffers"),  # the whole model, not a part of it; the optimizer state is not read
                fallback=fallback,
            )
        except CheckpointMismatchError as error:
            raise CheckpointMismatchError(
                f"load_weights: checkpoint {error.which} in {run_dir / 'checkpoints'} holds another model than "
                f"the one given: {error.difference()}; build the model with the settings the run was trained with",
                step=error.step,
                missing=error.missing,
                unexpected=error.unexpected,
                mismatched=error.mismatched,
            ) from None
        except CheckpointCorruptedError as error:
            if not fallback:
                error.fix = (
                    f"load_weights: load the newest intact step with step='newest-intact', or another saved step "
                    f"({error.steps}); a checkpoint is checked whole, although only its weights are read"
                )
            raise
    if source is not None:
        dtype = _run_dtype(restored["params"])
        base_params = _read_base(
            model, params, dtype, metadata, source, load_base, run_dir / "checkpoints" / str(loaded)
        )
        params = {**params, **base_params}
    weights = {name: restored["params"].get(name, param) for name, param in params.items()}
    return weights, restored["buffers"], loaded


def _saved_dtypes(like: dict[str, dict[str, torch.Tensor]], dtypes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The template ``like`` (``{part: {name: tensor}}``) with each floating tensor that the step saved in another
    floating dtype (``dtypes``: ``CheckpointStore.peek_dtypes``) replaced by an empty one of that dtype (a template
    needs no values); other tensors, and names the step lacks (the restore names them), as they are.

    >>> _saved_dtypes({"params": {"w": torch.ones(2)}}, {"params/w": "bfloat16"})["params"]["w"].dtype
    torch.bfloat16
    """
    out: dict[str, dict[str, Any]] = {}
    for part, tensors in like.items():
        out[part] = {}
        for name, tensor in tensors.items():
            dtype = getattr(torch, dtypes.get(f"{part}/{name}", ""), None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point and tensor.is_floating_point():
                tensor = torch.empty_like(tensor, dtype=dtype) if dtype != tensor.dtype else tensor
            out[part][name] = tensor
    return out


def _run_dtype(params: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The one dtype of the floating ``params`` (a run's ``param_dtype``); ``None`` when there are none or several."""
    dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def _read_base(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    metadata: dict[str, Any],
    source: Path,
    load_base: Callable[[nn.Module, Path], None] | None,
    where: Path,
) -> dict[str, torch.Tensor]:
    """The base ``source`` read into ``model`` (whose ``params`` it updates in place) and returned by name, its floating
    params in ``dtype`` (``None``: as read; the dtype the run trained, and hashed, them in), checked against the step's
    fingerprint."""
    if not source.is_dir():
        raise FileNotFoundError(
            f"load_weights: checkpoint {where} holds the trained params only, and its frozen base is read from "
            f"{source}, which is not a folder now; put the model the run was trained on back at {source}"
        )
    if load_base is None:
        raise ValueError(
            f"load_weights: checkpoint {where} holds the trained params only (its frozen base is read from {source}); "
            "pass load_base= a function that loads that folder into the model (the model provider's "
            "d9dfn.loop.load_source_checkpoint)"
        )
    load_base(model, source)
    record = metadata[BASE_KEY]
    base = {name: params[name] for name in record["fingerprint"] if name in params}
    if dtype is not None:
        base = {n: p.to(dtype) if p.is_floating_point() else p for n, p in base.items()}
    prints = fingerprint(base)
    check_base(
        record,
        prints,
        where=where,
        source=source,
        fix=f"put the model the run was trained on back at {source}",
    )
    return base


def export_safetensors(skeleton: nn.Module, params: dict, buffers: dict, path: Path, mapper: Any = None) -> Path:
    """Write the module's persistent tensors (its ``state_dict`` names) to ``path/model.safetensors``."""
    from safetensors.torch import save_file

    # Tied parameters appear once in the state, under their first name; the file carries every name.
    first_name: dict[int, str] = {}
    alias = {name: first_name.setdefault(id(p), name) for name, p in skeleton.named_parameters(remove_duplicate=False)}
    names = list(skeleton.state_dict().keys())
    tensors = {**buffers, **params}
    missing = [name for name in names if alias.get(name, name) not in tensors]
    if missing:
        raise ValueError(f"export: the state has no tensors for {missing[:5]}; export a state built for this model")
    out = {name: tensors[alias.get(name, name)].detach().cpu().clone() for name in names}
    if mapper is not None:
        out = mapper(out)
    path.mkdir(parents=True, exist_ok=True)
    file = path / "model.safetensors"
    save_file(out, str(file))
    # safetensors writes through a private temporary file (mode 0600); an export is meant to be shared.
    os.chmod(file, 0o666 & ~_umask())
    return file


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` would race other threads' file creation)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022
