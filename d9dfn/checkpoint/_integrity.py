"""Whether a checkpoint step reads back as it was written: one crc32, two places, one error.

* **Each array leaf** carries the crc32 of its bytes in its rank's manifest (``_layout.encode``); a restore
  compares the bytes it decoded (:func:`crc32`). This covers the way from the tensor to the file and back.
* **Each file of the step** is listed with its size and crc32 in ``<step>/d9dfn/files.json``, written as the
  step's last file, just before orbax's commit rename (:func:`sealing_path_class`). A restore checks every
  listed file before it trusts anything in the step (:func:`check_files`), the files of the leaves it does
  not read included: inference reads only the weights, yet a damaged optimizer state, an edited
  ``log_lines``, a deleted ``_CHECKPOINT_METADATA`` or a damaged OCDBT manifest are found all the same.

Both raise :class:`CheckpointCorruptedError` (``docs/design/checkpoints.md``, "Integrity").
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FILE_LIST",
    "CheckpointCorruptedError",
    "ORBAX_METADATA",
    "array_files",
    "check_file_set",
    "check_files",
    "check_items",
    "check_leaf",
    "check_listed_files",
    "crc32",
    "other_files",
    "read_file_list",
    "sealing_path_class",
    "unlisted_problem",
    "write_file_list",
]

FILE_LIST = "d9dfn/files.json"
"""Where a step lists its files (relative to the step directory): ``{"files": {path: [size, crc32]}}``."""

_LOG = logging.getLogger("d9dfn.checkpoint")

_CHUNK = 1 << 24
"""Files are checksummed 16 MiB at a time (a 10 GB array file never sits in memory)."""


class CheckpointCorruptedError(ValueError):
    """A committed step directory that cannot be read back as it was written.

    ``what`` says which step, where, and what is wrong; ``fix`` how to go on, in the terms of the API that
    raised it (the CLI puts its own options there); ``steps`` are the saved steps, for that fix.

    >>> error = CheckpointCorruptedError("step 2 in ckpt/2 is corrupted: ...", "load step 1", steps=[1, 2])
    >>> str(error), error.what, error.steps
    ('step 2 in ckpt/2 is corrupted: ...; load step 1', 'step 2 in ckpt/2 is corrupted: ...', [1, 2])
    """

    def __init__(self, what: str, fix: str = "", *, steps: Sequence[int] = ()) -> None:
        super().__init__(what)
        self.what = what
        self.fix = fix
        self.steps = list(steps)

    def __str__(self) -> str:
        return f"{self.what}; {self.fix}" if self.fix else self.what


def crc32(array: np.ndarray) -> int:
    """The crc32 of an array's bytes (C order), as the manifests store it."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def _file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _step_files(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` but the list itself, as relative POSIX paths, sorted."""
    names = (path.relative_to(step_dir).as_posix() for path in step_dir.rglob("*") if not path.is_dir())
    return sorted(name for name in names if name != FILE_LIST)


def _list_crc32(files: dict[str, tuple[int, int]]) -> int:
    """The crc32 of a file list's entries (canonical JSON): the list's own checksum, so an edited list is found."""
    entries = {name: [size, crc] for name, (size, crc) in files.items()}
    return zlib.crc32(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def write_file_list(step_dir: Path) -> None:
    """List every file under ``step_dir`` (but the list itself) with its size and crc32 in :data:`FILE_LIST`, and
    the crc32 of those entries (:func:`read_file_list` checks it)."""
    files = {
        name: (path.stat().st_size, _file_crc32(path)) for name in _step_files(step_dir) if (path := step_dir / name)
    }
    lines = ",\n".join(f"  {json.dumps(name)}: [{size}, {crc}]" for name, (size, crc) in files.items())
    # One file a line, for a reader; the entries' own crc32 last.
    (step_dir / FILE_LIST).write_text(f'{{"files": {{\n{lines}\n}},\n"crc32": {_list_crc32(files)}}}\n')


def read_file_list(step_dir: Path) -> dict[str, tuple[int, int]] | None:
    """The step's listed files (``None``: it has no list); ``ValueError`` naming the problem if unreadable, or if
    its entries fail their own crc32 (a list written before d9dfn stored it is read without)."""
    path = step_dir / FILE_LIST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        files = {str(name): (int(size), int(crc)) for name, (size, crc) in data["files"].items()}
        own = data.get("crc32")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"its file list {FILE_LIST} is unreadable ({type(error).__name__}: {error})") from error
    if own is not None and own != _list_crc32(files):
        raise ValueError(f"its file list {FILE_LIST} fails its own checksum (crc32 of its entries): it was edited")
    return files


def check_file_set(step_dir: Path, files: dict[str, tuple[int, int]]) -> None:
    """Raise ``ValueError`` naming the first file of ``step_dir`` that its list does not name (one added after the
    save, or whose entry was dropped from the list: it would otherwise be read unchecked). A listed file that is
    missing is named by :func:`check_files`."""
    unlisted = [name for name in _step_files(step_dir) if name not in files]
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise ValueError(
            f"file {unlisted[0]}{more} is not listed in {FILE_LIST}: added after the step was saved, or its entry was "
            "dropped from the list"
        )


def check_items(
    files: dict[str, tuple[int, int]], required: Iterable[str], what: str, allowed: Iterable[str] = ()
) -> None:
    """Raise ``ValueError`` unless the items (top-level folders) of the listed files are those the step's own
    metadata (``what``) names: every ``required`` one, and no other than those and ``allowed``. A list that lost an
    item's entries, or names an item the step does not have, disagrees with it.

    >>> check_items({"a/x": (1, 0)}, ["a", "b"], "the header")
    Traceback (most recent call last):
    ...
    ValueError: its file list d9dfn/files.json names no file of item(s) ['b'], which the header names
    """
    listed = {name.split("/", 1)[0] for name in files if "/" in name}
    required = set(required)
    lacking, extra = sorted(required - listed), sorted(listed - required - set(allowed))
    if lacking:
        raise ValueError(f"its file list {FILE_LIST} names no file of item(s) {lacking}, which {what} names")
    if extra:
        raise ValueError(f"its file list {FILE_LIST} names item(s) {extra}, which {what} does not name")


def _array_item_rank(name: str) -> int | None:
    top = name.split("/", 1)[0]
    return int(top[5:]) if top.startswith("rank_") and top[5:].isdigit() else None


def other_files(files: dict[str, tuple[int, int]]) -> list[str]:
    """The listed files outside the array items (the JSON items, orbax's metadata): rank 0 checks them."""
    return [name for name in files if _array_item_rank(name) is None]


def array_files(files: dict[str, tuple[int, int]], rank: int, size: int) -> list[str]:
    """The files of the array items that ``rank`` of ``size`` checks: those of ``rank_r/`` fall to ``r % size``.

    >>> files = {"d9dfn/metadata": (1, 0), "rank_00000/d/a": (1, 0), "rank_00003/d/b": (1, 0)}
    >>> other_files(files), array_files(files, 0, 2), array_files(files, 1, 2)
    (['d9dfn/metadata'], ['rank_00000/d/a'], ['rank_00003/d/b'])
    """
    return [name for name in files if (owner := _array_item_rank(name)) is not None and owner % size == rank]


def check_files(step_dir: Path, files: dict[str, tuple[int, int]], names: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is missing, or differs in size or crc32."""
    for name in names:
        path = step_dir / name
        size, crc = files[name]
        if not path.is_file():
            gone = next((p for p in reversed(Path(name).parents[:-1]) if not (step_dir / p).is_dir()), None)
            if gone is not None:  # a whole folder (an item, a rank's data) went: name it, not its first file
                count = sum(other.startswith(f"{gone.as_posix()}/") for other in files)
                raise ValueError(f"folder {gone.as_posix()}/ is missing (its {count} files are listed in {FILE_LIST})")
            raise ValueError(f"file {name} is missing (listed in {FILE_LIST})")
        if path.stat().st_size != size:
            raise ValueError(f"file {name} has {path.stat().st_size} bytes, not the {size} listed in {FILE_LIST}")
        if _file_crc32(path) != crc:
            raise ValueError(f"file {name} fails its checksum (crc32 listed in {FILE_LIST})")


ORBAX_METADATA = "_CHECKPOINT_METADATA"
"""orbax's own file in a step: its items by name, with their handlers (``item_handlers``)."""


def check_listed_files(step_dir: Path) -> dict[str, tuple[int, int]] | None:
    """Rank 0's part of a restore: the step's file list (its own crc32), the step's files against it both ways, its
    files outside the array items checked (the array items' files are shared out over the ranks:
    :func:`array_files`), and its items against orbax's metadata; ``None``: the step has no list."""
    files = read_file_list(step_dir)
    if files is None:
        return None
    check_file_set(step_dir, files)
    check_files(step_dir, files, other_files(files))
    if ORBAX_METADATA not in files:
        raise ValueError(f"its file list {FILE_LIST} does not name orbax's {ORBAX_METADATA}")
    try:  # checked against the list above: what orbax wrote at the save
        items = json.loads((step_dir / ORBAX_METADATA).read_text())["item_handlers"]
        named = [str(item) for item in items]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{ORBAX_METADATA} is unreadable ({type(error).__name__}: {error})") from error
    check_items(files, named, f"orbax's {ORBAX_METADATA}")
    return files


def unlisted_problem(step_dir: Path, header: Any) -> str | None:
    """Why a step without a file list is corrupted (its header names one), or ``None`` with a warning: it was
    written before d9dfn listed a step's files, and is read with the arrays' crc32 alone."""
    if isinstance(header, dict) and "file_list" in header:
        return f"its file list {FILE_LIST} is missing"
    _LOG.warning(
        "%s has no file list (written before d9dfn listed a step's files): only the crc32 of the arrays read is "
        "checked; save a new step to have every file checked",
        step_dir,
    )
    return None


def check_leaf(key: str, where: Path, array: np.ndarray, dtype: np.dtype, shape: Sequence[int], crc: int) -> None:
    """Raise ``ValueError`` unless an array read back (from ``where``) has the dtype, shape and crc32 its manifest
    lists: this finds what changed between the tensor and the file (the file list, what changed on disk)."""
    if array.dtype != dtype or list(array.shape) != list(shape):
        raise ValueError(
            f"leaf {key!r} reads back as {array.dtype} {list(array.shape)}, not as the {dtype} {list(shape)} its "
            f"manifest lists"
        )
    if crc32(array) != crc:
        raise ValueError(f"leaf {key!r} in {where} fails its checksum (crc32)")


@functools.cache
def sealing_path_class() -> type:
    """orbax's atomic-rename temporary step directory, which writes :data:`FILE_LIST` just before the rename.

    orbax's ``AtomicRenameTemporaryPath.finalize`` updates ``_CHECKPOINT_METADATA`` (commit time), writes
    ``commit_success.txt`` and renames ``<step>.orbax-checkpoint-tmp`` to ``<step>``; this one does the same
    with the file list in between, so the list covers every file, orbax's included, and a step that lists as
    committed always has it. The items inside a step (their directories get the same class) finalize as in
    orbax. Read by orbax 0.12.8; an orbax that renames these internals fails every save loudly (tests).
    """
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata
    from orbax.checkpoint._src.path import async_path, atomicity, atomicity_types

    class SealingRename(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self) -> None:
            tmp, final = self.get(), self.get_final()
            if final.parent.name.endswith(atomicity_types.TMP_DIR_SUFFIX):  # an item inside a step
                await super().finalize()
                return
            store: Any = self._checkpoint_metadata_store
            if store is not None:
                await asyncio.to_thread(store.wait_until_finished)
                await asyncio.to_thread(
                    store.update,
                    file_path=step_metadata.step_metadata_file_path(tmp),
                    commit_timestamp_nsecs=time.time_ns(),
                )
                await asyncio.to_thread(store.wait_until_finished)
            await async_path.write_text(
                tmp / atomicity_types.COMMIT_SUCCESS_FILE, f"Checkpoint commit was successful to {final}"
            )
            await asyncio.to_thread(write_file_list, Path(tmp))
            await async_path.rename(tmp, final)

    return SealingRename
