"""d9dfn.parallel: the data-parallel step on real gloo process groups (2 and 4 forked CPU ranks).

Tolerance: the data-parallel step and the single-process step sum the same products in a different
order (per rank, then across ranks), so new params and losses agree to float32 rounding; we ask for
``atol=1e-5, rtol=1e-5`` after two SGD-with-momentum steps. SGD, not Adam: Adam (and clipping below the
gradient's norm) would hide a wrong global ``Σw``, which scales every gradient alike; with SGD at lr 0.5
it moves the params by O(0.1), far above the tolerance.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks
from torch import nn

import d9dfn.optim as optim
from d9dfn import DataParallel, init_train_state, make_train_step, parallel
from d9dfn.loop import init_data_parallel_mesh, init_distributed, per_rank_compile_cache
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask
from d9dfn.testing import assert_trees_close

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ = 13, 8
# Masked label positions per row (of SEQ): every rank and every microbatch carries a different token count,
# and row 3 (rank 1's second microbatch in the 2-rank tests) carries none, so its local Σw is 0.
MASKED = [0, 5, 2, 8, 1, 6, 3, 4]


class TinyLM(nn.Module):
    """(B, T) ids -> (B, T, V) logits: embedding, tanh, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(torch.tanh(self.embed(input_ids)))}


class LoggingLMTask(CausalLMTask):
    """CausalLMTask that also logs each microbatch's token-mean loss (to check that logs stay local)."""

    def compute_loss(self, outputs: Any, state: Any, step: torch.Tensor) -> Any:
        result = super().compute_loss(outputs, state, step)
        return dataclasses.replace(result, logs={"token_loss": result.loss.detach()})


def _global_batch(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    for row in range(rows):
        labels[row, : MASKED[row]] = IGNORE_INDEX
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}


def _rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {key: value[start:stop] for key, value in batch.items()}


def _setup() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)  # the same initial params on every rank
    model, task, opt = TinyLM(), LoggingLMTask(), optim.sgd(0.5, momentum=0.9)
    return model, task, init_train_state(model, opt, task=task)


def _step(
    reduce_gradients: Any = None, backend: str | None = None, num_microbatches: int = 2, plan: Any = None
) -> Callable:
    model, task, _ = _setup()
    return make_train_step(
        model,
        task,
        optim.sgd(0.5, momentum=0.9),
        num_microbatches=num_microbatches,
        max_grad_norm=10.0,  # the clip runs on the global norm but does not bind, so a scale error shows
        plan=plan,
        data_parallel=None if reduce_gradients is None else DataParallel(reduce_gradients),
        compile=backend or False,
    )


# --- the hook in make_train_step (one process) ---------------------------------------------------------------------


def test_make_train_step_data_parallel_reduce_runs_before_the_weight_scaling() -> None:
    _, _, state = _setup()
    batch = _global_batch(4)
    seen = []

    def identity(grad_sum: Any, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> tuple:
        seen.append(float(weight_sum))
        return grad_sum, loss_sum, weight_sum

    def double_weight(grad_sum: Any, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> tuple:
        return grad_sum, loss_sum, weight_sum * 2  # as if another rank had the same weight but zero gradient

    plain_state, plain = _step()(state, batch)
    same_state, same = _step(identity)(state, batch)
    half_state, half = _step(double_weight)(state, batch)
    assert seen == [float((batch["labels"] != IGNORE_INDEX).sum())]  # the local Σw of both microbatches
    assert_trees_close((same_state, same), (plain_state, plain), rtol=0, atol=0)
    torch.testing.assert_close(half.loss, plain.loss / 2)
    torch.testing.assert_close(half.loss_weight, plain.loss_weight * 2)
    torch.testing.assert_close(half.grad_norm, plain.grad_norm / 2)
    assert list(plain.logs) == ["token_loss"]
    assert_trees_close(half.logs, plain.logs, rtol=0, atol=0)  # the tasks' logs stay local means
    # SGD's first step moves params by -lr·g: half the gradient, half the move.
    moved = {k: (half_state.params[k] - state.params[k]) * 2 for k in state.params}
    assert_trees_close(moved, {k: plain_state.params[k] - state.params[k] for k in state.params}, **TOL)


# --- errors and helpers that need no process group ------------------------------------------------------------------


def test_data_parallel_reduction_requires_an_explicit_group() -> None:
    with pytest.raises(
        TypeError, match=r"data_parallel_reduction: group is None; pass the data-parallel process group"
    ):
        parallel.data_parallel_reduction(None)
    with pytest.raises(ValueError, match=r"group_name: torch\.distributed is not initialized"):
        parallel.group_name(object())


def test_bucketed_runs_one_collective_per_key_dtype_and_device_and_returns_views() -> None:
    from d9dfn.parallel._bucket import bucketed

    tensors = [torch.ones(2, 3), torch.arange(4), torch.full((5,), 2.0), torch.zeros(()), torch.ones(1)]
    calls: list[tuple[Any, torch.dtype, int]] = []

    def collective(flat: torch.Tensor, key: Any) -> torch.Tensor:
        calls.append((key, flat.dtype, flat.numel()))
        return flat * 10

    out = bucketed(tensors, collective, group_by=["a", "a", "a", "a", "b"])
    # First-appearance order, so every rank issues the same collectives in the same order.
    assert calls == [("a", torch.float32, 12), ("a", torch.int64, 4), ("b", torch.float32, 1)]
    for got, tensor in zip(out, tensors, strict=True):
        torch.testing.assert_close(got, tensor * 10, rtol=0, atol=0)
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()  # views of one bucket
    assert tensors[0].eq(1).all()  # inputs untouched


def test_all_reduce_sum_rejects_non_tensor_leaves() -> None:
    with pytest.raises(TypeError, match=r"all_reduce_sum: leaf \['grads'\]\['b'\] is a float, not a tensor"):
        parallel.all_reduce_sum({"grads": {"a": torch.zeros(2), "b": 1.0}}, "0")


def test_init_distributed_names_unimplemented_degrees_before_starting_a_group() -> None:
    from d9dfn.config import DeviceMeshParameters

    match = r"mesh.context_parallel_replicate=4 is not implemented .* set mesh.context_parallel_replicate=1"
    with pytest.raises(ValueError, match=match):  # tensor_parallel is implemented (tests/test_tensor_parallel.py)
        init_distributed(DeviceMeshParameters(data_parallel_replicate=2, context_parallel_replicate=4), timeout_s=1)
    # context_parallel_shard is implemented (tests/test_context_parallel.py): past the degrees, to the launch check.
    with pytest.raises(ValueError, match=r"this one was not started by torchrun"):
        init_distributed(DeviceMeshParameters(context_parallel_shard=2), timeout_s=1)
    with pytest.raises(ValueError, match=r"init_data_parallel_mesh: shard=0; pass a positive int"):
        init_data_parallel_mesh(shard=0)


def test_per_rank_compile_cache_gives_each_rank_its_own_directory(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    first = per_rank_compile_cache(1)
    assert first == str(tmp_path / "shared" / "rank_1") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert os.path.isdir(first)
    # Called again (a restarted worker): stays under the shared root instead of nesting rank_1/rank_0.
    assert per_rank_compile_cache(0) == str(tmp_path / "shared" / "rank_0")
    assert per_rank_compile_cache(3, tmp_path / "other") == str(tmp_path / "other" / "rank_3")
    with pytest.raises(ValueError, match=r"per_rank_compile_cache: rank=-1; pass this process's global rank"):
        per_rank_compile_cache(-1)


# --- the data-parallel step equals the single-process step ---------------------------------------------------------


def _dp_step_worker(rank: int, world_size: int, init_file: str, backend: str | None) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_data_parallel_mesh(replicate=world_size, device_type="cpu")
        step = _step(parallel.data_parallel_reduction(mesh), backend)
        reference = _step()  # single process, eager, on the whole batch: no communication
        _, _, state = _setup()
        expected_state = state
        for index in range(2):
            batch = _global_batch(4, seed=index)  # 2 rows per rank, 1 row per microbatch
            if index == 1 and backend is not None:
                torch.compiler.set_stance("fail_on_recompile")
            state, out = step(state, _rows(batch, 2 * rank, 2 * rank + 2))
            expected_state, expected = reference(expected_state, batch)
            assert_trees_close(state.params, expected_state.params, **TOL)
            assert_trees_close(state.opt_state, expected_state.opt_state, **TOL)
            torch.testing.assert_close(out.loss, expected.loss, **TOL)
            torch.testing.assert_close(out.loss_weight, expected.loss_weight, rtol=0, atol=0)
            torch.testing.assert_close(out.grad_norm, expected.grad_norm, **TOL)
        # The uneven counts matter: the mean of the ranks' own means is not the global token mean.
        batch, initial = _global_batch(4, seed=0), _setup()[2]
        local_losses = [reference(initial, _rows(batch, 2 * r, 2 * r + 2))[1].loss for r in range(world_size)]
        assert abs(float(sum(local_losses)) / world_size - float(reference(initial, batch)[1].loss)) > 1e-2
        # Every rank holds the same params afterwards.
        gathered = [None] * world_size
        dist.all_gather_object(gathered, state.params)
        assert_trees_close(gathered[0], gathered[1], rtol=0, atol=0)
    finally:
        torch.compiler.set_stance("default")
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
@pytest.mark.ranks
def test_data_parallel_reduction_step_matches_single_process(tmp_path: Any, backend: str | None) -> None:
    _run_ranks(_dp_step_worker, 2, tmp_path, backend)


# Each rank compiles the step cold with inductor on its own and then meets the other in the step's collectives, which
# wait for the slower rank's compile: the cold step took 47 s on each rank at load 3.75 on 2 cores (a shared
# machine), and at load 5-35 the 30-s collective timeout of _init fired (gloo's "Application timeout caused pair
# closure"). The margins are for a machine ~10x slower than that; only a failure waits for them: a dead rank still
# fails at once (its peer's pair closes, and _run_ranks sees it exit), a stuck one at the collective's timeout, with
# gloo's message, before the test's own limit.
COMPILE_SKEW_S = 600.0
"""How long a rank's collective waits for a peer still compiling its cold step (the process group's timeout)."""
INDUCTOR_CACHE_TEST_S = 900.0
"""The whole test: two ranks, a cold and a warm inductor step each (61 s at load 3.75)."""


def _inductor_cache_worker(rank: int, world_size: int, init_file: str, cache_root: str) -> None:
    from torch._dynamo.utils import counters

    dist = _init(rank, world_size, init_file, timeout_s=COMPILE_SKEW_S)
    try:
        torch._inductor.config.compile_threads = 1  # no pool of compile workers to start in each forked rank
        directory = per_rank_compile_cache(rank, cache_root)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == directory
        # DTensor params sharded unevenly (13 rows: 7 on rank 0, 6 on rank 1): the graphs pytorch issue 188390
        # is about, whose cache key is the same on every rank.
        mesh = init_data_parallel_mesh(shard=world_size, device_type="cpu")
        reduction = parallel.data_parallel_reduction(mesh)
        model, task, initial = _setup()
        state = init_train_state(model, optim.sgd(0.5, momentum=0.9), task=task, mesh=mesh)
        assert state.params["embed.weight"].to_local().shape[0] == (7, 6)[rank]
        batch = _global_batch(4)
        local = _rows(batch, 2 * rank, 2 * rank + 2)
        expected_state, expected = _step()(initial, batch)
        outputs, hits = [], []
        for _ in range(2):  # cold, then warm from this rank's own cache directory (the regression for 188390)
            torch._dynamo.reset()
            counters.clear()
            plan = parallel.plan_for(state.params, mesh)
            outputs.append(_step(reduction, "inductor", num_microbatches=1, plan=plan)(state, local))
            hits.append(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])
        assert hits[0] == 0, hits  # the per-rank directory starts empty
        assert hits[1] > 0, hits  # and the second compile reads what this rank wrote
        (cold_state, cold), (warm_state, warm) = outputs
        assert_trees_close(parallel.full_tensors(cold_state.params), expected_state.params, **TOL)
        torch.testing.assert_close(cold.loss, expected.loss, **TOL)
        assert_trees_close(
            (warm_state.params, warm.loss, warm_state.opt_state),
            (cold_state.params, cold.loss, cold_state.opt_state),
            rtol=0,
            atol=0,
        )
        assert sorted(os.listdir(directory))  # this rank's artifacts landed in its own directory
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_per_rank_compile_cache_inductor_step_cold_and_warm(tmp_path: Any) -> None:
    _run_ranks(_inductor_cache_worker, 2, tmp_path, str(tmp_path / "inductor"), timeout_s=INDUCTOR_CACHE_TEST_S)
    assert sorted(os.listdir(tmp_path / "inductor")) == ["rank_0", "rank_1"]


def _all_reduce_sum_worker(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed._functional_collectives as funcol

    dist = _init(rank, world_size, init_file)
    try:

        def tree(r: int) -> dict[str, Any]:
            gen = torch.Generator().manual_seed(r)
            return {
                "w": torch.randn(2, 3, generator=gen),
                "half": torch.randn(4, generator=gen).to(torch.bfloat16),
                "count": torch.tensor(r + 1),
                "t": torch.randn(3, 2, generator=gen).t(),  # not contiguous
                "nested": [torch.randn((), generator=gen)],
            }

        local = tree(rank)
        calls = []
        all_reduce = funcol.all_reduce
        funcol.all_reduce = lambda *args, **kwargs: calls.append(args[0].dtype) or all_reduce(*args, **kwargs)
        try:
            summed = parallel.all_reduce_sum(local, dist.group.WORLD)
        finally:
            funcol.all_reduce = all_reduce
        assert sorted(map(str, calls)) == ["torch.bfloat16", "torch.float32", "torch.int64"]  # one per dtype
        trees = [tree(r) for r in range(world_size)]
        expected = {
            key: (
                [trees[0][key][0] + trees[1][key][0]]
                if key == "nested"
                else (trees[0][key].float() + trees[1][key].float()).to(trees[0][key].dtype)
            )
            for key in local
        }
        assert_trees_close(summed, expected, rtol=0, atol=0)
        assert_trees_close(local, tree(rank), rtol=0, atol=0)  # the input is untouched
        assert type(summed["w"]) is torch.Tensor  # no AsyncCollectiveTensor escapes
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_all_reduce_sum_buckets_by_dtype_and_keeps_the_tree(tmp_path: Any) -> None:
    _run_ranks(_all_reduce_sum_worker, 2, tmp_path)


# --- DTensor params: replicated, sharded (FSDP-style) and hybrid ---------------------------------------------------


def _placements_of(tree: Any) -> set[tuple[str, ...]]:
    return {tuple(str(p) for p in leaf.placements) for leaf in tree.values()}


def _sharded_step_worker(
    rank: int, world_size: int, init_file: str, degrees: tuple[int, int], backend: str | None
) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist = _init(rank, world_size, init_file)
    try:
        replicate, shard = degrees
        mesh = init_data_parallel_mesh(replicate, shard, device_type="cpu")
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert tuple(mesh.shape) == degrees
        model, task, opt = TinyLM(), LoggingLMTask(), optim.adamw(0.05, weight_decay=0.1)
        torch.manual_seed(rank)  # ranks initialize differently: distribute_params takes the first rank's values
        state = init_train_state(model, opt, task=task, mesh=mesh)
        torch.manual_seed(0)
        expected_state = init_train_state(TinyLM(), opt, task=task)  # what rank 0 initialized
        assert all(isinstance(p, DTensor) for p in state.params.values())
        want = (Replicate(), Shard(0))  # Shard(0) on a size-1 axis is a whole tensor
        assert all(tuple(p.placements) == want for p in state.params.values()), _placements_of(state.params)
        assert all(tuple(m.placements) == want for m in state.opt_state.mu.values())  # sharded like its param
        # Shards are uneven (13 rows over 2 or 4 ranks) and rank 0's initial values won.
        assert_trees_close(parallel.full_tensors(state.params), expected_state.params, rtol=0, atol=0)

        def build(reduce: Any, compile_with: str | None) -> Callable:
            return make_train_step(
                model,
                task,
                opt,
                num_microbatches=2,
                max_grad_norm=0.1,  # binds: the clip must see the norm over all shards
                plan=None if reduce is None else parallel.plan_for(state.params, mesh),
                data_parallel=None if reduce is None else DataParallel(reduce, rank),
                compile=compile_with or False,
            )

        step, reference = build(parallel.data_parallel_reduction(mesh), backend), build(None, None)
        rows = 8 // world_size
        for index in range(2):
            batch = _global_batch(8, seed=index)
            if index == 1 and backend is not None:
                torch.compiler.set_stance("fail_on_recompile")
            state, out = step(state, _rows(batch, rows * rank, rows * rank + rows))
            expected_state, expected = reference(expected_state, batch)
            assert_trees_close(parallel.full_tensors(state.params), expected_state.params, **TOL)
            assert_trees_close(parallel.full_tensors(state.opt_state), expected_state.opt_state, **TOL)
            torch.testing.assert_close(out.loss, expected.loss, **TOL)
            torch.testing.assert_close(out.loss_weight, expected.loss_weight, rtol=0, atol=0)
            torch.testing.assert_close(out.grad_norm, expected.grad_norm, **TOL)
            assert float(expected.grad_norm) > 0.1  # the clip bound
            assert type(out.grad_norm) is torch.Tensor
            assert type(out.loss) is torch.Tensor
        assert all(tuple(p.placements) == want for p in state.params.values())
        local_rows = {name: p.to_local().shape[0] for name, p in state.params.items()}
        assert sum(dist_all(local_rows["embed.weight"], mesh)) == VOCAB * replicate, local_rows
    finally:
        torch.compiler.set_stance("default")
        dist.destroy_process_group()


def dist_all(value: int, mesh: Any) -> list[int]:
    import torch.distributed as dist

    gathered = [0] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@pytest.mark.slow
@pytest.mark.parametrize(
    ("degrees", "backend"),
    [((1, 2), None), ((2, 1), None), ((1, 2), "aot_eager"), ((2, 2), None), ((1, 4), "aot_eager")],
    ids=["shard2-eager", "replicate2-eager", "shard2-aot_eager", "hybrid2x2-eager", "shard4-aot_eager"],
)
@pytest.mark.ranks
def test_sharded_step_matches_single_process(tmp_path: Any, degrees: tuple[int, int], backend: str | None) -> None:
    _run_ranks(_sharded_step_worker, degrees[0] * degrees[1], tmp_path, degrees, backend, timeout_s=240)


def _placement_errors_worker(rank: int, world_size: int, init_file: str) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_data_parallel_mesh(shard=world_size, device_type="cpu")
        params = {"w": torch.ones(3, 2), "scale": torch.ones(())}
        placed = parallel.distribute_params(params, mesh)
        assert tuple(placed["w"].placements) == (Replicate(), Shard(0))
        assert tuple(placed["scale"].placements) == (Replicate(), Replicate())  # a 0-d tensor cannot be split
        with pytest.raises(ValueError, match=r"params\['w'\] got placements \(Replicate\(\),\) for a 2-axis mesh"):
            parallel.distribute_params(params, mesh, lambda name, tensor, mesh: (Replicate(),))
        with pytest.raises(ValueError, match=r"params\['w'\] got placement Partial\(sum\); a parameter is"):
            parallel.distribute_params(params, mesh, lambda name, tensor, mesh: (Replicate(), Partial()))
        with pytest.raises(ValueError, match=r"params\['w'\] has shape \(3, 2\) but got Shard\(dim=2\)"):
            parallel.distribute_params({"w": params["w"]}, mesh, lambda name, tensor, mesh: (Replicate(), Shard(2)))
        with pytest.raises(ValueError, match=r"placements were given without a mesh"):
            init_train_state(TinyLM(), optim.sgd(0.1), placements=parallel.data_parallel_placements)
        model, task, _ = _setup()
        state = init_train_state(model, optim.sgd(0.1), task=task, mesh=mesh)
        step = make_train_step(model, task, optim.sgd(0.1), compile=False)
        with pytest.raises(
            ValueError, match=r"params\['embed.weight'\] is a DTensor but the step was built without a plan"
        ):
            step(state, _rows(_global_batch(4), 2 * rank, 2 * rank + 2))
        with pytest.raises(ValueError, match=r"shard=1 = 1 processes, but the job has 2"):
            init_data_parallel_mesh(replicate=1, device_type="cpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_placement_errors_name_the_parameter_and_the_fix(tmp_path: Any) -> None:
    _run_ranks(_placement_errors_worker, 2, tmp_path)


# --- the loss weight is summed over the data-parallel group only ----------------------------------------------------


def _two_groups_worker(rank: int, world_size: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist = _init(rank, world_size, init_file)
    try:
        # WORLD = 4 ranks = 2 replica sets x 2 data-parallel ranks: DP groups {0, 1} and {2, 3}.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica_set", "dp"))
        group_index, dp_rank = divmod(rank, 2)
        assert mesh["dp"].mesh.tolist() == [2 * group_index, 2 * group_index + 1]
        batch = _global_batch(4, seed=10 + group_index)  # each DP group trains on its own data
        _, _, state = _setup()
        state, out = _step(parallel.data_parallel_reduction(mesh["dp"]))(
            state, _rows(batch, 2 * dp_rank, 2 * dp_rank + 2)
        )
        expected_state, expected = _step()(_setup()[2], batch)
        assert_trees_close(state.params, expected_state.params, **TOL)
        torch.testing.assert_close(out.loss, expected.loss, **TOL)
        # Σw is this group's token count, not WORLD's (d9d's bug §11.7 would double it here).
        num_tokens = float((batch["labels"] != IGNORE_INDEX).sum())
        assert float(out.loss_weight) == num_tokens, (float(out.loss_weight), num_tokens)
        losses = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(losses, out.loss)
        assert losses[0] == losses[1], losses
        assert losses[2] == losses[3], losses
        assert losses[0] != losses[2], losses
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_data_parallel_reduction_sums_over_its_group_not_world(tmp_path: Any) -> None:
    _run_ranks(_two_groups_worker, 4, tmp_path)


# --- a failing rank fails the test instead of hanging it -----------------------------------------------------------


def _failing_worker(rank: int, world_size: int, init_file: str, how: str) -> None:
    dist = _init(rank, world_size, init_file, timeout_s=3.0)
    try:
        if rank == 1 and how == "raise":
            raise RuntimeError("rank 1 fails before its step on purpose")
        if rank == 1 and how == "vanish":
            os._exit(0)  # dies silently: join sees a success, so only the process group can notice
        if rank == 1 and how == "stall":
            time.sleep(60)  # alive but absent: only the process group's timeout can notice
        _, _, state = _setup()
        # Rank 0 enters the step's all-reduce that rank 1 never joins.
        _step(parallel.data_parallel_reduction(dist.group.WORLD))(state, _rows(_global_batch(4), 0, 2))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "failed_rank", "message"),
    [
        # join tears rank 0 down, unless gloo's closed socket reaches it first
        ("raise", None, "rank 1 fails before its step on purpose|Connection (closed|reset) by peer"),
        ("vanish", 0, "Connection (closed|reset) by peer"),  # gloo notices the closed socket at once
        ("stall", 0, "Timed out"),  # the process group's 3 s timeout fires
    ],
)
@pytest.mark.ranks
def test_run_ranks_fails_fast_when_a_rank_dies(tmp_path: Any, how: str, failed_rank: int | None, message: str) -> None:
    from torch.multiprocessing import ProcessRaisedException

    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match=message) as info:
        _run_ranks(_failing_worker, 2, tmp_path, how, timeout_s=60)
    assert failed_rank is None or info.value.error_index == failed_rank
    assert time.monotonic() - start < 30  # well before the 60 s limit: nobody waited forever


def test_init_distributed_outside_torchrun_names_the_launch_command(monkeypatch):
    from d9dfn.config import DeviceMeshParameters

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert not torch.distributed.is_initialized()
    launch = r"not started by torchrun .* `torchrun --nproc-per-node 2 -m d9dfn train \.\.\.`"
    with pytest.raises(ValueError, match=launch):
        init_distributed(DeviceMeshParameters(pipeline_parallel=2), timeout_s=5)
