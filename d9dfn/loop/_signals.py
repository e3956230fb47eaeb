"""Stopping a training run on SIGTERM or SIGINT: at a step boundary, with a checkpoint, on every rank at once.

Schedulers send SIGTERM before they preempt or cancel a job (SLURM, Kubernetes, spot instances: then SIGKILL
after a grace period, often 30 s), ``kill`` sends it, and Ctrl-C sends SIGINT. While ``Trainer.train`` runs,
:class:`StopSignals` turns the first of them into a flag that the loop reads between steps; the loop then
finishes the step in flight, saves the checkpoint of that step (the store's atomic orbax commit), and
``train`` raises :class:`TrainingStopped`. A second signal ends the process at once.

Design choices (``docs/design/run-directory.md`` has the longer note):

* **A flag, not an exception from the handler.** An exception raised at an arbitrary bytecode (Python's
  ``KeyboardInterrupt``) can land in the middle of a checkpoint write, where it left an uncommitted step and
  ~100 lines of tracebacks from orbax's threads. The handler only records the signal; the loop acts
  on it where the state is consistent: after a step, after a save.
* **Except during a compile: an exception at once** (:meth:`StopSignals.abrupt`). The process's first step
  compiles for tens of seconds to minutes (issue 44: 114 s on a loaded machine), longer than torchrun's 30 s
  grace before its SIGKILL, and nothing a resume needs is written meanwhile: no checkpoint write can be in flight
  (saves come after steps), the step's result is not yet in the state, the log or the data position, and the
  compile caches' unfinished files are swept at the next start. So there the handler raises in the main thread
  (Python runs it between bytecodes: dynamo and inductor are mostly Python; a wait for a ``g++`` or a build
  thread is interrupted, PEP 475 retrying only when the handler returns), ``train`` raises
  :class:`TrainingStopped` saying no checkpoint was written, and the command exits 143 / 130 within seconds. The
  watcher thread (below) is the backstop: a main thread still inside the compile ``deadline_s`` after the
  signal (blocked in C: a collective waiting for a rank that left, a long kernel) is ended there with one line.
* **The second signal is counted by a thread, not by the handler.** Python runs signal handlers in the main
  thread between bytecodes, so a main thread blocked in C (a long kernel, a collective waiting for a peer,
  tensorstore) would delay a Python handler. CPython's C-level handler also writes the signal's number to
  :func:`signal.set_wakeup_fd`'s pipe, at once, whatever the main thread does; a watcher thread reads it and
  on the second SIGTERM/SIGINT prints one line and calls ``os._exit(128 + signal)``. Nothing half-written is
  then trusted: an orbax step is committed by one rename, so an interrupted save stays a
  ``<step>.orbax-checkpoint-tmp`` folder that is never listed and that the next run's store deletes.
* **Ranks agree by one all-reduce per step** (:class:`StopAgreement`): a signal may reach one rank only (``kill``
  of a worker) or ranks at different steps, but every rank must save the same step (the save is collective).
  After each step every rank contributes the signal it saw (0: none) to an ``all_reduce(MAX)`` of one int32 on
  a CPU (gloo) group of its own, so all of them stop after the same step, with the same signal (SIGTERM wins
  over SIGINT). Measured: ~0.2 ms per step on 2 CPU ranks of a loaded 2-core machine; no device sync, since
  the tensor lives on the CPU. Checking only at the existing sync points (the logging flush, saves) would
  cost nothing but could stop ``logging.period_steps`` steps late, too late for a 30 s grace period when
  steps are long; exchanging asynchronously (read one step later) would add one step of latency for the
  same ~0.2 ms. The group has its own timeout (``step_timeout`` after the first step), so a dead peer fails
  it as fast as the step's own collectives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

__all__ = ["STOP_SIGNALS", "StopAgreement", "StopDuring", "StopSignals", "TrainingStopped", "committed_steps"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a training run at the next step boundary (a second one exits at once)."""

_ACTIVE: list[StopSignals] = []
"""The entered :class:`StopSignals` (at most one per process: signal handlers are process-wide)."""


def _forget_in_child() -> None:
    """In a child forked while a :class:`StopSignals` is entered (a ``DataLoader`` worker): the parent's handlers
    and wakeup fd do not apply. Else a Ctrl-C, which reaches the whole process group, would write a second
    byte into the parent's pipe from the child, and the parent would count it as a second signal."""
    if _ACTIVE and threading.current_thread() is threading.main_thread():
        _ACTIVE.pop()._restore()


os.register_at_fork(after_in_child=_forget_in_child)


class TrainingStopped(BaseException):
    """``Trainer.train`` stopped early on SIGTERM or SIGINT, once the checkpoint of its last step was committed.

    A ``BaseException``, like ``KeyboardInterrupt``: ``except Exception`` does not swallow it, so a script that
    called ``train()`` does not go on (evaluate, export) as if training had finished. Resume by calling
    ``train()`` again (or rerunning the command): it restores :attr:`checkpoint_step`. ``d9dfn train`` prints
    ``d9dfn: <this message>; to resume, run the same command: ...`` and exits with :attr:`exit_code`.

    >>> stop = TrainingStopped(15, step=7, total_steps=40, checkpoint_step=7, checkpoint_dir=Path("ck"), saved=True)
    >>> (str(stop), stop.exit_code)
    ('stopped by SIGTERM after step 7 of 40: checkpoint step 7 saved in ck', 143)
    >>> during = "the first step's compile"  # a stop that did not wait: nothing of this call was written
    >>> stop = TrainingStopped(2, step=4, total_steps=40, checkpoint_step=4, checkpoint_dir=Path("ck"), saved=False,
    ...                        during=during)
    >>> str(stop).partition(": ")[0]
    "stopped by SIGINT during the first step's compile (step 5 of 40)"
    >>> str(stop).partition(": ")[2]
    'no checkpoint written this run; checkpoint step 4 in ck is unchanged'
    """

    def __init__(
        self,
        signal_number: int,
        *,
        step: int,
        total_steps: int,
        checkpoint_step: int | None,
        checkpoint_dir: Path,
        saved: bool,
        during: str | None = None,
    ) -> None:
        self.signal_number = signal_number
        self.step = step
        """The run's step when it stopped (the last one trained)."""
        self.total_steps = total_steps
        self.checkpoint_step = checkpoint_step
        """The newest committed checkpoint, which a resume restores (``None``: none, a resume starts over)."""
        self.checkpoint_dir = checkpoint_dir
        self.saved = saved
        """Whether this call trained and saved ``checkpoint_step`` (else it stopped before its first step)."""
        self.during = during
        """What the signal cut short (``"the first step's compile"``: :meth:`StopSignals.abrupt`), else ``None``: it
        came between steps or during one, which finished first."""
        super().__init__(self._message())

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"`` or ``"SIGINT"``."""
        return signal.Signals(self.signal_number).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 128 + its number (143 for SIGTERM, 130 for SIGINT)."""
        return 128 + self.signal_number

    def _message(self) -> str:
        stopped = f"stopped by {self.signal_name}"
        if self.during is not None:
            stopped = (
                f"{stopped} during {self.during} (step {self.step + 1} of {self.total_steps}): no checkpoint written"
            )
            if self.checkpoint_step is None:
                return f"{stopped} this run, and none saved before"
            return f"{stopped} this run; checkpoint step {self.checkpoint_step} in {self.checkpoint_dir} is unchanged"
        if self.saved:
            return (
                f"{stopped} after step {self.step} of {self.total_steps}: checkpoint step {self.checkpoint_step} saved "
                f"in {self.checkpoint_dir}"
            )
        if self.checkpoint_step is None:
            return f"{stopped} before step {self.step + 1} of {self.total_steps}: no checkpoint saved"
        return (
            f"{stopped} before step {self.step + 1} of {self.total_steps}: checkpoint step {self.checkpoint_step} in "
            f"{self.checkpoint_dir} is unchanged"
        )


def committed_steps(checkpoints: Path) -> list[int]:
    """The committed step numbers in a ``checkpoints/`` folder, oldest first, by listing it (no orbax, no lock).

    A partial save (``<step>.orbax-checkpoint-tmp``) is not a step. Safe from any thread.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> for name in ("4", "8", "12.orbax-checkpoint-tmp"):
    ...     (folder / name).mkdir()
    >>> committed_steps(folder), committed_steps(folder / "missing")
    ([4, 8], [])
    """
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


class StopDuring(BaseException):
    """A stop signal inside :meth:`StopSignals.abrupt`: raised there in the main thread, at once (``Trainer`` turns it
    into :class:`TrainingStopped`). A ``BaseException``: the compiler's ``except Exception`` lets it through."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal_number)
        self.signal_number = signal_number


DEADLINE_S = 10.0
"""How long after a stop signal a main thread still inside :meth:`StopSignals.abrupt` is given before the watcher
thread ends the process: well inside torchrun's 30 s grace; a main thread that can act stops within about a second."""


class StopSignals:
    """While entered: the first SIGTERM/SIGINT is noted in :attr:`received`; a second one exits the process at once.

    Entered from a thread other than the main one, it changes nothing (only the main thread may set signal
    handlers): the signals keep their previous behaviour. On exit the previous handlers and wakeup fd come back;
    a signal noted but not acted on (the block ended normally: it came after the loop's last look) is then
    raised again, so it reaches the handler it would have reached without this block. Leaving with
    :class:`TrainingStopped` or another exception drops it: it was acted on, or something else ended the run.

    Args:
        on_disk: what a rerun would resume from, for the line a second signal prints as it ends the process
            (called from the watcher thread: list files, never touch orbax or torch.distributed).
        deadline_s: inside :meth:`abrupt`, how long after the signal the main thread has to leave it before the
            watcher thread ends the process.
    """

    def __init__(self, on_disk: Callable[[], str], deadline_s: float = DEADLINE_S) -> None:
        self.on_disk = on_disk
        self.deadline_s = deadline_s
        self.received = 0
        """The first stop signal's number since entering; 0 while none has arrived."""
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None
        self._during: str | None = None  # inside abrupt(): what the main thread is doing, for the lines
        self._raised = False  # abrupt() has raised StopDuring (once: a second signal is the watcher's)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        if _ACTIVE:
            raise RuntimeError(
                "StopSignals: already entered in this process (Trainer.train inside Trainer.train?); signal "
                "handlers are process-wide, so one training loop at a time handles SIGTERM/SIGINT"
            )
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd requires it: a signal must never block on a full pipe
        self._pipe = (read, write)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="d9dfn-stop-signals", daemon=True)
        self._watcher.start()
        self._previous = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}
        _ACTIVE.append(self)
        return self

    @contextlib.contextmanager
    def abrupt(self, during: str) -> Iterator[None]:
        """While the block runs, the first stop signal raises :class:`StopDuring` in the main thread at once.

        For a block that writes nothing a resume needs (the first step's compile: the module docstring says why), so
        a signal need not wait for it to end. Any other exception the block raises once a signal has arrived becomes
        that :class:`StopDuring` too: a collective failing because a peer rank stopped first. A main thread that
        stays inside the block :attr:`deadline_s` after the signal (blocked in C, where no Python handler runs)
        is ended by the watcher thread: one line, exit code 128 + signal. A signal that came before the block
        raises on entering it. Outside the main thread (not entered) the block runs as it is.

        Args:
            during: what the block does, for the lines (``"the first step's compile"``).

        Raises:
            StopDuring: a stop signal arrived before or while the block ran.
        """
        if self._pipe is None:
            yield
            return
        if self.received:
            raise StopDuring(self.received)
        self._during, self._raised = during, False
        try:
            yield
        except StopDuring:
            raise
        except BaseException as error:
            if not self.received:
                raise
            self._raised = True
            raise StopDuring(self.received) from error
        finally:
            self._during = None

    def _restore(self) -> None:
        """The handlers and wakeup fd from before :meth:`__enter__`."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)  # None: set outside Python
        signal.set_wakeup_fd(self._previous_fd)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._pipe is None:
            return
        _ACTIVE.remove(self)
        self._restore()
        read, write = self._pipe
        self._pipe = None
        os.write(write, b"\0")  # no signal is 0: tells the watcher to return
        assert self._watcher is not None
        self._watcher.join()
        os.close(read)
        os.close(write)
        if kind is None and self.received:
            signal.raise_signal(self.received)

    def _note(self, number: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread): the watcher counts; this makes the first one visible at once, and
        inside :meth:`abrupt` raises it."""
        self.received = self.received or number
        if self._during is not None and not self._raised:
            self._raised = True
            raise StopDuring(self.received)

    def _watch(self) -> None:
        assert self._pipe is not None
        read, count = self._pipe[0], 0
        while True:
            for number in os.read(read, 64):  # one byte per signal, written by CPython's C-level handler
                if number == 0:
                    return
                if number not in STOP_SIGNALS:
                    continue  # another signal with a Python handler (e.g. the DataLoader's SIGCHLD)
                self.received = self.received or number
                count += 1
                if count >= 2:
                    name = signal.Signals(number).name
                    self._exit_now(
                        number,
                        f"{name} again while stopping: exited at once, without waiting for the step or its checkpoint",
                    )
                if count == 1 and self._during is not None:
                    threading.Thread(
                        target=self._deadline, args=(number,), name="d9dfn-stop-deadline", daemon=True
                    ).start()

    def _deadline(self, number: int) -> None:
        """Inside :meth:`abrupt`: end the process if the main thread has not left it ``deadline_s`` after the signal."""
        during = self._during
        time.sleep(self.deadline_s)
        if self._during is not None and self._pipe is not None:
            self._exit_now(
                number,
                f"stopped by {signal.Signals(number).name} during {during}, still running {self.deadline_s:g} s later "
                "(blocked in C: a collective, a kernel): exited at once, no checkpoint written this run",
            )

    def _exit_now(self, number: int, what: str) -> None:
        """Print ``d9dfn: [rank N: ]<what>; <on_disk>`` and end the process with code 128 + ``number``."""
        rank = os.environ.get("RANK")  # torchrun's: each rank that exits here says so
        line = f"d9dfn: {f'rank {rank}: ' if rank else ''}{what}; "
        try:
            line += self.on_disk()
        except Exception as error:  # the process ends either way; say what we can
            line += f"what is on disk is unknown ({type(error).__name__}: {error})"
        with contextlib.suppress(OSError):
            os.write(2, f"\n{line}\n".encode())  # not sys.stderr: the main thread may hold its lock
        os._exit(128 + number)


class StopAgreement:
    """Whether the run stops now, the same answer on every rank: the largest stop signal any rank has noted.

    One process: :attr:`StopSignals.received` as it is. Several: one ``all_reduce(MAX)`` of an int32 over
    ``group`` (gloo, CPU: no device sync), a collective every rank must call at the same points of the loop.
    """

    def __init__(self, signals: StopSignals, group: Any = None) -> None:
        self.signals = signals
        self.group = group

    def __call__(self) -> int:
        if self.group is None:
            return self.signals.received
        flag = torch.tensor([self.signals.received], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag[0])
