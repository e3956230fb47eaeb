"""The loop end to end: Trainer.train, Inference.infer, checkpoints, resume, events, export and the CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from d9dfn.cli import main
from d9dfn.config import DeviceMeshParameters, load_config
from d9dfn.jobs import (
    CorpusProvider,
    LMJobConfig,
    Qwen3Provider,
    evaluate_lm,
    export_lm,
    run_dir_of,
    train_lm,
)
from d9dfn.loop import TrainingConfigurator
from d9dfn.loop import _events as ev
from d9dfn.models import Qwen3LM
from d9dfn.tasks import CausalLMTask

TINY = [
    "trainer.total_steps=12",
    "trainer.batching.global_batch_size=4",
    "trainer.batching.microbatch_size=2",
    "trainer.checkpointing.period_steps=4",
    "trainer.checkpointing.num_to_keep=2",
    "trainer.logging.period_steps=2",
    "trainer.lr_scheduler=null",
    "trainer.compile=false",
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=8",
    "model.intermediate_size=32",
    "data.max_bytes=20000",
    "data.seq_len=16",
    "eval_batches=2",
    "sample.num_bytes=8",
]


def tiny_job(tmp_path: Path, *overrides: str) -> LMJobConfig:
    return load_config(
        LMJobConfig, None, [*TINY, f"trainer.checkpointing.save_dir={tmp_path}", *overrides], default=LMJobConfig()
    )


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl; fails if any step was logged twice."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# --- end to end --------------------------------------------------------------------------------------


def test_train_lm_trains_keeps_checkpoints_evaluates_and_exports(tmp_path):
    job = tiny_job(tmp_path)
    result = train_lm(job)
    trace = losses(result.run_dir)
    assert sorted(trace) == list(range(1, 13))  # every step logged exactly once
    assert trace[12] < trace[1]  # the loss falls
    assert sorted(int(p.name) for p in (result.run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [8, 12]
    assert (result.run_dir / "hparams.json").is_file()
    assert any(
        "metrics/" in key
        for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        for key in json.loads(line)
    )

    report = evaluate_lm(job)
    assert report["checkpoint_step"] == 12
    assert 1.0 < report["perplexity"] < 256.0
    assert report["sample"].startswith("def ")

    path = export_lm(result.run_dir, tmp_path / "export")
    model = Qwen3LM(job.model.to_qwen3(job.data.seq_len))
    model.load_state_dict(load_file(path), strict=True)
    ids = torch.randint(0, 256, (1, 8))
    expected = torch.func.functional_call(model, {**result.state.params, **result.state.buffers}, (ids,))
    torch.testing.assert_close(model(ids)["logits"], expected["logits"])


class RecordingTask(CausalLMTask):
    """Records every event id it sees, in order."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def register_events(self, bus: ev.EventBus) -> None:
        for event in ev.TRAIN_EVENTS:
            bus.subscribe(event, lambda ctx, event=event: self.seen.append(event.id))


class NaNFromStep5Task(CausalLMTask):
    """The loss turns NaN from the fifth step on (a pure function of the step tensor)."""

    def compute_loss(self, outputs, state, step):
        result = super().compute_loss(outputs, state, step)
        poison = torch.where(step >= 4, torch.tensor(float("nan")), torch.tensor(1.0))
        return result.replace(loss=result.loss * poison)


def _configure(job: LMJobConfig, seen: list[str], task_class: type = RecordingTask):
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=lambda: task_class(seen) if task_class is RecordingTask else task_class(),
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()


def test_trainer_event_order_for_three_steps_with_two_microbatches(tmp_path):
    seen: list[str] = []
    job = tiny_job(tmp_path, "trainer.total_steps=3")
    _configure(job, seen).train()
    per_step = [
        "train.step.pre",
        "train.forward_backward.pre",
        "train.forward_backward.post",
        "train.optimizer_step.pre",
        "train.optimizer_step.post",
        "train.step.post",
    ]
    assert seen == [
        "train.configuration.start",
        "train.configuration.data_loader",
        "train.configuration.model_stages",
        "train.configuration.optimizer",
        "train.configuration.lr_scheduler",
        "train.ready",
        *per_step * 3,
        "train.finished",
    ]


def test_trainer_already_trained_still_finalizes_and_fires_finished(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=2")
    _configure(job, []).train()
    seen: list[str] = []
    result = _configure(job, seen).train()
    assert result.steps_run == 0
    assert int(result.state.step) == 2
    assert seen[-1] == "train.finished"
    assert "train.step.pre" not in seen


def test_trainer_refuses_a_checkpoint_with_other_totals(tmp_path):
    train_lm(tiny_job(tmp_path, "trainer.total_steps=4"))
    with pytest.raises(ValueError, match=r"total_steps=4 but this run has total_steps=6"):
        train_lm(tiny_job(tmp_path, "trainer.total_steps=6"))


@pytest.mark.slow
def test_trainer_stops_on_nan_loss_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=8")
    with pytest.raises(FloatingPointError, match=r"NaN/inf at step\(s\) \[5, 6\].*last checkpoint is intact"):
        _configure(job, [], NaNFromStep5Task).train()
    # Steps 1-4 were finite and checkpointed; the run can still be evaluated from there.
    assert evaluate_lm(job)["checkpoint_step"] == 4


@pytest.mark.slow
def test_trainer_skip_nonfinite_finishes_the_run_with_the_last_finite_params(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=6", "trainer.skip_nonfinite=true")
    result = _configure(job, [], NaNFromStep5Task).train()
    assert int(result.state.step) == 6
    finite = _configure(tiny_job(tmp_path / "finite", "trainer.total_steps=4"), []).train()
    torch.testing.assert_close(result.state.params, finite.state.params, rtol=0, atol=0)


# --- the command line and bad inputs -----------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_cli_rejects_an_unknown_config_key(capsys):
    code, out = _cli(capsys, "train", "--set", "trainer.batching.global_batchsize=8")
    assert code == 2
    assert "trainer.batching" in out
    assert "global_batchsize" in out


def test_cli_rejects_a_wrong_type(capsys):
    code, out = _cli(capsys, "train", "--set", "trainer.total_steps=many")
    assert code == 2
    assert "trainer.total_steps" in out


def test_cli_rejects_a_global_batch_the_microbatch_does_not_divide(capsys):
    code, out = _cli(
        capsys, "train", "--set", "trainer.batching.global_batch_size=10", "--set", "trainer.batching.microbatch_size=4"
    )
    assert code == 2
    assert "microbatch_size" in out


def test_cli_rejects_a_missing_config_file(capsys, tmp_path):
    code, out = _cli(capsys, "train", str(tmp_path / "nope.json"))
    assert code == 2
    assert "nope.json" in out


def test_cli_infer_without_a_checkpoint_says_train_first(capsys, tmp_path):
    code, out = _cli(capsys, "infer", "--set", f"trainer.checkpointing.save_dir={tmp_path}")
    assert code == 2
    assert "train first" in out


def test_cli_infer_reports_a_corrupted_checkpoint(capsys, tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=4")
    train_lm(job)
    config = tmp_path / "job.json"
    config.write_text(job.model_dump_json())
    for array in (run_dir_of(job) / "checkpoints" / "4").rglob("*"):
        if array.is_file() and array.stat().st_size > 1000:
            array.write_bytes(array.read_bytes()[:100])
    code, out = _cli(capsys, "infer", str(config))
    assert code == 2
    assert "4" in out
    assert "corrupt" in out.lower()


# --- exact resume after SIGKILL ------------------------------------------------------------------------


def _run_cli(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "d9dfn", "train", str(config)],
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
def test_train_resumes_bitwise_after_sigkill(tmp_path):
    rng = random.Random(1234)
    overrides = [
        "trainer.total_steps=16",
        "trainer.checkpointing.period_steps=3",
        "trainer.logging.period_steps=1",
        "data.max_bytes=40000",
    ]
    configs = {}
    for name in ("killed", "clean"):
        job = tiny_job(tmp_path / name, *overrides)
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(job.model_dump_json())
    clean = _run_cli(configs["clean"], tmp_path / "clean.log")
    assert clean.wait(timeout=300) == 0, (tmp_path / "clean.log").read_text()

    metrics = tmp_path / "killed" / "stdlib-lm" / "metrics.jsonl"
    kill_after = rng.randint(1, 12)  # steps logged before the kill, then a random extra delay
    log = tmp_path / "killed.log"
    process = _run_cli(configs["killed"], log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            time.sleep(rng.uniform(0.0, 0.3))
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = _run_cli(configs["killed"], log)
    assert resumed.wait(timeout=300) == 0, log.read_text()

    expected = losses(tmp_path / "clean" / "stdlib-lm")
    got = losses(tmp_path / "killed" / "stdlib-lm")
    assert sorted(got) == list(range(1, 17))
    assert got == expected  # bitwise: JSON floats round-trip exactly


def test_trainer_writes_profiler_traces_on_the_configured_period(tmp_path):
    traces = tmp_path / "traces"
    job = tiny_job(
        tmp_path,
        "trainer.total_steps=4",
        f"trainer.profiling.traces_dir={traces}",
        "trainer.profiling.period_steps=3",
        "trainer.profiling.warmup_steps=1",
        "trainer.profiling.active_steps=1",
    )
    train_lm(job)
    assert [p.suffix for p in traces.iterdir()] == [".json"]


def test_examples_pretrain_json_is_a_valid_job():
    root = Path(__file__).resolve().parent.parent
    job = load_config(LMJobConfig, root / "examples" / "pretrain.json")
    assert job.trainer.batching.global_batch_size // job.trainer.batching.microbatch_size == 2


@pytest.mark.slow
def test_trainer_starts_from_source_checkpoint_weights(tmp_path):
    first = train_lm(tiny_job(tmp_path / "a", "trainer.total_steps=2"))
    export_lm(first.run_dir, tmp_path / "export")
    job = tiny_job(
        tmp_path / "b",
        "trainer.total_steps=1",
        f"trainer.model_stage_factory.source_checkpoint={tmp_path / 'export'}",
        "trainer.optimizer.lr=1e-12",  # one step that barely moves: the weights are the exported ones
    )
    second = train_lm(job)
    torch.testing.assert_close(second.state.params, first.state.params, rtol=1e-6, atol=1e-9)
