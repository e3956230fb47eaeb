"""The run directory's edge: one writer at a time (a lock), writability checked up front, atomic rewrites.

A training run's directory (``checkpointing.save_dir / run.name``) is written by one process: the main
process of one job. :class:`RunLock` is an OS advisory lock (``fcntl.flock``) on ``<run_dir>/.lock``,
taken before anything else is written there. The kernel drops it when its process exits, however it exits
(SIGKILL included), so a killed run leaves no stale lock to clean up: the next run takes it at once. The
file keeps the holder's pid and host only for the refusal message. (``flock`` is local to one machine on
some network filesystems; two hosts sharing an NFS run directory are not guarded.)

:func:`atomic_write` is how every run file that is *rewritten* (``job.json``, ``hparams.json``, the
tracker's truncation on resume, ``loss.png``) reaches the disk: a temporary file in the same directory,
flushed and ``fsync``'d, then renamed over the old one, so a crash leaves the old file or the new one,
never a torn one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["RunDirectoryError", "RunLock", "append_jsonl", "atomic_write", "check_writable"]


class RunDirectoryError(ValueError):
    """The run directory cannot be used: another process writes it, or it (or a folder in it) is not writable."""


def check_writable(directory: Path, setting: str) -> None:
    """Create ``directory`` if needed and write (then remove) a file in it; else a :class:`RunDirectoryError`.

    ``setting`` names the config field(s) that chose the path, for the message. A real write is the only
    check that holds for root, read-only mounts and ACLs alike (``os.access`` is not).

    >>> import tempfile
    >>> check_writable(Path(tempfile.mkdtemp()) / "run", "checkpointing.save_dir")
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".d9dfn-write-test-"):
            pass
    except OSError as error:
        raise RunDirectoryError(
            f"the run cannot write to {directory} ({type(error).__name__}: {error.strerror or error}); it comes "
            f"from {setting}: make that folder writable, or point {setting} somewhere writable"
        ) from error


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/.lock``, held from :meth:`acquire` to :meth:`release`.

    Re-acquiring a lock this object holds is a no-op; a second object (in this process or another) on the
    same directory is refused while the first holds it. The lock is released when its process exits,
    whatever the cause, and when this object is garbage-collected.

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> first, second = RunLock(run), RunLock(run)
    >>> first.acquire()
    >>> try:
    ...     second.acquire()
    ... except RunDirectoryError as error:
    ...     print("refused:", "is being written by pid" in str(error))
    refused: True
    >>> first.release(); second.acquire(); second.release()
    """

    def __init__(self, run_dir: Path, setting: str = "checkpointing.save_dir / run.name") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self.setting = setting
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock (creating the run directory), or raise naming the process that holds it.

        Raises:
            RunDirectoryError: another process (or another ``RunLock``) holds it, or the directory is not
                writable.
        """
        if self._file is not None:
            return
        check_writable(self.run_dir, self.setting)
        file = self.path.open("a+", encoding="utf-8")  # "a+": never truncates another holder's pid
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "an unknown process"
            file.close()
            raise RunDirectoryError(
                f"run directory {self.run_dir} is being written by {holder} (it holds {self.path}); wait for that "
                f"run to finish or stop it, or give this run another directory ({self.setting})"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Release the lock (a no-op when not held). The file stays: its lock, not its presence, is what counts."""
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None

    def __del__(self) -> None:
        self.release()


@contextlib.contextmanager
def _replacing(path: Path, mode: str, **kwargs: Any) -> Iterator[IO[Any]]:
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; a rewrite keeps the usual mode
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(path.parent)


def atomic_write(path: Path, data: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Replace ``path`` with ``data`` (text as UTF-8, bytes, or a writer called with a binary file), atomically.

    Written to a temporary file beside ``path``, ``fsync``'d, renamed over ``path``, and the directory
    ``fsync``'d: readers and a crash see the old content or the new one, never a mix. Returns ``path``.

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "job.json"
    >>> atomic_write(target, '{"a": 1}').read_text()
    '{"a": 1}'
    """
    path = Path(path)
    with _replacing(path, "wb") as file:
        if callable(data):
            data(file)
        else:
            file.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, racing other threads' writes)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_jsonl(path: Path, record: dict[str, Any]) -> Path:
    """Append ``record`` to ``path`` as one JSON line (one ``write`` of a whole line, then ``fsync``).

    >>> import json, tempfile
    >>> target = Path(tempfile.mkdtemp()) / "timings.jsonl"
    >>> _ = append_jsonl(target, {"a": 1}); _ = append_jsonl(target, {"a": 2})
    >>> [json.loads(line)["a"] for line in target.read_text().splitlines()]
    [1, 2]
    """
    path = Path(path)
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
        file.flush()
        os.fsync(file.fileno())
    return path
