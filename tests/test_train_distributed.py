"""The loop on several processes: ``torchrun -m d9dfn train`` on CPU (gloo), and a rank that dies.

Launched runs are compared with the single-process run of the same job: every rank feeds its rows of the
same global batches (``StatefulBatchIterator(part=...)``) and the step sums over the data-parallel group,
so the logged loss of every step must match the one-process run to float32 rounding (``rtol=1e-5``,
``atol=1e-6``: sums in another order; eager steps, twelve of them, Adam).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks
from test_train import losses, tiny_job

from d9dfn.checkpoint import CheckpointStore
from d9dfn.config import DeviceMeshParameters
from d9dfn.jobs import CorpusProvider, Qwen3Provider, train_lm
from d9dfn.loop import TrainingConfigurator
from d9dfn.loop import _events as ev
from d9dfn.tasks import CausalLMTask

TORCHRUN_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def torchrun_command(config: Path) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2 -m d9dfn train CONFIG`` with this interpreter."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return [*command, "-m", "d9dfn", "train", str(config)]


def _torchrun(config: Path, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_command(config), cwd=cwd, env=TORCHRUN_ENV, capture_output=True, text=True, timeout=timeout_s
    )


PIPELINED = (
    "model.num_layers=3",
    "model.tie_word_embeddings=false",
    'trainer.pipelining={"schedule": {"schedule": "1f1b"}}',
    "trainer.batching.microbatch_size=1",
)
"""2 stages (2 blocks, then 1 beside the head) in 2 microbatches, both run by each tensor-parallel rank (one pipeline
rank: the one-process ``Pipeline`` executor), every stage's blocks, embedding and head bound to the tensor group."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "pipelined"),
    [
        pytest.param(None, (), id="replicate"),
        pytest.param({"data_parallel_shard": 2}, (), id="shard"),
        pytest.param({"tensor_parallel": 2}, (), id="tensor"),
        pytest.param({"tensor_parallel": 2, "sequence_parallel": True}, (), id="tensor-sequence"),
        pytest.param({"tensor_parallel": 2}, PIPELINED, id="tensor-pipelined"),
        pytest.param({"context_parallel_shard": 2}, (), id="context"),
    ],
)
@pytest.mark.cli
def test_torchrun_two_ranks_train_like_one_process(
    tmp_path: Path, mesh: dict[str, int] | None, pipelined: tuple[str, ...]
) -> None:
    # Validation at 6 and 12: each rank evaluates its rows of every validation batch, the sums are reduced. Tensor
    # parallelism: both ranks see every row, each computes one of the 2 heads and kv-heads and half the MLP, holds half
    # of the tied embedding's vocabulary rows and computes the loss, the accuracy and the validation on its half of
    # the logits (mesh.vocab_parallel, the default); with sequence parallelism it also holds half of each sequence
    # between the blocks. Context parallelism: both ranks take every row, each its head and tail quarter (rank 0) or
    # its two middle quarters (rank 1) of each sequence, attending to both ranks' keys and values; the metric states
    # differ per rank, so a checkpoint holds 2 rows of them. After training, rank 0 evaluates and samples from the
    # checkpoint on one process.
    overrides = [
        "trainer.checkpointing.period_steps=6",
        "trainer.evaluation.period_steps=6",
        "trainer.evaluation.num_batches=2",
        *(["model.num_kv_heads=2"] if mesh and "tensor_parallel" in mesh else []),
        *pipelined,
    ]
    reference = train_lm(tiny_job(tmp_path / "one", *overrides))
    job = tiny_job(tmp_path / "two", *overrides)
    job = job.model_copy(update={"mesh": None if mesh is None else DeviceMeshParameters(**mesh)})
    config = tmp_path / "two.json"
    config.write_text(job.model_dump_json())

    done = _torchrun(config, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "two" / "stdlib-lm"
    # Outputs come from rank 0 only: each line once, the plot and the checkpoints.
    assert done.stdout.count("d9dfn: trained 12 steps") == 1, done.stdout
    assert done.stdout.count("d9dfn: validation perplexity") == 1, done.stdout
    assert (run_dir / "loss.png").is_file()
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [6, 12]
    got, expected = losses(run_dir), losses(reference.run_dir)  # losses() fails on a step logged twice
    assert sorted(got) == list(range(1, 13))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)]),
        torch.tensor([expected[s] for s in sorted(got)]),
        rtol=1e-5,
        atol=1e-6,
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference_metrics = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["metrics/accuracy"] for r in metrics if "metrics/accuracy" in r]
    expected_accuracy = [r["metrics/accuracy"] for r in reference_metrics if "metrics/accuracy" in r]
    assert accuracy
    assert accuracy == pytest.approx(expected_accuracy, abs=1e-6)
    validation = [r for r in metrics if "val/loss" in r]
    expected_validation = [r for r in reference_metrics if "val/loss" in r]
    assert [r["step"] for r in validation] == [r["step"] for r in expected_validation] == [6, 12]
    for two, one in zip(validation, expected_validation, strict=True):
        assert two["val/loss_weight"] == one["val/loss_weight"] == 2 * 4 * 16  # every row, once
        assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-5)
        assert two["val/metrics/accuracy"] == pytest.approx(one["val/metrics/accuracy"], abs=1e-6)

    # The 2-rank checkpoint of step 6 (tensor-parallel shards too) resumes on one process (resharded on restore) and
    # finishes the run
    # as the one-process run did: same data position, same params, same losses.
    # One row of metric states per rank whose states differ: the token axes' ranks (data × context, not tensor).
    with CheckpointStore(run_dir / "checkpoints", create=False) as store:
        assert store.peek_metadata(6)["metric_state_ranks"] == (1 if mesh and "tensor_parallel" in mesh else 2)
    shutil.rmtree(run_dir / "checkpoints" / "12")
    resumed = train_lm(job.model_copy(update={"mesh": None}))
    assert resumed.steps_run == 6
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 13))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)]),
        torch.tensor([expected[s] for s in sorted(got)]),
        rtol=1e-5,
        atol=1e-6,
    )
    # Pipelined at tp=2, 3 blocks: the row-parallel sums' rounding (adds in another order, 6 steps) moved by Adam over
    # 6 more steps reaches a few near-zero elements of down_proj (measured max |Δ| 2.2e-6 on 3 of its 512).
    atol = 1e-5 if pipelined else 1e-6
    torch.testing.assert_close(resumed.state.params, reference.state.params, rtol=1e-5, atol=atol)


@pytest.mark.slow
@pytest.mark.cli
def test_torchrun_on_a_run_directory_another_process_writes_fails_on_every_rank(tmp_path: Path) -> None:
    from d9dfn.loop import RunLock

    job = tiny_job(tmp_path / "two").model_copy(update={"mesh": DeviceMeshParameters(data_parallel_replicate=2)})
    config = tmp_path / "two.json"
    config.write_text(job.model_dump_json())
    lock = RunLock(tmp_path / "two" / "stdlib-lm")
    lock.acquire()  # this process plays the other writer
    try:
        started = time.monotonic()
        done = _torchrun(config, tmp_path)
    finally:
        lock.release()
    assert done.returncode != 0
    # Rank 0 is refused; it broadcasts the verdict, so rank 1 fails alike at once instead of waiting for it. The line
    # shows once, last, in torchrun's block of failed ranks (issue 44 point 9; each rank printed it before).
    assert done.stderr.count(f"is being written by pid {os.getpid()} on host") == 1, done.stderr[-3000:]
    assert "  traceback : d9dfn: error: TrainingConfigurator: run directory " in done.stderr
    assert time.monotonic() - started < 120
    assert not (tmp_path / "two" / "stdlib-lm" / "metrics.jsonl").exists()


class _DiesAtStep3(CausalLMTask):
    """Rank 1 leaves without a word before step 3's collective; rank 0 must fail, not hang."""

    def register_events(self, bus: ev.EventBus) -> None:
        import torch.distributed as dist

        def maybe_die(context: Any) -> None:
            if context.step == 3 and dist.get_rank() == 1:
                os._exit(0)

        bus.subscribe(ev.EVENT_TRAIN_STEP_PRE, maybe_die)


def _dying_rank_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    from d9dfn.loop import CollectiveError

    _init(rank, world_size, init_file, timeout_s=60.0)
    job = tiny_job(Path(save_dir), "trainer.timeout.step_timeout=5", "trainer.checkpointing.period_steps=2")
    trainer = TrainingConfigurator(
        mesh=DeviceMeshParameters(data_parallel_replicate=2),
        parameters=job.trainer,
        task_provider=_DiesAtStep3,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()
    started = time.monotonic()
    with pytest.raises(CollectiveError, match=r"rank 0 of 2: step 3 failed in a collective .* rerun the same"):
        trainer.train()
    assert time.monotonic() - started < 30
    # The checkpoint of step 2 was committed before rank 1 left, and reads back on one process.
    assert trainer.checkpoints.all_steps() == [2]


@pytest.mark.slow
@pytest.mark.ranks
def test_a_rank_that_dies_fails_the_others_with_a_clear_error(tmp_path: Path) -> None:
    # Rank 1 exits with status 0 (so join alone would not notice); rank 0 checks its own error and timing.
    _run_ranks(_dying_rank_worker, 2, tmp_path, str(tmp_path / "runs"), timeout_s=120, clean=True)


class _ReplicatedEmbeddings(Qwen3Provider):
    """Keeps the embedding whole on every rank and lets the default shard the rest."""

    def parallelize_model_stage(self, context: Any, model: Any) -> Any:
        from torch.distributed.tensor import Replicate

        from d9dfn.parallel import data_parallel_placements

        assert context.device_mesh is not None
        assert context.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")

        def choose(name: str, tensor: torch.Tensor, mesh: Any) -> Any:
            if "embed" in name:
                return (Replicate(), Replicate())
            return data_parallel_placements(name, tensor, mesh)

        return choose


def _provider_placements_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _init(rank, world_size, init_file)
    job = tiny_job(Path(save_dir))
    trainer = TrainingConfigurator(
        mesh=DeviceMeshParameters(data_parallel_shard=2),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=_ReplicatedEmbeddings(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()
    state = trainer.initial_state()
    placements = {name: tuple(p.placements) for name, p in state.params.items()}
    assert all(isinstance(p, DTensor) for p in state.params.values())
    embeds = [name for name in placements if "embed" in name]
    assert embeds
    assert all(placements[name] == (Replicate(), Replicate()) for name in embeds), placements
    assert all(placements[name] == (Replicate(), Shard(0)) for name in placements if name not in embeds), placements
    assert {name: tuple(m.placements) for name, m in state.opt_state.mu.items()} == placements  # AdamW's moments
    _export_writes_the_full_params(trainer, state, save_dir, rank)


def _export_writes_the_full_params(trainer: Any, state: Any, save_dir: str, rank: int) -> None:
    """Export gathers the shards on every rank; rank 0 alone writes the file, which holds every full param."""
    path = trainer.export(Path(save_dir) / "export", load_checkpoint=False)
    full = {name: p.full_tensor() for name, p in state.params.items()}
    if rank == 0:
        from safetensors.torch import load_file

        written = load_file(path)
        assert all(torch.equal(written[name], tensor) for name, tensor in full.items())
    trainer.checkpoints.close()


@pytest.mark.slow
@pytest.mark.ranks
def test_model_provider_chooses_placements(tmp_path: Path) -> None:
    _run_ranks(_provider_placements_worker, 2, tmp_path, str(tmp_path / "runs"), timeout_s=120, clean=True)


@pytest.mark.slow
@pytest.mark.cli
def test_torchrun_resume_inside_a_logging_period_logs_byte_identical_metrics(tmp_path: Path, capsys: Any) -> None:
    """Checkpoints at 3 and 6 fall inside the logging periods 1-4 and 5-8, where each rank's metric state holds
    the partial sums of its own rows: resumed from step 3, the run must log ``metrics/*`` at step 4 (and everything
    else) byte for byte as the uninterrupted run did. Then step 3 on one process: the two ranks' states merge."""
    overrides = [
        "trainer.total_steps=8",
        "trainer.logging.period_steps=4",
        "trainer.checkpointing.period_steps=3",
        "trainer.checkpointing.num_to_keep=null",
        "eval_batches=1",
        "sample.num_bytes=0",
    ]
    job = tiny_job(tmp_path, *overrides)
    config = tmp_path / "job.json"
    config.write_text(job.model_dump_json())
    done = _torchrun(config, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "stdlib-lm"
    uninterrupted = (run_dir / "metrics.jsonl").read_bytes()
    records = [json.loads(line) for line in uninterrupted.splitlines()]
    assert [r["step"] for r in records if "metrics/accuracy" in r] == [4, 8]
    checkpoints = run_dir / "checkpoints"

    def keep_step_3() -> None:  # as if killed after step 5: the newest checkpoint is step 3, inside the first period
        assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [3, 6, 8]
        for step in (6, 8):
            shutil.rmtree(checkpoints / str(step))

    keep_step_3()
    resumed = _torchrun(config, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert resumed.stdout.count(f"d9dfn: resuming {run_dir} from step 3") == 1, resumed.stdout
    assert "metric states of" not in resumed.stdout  # as many ranks as saved: each gets its own row back
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted

    # On one process: rank 0 continues with the merge of both rows, so step 4's metrics are those of all the
    # period's rows (summed in another order: equal up to float rounding, like the one-process losses).
    keep_step_3()
    capsys.readouterr()
    train_lm(job)
    assert (
        "d9dfn: checkpoint step 3 holds the metric states of 2 data-parallel ranks and this run has 1: rank 0 "
        "continues with their merge"
    ) in capsys.readouterr().out
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [r["step"] for r in records]
    for one, two in zip(again, records, strict=True):
        assert one.keys() == two.keys()
        assert one == pytest.approx(two, rel=1e-5, abs=1e-6)


def _tensor_parallel_loop_worker(
    rank: int, world_size: int, init_file: str, save_dir: str, sequence: bool, vocab: bool
) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from d9dfn.models._decoder import Qwen3Attention, Qwen3MLP

    _init(rank, world_size, init_file)
    job = tiny_job(Path(save_dir), "model.num_kv_heads=2")
    whole = {"vocab_parallel": False}  # vocabulary parallelism is the default: only turned off is it named
    trainer = TrainingConfigurator(
        mesh=DeviceMeshParameters(tensor_parallel=2, sequence_parallel=sequence, **({} if vocab else whole)),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()
    assert trainer.data_parallel_size == 1  # both ranks see every row
    blocks = [m for m in trainer.skeleton.modules() if isinstance(m, Qwen3Attention | Qwen3MLP)]
    assert blocks
    assert all(m.tensor_parallel is not None and m.tensor_parallel.size == 2 for m in blocks)
    assert all(m.tensor_parallel.sequence == sequence for m in blocks)
    # With SP the model splits the sequence between its blocks, and the blocks' norms' gradients are partial over tp;
    # with vocabulary parallelism (mesh.vocab_parallel, the default) its embedding and tied head hold half the rows.
    bound = trainer.skeleton.tensor_parallel
    assert (bound is not None) == (sequence or vocab)
    assert bound is None or (bound.sequence, bound.vocab) == (sequence, vocab)
    assert ("tp" in trainer.parallelism.plan.params["layers.0.input_layernorm.weight"].partial) == sequence
    state = trainer.initial_state()
    assert all(isinstance(p, DTensor) for p in state.params.values())
    q, o = state.params["layers.0.self_attn.q_proj.weight"], state.params["layers.0.self_attn.o_proj.weight"]
    assert tuple(q.placements) == (Replicate(), Replicate(), Shard(0))  # (dp_replicate, dp_shard, tp)
    assert tuple(o.placements) == (Replicate(), Shard(0), Shard(1))  # dim 0 over the 1-rank dp_shard: whole
    assert q.to_local().shape[0] * 2 == q.shape[0]  # this rank's heads only
    assert tuple(state.params["norm.weight"].placements) == (Replicate(), Shard(0), Replicate())
    embed = state.params["embed_tokens.weight"]  # (256, D), tied: the LM head too
    assert tuple(embed.placements) == (
        (Replicate(), Replicate(), Shard(0)) if vocab else (Replicate(), Shard(0), Replicate())
    )
    assert embed.to_local().shape[0] == (128 if vocab else 256)
    _export_writes_the_full_params(trainer, state, save_dir, rank)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize(
    ("sequence", "vocab"), [(False, True), (True, False)], ids=["tensor-vocab", "tensor-sequence-whole-vocab"]
)
def test_the_loop_splits_heads_and_mlp_over_tensor_parallel_ranks(tmp_path: Path, sequence: bool, vocab: bool) -> None:
    # mesh.vocab_parallel is on by default (the torchrun test above trains with it, with and without SP); off here
    # with SP, the embedding and the head are whole on every rank.
    run = str(tmp_path / "runs")
    _run_ranks(_tensor_parallel_loop_worker, 2, tmp_path, run, sequence, vocab, timeout_s=120, clean=True)
