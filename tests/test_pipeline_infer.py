"""``d9dfn infer`` (and the evaluation after ``d9dfn train``) on a pipeline mesh: the inference schedule across
the ``pp`` ranks, each rank restoring only its stage from the checkpoint, equal to one process.

Every rank builds the stage skeletons on meta, materializes its one stage of ``pipeline.inference(pp, 1, m)`` and
restores its tensors by full name (any training layout); the last stage's rank folds the outputs into the task
state, which is broadcast over ``pp`` at the end. The sample is generated through the same forwards: the last
stage's rank samples each byte and broadcasts it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _ranks import _init, _run_ranks
from test_pipeline_loop import PIPELINE, _pipelining, _sets
from test_train import tiny_job

from d9dfn.config import DeviceMeshParameters, InferenceConfig
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, evaluate_lm, inference_mesh, train_lm
from d9dfn.loop import InferenceConfigurator
from d9dfn.loop import _inference as inference_module
from d9dfn.models import Qwen3LM
from d9dfn.pipeline import inference as pipeline_inference
from d9dfn.tasks import PerplexityTask

EVAL = ["trainer.batching.global_batch_size=6", "eval_batches=50", "sample.num_bytes=12"]
"""Evaluation over the whole validation split (124 windows: 20 batches of 6, then a tail of 4 as one
microbatch), three microbatches per full batch, a 12-byte sample."""


def _provider(job: LMJobConfig) -> Qwen3Provider:
    return Qwen3Provider(job.model.to_qwen3(job.data.seq_len))


# --- set-up, no ranks -------------------------------------------------------------------------------------


def test_inference_mesh_is_the_jobs_with_a_pipeline_else_one_process() -> None:
    assert inference_mesh(LMJobConfig()) == DeviceMeshParameters()
    assert inference_mesh(LMJobConfig(mesh=DeviceMeshParameters(data_parallel_shard=2))) == DeviceMeshParameters()
    piped = DeviceMeshParameters(pipeline_parallel=2, data_parallel_replicate=2)
    assert inference_mesh(LMJobConfig(mesh=piped)) == piped


def test_inference_timeout_init_timeout_is_the_process_group_timeout(monkeypatch: Any) -> None:
    seen = {}

    def fake_init_distributed(mesh: Any, *, timeout_s: float, device_type: Any = None) -> Any:
        seen["timeout_s"], seen["mesh"] = timeout_s, mesh
        raise RuntimeError("stop here: the timeout was observed")

    monkeypatch.setattr(inference_module, "init_distributed", fake_init_distributed)
    job = LMJobConfig()
    configurator = InferenceConfigurator(
        mesh=DeviceMeshParameters(pipeline_parallel=2),
        parameters=InferenceConfig(timeout={"init_timeout": 321}),
        task_provider=PerplexityTask,
        model_provider=_provider(job),
        data_provider=CorpusProvider(job.data),
    )
    with pytest.raises(RuntimeError, match="stop here"):
        configurator.configure()
    assert seen == {"timeout_s": 321, "mesh": DeviceMeshParameters(pipeline_parallel=2)}


def test_pipelined_inference_refuses_source_checkpoint_weights_naming_the_workaround() -> None:
    job = LMJobConfig()
    configurator = InferenceConfigurator(
        mesh=DeviceMeshParameters(pipeline_parallel=2),
        parameters=InferenceConfig(checkpointing=None, model_stage_factory={"source_checkpoint": "/weights"}),
        task_provider=PerplexityTask,
        model_provider=_provider(job),
        data_provider=CorpusProvider(job.data),
    )
    with pytest.raises(
        NotImplementedError, match=r"source_checkpoint with mesh.pipeline_parallel=2.*pipeline_parallel=1"
    ):
        configurator.configure()


def test_a_data_parallel_mesh_without_a_pipeline_still_runs_inference_on_one_process_only() -> None:
    job = LMJobConfig()
    configurator = InferenceConfigurator(
        mesh=DeviceMeshParameters(data_parallel_replicate=2),
        parameters=InferenceConfig(),
        task_provider=PerplexityTask,
        model_provider=_provider(job),
        data_provider=CorpusProvider(job.data),
    )
    with pytest.raises(NotImplementedError, match="runs on one process only"):
        configurator.configure()


# --- real ranks ---------------------------------------------------------------------------------------------


def _infer_worker(rank: int, world_size: int, init_file: str, save_dir: str, mesh: str) -> None:
    """``evaluate_lm`` on this rank of ``mesh`` (a pp=2 run's checkpoint); its report and timeouts to JSON."""
    _init(rank, world_size, init_file, timeout_s=60.0)
    seen: dict[str, Any] = {"timeouts": [], "programs": []}
    real_timeout, real_load, real_step = (
        inference_module.set_collective_timeout,
        inference_module.load_weights,
        inference_module.make_inference_step,
    )

    def timeout_spy(timeout_s: float, groups: Any = ()) -> None:
        seen["timeouts"].append(timeout_s)
        real_timeout(timeout_s, groups)

    def load_spy(run_dir: Path, model: Any, step: Any = None, **options: Any) -> Any:
        seen["loaded"] = sorted(name for name, _ in model.named_parameters())  # this rank's stage only
        return real_load(run_dir, model, step, **options)

    def step_spy(model: Any, task: Any, **options: Any) -> Any:
        rank_pipeline = options["executor"]
        seen["programs"].append(str(rank_pipeline.program))
        seen["pp_rank"] = rank_pipeline.rank
        return real_step(model, task, **options)

    # A forked rank: nothing else sees these.
    inference_module.set_collective_timeout = timeout_spy
    inference_module.load_weights = load_spy
    inference_module.make_inference_step = step_spy
    job = tiny_job(Path(save_dir), *PIPELINE, *EVAL, f"mesh={mesh}", "trainer.timeout.step_timeout=37")
    report = evaluate_lm(job)
    (Path(save_dir) / f"report-{world_size}-{rank}.json").write_text(json.dumps({**report, **seen}))


@pytest.mark.slow
@pytest.mark.ranks
def test_pipelined_evaluate_lm_equals_one_process_on_every_rank(tmp_path: Path) -> None:
    """pp=2 and pp=2 × dp_replicate=2 (each replica a whole pipeline) restore a two-stages-per-rank pp=1 run's
    checkpoint into one stage per rank; every rank reports the one-process perplexity, nll, token count and
    sample exactly (JSON round-trips floats exactly); step_timeout applies after the first batch."""
    train_lm(tiny_job(tmp_path, *PIPELINE, _pipelining("1f1b", num_stages_per_rank=2)))
    job = tiny_job(tmp_path, *PIPELINE, *EVAL)
    expected = evaluate_lm(job)
    assert expected["num_tokens"] == 124 * 16  # every window, the tail batch included
    for world_size, mesh in (
        (2, '{"pipeline_parallel": 2}'),
        (4, '{"pipeline_parallel": 2, "data_parallel_replicate": 2}'),
    ):
        _run_ranks(_infer_worker, world_size, tmp_path, str(tmp_path), mesh, timeout_s=200, clean=True)
        loaded: dict[int, set[str]] = {}
        for rank in range(world_size):
            got = json.loads((tmp_path / f"report-{world_size}-{rank}.json").read_text())
            assert got.pop("timeouts") == [37], (world_size, rank)
            # The full batch's program (3 microbatches), then the tail's (1): the inference schedule, 1 stage/rank.
            assert got.pop("programs") == [str(pipeline_inference(2, 1, 3)), str(pipeline_inference(2, 1, 1))]
            pp_rank = got.pop("pp_rank")
            assert pp_rank == rank // (world_size // 2)  # pp outermost
            stage = set(got.pop("loaded"))
            assert loaded.setdefault(pp_rank, stage) == stage  # a dp replica holds the same stage
            assert got == expected, (world_size, rank)
        assert not loaded[0] & loaded[1]
        assert "lm_head.weight" in loaded[1]
        assert loaded[0] | loaded[1] == {name for name, _ in Qwen3LM(_provider(job).config).named_parameters()}


def _cli(cwd: Path, command: str, *args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    command_line = [*(launcher if ranks > 1 else [sys.executable]), "-m", "d9dfn", command, *args]
    done = subprocess.run(command_line, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _evaluation(stdout: str) -> list[str]:
    return re.findall(r"^d9dfn: validation perplexity .*$", stdout, flags=re.MULTILINE)


@pytest.mark.slow
@pytest.mark.cli
def test_torchrun_pipelined_train_then_infer_equal_one_process_infer(tmp_path: Path) -> None:
    """``torchrun ... d9dfn train`` with pp=2 (ZB-V: 4 stages, a V over 2 ranks) evaluates across both ranks, and
    ``torchrun ... d9dfn infer`` with the same mesh (the inference schedule, 2 stages) prints once, rank 0, the
    validation line and the sample that ``d9dfn infer`` prints on one process from the same run."""
    job = [*PIPELINE, "model.num_layers=7", f"trainer.checkpointing.save_dir={tmp_path / 'runs'}"]
    mesh = ["--set", 'mesh={"pipeline_parallel": 2}']
    trained = _cli(tmp_path, "train", *mesh, *_sets(*job, _pipelining("zero_bubble_v")), ranks=2)
    assert trained.stdout.count("d9dfn: trained 6 steps") == 1, trained.stdout
    piped = _cli(tmp_path, "infer", *mesh, *_sets(*job), ranks=2)
    alone = _cli(tmp_path, "infer", *_sets(*job))
    assert len(_evaluation(piped.stdout)) == 1, piped.stdout  # one rank prints
    assert _evaluation(trained.stdout) == _evaluation(piped.stdout) == _evaluation(alone.stdout)
    assert "checkpoint step 6" in _evaluation(alone.stdout)[0]
    sample = alone.stdout[alone.stdout.index("d9dfn: sample:") :]
    assert piped.stdout.count("d9dfn: sample:") == 1
    assert piped.stdout[piped.stdout.index("d9dfn: sample:") :] == sample
