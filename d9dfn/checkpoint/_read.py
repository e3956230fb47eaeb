"""Reading one committed checkpoint step back: its JSON items, the integrity of its files, this rank's leaves.

``CheckpointStore.restore`` drives the ranks (who reads what, and when every rank hears of an error); a
:class:`StepReader` does the reading: rank 0 the step's header, metadata and manifests (:meth:`StepReader.head`),
every rank its share of the array files' checks and the arrays its template needs (:meth:`StepReader.state`). Any
damage becomes a ``CheckpointCorruptedError`` naming the step and the file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from d9dfn._types import PyTree
from d9dfn.checkpoint import _layout as layout
from d9dfn.checkpoint._integrity import (
    CheckpointCorruptedError,
    array_files,
    check_files,
    check_items,
    check_leaf,
    check_listed_files,
    unlisted_problem,
)
from d9dfn.checkpoint._orbax import brief, draining_event_loops
from d9dfn.checkpoint._ranks import Ranks, manifest_item, outcome_of, rank_item

__all__ = ["FORMAT", "FORMAT_VERSION", "StepReader"]

FORMAT = "d9dfn.checkpoint"
"""The name written in every step's ``d9dfn`` item."""

FORMAT_VERSION = 1
"""Bumped on any change a reader of the previous version could not read."""

_LOG = logging.getLogger("d9dfn.checkpoint")


class StepReader:
    """Reads the steps of the checkpoint ``directory`` on the store's ``ranks`` (orbax module ``ocp``)."""

    def __init__(self, directory: Path, ocp: ModuleType, ranks: Ranks) -> None:
        self.directory = directory
        self._ocp = ocp
        self.ranks = ranks

    def step_directory(self, step: int) -> Path:
        """Where ``step`` is stored."""
        return self.directory / str(step)

    def read(
        self, candidates: list[int], steps: list[int], like: PyTree, *, strict: layout.Strict, fallback: bool
    ) -> tuple[PyTree, dict[str, Any], int]:
        """The first of ``candidates`` that reads back intact, as ``(state, metadata, step)``; collective.

        ``steps`` are all the saved steps (rank 0's word). With ``fallback``, a corrupted candidate is logged as a
        warning and the next is tried; otherwise (or when none is left) every rank raises the same error.
        """
        ranks = self.ranks
        claimed = self._claimed(like) if strict and ranks.size > 1 else None
        if not (ranks.size == 1 or claimed is not None):  # None: a rank reads every saved leaf
            strict = False
        # Rank 0 reads the small JSON items; the others follow its word.
        for i, candidate in enumerate(candidates):
            head, error = None, None
            if ranks.rank == 0:
                try:
                    head = self.head(candidate, steps)
                except Exception as caught:  # every rank must hear of it
                    error = caught
            head = ranks.broadcast(head if error is None else ("error", outcome_of(error)))
            if head[0] == "error":
                outcomes = [head[1]]
            else:
                # Every rank checks its share of the array files before any rank reads one (one gather).
                try:
                    self.check_array_files(candidate, steps, head[3])
                except Exception as caught:  # as above
                    error = caught
                outcomes = ranks.all_gather(outcome_of(error))
                if not any(outcomes):
                    try:
                        state = self.state(candidate, steps, head[1], like, strict, claimed)
                    except Exception as caught:  # as above
                        error = caught
                    outcomes = ranks.all_gather(outcome_of(error))
                    if not any(outcomes):
                        return state, head[2], candidate
            corrupt = all(o is None or o[0] == CheckpointCorruptedError.__name__ for o in outcomes)
            if not (fallback and corrupt and i + 1 < len(candidates)):
                try:
                    ranks.settle(error, outcomes)
                except CheckpointCorruptedError as corrupted:  # the way out, named once for every rank
                    corrupted.steps = steps
                    corrupted.fix = (
                        f"no saved step is intact (saved steps: {steps}; a warning names each one's damage); "
                        f"delete {self.directory} to start over"
                        if fallback
                        else f"restore another step (saved steps: {steps}) with CheckpointStore.restore(step=...) or "
                        f"fallback=True, or delete {self.step_directory(candidate)}"
                    )
                    raise
            _LOG.warning("%s; falling back to step %d", next(o[1] for o in outcomes if o), candidates[i + 1])
        raise AssertionError("unreachable: the loop returns or raises")

    def _claimed(self, like: PyTree) -> set[str] | None:
        """The keys of all ranks' templates together (one object all-gather); ``None`` if a rank has ``like=None``.

        A rank restores only its own template's leaves (a pipeline rank: its stages'); ``strict`` then asks
        that every saved leaf has a place in some rank's template.
        """
        try:
            mine = None if like is None else layout.leaf_keys(like)
        except Exception:  # the same flatten fails again in state(), where it is reported to every rank
            mine = []
        gathered = self.ranks.all_gather(mine)
        if any(keys is None for keys in gathered):
            return None
        return set().union(*gathered)

    def corrupted(self, step: int, steps: list[int], problem: str) -> CheckpointCorruptedError:
        """The error for ``step``; ``CheckpointStore.restore`` adds the way out once every rank has heard of it."""
        return CheckpointCorruptedError(
            f"step {step} in {self.step_directory(step)} is corrupted: {problem}", steps=steps
        )

    def head(
        self, step: int, steps: list[int]
    ) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, tuple[int, int]] | None]:
        """Rank 0: ``("ok", index of every saved leaf, metadata, file list)`` from the step's JSON items.

        The files outside the array items are checked against the file list first; a step written before
        d9dfn listed files (no ``file_list`` in its header) is read with a warning, its arrays' crc32 alone.
        """
        step_dir = self.step_directory(step)
        json_handler = self._ocp.JsonCheckpointHandler()
        try:  # first: a damaged file is named as such, not by the error it causes further on
            files = check_listed_files(step_dir)
        except ValueError as error:
            raise self.corrupted(step, steps, str(error)) from error
        try:
            header = json_handler.restore(step_dir / "d9dfn")
        except Exception as error:  # orbax/json raise many types; all mean "unreadable" here.
            raise self.corrupted(step, steps, brief(error)) from error
        if files is None and (problem := unlisted_problem(step_dir, header)):
            raise self.corrupted(step, steps, problem)
        try:
            metadata = json_handler.restore(step_dir / "metadata")
        except Exception as error:  # as above
            raise self.corrupted(step, steps, brief(error)) from error
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise self.corrupted(step, steps, f"{step_dir / 'd9dfn'} does not describe a {FORMAT} (got {header!r})")
        num_ranks = header.get("num_ranks")
        if header.get("version") != FORMAT_VERSION:
            raise NotImplementedError(
                f"CheckpointStore.restore: step {step} in {step_dir} has format version {header.get('version')}; "
                f"this d9dfn reads version {FORMAT_VERSION}; restore it with the d9dfn version that wrote it"
            )
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise self.corrupted(step, steps, f"{step_dir / 'd9dfn'} gives num_ranks {num_ranks!r}")
        if files is not None:  # the list's items against the header's: a manifest per rank, an array item or none
            try:
                check_items(
                    files,
                    ["d9dfn", "metadata", *(manifest_item(rank) for rank in range(num_ranks))],
                    f"the header ({num_ranks} rank(s))",
                    allowed=[rank_item(rank) for rank in range(num_ranks)],
                )
            except ValueError as error:
                raise self.corrupted(step, steps, str(error)) from error
        manifests = []
        for rank in range(num_ranks):
            try:
                manifests.append(json_handler.restore(step_dir / manifest_item(rank)))
            except Exception as error:  # as above
                raise self.corrupted(step, steps, f"{manifest_item(rank)}: {brief(error)}") from error
        try:
            index = layout.index_manifests(manifests)
        except (ValueError, KeyError, TypeError) as error:
            raise self.corrupted(step, steps, f"the manifests disagree: {brief(error)}") from error
        return "ok", index, metadata, files

    def metadata(self, step: int) -> dict[str, Any] | None:
        """Rank 0: ``step``'s metadata item as saved, unchecked; ``None`` when it does not read as a JSON object."""
        try:
            metadata = self._ocp.JsonCheckpointHandler().restore(self.step_directory(step) / "metadata")
        except Exception:  # orbax/json raise many types; the restore names the damage
            return None
        return metadata if isinstance(metadata, dict) else None

    def dtypes(self, step: int) -> dict[str, str] | None:
        """Rank 0: the dtype of each tensor leaf of ``step`` by key, as its manifests list them, unchecked; ``None``
        when they do not read (the restore names the damage)."""
        json_handler = self._ocp.JsonCheckpointHandler()
        step_dir = self.step_directory(step)
        try:
            num_ranks = json_handler.restore(step_dir / "d9dfn")["num_ranks"]
            index = layout.index_manifests(
                [json_handler.restore(step_dir / manifest_item(rank)) for rank in range(num_ranks)]
            )
        except Exception:  # orbax/json raise many types; the restore names the damage
            return None
        return {key: leaf.dtype for key, leaf in index.items() if isinstance(leaf, layout.SavedArray)}

    def check_array_files(self, step: int, steps: list[int], files: dict[str, tuple[int, int]] | None) -> None:
        """This rank's share of the array items' files against the step's file list (all of them, whether this
        rank reads them or not, so that every file of the step is checked by some rank)."""
        if files is not None:
            try:
                check_files(self.step_directory(step), files, array_files(files, self.ranks.rank, self.ranks.size))
            except ValueError as error:
                raise self.corrupted(step, steps, str(error)) from error

    def state(
        self,
        step: int,
        steps: list[int],
        index: dict[str, Any],
        like: PyTree,
        strict: layout.Strict,
        claimed: set[str] | None = None,
    ) -> PyTree:
        """This rank's part of ``step`` in ``like``'s structure, read from the rank items that hold it."""
        targets, treespec = layout.targets_for(index, like, strict=strict, step=step, claimed=claimed)
        outs: list[Any] = []
        for target in targets:
            saved = index[target.key]
            if target.region is None:
                outs.append(saved.value)
                continue
            try:
                layout.check_cover(saved, target.region)
            except ValueError as error:
                raise self.corrupted(step, steps, f"leaf {target.key!r}: {error}") from error
            outs.append(torch.empty(target.region.shape, dtype=getattr(torch, saved.dtype)))
        # One rank item at a time: this rank holds its own shards plus the arrays of one item at most.
        for rank, keys in sorted(layout.reads_needed(index, targets).items()):
            arrays = self._rank_item(step, steps, index, rank, keys)
            for target, out in zip(targets, outs, strict=True):
                if target.key in arrays:
                    piece = next(p for p in index[target.key].pieces if p.rank == rank)
                    assert target.region is not None  # Python values (no region) were restored above
                    layout.copy_overlap(out, target.region, piece.region, arrays[target.key])
        return layout.unflatten(treespec, targets, [layout.place(t, out) for t, out in zip(targets, outs, strict=True)])

    def _rank_item(
        self, step: int, steps: list[int], index: dict[str, Any], rank: int, keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """The arrays ``keys`` of ``rank_r`` as CPU tensors, checked against the manifest (dtype, shape, crc32)."""
        item_dir = self.step_directory(step) / rank_item(rank)
        pieces = {
            key: piece
            for key, saved in index.items()
            if isinstance(saved, layout.SavedArray)
            for piece in saved.pieces
            if piece.rank == rank and piece.stored
        }
        args, handler = self._ocp.args, self._ocp.PyTreeCheckpointHandler()
        if sorted(keys) == sorted(pieces):
            request = args.PyTreeRestore()  # everything (and a check that the item holds nothing else)
        else:
            request = args.PyTreeRestore(
                item=dict.fromkeys(keys, 0),
                restore_args={key: self._ocp.RestoreArgs(restore_type=np.ndarray) for key in keys},
                partial_restore=True,
            )
        try:
            with draining_event_loops():
                arrays = handler.restore(item_dir, args=request)
        except Exception as error:  # orbax/tensorstore raise many types; all mean "unreadable" here.
            raise self.corrupted(step, steps, f"cannot read {item_dir} ({brief(error)})") from error
        finally:
            handler.close()
        expected = sorted(keys) if request.partial_restore else sorted(pieces)
        if sorted(arrays) != expected:
            raise self.corrupted(
                step, steps, f"{item_dir} holds keys {sorted(arrays)} but its manifest lists {expected}"
            )
        out = {}
        for key in keys:
            array, dtype, piece = arrays[key], index[key].dtype, pieces[key]
            try:
                numpy_dtype = layout.numpy_dtype(getattr(torch, dtype))
                check_leaf(key, item_dir, array, numpy_dtype, piece.region.shape, piece.crc32)
            except ValueError as error:
                raise self.corrupted(step, steps, str(error)) from error
            out[key] = layout.numpy_to_tensor(array, dtype)
        return out
