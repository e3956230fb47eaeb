"""``d9dfn`` exit codes: 0 on success, 2 for bad input found before the run starts, 1 once it has started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, job_argv

from d9dfn.cli import main
from d9dfn.jobs import Qwen3Provider
from d9dfn.tasks import CausalLMTask

TINY = (*TINY_TRAINER, "trainer.total_steps=2", "trainer.checkpointing.period_steps=2", *TINY_MODEL, *TINY_DATA)


def _argv(command: str, tmp_path: Path, *overrides: str) -> list[str]:
    return job_argv(command, tmp_path, *overrides, base=TINY)


def test_main_trains_and_evaluates_with_exit_code_0(tmp_path, capsys):
    assert main(_argv("train", tmp_path)) == 0
    assert "validation perplexity" in capsys.readouterr().out


def test_main_usage_error_exits_2_with_one_line(capsys):
    assert main(["train", "--no-such-flag"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "d9dfn: error: d9dfn: unrecognized arguments: --no-such-flag; see `d9dfn --help`"
    ]
    assert main(["train", "--resume-from", "yesterday"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "d9dfn: error: d9dfn train: argument --resume-from: 'yesterday' is not 'latest', 'newest-intact' or a step "
        "number (e.g. 200); see `d9dfn train --help`"
    ]


def test_main_help_still_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    assert "--resume-from" in capsys.readouterr().out


def test_main_config_error_exits_2_and_names_the_field(tmp_path, capsys):
    assert main(_argv("train", tmp_path, "model.num_layers=0")) == 2
    err = capsys.readouterr().err
    assert "model.num_layers" in err
    assert "Traceback" not in err


def test_main_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_main_checkpoint_that_does_not_fit_on_resume_exits_2(tmp_path, capsys):
    assert main(_argv("train", tmp_path)) == 0
    capsys.readouterr()
    assert main(_argv("train", tmp_path, "trainer.batching.microbatch_size=1")) == 2
    err = capsys.readouterr().err
    assert "microbatch_size=2 but this run has microbatch_size=1; to resume that run, keep --set " in err
    assert "Traceback" not in err
    # The constant learning rate of this job does not depend on total_steps: a finished run goes on.
    assert main(_argv("train", tmp_path, "trainer.total_steps=3")) == 0


@pytest.mark.parametrize("override", ["model.num_layers=2", "trainer.batching.microbatch_size=1"])
def test_main_refused_resume_leaves_job_json_and_export_intact(tmp_path, capsys, override):
    assert main(_argv("train", tmp_path)) == 0
    job_json = tmp_path / "stdlib-lm" / "job.json"
    good = job_json.read_bytes()
    capsys.readouterr()
    assert main(_argv("train", tmp_path, override)) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert job_json.read_bytes() == good  # written only once the resume check has passed
    assert main(["export", str(tmp_path / "stdlib-lm"), str(tmp_path / "export")]) == 0
    mode = (tmp_path / "export" / "model.safetensors").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # 0644 under the usual umask 022, as for any file the user writes


def test_main_value_error_during_the_run_exits_1_with_the_traceback(tmp_path, capsys, monkeypatch):
    def broken_loss(self, outputs, state, step):
        raise ValueError("compute_loss: logits have the wrong shape")

    monkeypatch.setattr(CausalLMTask, "compute_loss", broken_loss)
    assert main(_argv("train", tmp_path)) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert "broken_loss" in err
    summary = _summary_before_traceback(err)  # what failed, what is on disk, how to go on
    assert summary.startswith("d9dfn: error: ValueError: compute_loss: logits have the wrong shape [")
    assert summary.endswith("no checkpoint saved yet; rerun the same command to start over]")


def test_main_unexpected_error_during_set_up_exits_1_with_the_traceback(tmp_path, capsys, monkeypatch):
    def crash(self, context):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Qwen3Provider, "initialize_model_stage", crash)
    assert main(_argv("train", tmp_path)) == 1
    err = capsys.readouterr().err
    assert _summary_before_traceback(err).startswith("d9dfn: error: RuntimeError: out of memory [")


def _summary_before_traceback(err: str) -> str:
    """The ``d9dfn: error:`` summary, checked to come before the traceback and again as the last line."""
    lines = err.splitlines()
    summaries = [i for i, line in enumerate(lines) if line.startswith("d9dfn: error:")]
    assert len(summaries) == 2, lines
    assert summaries[0] < lines.index("Traceback (most recent call last):")
    assert summaries[1] == len(lines) - 1
    assert lines[summaries[0]] == lines[summaries[1]]
    return lines[summaries[0]]


def _cli_process(*argv: str) -> subprocess.CompletedProcess:
    # A child process: orbax's at-exit noise (if any) lands in its stderr, where a user would see it.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "d9dfn", *argv], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.slow
@pytest.mark.cli
def test_main_corrupt_latest_checkpoint_is_refused_then_resumed_from_the_newest_intact_step(tmp_path, capsys):
    steps = ("trainer.total_steps=4", "trainer.logging.period_steps=1")
    assert main(_argv("train", tmp_path / "clean", *steps)) == 0
    assert main(_argv("train", tmp_path, *steps)) == 0  # steps 2 and 4 saved
    capsys.readouterr()
    run = tmp_path / "stdlib-lm"
    arrays = run / "checkpoints" / "4" / "rank_00000"
    for file in [f for f in arrays.rglob("*") if f.is_file() and f.stat().st_size > 1000]:
        file.write_bytes(file.read_bytes()[:100])  # truncated array files: the manifests still read
    argv = _argv("train", tmp_path, *steps)
    refused = _cli_process(*argv)
    assert refused.returncode == 2, refused.stderr
    assert "step 4" in refused.stderr
    assert "--resume-from newest-intact" in refused.stderr
    assert "Traceback" not in refused.stderr  # nor orbax's "RuntimeError: Event loop is closed"
    assert "Event loop is closed" not in refused.stderr

    resumed = _cli_process(*argv, "--resume-from", "newest-intact")
    assert resumed.returncode == 0, resumed.stderr
    assert f"d9dfn: resuming {run} from step 2 (resume_from='newest-intact')" in resumed.stdout
    assert "set aside the later step(s) [4]" in resumed.stdout
    assert (run / "checkpoints" / ".d9dfn-set-aside" / "4").is_dir()
    # Resumed at step 2 with step 2's data position and log: the same records as a run never interrupted.
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "clean" / "stdlib-lm" / "metrics.jsonl").read_bytes()


def test_main_resume_from_a_named_step_and_a_missing_one(tmp_path, capsys):
    assert main(_argv("train", tmp_path, "trainer.total_steps=4", "trainer.checkpointing.period_steps=1")) == 0
    capsys.readouterr()
    assert main([*_argv("train", tmp_path, "trainer.total_steps=4"), "--resume-from", "9"]) == 2
    checkpoints = tmp_path / "stdlib-lm" / "checkpoints"
    assert capsys.readouterr().err == (  # in the command's terms (was: "pass one of them, or None for the newest")
        f"d9dfn: error: --resume-from 9: {checkpoints} holds no step 9 (saved steps: [3, 4]); pass one of "
        "them, or leave --resume-from out to resume from the newest\n"
    )
    assert main([*_argv("train", tmp_path, "trainer.total_steps=4"), "--resume-from", "3"]) == 0
    out = capsys.readouterr().out
    assert f"d9dfn: resuming {tmp_path}/stdlib-lm from step 3 (resume_from=3)\n" in out
    # The folders as paths (was: a Python list of PosixPath(...)).
    assert f"d9dfn: set aside the later step(s) [4]: {checkpoints / '.d9dfn-set-aside' / '4'}\n" in out
    assert main([*_argv("train", tmp_path), "--resume-from", "newest"]) == 2
    assert "'newest' is not 'latest', 'newest-intact' or a step number" in capsys.readouterr().err


def test_main_infer_without_a_checkpoint_names_keys_the_cli_accepts(tmp_path, capsys):
    assert main(_argv("infer", tmp_path)) == 2
    err = capsys.readouterr().err
    assert "trainer.checkpointing.save_dir and trainer.run.name" in err
    assert "checkpointing.load_dir" not in err  # an InferenceConfig key, not one of the job's
    # The keys the hint names are keys the CLI accepts:
    assert main(_argv("infer", tmp_path, f"trainer.checkpointing.save_dir={tmp_path}", "trainer.run.name=x")) == 2
    assert "unknown key" not in capsys.readouterr().err
