"""Pipeline parallelism on real gloo ranks: each rank runs its row of a program with sends and receives, and the
step equals the single-process, unpipelined step (bitwise for pure pipelines; the DP tests' tolerance with pp×dp).

Construction consistency (d9d): every rank builds the whole tiny model on CPU from one seed and keeps only its
stages' params (``Stage.select_params``), so the initial weights are the single-process model's. A large model
would build the meta skeleton and materialize only its stages (seeded per name, or loaded from a checkpoint).
Each launch runs several schedules over one process group to keep the ranks' start-up cost low.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks
from test_pipeline_executor import _contiguous_split, _Regression, _setup

import d9dfn.optim as optim
from d9dfn import make_train_step, parallel, pipeline
from d9dfn.loop import init_pipeline_mesh, set_collective_timeout
from d9dfn.testing import assert_trees_close

pytestmark = pytest.mark.slow

TOL = {"rtol": 1e-5, "atol": 1e-5}  # test_parallel.py's, for pp×dp (the dp sum changes the summation order)
OUTPUT_FIELDS = ("loss", "loss_weight", "grad_norm", "lr", "nonfinite", "skipped")


def _local_state(state: Any, opt: Any, stages: tuple[pipeline.Stage, ...]) -> Any:
    """This rank's slice of the whole model's train state: its stages' params, buffers and optimizer state."""
    params = {name: p for s in stages for name, p in s.select_params(state.params).items()}
    buffers = {name: b for s in stages for name, b in s.select_buffers(state.buffers).items()}
    return state.replace(params=params, buffers=buffers, opt_state=opt.init(params))


def _run(
    mesh: Any,
    name: str,
    stages_per_rank: int,
    num_microbatches: int,
    *,
    clip: float | None = 0.05,
    nan: bool = False,
    exact: bool = True,
) -> None:
    """Two steps of ``name`` on this rank vs the one-process step on the whole batch, on every rank."""
    num_ranks = mesh.size(0)
    dp_mesh = parallel.data_parallel_submesh(mesh)
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_rank() % dp_mesh.size()
    program = pipeline.SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches)
    num_layers = program.num_stages
    model, opt, state, batches = _setup(num_layers, 5, norm=True, dropout=0.25)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    stages = pipeline.split_stages(model, _contiguous_split(num_layers, program.num_stages))
    rank_pipeline = pipeline.PipelineRank(program, stages, parallel.pipeline_rank(mesh), parallel.pipeline_group(mesh))
    options = {"rng_kwarg": "dropout_key", "max_grad_norm": clip, "skip_nonfinite": nan, "compile": False}
    reference = make_train_step(model, _Regression(), opt, num_microbatches=num_microbatches * dp_size, **options)
    step = make_train_step(
        model,
        _Regression(),
        opt,
        num_microbatches=num_microbatches,
        executor=rank_pipeline,
        data_parallel=parallel.data_parallel(dp_mesh, dp_rank) if dp_size > 1 else None,
        **options,
    )
    if nan:
        batches[1]["y"][0, 0] = float("nan")
    local, expected = _local_state(state, opt, rank_pipeline.local_stages), state
    rows = 8 // dp_size
    tol = {"rtol": 0, "atol": 0} if exact else TOL
    for batch in batches:
        expected, want = reference(expected, batch)
        mine = {key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch.items()}
        local, got = step(local, mine)
        for field in OUTPUT_FIELDS:
            assert_trees_close(getattr(got, field), getattr(want, field), **tol)
    if clip is not None:
        assert float(want.grad_norm) > clip  # the clip bound is active: the norm over all stages decides
    if nan:
        assert bool(got.skipped)  # on every rank: the NaN loss lives on the last stage only
        assert bool(got.nonfinite)
    for stage in rank_pipeline.local_stages:
        assert_trees_close(stage.select_params(local.params), stage.select_params(expected.params), **tol)
        if dp_size == 1:  # BatchNorm's running statistics are per data-parallel replica, as with DDP
            assert_trees_close(stage.select_buffers(local.buffers), stage.select_buffers(expected.buffers), **tol)


def _schedules_worker(rank: int, world_size: int, init_file: str, degrees: tuple[int, int], configs: list) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_pipeline_mesh(*degrees, device_type="cpu")
        for name, stages_per_rank, num_microbatches, options in configs:
            try:
                _run(mesh, name, stages_per_rank, num_microbatches, **options)
            except Exception as error:
                raise AssertionError(f"{name} v={stages_per_rank} m={num_microbatches} {options}: {error}") from error
    finally:
        dist.destroy_process_group()


# Every training schedule on real ranks, m < p included (no deadlock), clipping active, a NaN skipped everywhere.
PP2 = [
    ("gpipe", 1, 4, {}),
    ("one_f_one_b", 1, 2, {}),
    ("looped_bfs", 1, 1, {}),  # m < p
    ("zero_bubble_1f1b", 1, 4, {"clip": None}),
    ("one_f_one_b", 2, 4, {}),  # interleaved: two stages per rank, loop placement
    ("looped_bfs", 2, 2, {}),
    ("zero_bubble_1f1b", 2, 1, {}),  # m < p stages
    ("zero_bubble_v", 2, 2, {}),  # V placement: same-rank turn
    ("dual_pipe_v", 2, 4, {}),
    ("one_f_one_b", 1, 2, {"nan": True, "clip": None}),
]
PP4 = [
    ("gpipe", 1, 2, {}),  # m < p for every one-stage schedule
    ("one_f_one_b", 1, 2, {}),
    ("looped_bfs", 1, 4, {}),
    ("zero_bubble_1f1b", 1, 1, {}),
    ("zero_bubble_v", 2, 2, {}),
]


@pytest.mark.parametrize(
    ("degrees", "configs"),
    [((2, 1), PP2), ((4, 1), PP4), ((2, 2), [("one_f_one_b", 1, 2, {"exact": False})])],
    ids=["pp2", "pp4", "pp2xdp2"],
)
@pytest.mark.ranks
def test_pipeline_ranks_equal_the_single_process_step(tmp_path: Any, degrees: tuple[int, int], configs: list) -> None:
    _run_ranks(_schedules_worker, degrees[0] * degrees[1], tmp_path, degrees, configs, timeout_s=170)


def _dead_rank_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file, timeout_s=5.0)
    try:
        mesh = init_pipeline_mesh(2, device_type="cpu")
        dist.barrier()
        if rank == 1:
            os._exit(0)  # leaves without a word before its first receive
        model, opt, state, batches = _setup(2, 5, norm=False, dropout=0.0)
        stages = pipeline.split_stages(model, _contiguous_split(2, 2))
        rank_pipeline = pipeline.PipelineRank(pipeline.gpipe(2, 1, 2), stages, 0, parallel.pipeline_group(mesh))
        step = make_train_step(model, _Regression(), opt, num_microbatches=2, executor=rank_pipeline, compile=False)
        started = time.monotonic()
        error = r"rank 0 at step 0: 0(SEND_F|RECV_B)\d \(microbatch \d\) with pipeline rank 1 failed"
        with pytest.raises(RuntimeError, match=error):
            step(_local_state(state, opt, rank_pipeline.local_stages), batches[0])
        assert time.monotonic() - started < 30
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_a_rank_that_dies_mid_step_fails_its_peer_with_the_action_and_rank(tmp_path: Any) -> None:
    _run_ranks(_dead_rank_worker, 2, tmp_path, timeout_s=90)


def _stalled_rank_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file, timeout_s=30.0)
    mesh = init_pipeline_mesh(2, device_type="cpu")
    group = parallel.pipeline_group(mesh)
    set_collective_timeout(3.0, [group])  # the pp group's own timeout bounds every P2P wait
    dist.barrier()
    if rank == 1:
        time.sleep(12)  # alive but silent: its connections stay open, so only a timeout can end the wait
        os._exit(0)
    model, opt, state, batches = _setup(2, 5, norm=False, dropout=0.0)
    stages = pipeline.split_stages(model, _contiguous_split(2, 2))
    rank_pipeline = pipeline.PipelineRank(pipeline.gpipe(2, 1, 2), stages, 0, group)
    step = make_train_step(model, _Regression(), opt, num_microbatches=2, executor=rank_pipeline, compile=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 at step 0: 0(SEND_F|RECV_B)\d .* with pipeline rank 1 failed"):
        step(_local_state(state, opt, rank_pipeline.local_stages), batches[0])
    assert time.monotonic() - started < 10  # the 3 s timeout, not the peer's 12 s stall
    os._exit(0)  # only on success (a failure above propagates): rank 1 still sleeps, no teardown with it


@pytest.mark.ranks
def test_a_rank_that_stalls_mid_step_fails_its_peer_within_the_pp_groups_timeout(tmp_path: Any) -> None:
    _run_ranks(_stalled_rank_worker, 2, tmp_path, timeout_s=90)


def test_split_stages_refuses_a_weight_tied_across_stages() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
            self.head.weight = self.embed.weight

    with pytest.raises(ValueError, match=r"'embed.weight' is tied to \['head.weight'\] .* stages \[0, 1\]"):
        pipeline.split_stages(Tied(), [["embed"], ["head"]])
