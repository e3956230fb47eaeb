"""The loop with ``trainer.pipelining`` and a pipeline mesh: ``torchrun -m d9dfn train`` on gloo ranks.

A pipelined run builds every stage from the model provider on meta and materializes only its own; each module is
initialized under a seed of its full name, so the weights do not depend on the layout. A pp=2 run therefore
equals the one-process run of the same program (``make_train_step(executor=Pipeline(program, stages))``) bit for bit:
losses, metrics and task logs, which only the last stage's rank computes and shares at log time.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from _ranks import _init, _run_ranks
from test_train import losses, tiny_job

from d9dfn.config import DeviceMeshParameters, PipeliningConfig
from d9dfn.jobs import CorpusProvider, Qwen3Provider, train_lm
from d9dfn.loop import InitializeModelStageContext, TrainingConfigurator
from d9dfn.loop import _events as ev
from d9dfn.loop._pipelining import build_program, seeded_reset
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.pipeline import SCHEDULES, PipelineStageInfo
from d9dfn.tasks import CausalLMTask

PIPELINE = [
    "model.num_layers=3",
    "model.tie_word_embeddings=false",
    "trainer.total_steps=6",
    "trainer.repeated_blocks=[]",
]
"""The tiny job, with three blocks (two stages need one each besides the head) and an untied head; the stages
traced whole (a zero-bubble schedule always traces them, and per-block stages equal traced ones to rounding only,
so the runs compared bit for bit across schedules and layouts all trace)."""
ONE_F_ONE_B_ZB = '{"schedule": {"schedule": "1f1b", "zero_bubble": true}}'


def _pipelining(schedule: str, **fields: Any) -> str:
    return "trainer.pipelining=" + json.dumps({"schedule": {"schedule": schedule, **fields}})


GPIPE = [
    'trainer.pipelining={"schedule": {"schedule": "gpipe"}}',
    "trainer.checkpointing.period_steps=2",
    "trainer.checkpointing.num_to_keep=3",
]
"""GPipe, a checkpoint every second step, all three kept (a run resumes from step 2)."""
VALIDATION = ["trainer.evaluation.period_steps=3", "trainer.evaluation.num_batches=2"]
"""Validation during training at steps 3 and 6, over two validation batches."""


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- set-up, no ranks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"schedule": "gpipe"}, ("gpipe", 1)),
        ({"schedule": "looped_bfs", "num_stages_per_rank": 3}, ("looped_bfs", 3)),
        ({"schedule": "1f1b", "num_stages_per_rank": 2}, ("one_f_one_b", 2)),
        ({"schedule": "1f1b", "zero_bubble": True}, ("zero_bubble_1f1b", 1)),
        ({"schedule": "zero_bubble_v"}, ("zero_bubble_v", 2)),
        ({"schedule": "dual_pipe_v"}, ("dual_pipe_v", 2)),
    ],
)
def test_build_program_reads_every_schedule_config(schedule: dict[str, Any], expected: tuple[str, int]) -> None:
    # The JSON a user writes selects the builder and the stages per rank (through the schedule's registry entry).
    config = PipeliningConfig.model_validate({"schedule": schedule})
    name, per_rank = expected
    assert build_program(config, 2, 3) == SCHEDULES[name](2, per_rank, 3)


def test_seeded_reset_gives_a_stage_the_whole_models_weights() -> None:
    config = Qwen3Config.tiny(num_layers=5, tie_word_embeddings=False)
    with torch.device("meta"):
        whole = Qwen3LM(config)
        stages = [Qwen3LM(config, PipelineStageInfo(i, 3)) for i in range(3)]
    whole = whole.to_empty(device="cpu")
    seeded_reset(whole, 7)
    weights = dict(whole.named_parameters())
    seen = set()
    for stage in stages:
        stage = stage.to_empty(device="cpu")
        seeded_reset(stage, 7)
        for name, tensor in stage.named_parameters():
            assert torch.equal(tensor, weights[name]), name
            seen.add(name)
    assert seen == set(weights)
    other = Qwen3LM(config).to_empty(device="cpu")
    seeded_reset(other, 8)  # another seed, other weights
    assert not torch.equal(other.lm_head.weight, whole.lm_head.weight)


def test_pipelining_refuses_tied_embeddings_naming_the_job_field(tmp_path: Path) -> None:
    job = tiny_job(tmp_path, "model.num_layers=3", _pipelining("1f1b", num_stages_per_rank=2))
    with pytest.raises(ValueError, match=r"set model.tie_word_embeddings=false"):
        train_lm(job)


def test_a_zero_bubble_schedule_refuses_named_repeated_blocks(tmp_path: Path) -> None:
    # Its stages are traced whole to split each backward into I and W: a named block class cannot run there.
    job = tiny_job(
        tmp_path,
        *PIPELINE[:-1],
        'trainer.repeated_blocks=["Qwen3DecoderLayer"]',
        _pipelining("1f1b", num_stages_per_rank=2, zero_bubble=True),
    )
    with pytest.raises(ValueError, match=r"splits each stage's backward into I and W.*pass repeated_blocks=\(\)"):
        train_lm(job)
    assert not (tmp_path / "stdlib-lm" / "metrics.jsonl").exists()


def test_a_pipeline_mesh_without_a_schedule_is_refused(tmp_path: Path) -> None:
    job = tiny_job(tmp_path, *PIPELINE)
    configurator = TrainingConfigurator(
        mesh=DeviceMeshParameters(pipeline_parallel=2),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    )
    with pytest.raises(ValueError, match=r"mesh.pipeline_parallel=2 needs a pipeline schedule.*trainer.pipelining"):
        configurator.configure()


def test_pipelining_on_one_process_runs_the_program_and_every_schedule_agrees(tmp_path: Path) -> None:
    # Two stages on one process: 1F1B and its zero-bubble variant are the same sums in the same order.
    plain = train_lm(tiny_job(tmp_path / "a", *PIPELINE, *VALIDATION, _pipelining("1f1b", num_stages_per_rank=2)))
    zero_bubble = train_lm(
        tiny_job(tmp_path / "b", *PIPELINE, *VALIDATION, _pipelining("1f1b", num_stages_per_rank=2, zero_bubble=True))
    )
    assert sorted(losses(plain.run_dir)) == list(range(1, 7))
    assert losses(plain.run_dir) == losses(zero_bubble.run_dir)
    assert losses(plain.run_dir)[6] < losses(plain.run_dir)[1]
    torch.testing.assert_close(plain.state.params, zero_bubble.state.params, rtol=0, atol=0)
    assert any("metrics/accuracy" in r for r in _records(plain.run_dir))
    validation = [r for r in _records(plain.run_dir) if "val/loss" in r]  # the program's forwards, on stages
    assert [r["step"] for r in validation] == [3, 6]
    assert validation == [r for r in _records(zero_bubble.run_dir) if "val/loss" in r]
    # The default, repeated_blocks=null, compiles the decoder layer once inside the 1F1B stages (autograd).
    blocks = train_lm(tiny_job(tmp_path / "c", *PIPELINE[:-1], _pipelining("1f1b", num_stages_per_rank=2)))
    torch.testing.assert_close(blocks.state.params, plain.state.params, rtol=1e-4, atol=1e-6)


# --- real ranks ---------------------------------------------------------------------------------------------


def _torchrun(cwd: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, "-m", "d9dfn", "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def _sets(*overrides: str) -> list[str]:
    from test_train import TINY

    return [arg for override in (*TINY, *overrides) for arg in ("--set", override)]


@pytest.mark.slow
@pytest.mark.cli
def test_torchrun_pipeline_cli_equals_one_process_and_resumes_on_one_process(tmp_path: Path) -> None:
    """pp=2 under torchrun (1F1B zero-bubble): the one-process run's losses and metrics, bit for bit; its step-2
    checkpoint resumes on one process without pipelining and finishes as the pp=2 run did."""
    schedule = f"trainer.pipelining={ONE_F_ONE_B_ZB}"
    overrides = [
        *PIPELINE,
        "trainer.checkpointing.period_steps=2",
        "trainer.checkpointing.num_to_keep=3",
        "trainer.determinism.deterministic_algorithms=true",
    ]
    reference = train_lm(
        tiny_job(tmp_path / "one", *overrides, _pipelining("1f1b", num_stages_per_rank=2, zero_bubble=True))
    )
    save = f"trainer.checkpointing.save_dir={tmp_path / 'two'}"
    done = _torchrun(tmp_path, "--set", 'mesh={"pipeline_parallel": 2}', *_sets(*overrides, schedule, save))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "two" / "stdlib-lm"
    assert done.stdout.count("d9dfn: trained 6 steps") == 1, done.stdout  # one rank prints
    assert done.stdout.count("d9dfn: validation perplexity") == 1, done.stdout
    assert (run_dir / "loss.png").is_file()
    assert json.loads((run_dir / "job.json").read_text())["trainer"]["pipelining"] is not None
    got, expected = _records(run_dir), _records(reference.run_dir)
    assert got == expected  # every logged value: loss, grad norm, lr, Σw and the metrics (last stage's)
    assert [r["step"] for r in got if "metrics/accuracy" in r] == [2, 4, 6]

    # pp=2 → pp=1 (and no pipelining): resume from step 2 through the CLI, finish like the pp=2 run.
    saved = {s: losses(run_dir)[s] for s in range(1, 7)}
    resumed = subprocess.run(
        [sys.executable, "-m", "d9dfn", "train", "--resume-from", "2", *_sets(*overrides, save)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "d9dfn: trained 4 steps" in resumed.stdout
    again = losses(run_dir)
    assert sorted(again) == list(range(1, 7))
    torch.testing.assert_close(
        torch.tensor([again[s] for s in range(1, 7)]), torch.tensor([saved[s] for s in range(1, 7)]), rtol=0, atol=0
    )


class _LogsTask(CausalLMTask):
    """Reports a task log (``tokens``), so the last stage's logs must reach the output rank."""

    def compute_loss(self, outputs: Any, state: Any, step: torch.Tensor) -> Any:
        import dataclasses

        result = super().compute_loss(outputs, state, step)
        return dataclasses.replace(result, logs={"tokens": result.loss_weight.float()})


def _configure(job: Any, mesh: DeviceMeshParameters, task: Any = _LogsTask) -> Any:
    return TrainingConfigurator(
        mesh=mesh,
        parameters=job.trainer,
        task_provider=task,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()


def _gpipe_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    _init(rank, world_size, init_file, timeout_s=60.0)
    job = tiny_job(Path(save_dir) / "two", *PIPELINE, *GPIPE, *VALIDATION)
    trainer = _configure(job, DeviceMeshParameters(pipeline_parallel=2))
    assert trainer.main_process == (rank == 0)
    assert sorted(trainer.initial_state().params) == sorted(
        name for module in trainer.pipeline.modules for name, _ in module.named_parameters()
    )  # this rank's stage only
    trainer.train()
    with pytest.raises(
        NotImplementedError, match=r"each hold only their pipeline stages.*`d9dfn export .*stdlib-lm OUT"
    ):
        trainer.export(Path(save_dir) / "export")
    # pp=1 → pp=2: resume the one-process run's step 2 on two ranks
    job = tiny_job(Path(save_dir) / "one", *PIPELINE, *GPIPE, *VALIDATION)
    _configure(job, DeviceMeshParameters(pipeline_parallel=2)).train(resume_from=2)


@pytest.mark.slow
@pytest.mark.ranks
def test_gpipe_through_the_loop_logs_the_last_stages_values_and_resumes_a_one_process_checkpoint(
    tmp_path: Path,
) -> None:
    one = tiny_job(tmp_path / "one", *PIPELINE, *GPIPE, *VALIDATION)
    reference = TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=one.trainer,
        task_provider=_LogsTask,
        model_provider=Qwen3Provider(one.model.to_qwen3(one.data.seq_len)),
        data_provider=CorpusProvider(one.data),
    ).configure()
    expected = _records(reference.train().run_dir)
    assert any("task/tokens" in r for r in expected)
    assert [r["step"] for r in expected if "val/loss" in r] == [3, 6]  # and the last stage's val/metrics
    _run_ranks(_gpipe_worker, 2, tmp_path, str(tmp_path), timeout_s=200, clean=True)
    assert _records(tmp_path / "two" / "stdlib-lm") == expected  # task logs and metrics: the last stage's
    assert _records(tmp_path / "one" / "stdlib-lm") == expected  # resumed on pp=2 from step 2: the same steps 3-6


class _DiesAtStep3(_LogsTask):
    def register_events(self, bus: ev.EventBus) -> None:
        import torch.distributed as dist

        def maybe_die(context: Any) -> None:
            if context.step == 3 and dist.get_rank() == 1:
                os._exit(0)

        bus.subscribe(ev.EVENT_TRAIN_STEP_PRE, maybe_die)


def _dead_stage_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    from d9dfn.loop import CollectiveError

    _init(rank, world_size, init_file, timeout_s=60.0)
    job = tiny_job(Path(save_dir), *PIPELINE, _pipelining("1f1b"), "trainer.timeout.step_timeout=5")
    trainer = _configure(job, DeviceMeshParameters(pipeline_parallel=2), task=_DiesAtStep3)
    started = time.monotonic()
    with pytest.raises(
        CollectiveError, match=r"rank 0 of 2: step 3 failed in a collective .*pipeline rank 0 at step 2"
    ):
        trainer.train()
    assert time.monotonic() - started < 30


@pytest.mark.slow
@pytest.mark.ranks
def test_a_dead_pipeline_rank_fails_its_peer_with_a_collective_error(tmp_path: Path) -> None:
    _run_ranks(_dead_stage_worker, 2, tmp_path, str(tmp_path / "runs"), timeout_s=120, clean=True)


def test_initialize_model_stage_context_reaches_the_provider(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []

    class Recording(Qwen3Provider):
        def initialize_model_stage(self, context: InitializeModelStageContext) -> Any:
            seen.append((context.stage_index, context.num_stages))
            return super().initialize_model_stage(context)

    job = tiny_job(tmp_path, *PIPELINE, _pipelining("looped_bfs", num_stages_per_rank=2))
    TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Recording(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()
    # the whole model once (the export skeleton), every stage's skeleton, then this (only) rank's two stages
    assert seen == [(0, 1), (0, 2), (1, 2), (0, 2), (1, 2)]


class _RecordingPlacements(Qwen3Provider):
    """Records which stages the loop asks for placements, on which mesh; keeps the default placements."""

    asked: ClassVar[list[tuple[int, Any]]] = []

    def parallelize_model_stage(self, context: Any, model: Any) -> Any:
        self.asked.append((context.stage_index, context.device_mesh.mesh_dim_names))
        return None


def _pp_dp_worker(rank: int, world_size: int, init_file: str, save_dir: str, degrees: dict[str, int]) -> None:
    from torch.distributed.tensor import DTensor

    from d9dfn.parallel import data_parallel_placements

    _init(rank, world_size, init_file, timeout_s=60.0)
    # Checkpoints at 3 and 6: step 3 is inside the logging period of steps 3-4.
    job = tiny_job(Path(save_dir), *PIPELINE, _pipelining("1f1b"), "trainer.checkpointing.period_steps=3")
    trainer = TrainingConfigurator(
        mesh=DeviceMeshParameters(pipeline_parallel=2, **degrees),
        parameters=job.trainer,
        task_provider=_LogsTask,
        model_provider=_RecordingPlacements(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()
    assert _RecordingPlacements.asked == [(rank // 2, ("dp_replicate", "dp_shard"))]  # its one stage, its dp pair
    assert trainer.data_parallel_size == 2
    assert trainer.main_process == (rank == 0)
    params = trainer.initial_state().params
    split = 0
    for name, param in params.items():
        assert isinstance(param, DTensor), name
        assert param.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard"), name
        assert tuple(param.placements) == data_parallel_placements(name, param, param.device_mesh), name
        split += param.to_local().numel() < param.numel()
    assert (split > 0) == ("data_parallel_shard" in degrees)  # sharded stages hold a slice of their params
    trainer.train()
    # After the first step every group the step waits on has step_timeout, the mesh's subgroups included (each
    # keeps the timeout it was created with otherwise, and a stalled peer would hold the others that long).
    step_timeout = datetime.timedelta(seconds=job.trainer.timeout.step_timeout)
    for group in (trainer.pipeline_group, trainer.dp_group, *trainer.device_mesh.get_all_groups()):
        assert group._get_backend(torch.device("cpu")).options._timeout == step_timeout
    # Resumed from step 3, where each dp rank of the last stage holds a partial metric state: the same bytes.
    metrics = Path(save_dir) / "stdlib-lm" / "metrics.jsonl"
    uninterrupted = metrics.read_bytes()
    _configure(job, DeviceMeshParameters(pipeline_parallel=2, **degrees)).train(resume_from=3)
    if rank == 0:
        assert metrics.read_bytes() == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize(
    "degrees", [{"data_parallel_replicate": 2}, {"data_parallel_shard": 2}], ids=["dp_replicate", "dp_shard"]
)
@pytest.mark.ranks
def test_pp2_dp2_through_the_loop_trains_like_one_process(tmp_path: Path, degrees: dict[str, int]) -> None:
    """4 ranks, (pp, dp) = (2, 2), dp replicated or sharded: each stage's params are DTensors on its dp pair and
    its gradients are reduced there, both pipeline ranks of a replica read its rows, and the logs equal the
    one-process run's up to the summation order; resumed from step 3 (inside a logging period) it logs the same
    bytes; the checkpoint restores on one process without pipelining (the two dp ranks' metric states merged)."""
    one = tiny_job(tmp_path / "one", *PIPELINE, _pipelining("1f1b", num_stages_per_rank=2))
    reference = _configure(one, DeviceMeshParameters()).train()
    expected = _records(reference.run_dir)
    _run_ranks(_pp_dp_worker, 4, tmp_path, str(tmp_path / "four"), degrees, timeout_s=200, clean=True)
    got = _records(tmp_path / "four" / "stdlib-lm")
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for mine, theirs in zip(got, expected, strict=True):
        for key in ("loss", "grad_norm", "loss_weight", "metrics/loss", "metrics/accuracy"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)
    resumed = _configure(tiny_job(tmp_path / "four", *PIPELINE), DeviceMeshParameters())  # not pipelined
    state = resumed.restore_latest(resumed.initial_state())
    assert int(state.step) == 6
    torch.testing.assert_close(state.params, reference.state.params, rtol=1e-5, atol=1e-6)


def _v_worker(rank: int, world_size: int, init_file: str, save_dir: str, schedule: str) -> None:
    _init(rank, world_size, init_file, timeout_s=60.0)
    job = tiny_job(Path(save_dir), *PIPELINE, "model.num_layers=7", _pipelining(schedule))
    trainer = _configure(job, DeviceMeshParameters(pipeline_parallel=2))
    assert trainer.pipeline.last_stage_rank == 0  # the V: rank 0 holds stages 0 and 3
    assert [s.index for s in trainer.pipeline.stages if trainer.pipeline.program.stage_to_rank[s.index] == rank] == (
        [0, 3] if rank == 0 else [1, 2]
    )
    trainer.train()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zero_bubble_v", "dual_pipe_v"])
@pytest.mark.ranks
def test_v_schedules_through_the_loop_equal_one_process(tmp_path: Path, schedule: str) -> None:
    """Two stages per rank in a V (4 stages over 2 ranks; the last stage back on rank 0) log bitwise what the same
    schedule logs on one process (2 stages)."""
    one = tiny_job(tmp_path / "one", *PIPELINE, "model.num_layers=7", _pipelining(schedule))
    expected = _records(_configure(one, DeviceMeshParameters()).train().run_dir)
    _run_ranks(_v_worker, 2, tmp_path, str(tmp_path / "two"), schedule, timeout_s=200, clean=True)
    assert _records(tmp_path / "two" / "stdlib-lm") == expected


def _dp_program_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    _init(rank, world_size, init_file, timeout_s=60.0)
    job = tiny_job(Path(save_dir), *PIPELINE, _pipelining("1f1b", num_stages_per_rank=2))
    trainer = _configure(job, DeviceMeshParameters(data_parallel_replicate=2))
    assert trainer.pipeline_group is None  # pp = 1: each data-parallel rank runs the whole two-stage program
    trainer.train()


@pytest.mark.slow
@pytest.mark.ranks
def test_pipelining_on_data_parallel_ranks_without_a_pipeline_mesh(tmp_path: Path) -> None:
    one = tiny_job(tmp_path / "one", *PIPELINE, _pipelining("1f1b", num_stages_per_rank=2))
    expected = _records(_configure(one, DeviceMeshParameters()).train().run_dir)
    _run_ranks(_dp_program_worker, 2, tmp_path, str(tmp_path / "two"), timeout_s=200, clean=True)
    got = _records(tmp_path / "two" / "stdlib-lm")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for mine, theirs in zip(got, expected, strict=True):
        for key in ("loss", "grad_norm", "metrics/loss", "metrics/accuracy"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (mine["step"], key)
