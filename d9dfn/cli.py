"""The command line: ``d9dfn train``, ``d9dfn infer``, ``d9dfn export`` (also ``python -m d9dfn``).

Under ``torchrun``, the evaluation (after ``train``, and ``infer``) runs on rank 0 alone after the other ranks
leave, except on a pipeline mesh (``mesh.pipeline_parallel > 1``): there every rank evaluates its stage with the
inference schedule, and rank 0 prints.

Argument parsing and exit codes live here and nowhere else. The code says *when* something went wrong:

* 0: success.
* 2: bad input found before the run starts: a usage error (argparse), a config that does not load or
  validate, a missing file, a model too large for the device's memory, a checkpoint that is missing,
  corrupted or does not fit the job on resume. Exactly one line ``d9dfn: error: ...`` names the field or file
  and the fix (a message of several lines is joined into one). A corrupted checkpoint is refused alike by
  ``train``, ``infer`` and ``export`` (each checks the whole step: ``docs/design/checkpoints.md``), and the line
  names the command's option that reads another step (``--resume-from`` / ``--step``).
* 1: a failure once the run has started (after ``train.ready`` / ``inference.ready``: a task's shape
  error, a NaN loss, a full disk, a dead peer), or an unexpected error during set-up: a one-line
  ``d9dfn: error: ...`` summary (what failed, the newest checkpoint on disk, how to resume), then the
  traceback, then the summary again, so that it is also the last line.
* 143 (SIGTERM) / 130 (SIGINT, Ctrl-C): stopped by the signal. During training the step in flight finishes and
  its checkpoint is committed first (``Trainer.train`` raises ``TrainingStopped``); elsewhere (set-up,
  evaluation) the command stops where it is. One line ``d9dfn: stopped by SIGTERM ...`` says what happened,
  the checkpoint a rerun resumes from and the command to rerun. A second signal exits at once, same code.

Errors that background threads report while the command runs (orbax's writer threads log each failed write
with its traceback; tensorstore's callbacks print theirs) are held back: after a failure they go to
``error.log`` in the run directory (``error.rank<N>.log`` on other ranks; on stderr before the last line when
that cannot be written, e.g. on a full disk), and the last line says where; after a success they are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from d9dfn.checkpoint import CheckpointCorruptedError
    from d9dfn.loop import TrainResult

__all__ = ["main"]


class _UsageError(Exception):
    """A command line argparse refuses; ``main`` turns it into one ``d9dfn: error:`` line and exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error raises instead of printing the usage block and exiting (one line, not four)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message}; see `{self.prog} --help`")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="d9dfn", description="A functional training and inference loop.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train a language-model job (no CONFIG: the embedded default job)"),
        ("infer", "validation perplexity and a sample from a job's latest checkpoint"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("config", nargs="?", type=Path, help="job config (JSON or YAML); default: embedded")
        command.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="a.b=value",
            help="override a config field (value parsed as JSON); repeatable",
        )
        if name == "train":
            command.add_argument(
                "--resume-from",
                type=_checkpoint_choice,
                default="latest",
                metavar=_CHOICES,
                help="the checkpoint to resume from: the newest (default; a corrupted one is an error), the newest "
                "intact one, or a step number; later steps are set aside in checkpoints/.d9dfn-set-aside",
            )
        else:
            _add_step_option(command)
    export = commands.add_parser("export", help="write a run's latest weights as safetensors")
    export.add_argument("run_dir", type=Path, help="the run directory (runs/<name>)")
    export.add_argument("out_dir", type=Path, help="where model.safetensors and config.json go")
    _add_step_option(export)
    export.add_argument(
        "--format",
        choices=("d9dfn", "hf"),
        default="d9dfn",
        help="d9dfn: d9dfn's names and config (default); hf: a Hugging Face folder of the job's model.family "
        "(Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) that transformers' "
        "AutoModelForCausalLM.from_pretrained loads",
    )
    return parser


_CHOICES = "{latest,newest-intact,STEP}"


def _add_step_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--step",
        type=_checkpoint_choice,
        default="latest",
        metavar=_CHOICES,
        help="the checkpoint to read: the newest (default; a corrupted one is an error), the newest intact one, "
        "or a step number",
    )


def _checkpoint_choice(text: str) -> int | str:
    """``--resume-from`` / ``--step``: which checkpoint a command reads."""
    if text in ("latest", "newest-intact"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not 'latest', 'newest-intact' or a step number (e.g. 200)")


def _corrupted(error: CheckpointCorruptedError, args: argparse.Namespace) -> str:
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


class _Phase:
    """Whether the run has started (set by the loop's ``*.ready`` event, once set-up is done), and its folder."""

    def __init__(self) -> None:
        self.running = False
        self.run_dir: Path | None = None
        self.doing = "set-up"
        """What the command is doing, for the line a signal outside the training loop prints."""

    def start(self) -> None:
        self.running = True


def _bad_input(error: BaseException | str, note: str = "") -> int:
    """Exactly one line ``d9dfn: error: ...`` (a message of several lines joined into one); exit code 2."""
    print(f"d9dfn: error: {_one_line(error)}{note}", file=sys.stderr)
    return 2


def _one_line(error: BaseException | str) -> str:
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


def _run_failed(error: BaseException, run_dir: Path | None, background: _BackgroundErrors) -> int:
    """The one-line summary (what failed, what is on disk, how to go on), the traceback, the summary again; exit 1.

    The summary comes first (what a reader of the top sees) and last (what a terminal shows after the traceback);
    errors of background threads go to the run's ``error.log`` (see the module docstring).
    """
    first_line = next(iter(str(error).splitlines()), "")
    what = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    summary = f"d9dfn: error: {what}{_on_disk(run_dir, error)}"
    print(summary, file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    print(summary + background.keep(run_dir), file=sys.stderr)
    return 1


def _on_disk(run_dir: Path | None, error: BaseException | None = None) -> str:
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


def _leave_process_group() -> bool:
    """Close the process group (if any) once training is done; ``True`` on the process that goes on alone.

    Evaluation and sampling read the checkpoint on one process (any checkpoint restores onto one), so
    under ``torchrun`` rank 0 continues and the other ranks exit. On a pipeline mesh every rank evaluates its
    stage first (``evaluate_lm``) and leaves only then.
    """
    import torch.distributed as dist

    from d9dfn.loop import is_main_process

    main = is_main_process()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 1, 2, 130 or 143: see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as error:
        return _bad_input(str(error))
    phase = _Phase()
    from d9dfn.loop import TrainingStopped

    with _BackgroundErrors.held() as background:
        try:
            with _signals_interrupt():
                code = _run(args, phase)
        except TrainingStopped as stop:  # the loop stopped at a step and committed its checkpoint
            if os.environ.get("TORCHELASTIC_RUN_ID") and threading.current_thread() is threading.main_thread():
                # Once one rank has exited (143), torchrun SIGTERMs the ranks still exiting: let them exit as stopped.
                for number in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(number, signal.SIG_IGN)
            main_process = _leave_process_group()  # every rank stopped after the same step; rank 0 says so
            if main_process:
                print(f"d9dfn: {stop}; to resume, run the same command: {_resume_command(argv)}", file=sys.stderr)
            return stop.exit_code
        except _Interrupted as interrupt:  # outside the loop (set-up, evaluation): nothing to finish
            print(_interrupted_line(interrupt.number, phase, _resume_command(argv)), file=sys.stderr)
            return 128 + interrupt.number
        except (ValueError, FileNotFoundError) as error:  # ConfigError and pydantic's errors are ValueErrors
            if phase.running:
                return _run_failed(error, phase.run_dir, background)
            from d9dfn.checkpoint import CheckpointCorruptedError

            if isinstance(error, CheckpointCorruptedError):
                return _bad_input(_corrupted(error, args), background.keep(phase.run_dir))
            return _bad_input(error, background.keep(phase.run_dir))
        except Exception as error:  # a bug or a crash, whenever it happened: the traceback is what helps
            return _run_failed(error, phase.run_dir, background)
        background.replay()
        return code


class _BackgroundErrors:
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
    def held(cls) -> Iterator[_BackgroundErrors]:
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

    def __init__(self, held: _BackgroundErrors) -> None:
        super().__init__()
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            logging.getLogger().callHandlers(record)
            return
        with self.held._lock:
            self.held.records.append(record)


class _Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT outside the training loop (which handles them itself): stop where the command is."""

    def __init__(self, number: int) -> None:
        super().__init__(number)
        self.number = number


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """While the command runs, SIGTERM interrupts it like SIGINT (Ctrl-C) does, as :class:`_Interrupted`.

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
        raise _Interrupted(number)

    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def _interrupted_line(number: int, phase: _Phase, command: str) -> str:
    """The one line for a signal outside the training loop: where it came, what a rerun starts from."""
    from d9dfn.loop import committed_steps

    rank = f"rank {os.environ.get('RANK', '?')}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    said = f"d9dfn: {rank}stopped by {signal.Signals(number).name} during {phase.doing} (no training step was running)"
    if phase.run_dir is None:
        return f"{said}; to retry, run the same command: {command}"
    steps = committed_steps(phase.run_dir / "checkpoints")
    if not steps:
        return f"{said}: no checkpoint saved in {phase.run_dir}; to start over, run the same command: {command}"
    return f"{said}: newest checkpoint step {steps[-1]} in {phase.run_dir}; to resume, run the same command: {command}"


def _resume_command(argv: Sequence[str] | None) -> str:
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


def _run(args: argparse.Namespace, phase: _Phase) -> int:
    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig, default_job, evaluate_lm, export_lm, inference_mesh, run_dir_of, train_lm

    step = None if args.command == "train" or args.step == "latest" else args.step
    if args.command == "export":
        phase.doing = "the export"
        path = export_lm(args.run_dir, args.out_dir, args.format, step=step)
        print(f"d9dfn: wrote {path}")
        return 0
    job = load_config(LMJobConfig, args.config, args.overrides, default=default_job())
    phase.run_dir = run_dir_of(job)
    # A pipeline mesh: every rank evaluates its stage, then all leave and rank 0 prints. Otherwise (plain data
    # parallelism under torchrun) the ranks leave first and rank 0 evaluates alone.
    pipelined = inference_mesh(job).pipeline_parallel > 1
    if args.command == "train":
        started = time.perf_counter()

        def training_started() -> None:
            phase.start()
            phase.doing = "the end of training"  # only a signal after the loop's last look lands here

        result = train_lm(job, on_ready=training_started, resume_from=args.resume_from)
        phase.doing = "the evaluation"
        seconds = time.perf_counter() - started
        main_process = _is_main_process() if pipelined else _leave_process_group()
        if main_process:
            _print_trained(result, seconds)
        elif not pipelined:
            return 0
    elif not pipelined and not _leave_process_group():
        return 0
    phase.doing = "the evaluation"
    report = evaluate_lm(job, on_ready=phase.start, step=step, reuse=True)
    if pipelined and not _leave_process_group():
        return 0
    if "stored" in report:  # this checkpoint was evaluated with these settings already (evaluate_lm)
        print(
            f"d9dfn: reusing the evaluation of checkpoint step {report['checkpoint_step']} stored in "
            f"{report['stored']} (delete it to evaluate again)"
        )
    print(
        f"d9dfn: validation perplexity {report['perplexity']:.3f} (nll {report['nll']:.4f} nats/byte over "
        f"{int(report['num_tokens'])} bytes, checkpoint step {report['checkpoint_step']})"
    )
    if args.command == "infer":
        print("d9dfn: sample:\n" + report["sample"])
    return 0


def _is_main_process() -> bool:
    from d9dfn.loop import is_main_process

    return is_main_process()


def _print_trained(result: TrainResult, seconds: float) -> None:
    print(f"d9dfn: trained {result.steps_run} steps in {seconds:.1f} s; run in {result.run_dir}")
    if result.steps_skipped:
        print(
            f"d9dfn: warning: {result.steps_skipped} of the {result.steps_run} steps were skipped (NaN/inf loss or "
            "gradient norm, skip_nonfinite=true); see the `skipped` column of the metrics"
        )
    if result.plot_path is not None:
        print(f"d9dfn: loss plot {result.plot_path}")


if __name__ == "__main__":
    sys.exit(main())
