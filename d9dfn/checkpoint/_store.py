"""Checkpoints on disk: orbax's ``CheckpointManager`` holding torch state as numpy arrays, one item per rank.

orbax gives the step directories, keep-N retention, the atomic commit (write to
``<step>.orbax-checkpoint-tmp``, rename when complete) and async saves. d9dfn decides what goes in a step
directory (``docs/design/checkpoints.md``)::

    <directory>/<step>/
        d9dfn/           JSON  {"format": "d9dfn.checkpoint", "version": 1, "num_ranks": W, "file_list": ...}
                         and files.json: every file of the step with its size and crc32 (``_integrity``)
        metadata/        JSON  the caller's metadata, as given (rank 0's)
        manifest_{r}/    JSON  rank r's leaves in tree order: key -> dtype, shape, global_shape, offsets, crc32 | value
        rank_{r}/        orbax PyTree  rank r's non-empty arrays, keyed by key-path string

A leaf's key is its key path joined by ``/`` (``"params/layers.0.weight"``, ``"opt_state/0/1/w"``), so
the format never depends on Python class names: any tree whose paths give the same keys restores it.
Tensors go to numpy; dtypes numpy lacks (bfloat16, float8) travel as ``ml_dtypes`` arrays, bit-exact.
Python scalars (``int``, ``float``, ``bool``, ``str``, ``None``) are stored in the manifest.

Several torch.distributed processes save and restore together (both calls are collective): each rank
writes only its own shards of DTensor leaves (one replica of each) and the plain leaves no lower rank holds,
rank 0 alone drives orbax, adopts the other ranks' staged items into its step and commits it, and a restore
reshards onto any mesh. What each rank stores and reads is worked out in ``_layout.py``; the collectives, the
errors every rank raises alike and the staging area are in ``_ranks.py``; reading a step back (and checking it)
in ``_read.py``; orbax's import and event loops in ``_orbax.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from d9dfn._types import PyTree
from d9dfn.checkpoint import _layout as layout
from d9dfn.checkpoint._integrity import FILE_LIST, CheckpointCorruptedError, sealing_path_class
from d9dfn.checkpoint._orbax import await_tmp_cleanup, draining_event_loops, load_orbax
from d9dfn.checkpoint._ranks import Ranks, drop_staging, manifest_item, outcome_of, rank_item, stage, staged_dir
from d9dfn.checkpoint._read import FORMAT, FORMAT_VERSION, StepReader

__all__ = ["FORMAT", "FORMAT_VERSION", "SET_ASIDE", "CheckpointCorruptedError", "CheckpointStore"]

_TRASH = ".d9dfn-deleted"
"""Where retention moves old steps (one atomic rename) before d9dfn deletes them."""

SET_ASIDE = ".d9dfn-set-aside"
"""Where :meth:`CheckpointStore.set_aside_after` moves the steps a run resumed before (kept for inspection)."""


@functools.cache
def _staged_item_args() -> type:
    """orbax args (and their handler) for an item another rank already wrote: saving it moves it in."""
    # Kept in this module: orbax records the handler's module and qualname in every step's metadata.
    ocp: Any = load_orbax()  # untyped library: its classes can be bases only as Any

    class StagedItemHandler(ocp.CheckpointHandler):
        """Moves a finished item directory (written by another rank) into the step orbax is writing."""

        def save(self, directory: Any, args: Any) -> None:
            source = Path(args.source)
            for entry in source.iterdir():  # same filesystem: renames, no copies
                os.replace(entry, Path(directory) / entry.name)

        def restore(self, directory: Any, args: Any = None) -> Any:
            raise NotImplementedError("staged items are read with their own handlers (PyTree, Json)")

        def metadata(self, directory: Any) -> None:
            return None

    @ocp.args.register_with_handler(StagedItemHandler, for_save=True, for_restore=True)
    @dataclasses.dataclass
    class StagedItem(ocp.args.CheckpointArgs):
        source: str

    return StagedItem


class CheckpointStore:
    """Numbered checkpoints of a torch state tree and JSON metadata in ``directory``, through orbax.

    With several torch.distributed processes, :meth:`save` and :meth:`restore` are collective: every rank
    of ``group`` calls them with its own state (DTensor leaves hold that rank's shards; a plain tensor or
    Python value is written by the lowest rank that holds its key, and must be the same on every rank that
    holds it: a pipeline rank holds only its stages' params). A restore reshards onto the template's mesh and
    placements, whatever the mesh that saved, and a rank's template may hold a subset of the saved leaves
    (its pipeline stages') as long as all templates together cover them (``strict``). The other methods are
    local.

    Args:
        directory: where the step directories live (seen by every rank); created unless ``create=False``.
        keep: how many of the newest steps to keep (``None``: all).
        async_save: return from :meth:`save` once the arrays are copied to the host and write them in a
            background thread; call :meth:`wait` (or :meth:`close`) before reading them back. With several
            processes only rank 0 writes in the background; the others stage their items before returning.
        create: create ``directory`` if it is missing (``False`` for read-only use: a missing directory
            is then an error).
        group: the torch.distributed process group that saves together (default: the whole world). It
            needs CPU collectives (gloo) and a timeout long enough for a save.

    Raises:
        ValueError: ``keep < 1``.
        FileNotFoundError: ``directory`` is missing and ``create=False``.

    >>> import tempfile, torch
    >>> with tempfile.TemporaryDirectory() as tmp, CheckpointStore(tmp, keep=2) as store:
    ...     store.save(3, {"w": torch.ones(2, dtype=torch.bfloat16), "step": 3}, {"note": "hi"})
    ...     store.restore(None, like={"w": torch.zeros(2, dtype=torch.bfloat16), "step": 0})
    ({'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': 3}, {'note': 'hi'})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = None,
        async_save: bool = False,
        create: bool = True,
        group: Any = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointStore: keep is {keep}; pass None (keep all) or an int >= 1")
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise FileNotFoundError(
                f"CheckpointStore: checkpoint directory {self.directory} does not exist; check the path (or the "
                f"run name), or train first so that checkpoints are written there"
            )
        self.keep = keep
        self.async_save = async_save
        self._ranks = Ranks(group, shared_errors=(CheckpointCorruptedError, layout.CheckpointMismatchError))
        ocp = load_orbax()
        if self._ranks.rank == 0:
            # Rank 0 alone runs orbax's manager: step creation, the commit rename, retention, tmp cleanup.
            options = ocp.CheckpointManagerOptions(
                preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(n=keep),
                enable_async_checkpointing=async_save,
                create=create,
                cleanup_tmp_directories=True,  # a save killed midway leaves <step>.orbax-checkpoint-tmp behind.
                # orbax deletes an old step file by file: a kill midway would leave a half-deleted step that
                # still looks committed. Renamed into the trash (atomic) instead, it is purged by d9dfn.
                todelete_subdir=_TRASH,
                save_root_metadata=False,
                # Writes the step's file list (every file, size and crc32) just before the commit rename.
                temporary_path_class=sealing_path_class(),
            )
        else:
            # The others only list steps, so they create, clean up and delete nothing: a manager with the
            # options above would delete rank 0's unfinished tmp steps. (orbax's read_only=True would do, but
            # logs a warning on every construction.)
            options = ocp.CheckpointManagerOptions(
                create=False, cleanup_tmp_directories=False, save_root_metadata=False, enable_async_checkpointing=False
            )
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        if self._ranks.rank == 0:
            await_tmp_cleanup(self._manager)
        self._reader = StepReader(self.directory, ocp, self._ranks)
        self._wrote = False  # only a store that saves purges the trash (readers never race a writer's rename)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first (partial saves are never listed)."""
        if self._ranks.rank != 0:
            self._manager.reload()  # rank 0 commits; the others look at the directory afresh
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def set_aside_after(self, step: int) -> list[Path]:
        """Move every committed step above ``step`` out of the way, so saves can go on from ``step``.

        For a run resumed from an older step than the newest (e.g. the newest is corrupted): each later step
        is renamed (atomically) to ``<directory>/.d9dfn-set-aside/<step>-<n>``, kept for inspection and never
        listed again. Returns the new paths. Collective with several processes (rank 0 moves).
        """

        def move() -> list[Path]:
            self._manager.wait_until_finished()
            self._manager.reload()
            moved = []
            for later in [s for s in self.all_steps() if s > step]:
                aside = self.directory / SET_ASIDE
                aside.mkdir(exist_ok=True)
                target = aside / str(later)
                n = 0
                while target.exists():
                    n += 1
                    target = aside / f"{later}-{n}"
                os.replace(self.step_directory(later), target)
                moved.append(target)
            self._manager.reload()
            return moved

        return list(self._ranks.on_root(move))

    def step_directory(self, step: int) -> Path:
        """Where ``step`` is (or would be) stored."""
        return self.directory / str(step)

    def save(self, step: int, state: PyTree, metadata: dict[str, Any] | None = None) -> None:
        """Write ``state`` (torch tensors, DTensors and Python scalars) and ``metadata`` (JSON) as ``step``.

        The step directory appears only once complete (every rank's part included), so a crash mid-save
        leaves the earlier steps as they were; after the save, all but the newest ``keep`` steps are deleted.
        Collective with several processes; rank 0's ``metadata`` is the one stored.

        Raises:
            ValueError: ``step`` is negative or not above every saved step, two leaves share a key,
                ``metadata`` is not JSON, or a DTensor's local shard is not where its placements say.
            TypeError: a leaf that is neither a tensor with data nor a Python scalar, or a DTensor placement
                other than ``Shard``/``Replicate``.
        """
        ranks = self._ranks
        error: Exception | None = None
        arrays: dict[str, np.ndarray] = {}
        leaves: dict[str, dict[str, Any]] = {}
        checked_metadata: dict[str, Any] = {}
        held: list[str] = []
        try:
            checked_metadata = _checked_metadata(step, metadata)
            held = layout.plain_keys(state)
        except Exception as caught:  # every rank must reach the collective below, then hear of it
            error = caught
        # One small object collective: which rank holds which plain leaf, so each is written once, by the
        # lowest rank holding it (pipeline ranks hold only their stages' params; dp replicas hold the same).
        writes = layout.first_holder_keys(ranks.all_gather(held), ranks.rank)
        try:
            if error is not None:
                raise error
            arrays, leaves = layout.encode(state, ranks.rank, writes)
            if ranks.rank == 0:
                self._check_above_latest(step)
                # Purge only with no save in flight: orbax's finalize thread moves old steps into the trash.
                self._manager.wait_until_finished()
                self._wrote = True
                self._purge_deleted()
                drop_staging(self.directory, keep_step=step)
            else:
                stage(self._ocp, self.directory, step, ranks.rank, arrays, leaves)
        except Exception as caught:  # every rank must hear of it, or the others would wait for this one
            error = caught
        gathered = ranks.all_gather((outcome_of(error), bool(arrays)))
        try:
            ranks.settle(error, [outcome for outcome, _ in gathered])
            if ranks.rank == 0:
                try:
                    self._commit(step, checked_metadata, arrays, leaves, [has for _, has in gathered])
                except Exception as caught:  # as above
                    error = caught
        finally:
            if ranks.rank == 0:
                drop_staging(self.directory, keep_step=None)
        ranks.settle(error if ranks.rank == 0 else None, [ranks.broadcast(outcome_of(error))])

    def _check_above_latest(self, step: int) -> None:
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"CheckpointStore.save: step {step} is not above the newest saved step {latest} in "
                f"{self.directory}; save increasing steps, or delete {self.step_directory(latest)} to rewrite it"
            )

    def _commit(
        self,
        step: int,
        metadata: dict[str, Any],
        arrays: dict[str, np.ndarray],
        leaves: dict[str, dict[str, Any]],
        has_arrays: list[bool],
    ) -> None:
        """Rank 0: save its items and adopt the staged ones in one orbax step, committed by one rename."""
        args, staged_item = self._ocp.args, _staged_item_args()
        header = {"format": FORMAT, "version": FORMAT_VERSION, "num_ranks": self._ranks.size, "file_list": FILE_LIST}
        items: dict[str, Any] = {
            "d9dfn": args.JsonSave(header),
            "metadata": args.JsonSave(metadata),
            manifest_item(0): args.JsonSave({"rank": 0, "leaves": leaves}),
        }
        if arrays:
            # orbax's NumpyHandler deep-copies host arrays before save returns (deepcopy_host_arrays=True),
            # so an async save is safe even though these arrays share memory with the caller's CPU tensors.
            items[rank_item(0)] = args.PyTreeSave(arrays)
        for rank in range(1, self._ranks.size):
            staged = staged_dir(self.directory, step, rank)
            items[manifest_item(rank)] = staged_item(str(staged / manifest_item(rank)))
            if has_arrays[rank]:
                items[rank_item(rank)] = staged_item(str(staged / rank_item(rank)))
        # The staged items are moved in before save returns (their handler is synchronous), async or not.
        # Draining: a write that fails (a full disk) must not leave the others' callbacks to a closed event loop,
        # each printing "RuntimeError: Event loop is closed" (~70 tracebacks before the error line, on a full disk).
        with draining_event_loops():
            saved = self._manager.save(step, args=args.Composite(**items))
        assert saved, f"orbax declined to save step {step}"
        if not self.async_save:
            self._purge_deleted()

    def wait(self) -> None:
        """Block until an async save has been committed (no-op for synchronous saves).

        On several ranks this is a collective: rank 0 waits for its background commit, and every rank
        returns (or raises the commit's error) only then, so any rank may read the step afterwards.
        """

        def commit() -> None:
            self._manager.wait_until_finished()
            self._purge_deleted()

        self._ranks.on_root(commit)

    def close(self) -> None:
        """Wait for pending saves and release orbax's resources."""
        self._manager.close()
        self._purge_deleted()

    def _purge_deleted(self) -> None:
        """Remove the steps that retention moved into the trash (a kill midway leaves them for next time)."""
        if self._wrote:
            shutil.rmtree(self.directory / _TRASH, ignore_errors=True)

    def peek_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (``None``: with the newest step whose metadata reads), before restoring
        it: for a caller whose template depends on what the step holds (``d9dfn.checkpoint.left_out``). Unchecked: the
        restore checks the step. ``{}`` when there is no step (or none whose metadata reads). Collective with several
        processes (rank 0 reads)."""

        return dict(self._ranks.on_root(lambda: self._peek(step, self._reader.metadata)))

    def peek_dtypes(self, step: int | None = None) -> dict[str, str]:
        """The dtype of each tensor leaf saved with ``step`` by key (``"params/w": "bfloat16"``; ``None``: the newest
        step whose manifests read), before restoring it: for a template that takes the step's own dtypes (a pure-bf16
        run's weights, ``d9dfn.checkpoint.load_weights``). Unchecked, like :meth:`peek_metadata`; collective."""
        return dict(self._ranks.on_root(lambda: self._peek(step, self._reader.dtypes)))

    def _peek(self, step: int | None, read: Callable[[int], dict[str, Any] | None]) -> dict[str, Any]:
        """Rank 0: ``read(step)``, or of the newest step it reads (``step=None``); ``{}`` when none does."""
        self._manager.wait_until_finished()
        self._manager.reload()
        for candidate in [step] if step is not None else self.all_steps()[::-1]:
            found = read(candidate)
            if found is not None:
                return found
        return {}

    def restore(
        self, step: int | None = None, like: PyTree = None, *, strict: layout.Strict = True, fallback: bool = False
    ) -> tuple[PyTree, dict[str, Any]]:
        """Read ``step`` (default: the newest) back as ``(state, metadata)``; collective with several processes.

        With a template ``like``, the state has ``like``'s structure, and every tensor must have its
        template's dtype and (global) shape. A plain tensor comes back whole on the template's device (CPU
        for a ``meta`` template); a DTensor template gets this rank's shard for its own mesh and placements,
        whichever mesh saved the step. Without a template, the state is the flat ``{key: leaf}`` dict of
        whole tensors.

        Args:
            step: which step; ``None`` for the newest.
            like: a tree of the same structure as the saved state, or ``None``. A leaf that is ``AS_SAVED`` comes
                back as saved (the whole tensor on the CPU, whatever its dtype and shape), for a part whose shape
                depends on the run that saved it.
            strict: refuse saved leaves that ``like`` has no place for (``False``: ignore them, e.g. to
                read only ``{"params": ...}`` out of a training state; a tuple of top-level keys such as
                ``("params", "buffers")``: refuse only those under them, e.g. to read a training state's whole
                model and nothing else).
            fallback: with ``step=None``, skip corrupted steps (logging a warning) and return the newest
                intact one; the caller learns which from the metadata it saved.

        Raises:
            FileNotFoundError: no checkpoint at all, or no ``step``.
            CheckpointCorruptedError: a file of the step is missing, truncated or altered (every file is checked
                against the step's file list, the leaves ``like`` leaves out included), or an array reads back
                unlike its manifest; with ``fallback=True``: every step is.
            CheckpointMismatchError: ``like`` does not match the saved leaves (key paths, dtypes, shapes, kinds); a
                ``ValueError``.
            TypeError: a DTensor template with a placement other than ``Shard``/``Replicate``.
        """
        state, metadata, _ = self.restore_with_step(step, like, strict=strict, fallback=fallback)
        return state, metadata

    def restore_with_step(
        self, step: int | None = None, like: PyTree = None, *, strict: layout.Strict = True, fallback: bool = False
    ) -> tuple[PyTree, dict[str, Any], int]:
        """:meth:`restore`, and the step it read (with ``fallback=True`` maybe older than the newest)."""
        # Rank 0 picks the steps to try; the reader reads them on every rank.
        candidates, steps = self._ranks.on_root(lambda: self._candidates(step, fallback))
        return self._reader.read(candidates, steps, like, strict=strict, fallback=fallback)

    def _candidates(self, step: int | None, fallback: bool) -> tuple[list[int], list[int]]:
        """Rank 0: the steps to try in order, and all saved steps."""
        self._manager.wait_until_finished()  # a step being saved asynchronously is read once committed
        self._manager.reload()  # see steps written or deleted by other stores since this one opened.
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"CheckpointStore.restore: no checkpoint in {self.directory}; check the directory (or run name), "
                f"or start from scratch"
            )
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"CheckpointStore.restore: no step {step} in {self.directory} (saved steps: {steps}); pass one of "
                f"them, or None for the newest"
            )
        return ([step] if step is not None else (steps[::-1] if fallback else [steps[-1]])), steps


def _checked_metadata(step: int, metadata: dict[str, Any] | None) -> dict[str, Any]:
    """``metadata`` (``{}`` for ``None``) once ``step`` and ``metadata`` are known to be storable."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"CheckpointStore.save: step is {step!r}; pass the optimizer step as an int >= 0")
    metadata = {} if metadata is None else metadata
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"CheckpointStore.save: metadata is not JSON ({error}); pass a dict of str keys and JSON values "
            f"(numbers, strings, lists, dicts), e.g. tensor.item() for scalars"
        ) from error
    return metadata
