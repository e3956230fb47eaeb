"""The command line: ``d9dfn train``, ``d9dfn infer``, ``d9dfn export`` (also ``python -m d9dfn``).

Under ``torchrun``, the evaluation (after ``train``, and ``infer``) runs on rank 0 alone after the other ranks
leave, except on a pipeline mesh (``mesh.pipeline_parallel > 1``): there every rank evaluates its stage with the
inference schedule, and rank 0 prints.

Argument parsing and exit codes live here and nowhere else. The code says *when* something went wrong:

* 0: success.
* 2: bad input found before the run starts: a usage error (argparse), a config that does not load or
  validate, a missing file, a checkpoint that is missing, corrupted or does not fit the job on resume. One
  line ``d9dfn: error: ...`` names the field or file. A corrupted checkpoint is refused alike by ``train``,
  ``infer`` and ``export`` (each checks the whole step: ``docs/design/checkpoints.md``), and the line names
  the command's option that reads another step (``--resume-from`` / ``--step``).
* 1: a failure once the run has started (after ``train.ready`` / ``inference.ready``: a task's shape
  error, a NaN loss, a dead peer), or an unexpected error during set-up: a one-line ``d9dfn: error: ...``
  summary (what failed, the newest checkpoint on disk, how to resume), then the traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d9dfn.checkpoint import CheckpointCorruptedError
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
    if run_dir is None:
        return ""
    checkpoints = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []
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
    """Run the command line; returns the exit code (0, 1 or 2: see the module docstring)."""
    args = _parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    phase = _Phase()
    try:
        return _run(args, phase)
    except (ValueError, FileNotFoundError) as error:  # ConfigError and pydantic's errors are ValueErrors
        if phase.running:
            return _run_failed(error, phase.run_dir)
        from d9dfn.checkpoint import CheckpointCorruptedError

        if isinstance(error, CheckpointCorruptedError):
            return _bad_input(_corrupted(error, args))
        return _bad_input(str(error))
    except Exception as error:  # a bug or a crash, whenever it happened: the traceback is what helps
        return _run_failed(error, phase.run_dir)


def _run(args: argparse.Namespace, phase: _Phase) -> int:
    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig, default_job, evaluate_lm, export_lm, inference_mesh, run_dir_of, train_lm

    step = None if args.command == "train" or args.step == "latest" else args.step
    if args.command == "export":
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
        result = train_lm(job, on_ready=phase.start, resume_from=args.resume_from)
        seconds = time.perf_counter() - started
        main_process = _is_main_process() if pipelined else _leave_process_group()
        if main_process:
            _print_trained(result, seconds)
        elif not pipelined:
            return 0
    elif not pipelined and not _leave_process_group():
        return 0
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
