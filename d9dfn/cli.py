"""The command line: ``d9dfn train``, ``d9dfn infer``, ``d9dfn export`` (also ``python -m d9dfn``).

Under ``torchrun``, the evaluation (after ``train``, and ``infer``) runs on rank 0 alone after the other ranks
leave, except on a pipeline mesh (``mesh.pipeline_parallel > 1``): there every rank evaluates its stage with the
inference schedule, and rank 0 prints.

Argument parsing and exit codes live here and nowhere else. The code says *when* something went wrong:

* 0: success.
* 2: bad input found before the run starts: a usage error (argparse), a config that does not load or
  validate, a missing file, a checkpoint that is missing, corrupted or does not fit the job on resume. One
  line ``d9dfn: error: ...`` names the field or file.
* 1: a failure once the run has started (after ``train.ready`` / ``inference.ready``: a task's shape
  error, a NaN loss, a dead peer), or an unexpected error during set-up: a one-line ``d9dfn: error: ...``
  summary (what failed, the newest checkpoint on disk, how to resume), then the traceback.
* 143 (SIGTERM) / 130 (SIGINT, Ctrl-C): stopped by the signal. During training the step in flight finishes and
  its checkpoint is committed first (``Trainer.train`` raises ``TrainingStopped``); elsewhere (set-up,
  evaluation) the command stops where it is. One line ``d9dfn: stopped by SIGTERM ...`` says what happened,
  the checkpoint a rerun resumes from and the command to rerun. A second signal exits at once, same code.
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d9dfn.loop import TrainResult

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d9dfn", description="A functional training and inference loop.")
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
                type=_resume_from,
                default="latest",
                metavar="{latest,newest-intact,STEP}",
                help="the checkpoint to resume from: the newest (default; a corrupted one is an error), the newest "
                "intact one, or a step number; later steps are set aside in checkpoints/.d9dfn-set-aside",
            )
    export = commands.add_parser("export", help="write a run's latest weights as safetensors")
    export.add_argument("run_dir", type=Path, help="the run directory (runs/<name>)")
    export.add_argument("out_dir", type=Path, help="where model.safetensors and config.json go")
    export.add_argument(
        "--format",
        choices=("d9dfn", "hf"),
        default="d9dfn",
        help="d9dfn: d9dfn's names and config (default); hf: a Hugging Face Qwen3ForCausalLM folder that "
        "transformers' AutoModelForCausalLM.from_pretrained loads",
    )
    return parser


def _resume_from(text: str) -> int | str:
    if text in ("latest", "newest-intact"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not 'latest', 'newest-intact' or a step number (e.g. 200)")


class _Phase:
    """Whether the run has started (set by the loop's ``*.ready`` event, once set-up is done), and its folder."""

    def __init__(self) -> None:
        self.running = False
        self.run_dir: Path | None = None
        self.doing = "set-up"
        """What the command is doing, for the line a signal outside the training loop prints."""

    def start(self) -> None:
        self.running = True


def _bad_input(message: str) -> int:
    print(f"d9dfn: error: {message}", file=sys.stderr)
    return 2


def _run_failed(error: BaseException, run_dir: Path | None) -> int:
    """The one-line summary (what failed, what is on disk, how to go on), then the traceback; exit code 1."""
    first_line = next(iter(str(error).splitlines()), "")
    what = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    print(f"d9dfn: error: {what}{_on_disk(run_dir)}", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    return 1


def _on_disk(run_dir: Path | None) -> str:
    """What a rerun would resume from: the newest committed checkpoint step of ``run_dir``, if any."""
    from d9dfn.loop import committed_steps

    if run_dir is None:
        return ""
    steps = committed_steps(run_dir / "checkpoints")
    if not steps:
        return f" [{run_dir}: no checkpoint saved yet; rerun the same command to start over]"
    return f" [{run_dir}: newest checkpoint step {steps[-1]}; rerun the same command to resume from it]"


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
    args = _parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    phase = _Phase()
    from d9dfn.loop import TrainingStopped

    try:
        with _signals_interrupt():
            return _run(args, phase)
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
            return _run_failed(error, phase.run_dir)
        return _bad_input(str(error))
    except Exception as error:  # a bug or a crash, whenever it happened: the traceback is what helps
        return _run_failed(error, phase.run_dir)


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

    if args.command == "export":
        phase.doing = "the export"
        path = export_lm(args.run_dir, args.out_dir, args.format)
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
    report = evaluate_lm(job, on_ready=phase.start)
    if pipelined and not _leave_process_group():
        return 0
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
