"""``d9dfn train``, ``d9dfn infer``, ``d9dfn export``: the parser, ``main`` and each command's run (the exit codes
are in the package's docstring)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from d9dfn.cli._errors import BackgroundErrors, bad_input, corrupted, run_failed
from d9dfn.cli._interrupt import Interrupted, interrupted_line, resume_command, signals_interrupt

if TYPE_CHECKING:
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
        (
            "train",
            "train a job: a language model (no CONFIG: the embedded default job), or a classifier (job=classification)",
        ),
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
        choices=("d9dfn", "hf", "peft"),
        default="d9dfn",
        help="d9dfn: d9dfn's names and config (default); hf: a Hugging Face folder of the job's model.family "
        "(Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) that transformers' "
        "AutoModelForCausalLM.from_pretrained loads (a trainer.peft run: its adapters merged into the base); "
        "peft: a LoRA run's adapters alone (adapter_config.json, adapter_model.safetensors) for "
        "peft.PeftModel.from_pretrained. The weights are written in the dtype the run kept them in "
        "(trainer.precision.param_dtype: float32, or bfloat16 for a pure-bf16 run; hf's config.json says which)",
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


class _Phase:
    """Whether the run has started (set by the loop's ``*.ready`` event, once set-up is done), and its folder."""

    def __init__(self) -> None:
        self.running = False
        self.run_dir: Path | None = None
        self.doing = "set-up"
        """What the command is doing, for the line a signal outside the training loop prints."""
        self.trained = False
        """Whether training has finished (``d9dfn train``, before its evaluation)."""

    def start(self) -> None:
        self.running = True


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
        return bad_input(str(error))
    phase = _Phase()
    from d9dfn.loop import TrainingStopped

    with BackgroundErrors.held() as background:
        try:
            with signals_interrupt():
                code = _run(args, phase)
        except TrainingStopped as stop:  # the loop stopped at a step and committed its checkpoint
            if os.environ.get("TORCHELASTIC_RUN_ID") and threading.current_thread() is threading.main_thread():
                # Once one rank has exited (143), torchrun SIGTERMs the ranks still exiting: let them exit as stopped.
                for number in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(number, signal.SIG_IGN)
            main_process = _leave_process_group()  # every rank stopped after the same step; rank 0 says so
            if main_process:
                print(f"d9dfn: {stop}; to resume, run the same command: {resume_command(argv)}", file=sys.stderr)
            return stop.exit_code
        except Interrupted as interrupt:  # outside the loop (set-up, evaluation): nothing to finish
            line = interrupted_line(
                interrupt.number, phase.doing, phase.run_dir, resume_command(argv), trained=phase.trained
            )
            print(line, file=sys.stderr)
            return 128 + interrupt.number
        except (ValueError, FileNotFoundError) as error:  # ConfigError and pydantic's errors are ValueErrors
            if phase.running:
                return run_failed(error, phase.run_dir, background)
            from d9dfn.checkpoint import CheckpointCorruptedError

            if isinstance(error, CheckpointCorruptedError):
                return bad_input(corrupted(error, args), background.keep(phase.run_dir))
            return bad_input(error, background.keep(phase.run_dir))
        except Exception as error:  # a bug or a crash, whenever it happened: the traceback is what helps
            return run_failed(error, phase.run_dir, background)
        background.replay()
        return code


def _run(args: argparse.Namespace, phase: _Phase) -> int:
    from d9dfn.config import config_value, load_config
    from d9dfn.jobs import LMJobConfig, default_job, evaluate_lm, export_lm, inference_mesh, run_dir_of, train_lm

    step = None if args.command == "train" or args.step == "latest" else args.step
    if args.command == "export":
        phase.doing = "the export"
        _check_step_choice(args, args.run_dir)
        path = export_lm(args.run_dir, args.out_dir, args.format, step=step)
        print(f"d9dfn: wrote {path}")
        return 0
    if config_value(args.config, args.overrides, "job") == "classification":
        return _run_classification(args, phase)
    job = load_config(LMJobConfig, args.config, args.overrides, default=default_job())
    _check_step_choice(args, run_dir_of(job))
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
        phase.doing, phase.trained = "the evaluation after training", True
        seconds = time.perf_counter() - started
        main_process = _is_main_process() if pipelined else _leave_process_group()
        if main_process:
            _print_trained(result, seconds)
        elif not pipelined:
            return 0
    elif not pipelined and not _leave_process_group():
        return 0
    phase.doing = "the evaluation after training" if phase.trained else "the evaluation"
    report = evaluate_lm(job, on_ready=phase.start, step=step, reuse=True)
    if pipelined and not _leave_process_group():
        return 0
    if "stored" in report:  # this checkpoint was evaluated with these settings already (evaluate_lm)
        print(
            f"d9dfn: reusing the evaluation of checkpoint step {report['checkpoint_step']} stored in "
            f"{report['stored']} (delete it to evaluate again)"
        )
    unit = report.get("unit", "byte")  # a token of model.source's tokenizer, or a byte
    print(
        f"d9dfn: validation perplexity {report['perplexity']:.3f} (nll {report['nll']:.4f} nats/{unit} over "
        f"{int(report['num_tokens'])} {unit}s, checkpoint step {report['checkpoint_step']})"
    )
    if args.command == "infer":
        print("d9dfn: sample:\n" + report["sample"])
    return 0


def _run_classification(args: argparse.Namespace, phase: _Phase) -> int:
    """A config with ``"job": "classification"``: ``d9dfn train`` trains the classifier (its metrics are in the run's
    ``metrics.jsonl``); ``infer`` has nothing to evaluate apart from those yet, and is refused."""
    from d9dfn.config import load_config
    from d9dfn.jobs import ClassificationJobConfig, classifier_run_dir, default_classification_job, train_classifier

    job = load_config(ClassificationJobConfig, args.config, args.overrides, default=default_classification_job())
    if args.command != "train":
        raise ValueError(
            f"d9dfn {args.command}: a classification job (job=classification) has no {args.command} command yet; its "
            "validation metrics are logged while it trains (trainer.evaluation, data.validation_files), in "
            f"{classifier_run_dir(job) / 'metrics.jsonl'}"
        )
    _check_step_choice(args, classifier_run_dir(job))
    phase.run_dir = classifier_run_dir(job)
    started = time.perf_counter()
    result = train_classifier(job, on_ready=phase.start, resume_from=args.resume_from)
    if _leave_process_group():
        _print_trained(result, time.perf_counter() - started)
    return 0


def _check_step_choice(args: argparse.Namespace, run_dir: Path) -> None:
    """A step number given to ``--step`` / ``--resume-from`` must be saved in ``run_dir``: refused in this command's
    terms before anything is built (the checkpoint store would name its own API's arguments)."""
    from d9dfn.loop import committed_steps

    option, choice = ("--resume-from", args.resume_from) if args.command == "train" else ("--step", args.step)
    if not isinstance(choice, int):
        return
    checkpoints = run_dir / "checkpoints"
    steps = committed_steps(checkpoints)
    if choice in steps:
        return
    if not steps:
        fix = "leave --resume-from out to start from scratch" if args.command == "train" else "train first"
        raise FileNotFoundError(f"{option} {choice}: {checkpoints} holds no checkpoint; {fix}")
    leave = "resume from" if args.command == "train" else "read"
    raise FileNotFoundError(
        f"{option} {choice}: {checkpoints} holds no step {choice} (saved steps: {steps}); pass one of them, or leave "
        f"{option} out to {leave} the newest"
    )


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
