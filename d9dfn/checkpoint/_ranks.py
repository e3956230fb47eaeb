"""How the processes of a ``CheckpointStore`` act together: collectives, shared errors, and staging.

A save or restore is collective over a torch.distributed group, and a failure on any rank must fail every
rank alike, or the others would wait in the next collective. :class:`Ranks` holds the group, its two object
collectives (no-ops in a single process) and :meth:`Ranks.settle`, which raises one rank's error on all of
them. Only rank 0 drives orbax, so a rank r > 0 writes its items (``manifest_r``, and ``rank_r`` when it
holds arrays) as a finished orbax checkpoint under ``<directory>/.d9dfn-staging/<step>/<r>`` (:func:`stage`);
rank 0 moves them into its step and then drops the staging area (:func:`drop_staging`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

__all__ = ["Ranks", "drop_staging", "manifest_item", "outcome_of", "rank_item", "stage", "staged_dir"]

STAGING = ".d9dfn-staging"
"""Where ranks > 0 write their items of a step before rank 0 moves them into orbax's temporary step."""

SHARED_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, FileNotFoundError, NotImplementedError)
"""Errors that every rank re-raises as the same type when one rank hit them (others become RuntimeError)."""


def rank_item(rank: int) -> str:
    return f"rank_{rank:05d}"


def manifest_item(rank: int) -> str:
    return f"manifest_{rank:05d}"


def outcome_of(error: Exception | None) -> tuple[str, str] | None:
    """What the other ranks learn of ``error``: its type's name and message (``None``: no error)."""
    return None if error is None else (type(error).__name__, str(error))


class Ranks:
    """The processes that save and restore together, and the two object collectives (no-ops alone).

    Args:
        group: the torch.distributed process group (``None``: the world); one process without
            torch.distributed initialized.
        shared_errors: error types, besides :data:`SHARED_ERRORS`, that every rank re-raises as their type.

    >>> ranks = Ranks(None)
    >>> ranks.rank, ranks.size, ranks.broadcast("x"), ranks.all_gather("x")
    (0, 1, 'x', ['x'])
    >>> ranks.settle(None, [None, outcome_of(ValueError("bad leaf"))])
    Traceback (most recent call last):
    ValueError: bad leaf [raised on rank 1]
    """

    def __init__(self, group: Any, shared_errors: tuple[type[Exception], ...] = ()) -> None:
        self.group = group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank = torch.distributed.get_rank(group)
            self.size = torch.distributed.get_world_size(group)
        else:
            self.rank, self.size = 0, 1
        self._shared = {cls.__name__: cls for cls in (*SHARED_ERRORS, *shared_errors)}

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out

    def settle(self, own: Exception | None, outcomes: list[tuple[str, str] | None]) -> None:
        """Raise on every rank if any rank failed: the own error where there is one, else the first rank's."""
        if own is not None:
            raise own
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                raise self._shared.get(outcome[0], RuntimeError)(f"{outcome[1]} [raised on rank {rank}]")

    def on_root(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 alone, its result on every rank; if it raised, every rank raises."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as caught:  # every rank must hear of it
                error = caught
        shared = self.broadcast(("ok", result) if error is None else ("error", outcome_of(error)))
        if shared[0] == "error":
            self.settle(error, [shared[1]])
        return shared[1]


def staged_dir(directory: Path, step: int, rank: int) -> Path:
    """Where rank ``rank`` > 0 stages its items of ``step``."""
    return directory / STAGING / str(step) / f"{rank:05d}"


def stage(
    ocp: ModuleType,
    directory: Path,
    step: int,
    rank: int,
    arrays: dict[str, np.ndarray],
    leaves: dict[str, dict[str, Any]],
) -> None:
    """Rank r > 0: write ``manifest_r`` (and ``rank_r``) as a finished orbax checkpoint in the staging area."""
    args = ocp.args
    target = staged_dir(directory, step, rank)
    shutil.rmtree(target, ignore_errors=True)  # left by a killed attempt at this step
    target.parent.mkdir(parents=True, exist_ok=True)
    items = {manifest_item(rank): args.JsonSave({"rank": rank, "leaves": leaves})}
    if arrays:
        items[rank_item(rank)] = args.PyTreeSave(arrays)
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        checkpointer.save(target, args=args.Composite(**items))
    finally:
        checkpointer.close()


def drop_staging(directory: Path, keep_step: int | None) -> None:
    """Remove staged items of other steps (killed saves), or all of them once a step is committed."""
    root = directory / STAGING
    if root.is_dir():
        for entry in root.iterdir():
            if keep_step is None or entry.name != str(keep_step):
                shutil.rmtree(entry, ignore_errors=True)
        if keep_step is None:
            shutil.rmtree(root, ignore_errors=True)
