"""What the command line says when something goes wrong: the one line of bad input, the summary of a failed run,
what is on disk to resume from, and the errors background threads report (held back, then kept in ``error.log``)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9dfn.checkpoint import CheckpointCorruptedError

__all__ = ["BackgroundErrors", "bad_input", "corrupted", "on_disk", "one_line", "run_failed", "to_torchrun"]


def bad_input(error: BaseException | str, note: str = "") -> int:
    """Exactly one line ``d9dfn: error: ...`` (a message of several lines joined into one); exit code 2.

    Under ``torchrun`` the line goes to torchrun instead (:func:`to_torchrun`), which prints it last, once.
    """
    line = f"d9dfn: error: {one_line(error)}{note}"
    if not to_torchrun(line, wait=True):
        print(line, file=sys.stderr)
    return 2


LATE_RANK_S = 3.0
"""How long a rank other than 0 waits before handing its line of bad input to torchrun: the same input fails rank 0
too, and torchrun stops the other ranks once one has failed, so the line shows once (rank 0's); a rank that fails
alone still reports, this much later."""


def to_torchrun(line: str, *, wait: bool = False) -> bool:
    """Under ``torchrun``: write ``line`` to this worker's error file (``TORCHELASTIC_ERROR_FILE``); ``True`` when
    written, ``False`` elsewhere (then print it).

    torchrun ends a failed job with its own block (its traceback, then every failed rank, the first failure last);
    there the first failure's ``traceback :`` field shows this line instead of a link to torch's docs, so the
    line is the last thing the user reads, and each worker printing it too would only repeat it above the block.
    With ``wait``, a rank other than 0 first waits :data:`LATE_RANK_S` (see there).
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    if wait and os.environ.get("RANK", "0") != "0":
        time.sleep(LATE_RANK_S)
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"message": line, "timestamp": int(time.time())}, file)
    except OSError:
        return False
    return True


def one_line(error: BaseException | str) -> str:
    """``error``'s message on one line: a pydantic error by its fields' paths, any other one with its lines joined."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):  # a config built in code (load_config's own errors are ConfigErrors)
        problems = [
            f"{'.'.join(map(str, err['loc'])) or error.title}: {err['msg']}" for err in error.errors(include_url=False)
        ]
        text = f"{error.title}: " + " | ".join(problems)
    else:
        text = str(error)
    return " ".join(text.split())


def run_failed(error: BaseException, run_dir: Path | None, background: BackgroundErrors) -> int:
    """The one-line summary (what failed, what is on disk, how to go on), the traceback, the summary again; exit 1.

    The summary comes first (what a reader of the top sees) and last (what a terminal shows after the traceback);
    errors of background threads go to the run's ``error.log`` (see the module docstring).
    """
    first_line = next(iter(str(error).splitlines()), "")
    what = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    summary = f"d9dfn: error: {what}{on_disk(run_dir, error)}"
    print(summary, file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    print(summary + background.keep(run_dir), file=sys.stderr)
    to_torchrun(summary)  # and last, in torchrun's block of failed ranks
    return 1


def on_disk(run_dir: Path | None, error: BaseException | None = None) -> str:
    """What a rerun would resume from: the newest committed checkpoint step of ``run_dir``, if any.

    After a full disk (``error`` or its causes say ENOSPC) the rerun needs space first, and the hint says so.
    """
    from d9dfn.loop import committed_steps

    if run_dir is None:
        return ""
    steps = committed_steps(run_dir / "checkpoints")
    first = f"free space on the disk of {run_dir} (it is full), then " if _disk_full(error) else ""
    if not steps:
        return f" [{run_dir}: no checkpoint saved yet; {first}rerun the same command to start over]"
    return f" [{run_dir}: newest checkpoint step {steps[-1]}; {first}rerun the same command to resume from it]"


def _disk_full(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, is "no space left on device" (tensorstore: a ValueError)."""
    seen = 0
    while error is not None and seen < 20:
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def corrupted(error: CheckpointCorruptedError, args: argparse.Namespace) -> str:
    """The one line for a corrupted checkpoint: what is damaged, then the option of this command that goes on."""
    train = args.command == "train"
    option, choice = ("--resume-from", args.resume_from) if train else ("--step", args.step)
    if choice == "newest-intact":
        fix = f"no saved step is intact (saved steps: {error.steps}); " + (
            "start over under another run name (--set trainer.run.name=NAME)" if train else "train again"
        )
    else:
        verb = {"train": "resume from", "infer": "evaluate", "export": "export"}[args.command]
        fix = (
            f"{verb} the newest intact step with `d9dfn {args.command} {option} newest-intact`, or a saved step with "
            f"`{option} STEP` (saved steps: {error.steps})" + ("; the later steps are then set aside" if train else "")
        )
    return f"checkpoint {error.what}; {fix}"


class BackgroundErrors:
    """Errors that other threads report while the command runs, held back from stderr (see the module docstring).

    What is held: ``absl`` log records at ERROR and above (orbax logs a failed write of each of its writer
    threads there, with the traceback), exceptions that end a thread (``threading.excepthook``), and exceptions
    printed through ``sys.excepthook`` (tensorstore's callbacks on an event loop orbax has closed).
    """

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self.texts: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[BackgroundErrors]:
        """Hold background errors while the block runs; the hooks and the logger are restored after it."""
        held = cls()
        absl = logging.getLogger("absl")
        handler = _HoldingHandler(held)
        saved = (threading.excepthook, sys.excepthook, absl.propagate)
        threading.excepthook = held._thread_error
        sys.excepthook = held._printed_error
        absl.addHandler(handler)
        absl.propagate = False
        try:
            yield held
        finally:
            threading.excepthook, sys.excepthook, absl.propagate = saved
            absl.removeHandler(handler)

    def _thread_error(self, args: Any) -> None:
        name = args.thread.name if args.thread is not None else "?"
        text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
        with self._lock:
            self.texts.append(f"Exception in thread {name}:\n{text}")

    def _printed_error(self, exc_type: type[BaseException], value: BaseException, tb: Any) -> None:
        with self._lock:
            self.texts.append("".join(traceback.format_exception(exc_type, value, tb)))

    def _lines(self) -> list[str]:
        formatter = logging.Formatter("%(levelname)s:%(name)s:%(message)s")
        with self._lock:
            return [formatter.format(record) for record in self.records] + list(self.texts)

    def replay(self) -> None:
        """After a success: print what was held, as it would have been printed."""
        for text in self._lines():
            print(text.rstrip("\n"), file=sys.stderr)

    def keep(self, run_dir: Path | None) -> str:
        """After a failure: write what was held to the run's error log; the note for the last line ("" if none)."""
        lines = self._lines()
        if not lines:
            return ""
        rank = int(os.environ.get("RANK", "0"))
        name = "error.log" if rank == 0 else f"error.rank{rank}.log"
        text = "\n".join(line.rstrip("\n") for line in lines) + "\n"
        if run_dir is not None:
            log = run_dir / name
            try:
                with log.open("a", encoding="utf-8") as file:  # a rerun that fails again appends
                    file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n{text}")
            except OSError as error:
                print(text, end="", file=sys.stderr)
                return f" ({len(lines)} error(s) of background threads above: {log} could not be written: {error})"
            return f" ({len(lines)} error(s) of background threads in {log})"
        print(text, end="", file=sys.stderr)
        return f" ({len(lines)} error(s) of background threads above)"


class _HoldingHandler(logging.Handler):
    """Holds ``absl`` records at ERROR and above; passes the others on to the root logger's handlers."""

    def __init__(self, held: BackgroundErrors) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            logging.getLogger().callHandlers(record)
            return
        with self.held._lock:
            self.held.records.append(record)
