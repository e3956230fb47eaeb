"""The loop end to end: Trainer.train, Inference.infer, checkpoints, resume, events, export and the CLI."""

from __future__ import annotations

import gc
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
from d9dfn.config import (
    DataLoadingConfig,
    DeterminismConfig,
    DeviceMeshParameters,
    GarbageCollectionConfig,
    InferenceCheckpointingConfig,
    InferenceConfig,
    ModelStageFactoryConfig,
    ProfilingConfig,
    load_config,
)
from d9dfn.jobs import (
    CorpusProvider,
    LMJobConfig,
    Qwen3Provider,
    evaluate_lm,
    export_lm,
    run_dir_of,
    train_lm,
)
from d9dfn.loop import InferenceConfigurator, TrainingConfigurator
from d9dfn.loop import _events as ev
from d9dfn.models import Qwen3LM
from d9dfn.step._tail import Tail
from d9dfn.tasks import CausalLMTask, PerplexityTask

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
    assert report["num_tokens"] == job.eval_batches * 4 * job.data.seq_len  # eval_batches global batches of 4
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


WARMUP_THEN_COSINE = (
    'trainer.lr_scheduler={"name": "piecewise", "scheduler": {"initial_multiplier": 0.1, "phases": ['
    '{"mode": "steps", "steps": 2, "target_multiplier": 1, "curve": {"type": "linear"}}, '
    '{"mode": "rest", "target_multiplier": 0.1, "curve": {"type": "cosine"}}]}}'
)
"""A warm-up of 2 steps, then a cosine to the last step: the rate of step 3 on depends on total_steps."""


def test_trainer_refuses_a_checkpoint_with_other_totals_and_says_how_to_go_on(tmp_path):
    train_lm(tiny_job(tmp_path, "trainer.total_steps=4", WARMUP_THEN_COSINE))
    with pytest.raises(ValueError, match="depends on total_steps") as refused:
        train_lm(tiny_job(tmp_path, "trainer.total_steps=6", WARMUP_THEN_COSINE))
    assert str(refused.value) == (
        f"Trainer: checkpoint {tmp_path}/stdlib-lm/checkpoints/4 was saved with total_steps=4 but this run has "
        "total_steps=6, and the learning-rate schedule depends on total_steps: step 3 had multiplier 0.55, which "
        "total_steps=6 would make 0.868198. To resume that run, keep --set trainer.total_steps=4; to train 6 steps, "
        "start a new run: --set trainer.run.name=stdlib-lm-new (run.name in a TrainerConfig)"
    )
    with pytest.raises(
        ValueError, match=r"saved with microbatch_size=2 but this run has microbatch_size=4; to resume "
    ):
        train_lm(tiny_job(tmp_path, "trainer.total_steps=4", WARMUP_THEN_COSINE, "trainer.batching.microbatch_size=4"))
    with pytest.raises(ValueError, match=r"the checkpoint is already at step 4"):
        train_lm(tiny_job(tmp_path, "trainer.total_steps=3", WARMUP_THEN_COSINE))


def test_trainer_extends_a_finished_run_whose_schedule_allows_it_bitwise(tmp_path, capsys):
    """A constant learning rate (and a warm-up alone) does not depend on total_steps: 4 steps, then on to 6, end
    with the weights of 6 steps in one go, and the resumed run says where it resumed and that it extended."""
    warmup_only = (
        'trainer.lr_scheduler={"name": "piecewise", "scheduler": {"initial_multiplier": 0.1, "phases": ['
        '{"mode": "steps", "steps": 2, "target_multiplier": 1, "curve": {"type": "linear"}}]}}'
    )
    train_lm(tiny_job(tmp_path / "extended", "trainer.total_steps=4", warmup_only))
    capsys.readouterr()
    extended = train_lm(tiny_job(tmp_path / "extended", "trainer.total_steps=6", warmup_only))
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"d9dfn: resuming {tmp_path}/extended/stdlib-lm from step 4",
        f"d9dfn: extending {tmp_path}/extended/stdlib-lm from total_steps=4 to 6 (the learning rate of steps 1-4 is "
        "the same under both)",
    ]
    assert extended.steps_run == 2
    whole = train_lm(tiny_job(tmp_path / "whole", "trainer.total_steps=6", warmup_only))
    torch.testing.assert_close(extended.state.params, whole.state.params, rtol=0, atol=0)
    assert losses(extended.run_dir) == losses(whole.run_dir)


@pytest.mark.slow
def test_trainer_stops_on_nan_loss_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=8")
    with pytest.raises(
        FloatingPointError, match=r"NaN/inf at step\(s\) \[5, 6\].*newest committed checkpoint is step 4"
    ):
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


def test_trainer_nan_before_any_checkpoint_says_none_is_saved(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=8", "trainer.checkpointing.period_steps=100")
    with pytest.raises(FloatingPointError, match=r"no checkpoint has been saved yet .* a rerun starts from scratch"):
        _configure(job, [], NaNFromStep5Task).train()


def test_trainer_counts_skipped_steps_in_metrics_and_the_result(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=8", "trainer.skip_nonfinite=true")
    result = _configure(job, [], NaNFromStep5Task).train()
    assert result.steps_skipped == 4
    assert logged(run_dir_of(job), "skipped") == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1}


def test_trainer_stops_after_max_consecutive_skipped_steps(tmp_path):
    job = tiny_job(
        tmp_path, "trainer.total_steps=12", "trainer.skip_nonfinite=true", "trainer.max_consecutive_skipped_steps=2"
    )
    with pytest.raises(
        FloatingPointError, match=r"3 consecutive steps \(up to step 7\).*max_consecutive_skipped_steps=2.*step 4"
    ):
        _configure(job, [], NaNFromStep5Task).train()
    assert logged(run_dir_of(job), "skipped") == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1}


def test_cli_summary_counts_skipped_steps(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("d9dfn.jobs._lm.CausalLMTask", NaNFromStep5Task)
    overrides = ["trainer.total_steps=6", "trainer.skip_nonfinite=true", f"trainer.checkpointing.save_dir={tmp_path}"]
    code, out = _cli(capsys, "train", *[arg for o in [*TINY, *overrides] for arg in ("--set", o)])
    assert code == 0, out
    assert "2 of the 6 steps were skipped" in out


PIECEWISE = (
    'trainer.lr_scheduler={"name": "piecewise", "scheduler": {"initial_multiplier": 0.5, "phases": ['
    '{"mode": "steps", "steps": 2, "target_multiplier": 1.0, "curve": {"type": "linear"}}, '
    '{"mode": "rest", "target_multiplier": 0.25, "curve": {"type": "linear"}}]}}'
)


def logged(run_dir: Path, column: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[column] for r in records if column in r}


@pytest.mark.slow  # two compiled tiny jobs
def test_trainer_logs_the_rate_the_update_used_for_the_auto_and_a_user_optimizer(tmp_path):
    from d9dfn import optim
    from d9dfn.config import build_lr_schedule

    job = tiny_job(tmp_path / "auto", "trainer.total_steps=4", PIECEWISE)
    multiplier = build_lr_schedule(job.trainer.lr_scheduler, 4)
    base_lr = job.trainer.optimizer.lr
    auto = _configure(job, []).train()
    expected = {s: float(base_lr * multiplier(torch.tensor(s - 1))) for s in range(1, 5)}
    assert logged(auto.run_dir, "lr") == expected  # the rate, not the multiplier (0.5, 0.75, ...)
    assert len(set(expected.values())) == 4

    # A user optimizer provider: the loop cannot know its rate; the optimizer's state records it.
    job = tiny_job(tmp_path / "user", "trainer.total_steps=4", PIECEWISE)
    user = TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
        optimizer_provider=lambda context: optim.sgd(lambda step: 0.02 * context.lr_multiplier(step)),
    ).configure()
    result = user.train()
    assert logged(result.run_dir, "lr") == {s: float(0.02 * multiplier(torch.tensor(s - 1))) for s in range(1, 5)}


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


def _run_cli(
    config: Path, log: Path, *, threads: int = 1, command: list[str] | None = None, compile_cache: Path | None = None
) -> subprocess.Popen:
    """``python -m d9dfn train CONFIG`` (or ``command``) in a child process, its output appended to ``log``.

    ``compile_cache``: an inductor cache directory of the test's (``TORCHINDUCTOR_CACHE_DIR``, which the run's own
    cache gives way to), so that two runs of the same job compile once: what is compared is what the compiled
    kernels compute, run after run, not how they were built.
    """
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),  # this tree's d9dfn, not an installed one
        "GLOO_SOCKET_IFNAME": "lo",  # for a torchrun ``command``
        **({"TORCHINDUCTOR_CACHE_DIR": str(compile_cache)} if compile_cache is not None else {}),
    }
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command or [sys.executable, "-m", "d9dfn", "train", str(config)],
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _logged_steps(metrics: Path) -> int:
    """The highest step with a complete record in ``metrics`` (0 if none)."""
    if not metrics.exists():
        return 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()[:-1] if line.strip()]
    return max(steps, default=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("compile_", "threads", "num_kills"),
    [(False, 1, 1), (True, 2, 2)],
    ids=["eager-1-thread", "compiled-2-threads"],
)
@pytest.mark.cli
def test_train_resumes_bitwise_after_sigkill(tmp_path, compile_, threads, num_kills):
    """SIGKILLs at random points (during steps and saves), each resumed: metrics.jsonl byte-identical.

    Compiled on 2 threads it is also the cross-process reproducibility check of the compiled step: the killed run's
    steps come from other processes than the clean run's, and the embedding gradient's ``index_put`` is where 2+
    threads would differ without ``deterministic_algorithms`` (README, "Reproducibility")."""
    rng = random.Random(1234)
    total_steps = 16 if num_kills == 1 else 24
    overrides = [
        f"trainer.total_steps={total_steps}",
        "trainer.checkpointing.period_steps=3",
        "trainer.logging.period_steps=1",
        f"trainer.compile={json.dumps(compile_)}",
        "trainer.determinism.deterministic_algorithms=true",
        "data.max_bytes=40000",
    ]
    configs = {}
    for name in ("killed", "clean"):
        job = tiny_job(tmp_path / name, *overrides)
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(job.model_dump_json())
    cache = tmp_path / "inductor"  # one cold compile for both runs
    clean = _run_cli(configs["clean"], tmp_path / "clean.log", threads=threads, compile_cache=cache)
    assert clean.wait(timeout=600) == 0, (tmp_path / "clean.log").read_text()

    metrics = tmp_path / "killed" / "stdlib-lm" / "metrics.jsonl"
    log = tmp_path / "killed.log"
    target = 0
    for _ in range(num_kills):
        # Kill once a step past everything logged so far is logged (the resumed run must redo the steps after
        # its checkpoint first), after a random delay: inside a step, a save or a deletion of an old step.
        target = min(target + rng.randint(1, 4), total_steps - 2)
        process = _run_cli(configs["killed"], log, threads=threads, compile_cache=cache)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None and _logged_steps(metrics) < target:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        assert process.poll() is None, f"the run ended before it could be killed:\n{log.read_text()}"
        process.send_signal(signal.SIGKILL)
        process.wait()
    resumed = _run_cli(configs["killed"], log, threads=threads, compile_cache=cache)
    assert resumed.wait(timeout=600) == 0, log.read_text()

    got = losses(tmp_path / "killed" / "stdlib-lm")
    assert sorted(got) == list(range(1, total_steps + 1))
    assert metrics.read_bytes() == (tmp_path / "clean" / "stdlib-lm" / "metrics.jsonl").read_bytes()


def test_the_default_job_compiles_with_deterministic_algorithms() -> None:
    """What makes the compiled default job reproducible on 2+ threads (README, "Reproducibility"); that it then is,
    process after process, is the compiled SIGKILL test's comparison of a clean run with a killed one."""
    job = LMJobConfig()
    assert job.trainer.compile
    assert job.trainer.determinism.deterministic_algorithms


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


# --- settings the loop applies for the run's duration -----------------------------------------------------


class ProbeTask(CausalLMTask):
    """Calls ``probe(ctx)`` on one event; the way a test looks inside a running job."""

    def __init__(self, event: ev.Event, probe) -> None:
        super().__init__()
        self.event, self.probe = event, probe

    def register_events(self, bus: ev.EventBus) -> None:
        bus.subscribe(self.event, self.probe)


class ProbePerplexityTask(PerplexityTask):
    """``ProbeTask`` for inference."""

    def __init__(self, event: ev.Event, probe) -> None:
        super().__init__()
        self.event, self.probe = event, probe

    def register_events(self, bus: ev.EventBus) -> None:
        bus.subscribe(self.event, self.probe)


def _configure_probed(job: LMJobConfig, event: ev.Event, probe, provider: type = Qwen3Provider):
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=lambda: ProbeTask(event, probe),
        model_provider=provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()


class _FrozenBaseProvider(Qwen3Provider):
    """Trains the norms and the head only: the rest is a frozen base (LoRA's shape, without the adapters)."""

    def parameters_to_train(self, context):
        return lambda name, tensor: "norm" in name or name.startswith("lm_head")


def test_trainer_passes_parameters_to_train_to_the_state(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=2")
    trainer = _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None, provider=_FrozenBaseProvider)
    before = trainer.initial_state()
    assert "embed_tokens.weight" in before.frozen
    assert "layers.0.mlp.up_proj.weight" in before.frozen
    assert not set(before.frozen) & set(before.buffers)
    assert not any(name in before.frozen for name in before.opt_state.mu)  # the optimizer covers the trained ones
    after = trainer.train().state
    assert after.frozen == before.frozen
    for name, p in after.params.items():
        assert torch.equal(p, before.params[name]) == (name in before.frozen), name


def _inference_probed(job: LMJobConfig, event: ev.Event, probe, **sections):
    config = InferenceConfig(
        **{
            "batching": job.trainer.batching,
            "checkpointing": InferenceCheckpointingConfig(load_dir=job.trainer.run_dir),
            "data_loading": DataLoadingConfig(),
            "compile": False,
            **sections,
        }
    )
    return InferenceConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=config,
        task_provider=lambda: ProbePerplexityTask(event, probe),
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
        max_batches=3,
    ).configure()


@pytest.mark.parametrize("enabled", [True, False])
def test_trainer_and_inference_deterministic_algorithms_hold_for_the_run_only(tmp_path, enabled):
    assert not torch.are_deterministic_algorithms_enabled()
    seen: list[bool] = []
    probe = lambda ctx: seen.append(torch.are_deterministic_algorithms_enabled())  # noqa: E731
    job = tiny_job(
        tmp_path, "trainer.total_steps=2", f"trainer.determinism.deterministic_algorithms={json.dumps(enabled)}"
    )
    _configure_probed(job, ev.EVENT_TRAIN_STEP_POST, probe).train()
    assert seen == [enabled, enabled]
    assert not torch.are_deterministic_algorithms_enabled()  # process-global: put back when the run ends

    seen.clear()
    determinism = DeterminismConfig(deterministic_algorithms=enabled)
    _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, probe, determinism=determinism).infer()
    assert seen == [enabled] * 3
    assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_algorithms_are_restored_when_the_run_fails(tmp_path):
    def fail(ctx):
        assert torch.are_deterministic_algorithms_enabled()
        raise RuntimeError("a handler failed")

    job = tiny_job(tmp_path, "trainer.total_steps=2", "trainer.determinism.deterministic_algorithms=true")
    with pytest.raises(RuntimeError, match="a handler failed"):
        _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, fail).train()
    assert not torch.are_deterministic_algorithms_enabled()


def test_trainer_data_loading_workers_train_like_the_main_process_and_resume_exactly(tmp_path):
    steps = ["trainer.total_steps=6", "trainer.logging.period_steps=1", "trainer.checkpointing.period_steps=3"]
    reference = losses(train_lm(tiny_job(tmp_path / "main", *steps)).run_dir)
    workers = [*steps, "trainer.data_loading.num_workers=2", "trainer.data_loading.prefetch_factor=3"]
    job = tiny_job(tmp_path / "workers", *workers)

    def stop_at_5(ctx):
        if ctx.step == 5:
            raise KeyboardInterrupt  # after the checkpoint of step 3, with batches 6.. already prefetched

    trainer = _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, stop_at_5)
    assert trainer.data.data_loader.num_workers == 2
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    result = _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None).train()
    assert result.steps_run == 3
    assert losses(result.run_dir) == reference  # bitwise, steps 4-6 from the resumed position


def _periodic_gc_calls(monkeypatch) -> list[int]:
    """Counts ``gc.collect(1)``: the loop's periodic collections (entry and exit collect everything)."""
    calls: list[int] = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: (calls.append(1) if args == (1,) else None, real(*args))[1])
    return calls


@pytest.mark.parametrize(
    ("period", "expected"), [("2", [0, 1, 1, 2, 2, 3]), ("4", [0, 0, 0, 1, 1, 1]), ("disable", [0] * 6)]
)
def test_trainer_and_inference_collect_garbage_on_gc_period_steps(tmp_path, monkeypatch, period, expected):
    job = tiny_job(tmp_path, "trainer.total_steps=6", f"trainer.gc.period_steps={period}")
    calls = _periodic_gc_calls(monkeypatch)
    seen: list[int] = []
    _configure_probed(job, ev.EVENT_TRAIN_STEP_POST, lambda ctx: seen.append(len(calls))).train()
    assert seen == expected
    calls.clear()
    seen.clear()
    gc_config = GarbageCollectionConfig(period_steps=int(period) if period.isdigit() else period)
    inference = _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: seen.append(len(calls)), gc=gc_config)
    inference.max_batches = 6
    inference.infer()
    assert seen == expected


def test_inference_writes_profiler_traces_on_the_configured_period(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=1")
    train_lm(job)
    traces = tmp_path / "traces"
    profiling = ProfilingConfig(traces_dir=traces, period_steps=3, warmup_steps=1, active_steps=1)
    _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None, profiling=profiling).infer()
    assert [p.name for p in traces.iterdir()] == ["trace_step3.json"]  # max_batches=3: one cycle, recording step 3


def test_inference_data_loading_workers_give_the_same_result(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=1")
    train_lm(job)
    plain = _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None).infer()
    loading = DataLoadingConfig(num_workers=2, persistent_workers=True)
    inference = _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None, data_loading=loading)
    assert inference.data.data_loader.num_workers == 2
    assert inference.infer().task_result == plain.task_result


def test_inference_without_a_training_checkpoint_runs_the_source_checkpoint(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=2")
    train_lm(job)
    from_checkpoint = _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None).infer()
    export_lm(run_dir_of(job), tmp_path / "export")
    source = ModelStageFactoryConfig(source_checkpoint=tmp_path / "export")
    result = _inference_probed(
        job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None, checkpointing=None, model_stage_factory=source
    ).infer()
    assert result.checkpoint_step is None
    assert result.task_result == pytest.approx(from_checkpoint.task_result, rel=1e-6)
    fresh = _inference_probed(job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None, checkpointing=None).infer()
    assert fresh.task_result["perplexity"] > result.task_result["perplexity"]  # untrained weights


def test_trainer_records_run_name_description_and_hparams(tmp_path):
    job = tiny_job(
        tmp_path,
        "trainer.total_steps=1",
        "trainer.run.name=my-run",
        "trainer.run.description=a note",
        'trainer.run.hparams={"tag": "x"}',
    )
    result = train_lm(job)
    assert result.run_dir == tmp_path / "my-run"
    hparams = json.loads((result.run_dir / "hparams.json").read_text())
    assert hparams["tag"] == "x"
    assert hparams["config"]["run"]["description"] == "a note"


def test_trainer_determinism_seed_fixes_the_initial_weights(tmp_path):
    def initial(seed: int):
        job = tiny_job(tmp_path, f"trainer.determinism.seed={seed}")
        return _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None).initial_state()

    first, again, other = initial(0), initial(0), initial(1)
    torch.testing.assert_close(first.params, again.params, rtol=0, atol=0)
    torch.testing.assert_close(first.rng, again.rng, rtol=0, atol=0)
    assert not torch.equal(first.params["embed_tokens.weight"], other.params["embed_tokens.weight"])
    assert not torch.equal(first.rng, other.rng)


def test_trainer_profiling_disabled_writes_no_traces(tmp_path):
    traces = tmp_path / "traces"
    job = tiny_job(
        tmp_path, "trainer.total_steps=3", f"trainer.profiling.traces_dir={traces}", "trainer.profiling.enabled=false"
    )
    train_lm(job)
    assert not traces.exists()


def test_inference_checkpointing_step_picks_the_checkpoint(tmp_path):
    job = tiny_job(tmp_path, "trainer.total_steps=8")  # keeps checkpoints 4 and 8
    train_lm(job)
    results = {}
    for step in (4, None):
        checkpointing = InferenceCheckpointingConfig(load_dir=job.trainer.run_dir, step=step)
        results[step] = _inference_probed(
            job, ev.EVENT_INFERENCE_STEP_POST, lambda ctx: None, checkpointing=checkpointing
        ).infer()
    assert (results[4].checkpoint_step, results[None].checkpoint_step) == (4, 8)
    assert results[4].task_result["perplexity"] != results[None].task_result["perplexity"]


def test_trainer_gradient_clipping_max_norm_bounds_an_sgd_update(tmp_path):
    def update_norm(*overrides: str) -> float:
        job = tiny_job(
            tmp_path / str(len(overrides)),
            "trainer.total_steps=1",
            'trainer.optimizer={"name": "sgd", "lr": 1.0}',
            *overrides,
        )
        trainer = _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None)
        before = trainer.initial_state().params
        after = trainer.train().state.params
        return float(torch.stack([(after[k] - before[k]).norm() for k in before]).norm())

    assert update_norm("trainer.gradient_clipping.max_norm=0.001") == pytest.approx(0.001, rel=1e-3)
    assert update_norm() > 0.01


@pytest.mark.parametrize("compile_", [True, False])
def test_trainer_compile_wraps_the_step_in_torch_compile(tmp_path, compile_):
    job = tiny_job(
        tmp_path, f"trainer.compile={json.dumps(compile_)}", f"trainer.checkpointing.async_save={json.dumps(compile_)}"
    )
    trainer = _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None)
    # head, per-microbatch piece, tail: each torch.compile's wrapper, but the tail that runs the optimizer's fused
    # kernel eagerly (AdamW on the CPU: trainer.optimizer.fused), which compiles nothing
    pieces = [piece for piece in trainer.step_fn.pieces.values() if not isinstance(piece, Tail)]
    assert len(pieces) == 2
    assert all(hasattr(piece, "_torchdynamo_orig_callable") is compile_ for piece in pieces)
    assert trainer.checkpoints.async_save is compile_  # CheckpointStore's own tests observe what it does


# --- validation during training, timings, load_model, a stored evaluation -----------------------------------


def test_validation_during_training_is_logged_resumes_exactly_and_matches_evaluate_lm(tmp_path):
    overrides = ("trainer.total_steps=8", "trainer.evaluation.period_steps=3", "trainer.evaluation.num_batches=2")
    clean = tiny_job(tmp_path / "clean", *overrides)
    result = train_lm(clean)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in validation] == [3, 6, 8]  # every 3 steps and after the last
    assert {r["val/loss_weight"] for r in validation} == {2 * 4 * 16}  # 2 batches of 4 windows of 16 bytes
    assert validation[0]["val/loss"] > validation[-1]["val/loss"]
    assert set(validation[-1]) == {"step", "val/loss", "val/loss_weight", "val/metrics/loss", "val/metrics/accuracy"}
    report = evaluate_lm(clean)  # the same 2 validation batches (eval_batches=2), checkpoint step 8
    assert validation[-1]["val/loss"] == pytest.approx(report["nll"], rel=1e-6)
    # Wall-clock figures go to timings.jsonl, never into metrics.jsonl (byte-identical across resumes).
    train_timing, evaluate_timing = map(json.loads, (result.run_dir / "timings.jsonl").read_text().splitlines())
    assert train_timing["command"] == "train"
    assert (train_timing["start_step"], train_timing["end_step"]) == (0, 8)
    assert train_timing["first_step_s"] > 0
    assert train_timing["step_s"] > 0
    assert train_timing["validation_s"] > 0
    assert result.first_step_s == pytest.approx(train_timing["first_step_s"], abs=1e-3)
    assert evaluate_timing["command"] == "evaluate"
    assert evaluate_timing["checkpoint_step"] == 8
    assert not any(key.startswith("time") for record in records for key in record)

    killed = tiny_job(tmp_path / "killed", *overrides)

    def crash_at_7(ctx):
        if ctx.step == 7:
            raise KeyboardInterrupt  # after the validation at 6; the last checkpoint is step 4

    with pytest.raises(KeyboardInterrupt):
        _configure_probed(killed, ev.EVENT_TRAIN_STEP_PRE, crash_at_7).train()
    _configure_probed(killed, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None).train()
    assert (killed.trainer.run_dir / "metrics.jsonl").read_bytes() == (result.run_dir / "metrics.jsonl").read_bytes()


def test_load_model_returns_the_trained_module_and_a_stored_evaluation_is_reused(tmp_path, monkeypatch):
    import d9dfn.jobs._lm as lm
    from d9dfn.jobs import load_model

    job = tiny_job(tmp_path, "trainer.total_steps=4")
    result = train_lm(job)
    model = load_model(result.run_dir)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, 256, (2, 8))
    expected = torch.func.functional_call(model, {**result.state.params, **result.state.buffers}, (ids,))
    torch.testing.assert_close(model(ids)["logits"], expected["logits"], rtol=0, atol=0)
    earlier = load_model(result.run_dir, step=4)
    assert torch.equal(earlier.embed_tokens.weight, model.embed_tokens.weight)

    fresh = evaluate_lm(job, reuse=True)  # nothing stored yet: evaluates, and stores
    assert "stored" not in fresh
    evaluations = []
    real = lm.InferenceConfigurator
    monkeypatch.setattr(lm, "InferenceConfigurator", lambda *a, **k: evaluations.append(1) or real(*a, **k))
    again = evaluate_lm(job, reuse=True)
    assert evaluations == []  # the stored result of the same checkpoint and settings
    assert again.pop("stored") == result.run_dir / "evaluation.json"
    assert again == fresh  # the sample too: generated anew from the checkpoint, with the same generator
    evaluate_lm(tiny_job(tmp_path, "trainer.total_steps=4", "eval_batches=1"), reuse=True)
    assert evaluations == [1]  # another setting: evaluated again
    train_lm(tiny_job(tmp_path, "trainer.total_steps=8"))  # a new checkpoint
    assert evaluate_lm(job, reuse=True)["checkpoint_step"] == 8
    assert evaluations == [1, 1]


def test_train_result_repr_summarizes_the_state():
    # Issue 44 point 9: print(trainer.train()) printed every parameter and moment (237 kB for a 4-layer model).
    from d9dfn import init_train_state, optim
    from d9dfn._pytree import tree_leaves
    from d9dfn.loop import TrainResult
    from d9dfn.models import Qwen3Config

    model = Qwen3LM(Qwen3Config.tiny(vocab_size=256))
    state = init_train_state(model, optim.adamw(1e-3))
    result = TrainResult(state=state, task_result={"loss": 1.5}, run_dir=Path("runs/x"), steps_run=2, plot_path=None)
    text = repr(result)
    moments = [t for t in tree_leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    assert text == (
        "TrainResult(run_dir='runs/x', steps_run=2, steps_skipped=0, state=TrainState(step=0, params="
        f"{len(state.params)} tensors / {sum(p.numel() for p in model.parameters()):.3g} elements, buffers=0 tensors "
        f"/ 0 elements, opt_state={len(moments)} tensors / {sum(t.numel() for t in moments):.3g} elements, "
        "metric_state=0 tensors / 0 elements), task_result={'loss': 1.5}, plot_path=None, first_step_s=None, "
        "step_s=None)"
    )
    assert len(moments) > 2 * len(state.params)  # the moments are counted, not printed
    assert result.state is state  # the fields hold everything
