"""A compile cache's seal: which of its files are known good, checked at every start (issue 44).

A file a compile cache holds is trusted only once a process has used it: its size and crc32 are then written to the
directory's seal, ``d9dfn-sealed.json`` (:func:`seal`, at the points where every library the process compiled has
loaded and run). At a process's start, :func:`sweep` checks every file against the seal:

- a sealed file whose size or crc32 differs (emptied, truncated, flipped bytes) is **damaged**: it is moved into
  ``<directory>/../.d9dfn-set-aside/<directory's name>/`` (kept for a bug report, the latest per path);
- a file the seal does not hold was left by a process that stopped before it proved the file good: killed while
  the file was written, or crashed loading it (a library that raises SIGILL never gets sealed). It is **removed**
  (nothing in it is worth keeping), and so are the temporary files of builds that never finished.

torch then misses those entries and compiles them again, byte for byte what it compiled the first time. Between
caches, :func:`link_from_host` and :func:`publish_to_host` hand on only sealed files that pass the check (the host's
cache to a new run, a run's files back to the host), adding their entries to the receiving seal: damage in the
host's cache never reaches a run, and damage in a run never reaches the host.

These are edge functions over one directory each (files, locks); the policy (when to seal, which directories) is
``d9dfn/loop/_compile_cache.py``'s. Locks: :func:`locked` takes ``flock`` on a file beside the seal, so two
processes never read-modify-write one seal at once (a host's lock is taken before a run's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from d9dfn.loop._run_dir import atomic_write

try:
    import fcntl
except ImportError:  # not POSIX: no locks between processes (one process per cache there)
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "SEAL",
    "SET_ASIDE",
    "Swept",
    "cache_files",
    "fingerprint",
    "intact",
    "link_from_host",
    "locked",
    "publish_to_host",
    "read_seal",
    "seal",
    "set_aside_folder",
    "sweep",
]

SEAL = "d9dfn-sealed.json"
"""The seal's file name, in the cache directory it describes."""
SET_ASIDE = ".d9dfn-set-aside"
"""Where damaged files go: ``<directory>/../.d9dfn-set-aside/<directory's name>/<relative path>``."""
_LOCK = "d9dfn-seal.lock"
_VERSION = 1
_log = logging.getLogger(__name__)

Entry = tuple[int, int]
"""A sealed file's ``(size in bytes, crc32)``."""


def _skipped(name: str) -> bool:
    """File names a cache walk leaves out: locks, temporary files (torch's ``.<pid>.<thread>.tmp``, d9dfn's builds
    and atomic writes, ``tmp*``), the seal itself."""
    return name == SEAL or name.endswith((".lock", ".tmp")) or name.startswith("tmp")


def _temporary(name: str) -> bool:
    return name.endswith(".tmp") or name.startswith("tmp")


def cache_files(directory: str) -> list[str]:
    """The files ``directory`` holds as cache entries, as sorted relative paths (``/``-separated): every file but
    torch's ``locks/`` folder, lock and temporary files and the seal.

    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> for name in ("ab/cabc.so", "locks/cabc.lock", "ab/.x.1.2.tmp", SEAL):
    ...     os.makedirs(os.path.dirname(os.path.join(root, name)) or root, exist_ok=True)
    ...     open(os.path.join(root, name), "w").close()
    >>> cache_files(root)
    ['ab/cabc.so']
    """
    found = []
    for folder, subfolders, files in os.walk(directory):
        # torch's locks; a writer's temporary folder (Triton writes a kernel's files into tmp.pid_<pid>_<id>/)
        subfolders[:] = sorted(name for name in subfolders if name != "locks" and not _temporary(name))
        relative = os.path.relpath(folder, directory)
        for name in files:
            if not _skipped(name):
                found.append(Path(relative, name).as_posix() if relative != "." else name)
    return sorted(found)


def fingerprint(path: str) -> Entry:
    """``path``'s size and crc32, read in 1 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as file:
        while piece := file.read(1 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return size, crc


def intact(path: str, entry: Entry) -> bool:
    """Whether the file at ``path`` is the one ``entry`` sealed: not empty, the same size (checked first, without
    reading it) and the same crc32. A file that cannot be read is not intact."""
    try:
        return entry[0] > 0 and os.path.getsize(path) == entry[0] and fingerprint(path) == tuple(entry)
    except OSError:
        return False


def read_seal(directory: str) -> dict[str, Entry]:
    """The seal of ``directory``: relative path -> entry. A missing, unreadable or malformed seal is an empty one
    (every file is then unsealed: compiled again, never trusted)."""
    try:
        with open(os.path.join(directory, SEAL), encoding="utf-8") as file:
            record = json.load(file)
        files = record["files"] if record.get("version") == _VERSION else {}
        return {str(path): (int(size), int(crc)) for path, (size, crc) in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _write_seal(directory: str, entries: dict[str, Entry]) -> None:
    record = {"version": _VERSION, "files": {path: list(entries[path]) for path in sorted(entries)}}
    atomic_write(Path(directory, SEAL), json.dumps(record, indent=0))


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """Hold ``directory``'s seal lock (exclusive ``flock``, waiting for it) while the block runs."""
    if fcntl is None:
        yield
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _LOCK), "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


@dataclass(frozen=True)
class Swept:
    """What :func:`sweep` took out of a directory: damaged files set aside, unsealed files removed (counts), and
    the folder the damaged ones went to."""

    damaged: int = 0
    unsealed: int = 0
    set_aside_in: str = ""

    def __bool__(self) -> bool:
        return bool(self.damaged or self.unsealed)

    def line(self, directory: str) -> str:
        """The one line that says what was taken out of ``directory`` (empty when nothing was)."""
        parts = []
        if self.damaged:
            parts.append(f"set aside {self.damaged} damaged file(s) in {self.set_aside_in}")
        if self.unsealed:
            parts.append(f"removed {self.unsealed} file(s) no finished process had used (a kill or crash)")
        if not parts:
            return ""
        return f"d9dfn: compile cache {directory}: {' and '.join(parts)}; torch compiles them again"


def set_aside_folder(directory: str) -> str:
    """Where :func:`sweep` moves ``directory``'s damaged files.

    >>> set_aside_folder("/runs/a/compile_cache/x86_64-1/rank_0")
    '/runs/a/compile_cache/x86_64-1/.d9dfn-set-aside/rank_0'
    """
    directory = os.path.normpath(directory)
    return os.path.join(os.path.dirname(directory), SET_ASIDE, os.path.basename(directory))


def _set_aside(directory: str, relative: str) -> None:
    into = os.path.join(set_aside_folder(directory), relative)
    os.makedirs(os.path.dirname(into), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(into)  # the latest one per path; and a rename onto a hard link of the same file would do nothing
    os.replace(os.path.join(directory, relative), into)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep(directory: str, *, unsealed: bool = True) -> Swept:
    """Take out of ``directory`` every file that fails its seal (set aside) and, with ``unsealed``, every file the
    seal lacks and every temporary file (removed); drop the seal's entries of files no longer there.

    ``unsealed=False`` where another live process may use the directory: its files are not sealed yet (and its
    temporary files are being written), so only what fails a seal is taken out.
    """
    damaged = removed = 0
    with locked(directory):
        entries = read_seal(directory)
        kept = {}
        for relative in cache_files(directory):
            path = os.path.join(directory, relative)
            entry = entries.get(relative)
            if entry is not None and intact(path, entry):
                kept[relative] = entry
            elif entry is not None:
                _set_aside(directory, relative)
                damaged += 1
            elif unsealed:
                _remove(path)
                removed += 1
        if unsealed:
            _remove_temporary(directory)
        if kept != entries:
            _write_seal(directory, kept)
    return Swept(damaged, removed, set_aside_folder(directory) if damaged else "")


def seal(directory: str) -> int:
    """Add every file of ``directory`` that its seal lacks, not empty, to the seal (its size and crc32); returns how
    many were added. Call it where everything the process compiled into ``directory`` has loaded and run."""
    with locked(directory):
        entries = read_seal(directory)
        added = {}
        for relative in cache_files(directory):
            if relative not in entries:
                with contextlib.suppress(OSError):  # gone meanwhile: nothing to seal
                    entry = fingerprint(os.path.join(directory, relative))
                    if entry[0] > 0:
                        added[relative] = entry
        if added:
            _write_seal(directory, {**entries, **added})
    return len(added)


def link_from_host(host: str, run: str) -> int:
    """Hard-link into ``run`` every file of ``host`` that the host's seal holds, that passes its check and that
    ``run`` lacks, and seal it in ``run``; returns how many were linked.

    Under the host's lock, the host is cleaned on the way: a sealed file that fails its check is set aside, and
    unsealed and temporary files (left by a process that stopped while publishing) are removed, each time with one
    line. A file ``run`` already holds unsealed is left alone (another live process of the run may be using it).
    """
    return _link(host, run, clean_source=True, replace_unsealed=False)


def publish_to_host(run: str, host: str) -> int:
    """Hard-link into ``host`` every file ``run`` has sealed, that passes its check (nothing unloadable is ever
    published) and that the host's seal lacks, and add it to the host's seal; returns how many were linked. A file
    the host holds unsealed (left by a process that stopped while publishing) is replaced."""
    return _link(run, host, clean_source=False, replace_unsealed=True)


def _link(source: str, target: str, *, clean_source: bool, replace_unsealed: bool) -> int:
    """Link ``source``'s sealed, intact files that ``target``'s seal lacks into ``target`` (hard links share their
    data: damage in either directory is the other's too, and each directory's own check finds it)."""
    linked: dict[str, Entry] = {}
    damaged, removed = [], 0
    with locked(source):
        entries = read_seal(source)
        if clean_source:
            for relative in cache_files(source):
                if relative not in entries:
                    _remove(os.path.join(source, relative))
                    removed += 1
            _remove_temporary(source)
        with locked(target):
            theirs = read_seal(target)
            for relative, entry in entries.items():
                path, into = os.path.join(source, relative), os.path.join(target, relative)
                if relative in theirs or not os.path.isfile(path):
                    continue
                if os.path.lexists(into):
                    if not replace_unsealed:
                        continue
                    _remove(into)  # an unsealed leftover: never trusted, replaced by the sealed file
                if not intact(path, entry):
                    damaged.append(relative)
                    continue
                os.makedirs(os.path.dirname(into), exist_ok=True)
                _link_or_copy(path, into)
                linked[relative] = entry
            if linked:
                _write_seal(target, {**theirs, **linked})
        if clean_source:
            for relative in damaged:
                with contextlib.suppress(FileNotFoundError):
                    _set_aside(source, relative)
            present = {path: entry for path, entry in entries.items() if path not in damaged}
            present = {path: entry for path, entry in present.items() if os.path.isfile(os.path.join(source, path))}
            if present != entries:
                _write_seal(source, present)
            swept = Swept(len(damaged), removed, set_aside_folder(source) if damaged else "")
            if swept:
                _log.warning(swept.line(source))
        elif damaged:
            _log.info("d9dfn: compile cache %s: %d damaged file(s) not published", source, len(damaged))
    return len(linked)


def _remove_temporary(directory: str) -> None:
    """Remove the temporary files and folders a process left in ``directory`` (only where no other process writes)."""
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = [name for name in subfolders if name != "locks"]
        for name in subfolders:
            if _temporary(name):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        subfolders[:] = [name for name in subfolders if not _temporary(name)]
        for name in files:
            if _temporary(name):
                _remove(os.path.join(folder, name))


def _link_or_copy(source: str, into: str) -> None:
    try:
        os.link(source, into)
    except OSError as error:
        if error.errno == errno.EEXIST:
            raise
        with open(source, "rb") as whole:  # another filesystem, or no hard links there: a whole copy
            atomic_write(Path(into), lambda file: shutil.copyfileobj(whole, file))
