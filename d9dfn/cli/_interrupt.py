"""Signals outside the training loop, and the command that resumes a stopped run.

While the command runs, SIGTERM interrupts it as SIGINT (Ctrl-C) does (:func:`signals_interrupt`); the training
loop installs its own handlers for its duration (a step finishes and is saved first). The line a stop prints ends
with the command to rerun (:func:`resume_command`): the one that started the process, without ``--resume-from``.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

__all__ = ["Interrupted", "interrupted_line", "resume_command", "signals_interrupt"]


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT outside the training loop (which handles them itself): stop where the command is."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While the command runs, SIGTERM interrupts it like SIGINT (Ctrl-C) does, as :class:`Interrupted`.

    The first one raises, in the main thread; the handlers then go back to the default action, so a second
    signal (while the first unwinds) ends the process at once. ``Trainer.train`` installs its own handlers
    for its duration (a step finishes and is saved first). Outside the main thread (``main`` called from a
    thread) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(number: int, frame: FrameType | None) -> None:
        for each in (signal.SIGTERM, signal.SIGINT):
            signal.signal(each, signal.SIG_DFL)
        raise Interrupted(number)

    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def interrupted_line(number: int, doing: str, run_dir: Path | None, command: str, *, trained: bool = False) -> str:
    """The one line for a signal outside the training loop: where it came, what a rerun starts from.

    ``trained``: training has finished (its last step's checkpoint is committed) and this came after it (the
    evaluation's compile, say): a rerun of the same command only evaluates.
    """
    from d9dfn.loop import committed_steps

    rank = f"rank {os.environ.get('RANK', '?')}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    said = f"d9dfn: {rank}stopped by {signal.Signals(number).name} during {doing}"
    steps = committed_steps(run_dir / "checkpoints") if run_dir is not None else []
    if trained and steps:
        return (
            f"{said}: training had finished, its last checkpoint (step {steps[-1]}) is committed in {run_dir}; to "
            f"evaluate, run the same command: {command}"
        )
    said += " (no training step was running)"
    if run_dir is None:
        return f"{said}; to retry, run the same command: {command}"
    if not steps:
        return f"{said}: no checkpoint saved in {run_dir}; to start over, run the same command: {command}"
    return f"{said}: newest checkpoint step {steps[-1]} in {run_dir}; to resume, run the same command: {command}"


def resume_command(argv: Sequence[str] | None) -> str:
    """The command that started this process, as a shell line, without ``--resume-from`` (a rerun with it would
    go back to that step again): under ``torchrun``, the launcher's command line (its workers' parent)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        launcher = _parent_command()
        if any(word.endswith(("torchrun", "torch.distributed.run")) for word in launcher):
            return shlex.join(_without_resume_from(_as_typed(launcher)))
        return "the same torchrun command"
    args = list(sys.argv[1:] if argv is None else argv)
    original = list(sys.orig_argv)
    prefix = ["d9dfn"]  # the console script, or main() called from Python
    if len(original) > 1 and os.path.basename(original[1]) == "d9dfn":  # the script: python /venv/bin/d9dfn
        typed = _as_typed(original[:2])
        prefix = typed if len(typed) == 1 else original[1:2]  # its name when PATH finds it, else its path
    for i in range(len(original) - 1):
        if original[i : i + 2] == ["-m", "d9dfn"]:  # python [options] -m d9dfn
            prefix = original[: i + 2]
            break
    return shlex.join([*prefix, *_without_resume_from(args)])


def _parent_command() -> list[str]:
    """The parent process's command line (Linux ``/proc``; empty elsewhere)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [word.decode(errors="replace") for word in raw.split(b"\0") if word]


def _as_typed(command: list[str]) -> list[str]:
    """``python /venv/bin/torchrun ...`` (a script's shebang expanded) as typed: ``torchrun ...`` when the
    script is what that name finds on ``PATH``."""
    if len(command) > 1 and not command[1].startswith("-") and os.sep in command[1]:
        name = os.path.basename(command[1])
        found = shutil.which(name)
        if found is not None and os.path.realpath(found) == os.path.realpath(command[1]):
            return [name, *command[2:]]
    return command


def _without_resume_from(command: list[str]) -> list[str]:
    out, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word == "--resume-from":
            skip = True
        elif not word.startswith("--resume-from="):
            out.append(word)
    return out
