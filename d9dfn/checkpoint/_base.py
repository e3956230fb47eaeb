"""A run's *base*: the frozen params it trains on (a LoRA run's pretrained weights), as its checkpoints record it.

A run whose frozen params come from files (``model.source``, ``model_stage_factory.source_checkpoint``) leaves them
out of its checkpoints: they are the files' tensors, and a LoRA checkpoint is then the adapters, their optimizer state
and the rest of the resume state. Each step's metadata records the base (:data:`BASE_KEY`): where it was read from and
a fingerprint of every frozen param (:func:`fingerprint`). Whoever restores such a step (a resume, ``d9dfn export``,
``d9dfn infer``) reads the base from its files again and refuses it, in one line naming the folder and the fix, when
its fingerprint differs (:func:`check_base`). A run whose frozen params are its own initialization (no source) keeps
them in its checkpoints, with the fingerprint: nothing else could bring them back for an export.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from d9dfn.parallel import is_distributed_tensor

__all__ = ["BASE_KEY", "base_record", "check_base", "fingerprint", "left_out"]

BASE_KEY = "base"
"""The metadata key of a step's base: ``{"source": folder or None, "fingerprint": {param name: digest}}``."""


def fingerprint(params: Mapping[str, torch.Tensor], names: Any = None) -> dict[str, str]:
    """A SHA-256 (16 hex digits) of each of ``names`` (default: all) in ``params``: its name, shape, dtype and the bytes
    of the whole tensor (a ``DTensor`` is gathered first, so every layout gives the same answer: a collective).

    >>> fingerprint({"w": torch.zeros(2)})
    {'w': 'fde9d0ac7fcd45d5'}
    """
    prints: dict[str, str] = {}
    for name in params if names is None else names:
        tensor = params[name]
        whole = tensor.full_tensor() if is_distributed_tensor(tensor) else tensor
        whole = whole.detach().contiguous().cpu()
        digest = hashlib.sha256(f"{name}|{tuple(whole.shape)}|{whole.dtype}|".encode())
        digest.update(whole.view(torch.uint8).numpy().tobytes() if whole.numel() else b"")
        prints[name] = digest.hexdigest()[:16]
    return prints


def base_record(source: Path | None, prints: Mapping[str, str]) -> dict[str, Any]:
    """What a step's metadata records of its base: the folder its frozen params are read from (``None``: they are
    in the checkpoint) and their fingerprint.

    >>> base_record(None, {"w": "ab"})
    {'source': None, 'fingerprint': {'w': 'ab'}}
    """
    return {"source": None if source is None else str(Path(source).absolute()), "fingerprint": dict(prints)}


def left_out(metadata: Mapping[str, Any]) -> tuple[Path | None, list[str]]:
    """The folder a step's frozen params are read from and their names, from the step's ``metadata``; ``(None, [])``
    when the step holds every param (a full fine-tune, a base of the run's own initialization, a step saved before
    bases were left out).

    >>> left_out({"base": {"source": "/models/qwen", "fingerprint": {"w": "ab"}}})
    (PosixPath('/models/qwen'), ['w'])
    """
    record = metadata.get(BASE_KEY)
    if not isinstance(record, dict) or record.get("source") is None:
        return None, []
    return Path(record["source"]), list(record.get("fingerprint", {}))


def check_base(
    saved: Mapping[str, Any] | None, ours: Mapping[str, str], *, where: Path, source: Path | None, fix: str
) -> None:
    """Raise unless the frozen params ``ours`` (their :func:`fingerprint`, read from ``source``; ``None``: the run's
    own initialization) are the base the step ``where`` recorded (``saved``: its :data:`BASE_KEY` record).

    Only the names both hold are compared (a pipeline rank holds its stages' params). A step that left its base out
    must find every one of its params in ``ours``.

    Raises:
        ValueError: one line naming the folder the step was trained on, the params that differ and ``fix``.
    """
    if not saved:
        return
    prints = saved.get("fingerprint", {})
    trained_on = saved.get("source")
    origin = f"the base read from {trained_on}" if trained_on else "its own initial weights as frozen base"
    here = f"from {source}" if source is not None else "from this run's initialization (no model.source)"
    absent = [name for name in prints if trained_on and name not in ours]
    differ = [name for name, value in ours.items() if name in prints and prints[name] != value]
    if absent or differ:
        names = absent or differ
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = "lacks" if absent else "has other values for"
        raise ValueError(
            f"checkpoint {where} was trained on {origin}, and the base read {here} {what} {shown} (another model, "
            f"or the folder's files changed); {fix}"
        )
