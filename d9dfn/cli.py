"""The command line: ``d9dfn train``, ``d9dfn infer``, ``d9dfn export`` (also ``python -m d9dfn``).

Argument parsing and exit codes live here and nowhere else: 0 on success, 2 for a bad config, a missing
file or a checkpoint that does not fit, 1 for a failure during the run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

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
    export = commands.add_parser("export", help="write a run's latest weights as safetensors")
    export.add_argument("run_dir", type=Path, help="the run directory (runs/<name>)")
    export.add_argument("out_dir", type=Path, help="where model.safetensors and config.json go")
    return parser


def _fail(message: str) -> int:
    print(f"d9dfn: error: {message}", file=sys.stderr)
    return 2


def _leave_process_group() -> bool:
    """Close the process group (if any) once training is done; ``True`` on the process that goes on alone.

    Evaluation and sampling read the checkpoint on one process (any checkpoint restores onto one), so
    under ``torchrun`` rank 0 continues and the other ranks exit.
    """
    import torch.distributed as dist

    from d9dfn.loop import is_main_process

    main = is_main_process()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return main


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    from d9dfn.config import ConfigError, load_config
    from d9dfn.jobs import LMJobConfig, default_job, evaluate_lm, export_lm, train_lm
    from d9dfn.loop import CollectiveError

    try:
        if args.command == "export":
            path = export_lm(args.run_dir, args.out_dir)
            print(f"d9dfn: wrote {path}")
            return 0
        job = load_config(LMJobConfig, args.config, args.overrides, default=default_job())
        if args.command == "train":
            started = time.perf_counter()
            result = train_lm(job)
            seconds = time.perf_counter() - started
            if not _leave_process_group():  # under torchrun: rank 0 evaluates alone, the others are done
                return 0
            print(f"d9dfn: trained {result.steps_run} steps in {seconds:.1f} s; run in {result.run_dir}")
            if result.plot_path is not None:
                print(f"d9dfn: loss plot {result.plot_path}")
        elif not _leave_process_group():
            return 0
        report = evaluate_lm(job)
        print(
            f"d9dfn: validation perplexity {report['perplexity']:.3f} (nll {report['nll']:.4f} nats/byte over "
            f"{int(report['num_tokens'])} bytes, checkpoint step {report['checkpoint_step']})"
        )
        if args.command == "infer":
            print("d9dfn: sample:\n" + report["sample"])
        return 0
    except (ConfigError, FileNotFoundError) as error:
        return _fail(str(error))
    except CollectiveError as error:  # another rank died or stalled: say so, exit 1 instead of hanging
        print(f"d9dfn: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # a checkpoint that does not fit this config, a corrupted checkpoint
        return _fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
