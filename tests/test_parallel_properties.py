"""Property: the sharded data-parallel step equals the single-process step on the whole batch.

Hypothesis draws small language models (odd and tiny widths, so ``Shard(0)`` splits unevenly and some
ranks hold empty shards), batches with random label masks (uneven token counts per rank, sometimes a
rank with none), the microbatch count, the optimizer (SGD with momentum, AdamW), clipping, and the
data-parallel mesh ``(dp_replicate, dp_shard)``: 1 rank, 2 and 4 replicated, 2 and 4 sharded, 2×2
hybrid. Each rank feeds its own consecutive slice of the global batch; after two steps every rank's
gathered params, optimizer state, loss, ``Σw`` and gradient norm must equal those of the eager
single-process step on the whole batch.

All ranks run in this one process: torch's ``fake`` process group gives ``init_device_mesh`` its groups,
and ``LocalTensorMode`` (``torch.distributed._local_tensor``) runs every op once per simulated rank and
every collective (DTensor all-gathers, reduce-scatters, the functional all-reduce of ``Σw``) as the sum
or gather over the simulated ranks. A step costs tens of milliseconds, so the property runs over many
meshes where forked gloo ranks (``tests/test_parallel.py``) would take seconds per example. What it does
not cover: ``torch.compile`` (eager only) and anything that asks ``torch.distributed.get_rank()``, which is
0 for every simulated rank (the step reads coordinates from the mesh, which LocalTensorMode patches).

Tolerance ``rtol = atol = 1e-5`` in float32 (``Σw`` exactly: it sums integer token counts). Both runs
add the same products, in a different order (per microbatch and rank, then across ranks); with values of
order 1 and at most a few hundred terms per sum, the rounding stays near 1e-6 while the
deliberately wrong reductions at the end move params by 1e-2 or more. AdamW uses ``eps=1e-3``: its first
update is about ``lr·g/(|g| + eps)``, so with torch's ``eps=1e-8`` a gradient entry that cancels to
rounding noise (~1e-7) in one run and to exactly 0 in the other would move a param by up to ``lr`` in one
and not at all in the other, a difference of reduction order, not a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

import d9dfn.optim as optim
from d9dfn import DataParallel, init_train_state, make_train_step, parallel, tree_map, tree_map_with_path
from d9dfn.loop import init_data_parallel_mesh
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask
from d9dfn.testing import assert_trees_close

TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_STEPS = 2
MESHES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
"""``(data_parallel_replicate, data_parallel_shard)``: 1 rank, DDP, FSDP-style sharding, and 2×2 HSDP."""


class TinyLM(nn.Module):
    """(B, T) ids -> (B, T, V) logits: embedding, optional tanh hidden layer, linear head, optional 0-d scale."""

    def __init__(self, vocab: int, width: int, hidden: int, bias: bool, scale: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)  # (V, D): dim 0 is the vocabulary, often odd
        self.hidden = nn.Linear(width, hidden, bias=bias) if hidden else None
        self.head = nn.Linear(hidden or width, vocab, bias=bias)
        self.scale = nn.Parameter(torch.tensor(1.5)) if scale else None  # 0-d: replicated everywhere

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = torch.tanh(self.embed(input_ids))  # (B, T, D)
        if self.hidden is not None:
            x = torch.tanh(self.hidden(x))  # (B, T, H)
        logits = self.head(x)  # (B, T, V)
        return {"logits": logits * self.scale if self.scale is not None else logits}


class Case(NamedTuple):
    """One drawn example: mesh, model shape, batch shape and masking, optimizer and clipping."""

    replicate: int
    shard: int
    vocab: int
    width: int
    hidden: int
    bias: bool
    scale: bool
    seq: int
    rows_per_microbatch: int
    num_microbatches: int
    mask_rate: float
    silent_rank: int | None  # a rank whose every label is masked (local Σw = 0), or None
    optimizer: str
    max_grad_norm: float | None
    seed: int

    @property
    def num_ranks(self) -> int:
        return self.replicate * self.shard

    @property
    def rows_per_rank(self) -> int:
        return self.rows_per_microbatch * self.num_microbatches


@st.composite
def cases(draw: st.DrawFn, meshes: list[tuple[int, int]] = MESHES) -> Case:
    """Small models, batches, optimizers and meshes; widths 1..7 so shards are uneven or empty."""
    replicate, shard = draw(st.sampled_from(meshes))
    num_ranks = replicate * shard
    return Case(
        replicate=replicate,
        shard=shard,
        vocab=draw(st.integers(2, 9)),
        width=draw(st.integers(1, 5)),
        hidden=draw(st.sampled_from([0, 1, 3, 6, 7])),
        bias=draw(st.booleans()),
        scale=draw(st.booleans()),
        seq=draw(st.integers(1, 4)),
        rows_per_microbatch=draw(st.integers(1, 2)),
        num_microbatches=draw(st.integers(1, 3)),
        mask_rate=draw(st.sampled_from([0.0, 0.3, 0.7])),
        silent_rank=draw(st.none() | st.integers(0, num_ranks - 1)) if num_ranks > 1 else None,
        optimizer=draw(st.sampled_from(["sgd", "adamw"])),
        # None: no clipping; 0.05: binding (random logits give norms of order 0.1-1); 100: computed, never binding.
        max_grad_norm=draw(st.sampled_from([None, 0.05, 100.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def _optimizer(case: Case) -> Any:
    if case.optimizer == "sgd":
        return optim.sgd(0.5, momentum=0.9)  # a large lr: a wrong Σw or gradient moves params far
    # eps: see the module docstring. Not the fused kernel: under LocalTensorMode an in-place kernel runs once per
    # simulated rank, so a plain tensor the ranks share (a 0-d param left unsharded) would be updated once per rank;
    # the fused tail on real ranks: test_train_distributed.py, test_parallel.py.
    return optim.adamw(0.05, eps=1e-3, weight_decay=0.1, fused=False)


def _model(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    return TinyLM(case.vocab, case.width, case.hidden, case.bias, case.scale)


def _global_batches(case: Case) -> list[dict[str, torch.Tensor]]:
    """``NUM_STEPS`` global batches of ``num_ranks × rows_per_rank`` rows; rank r feeds the r-th slice."""
    gen = torch.Generator().manual_seed(case.seed)
    rows = case.num_ranks * case.rows_per_rank
    batches = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, case.vocab, (rows, case.seq + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < case.mask_rate] = IGNORE_INDEX
        if case.silent_rank is not None:
            start = case.silent_rank * case.rows_per_rank
            labels[start : start + case.rows_per_rank] = IGNORE_INDEX
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return batches


def _reference(case: Case, trainable: Any = None) -> tuple[Any, Any, list[tuple[torch.Tensor, ...]]]:
    """The single-process eager step on the whole batch, ``NUM_STEPS`` times: (params, opt_state, outputs)."""
    model, task = _model(case), CausalLMTask()
    state = init_train_state(model, _optimizer(case), task=task, trainable=trainable)
    step = make_train_step(
        model, task, _optimizer(case), num_microbatches=1, max_grad_norm=case.max_grad_norm, compile=False
    )
    outputs = []
    for batch in _global_batches(case):
        state, out = step(state, batch)
        outputs.append((out.loss, out.loss_weight, out.grad_norm))
    return state.params, state.opt_state, outputs


def _agreed(tensor: Any) -> Any:
    """A simulated rank-by-rank value as one plain tensor, asserting that every rank holds the same one."""
    from torch.distributed._local_tensor import LocalTensor

    if parallel.is_distributed_tensor(tensor):
        tensor = tensor.full_tensor()  # all-gather over the mesh
    if not isinstance(tensor, LocalTensor):
        return tensor
    values = {rank: tensor._local_tensors[rank] for rank in sorted(tensor._ranks)}
    first = values[min(values)]
    for rank, value in values.items():
        # A value every rank must agree on (gathered params, the global loss): bitwise the same.
        assert torch.equal(value, first), f"rank {rank} holds {value} but rank {min(values)} holds {first}"
    return first.clone()


def _check_placements(state: Any, mesh: Any) -> None:
    """Params sit where ``data_parallel_placements`` puts them, and optimizer state that mirrors a param with it.

    A step that returned, say, replicated params or optimizer state would still pass the value checks
    (``full_tensor`` of a replicated tensor is the same tensor) while holding every shard on every rank.
    """
    mirrored = []
    for name, param in state.params.items():
        expected = parallel.data_parallel_placements(name, param, mesh)
        assert parallel.is_distributed_tensor(param), f"params[{name!r}] is a {type(param).__name__}, not a DTensor"
        assert tuple(param.placements) == expected, f"params[{name!r}] is placed {param.placements}, not {expected}"

    def check(path: tuple, leaf: Any) -> None:
        param = state.params.get(path[-1]) if path and isinstance(path[-1], str) else None
        if param is not None and tuple(leaf.shape) == tuple(param.shape):
            placements = getattr(leaf, "placements", type(leaf).__name__)
            assert placements == param.placements, f"opt_state{list(path)} is placed {placements}, not like its param"
            mirrored.append(path)

    tree_map_with_path(check, state.opt_state)
    assert mirrored, "no optimizer state mirrors a param: the placement check above checked nothing"


Reduction = Callable[[Any], Callable]
"""``mesh -> DataParallel.reduce`` hook; the correct one is ``parallel.data_parallel_reduction``."""


def _forget_meshes() -> None:
    """Clear DTensor's sharding-propagation caches, which hold the meshes of a destroyed process group.

    The caches are keyed by ``DTensorSpec``s, and a ``DeviceMesh`` compares equal to any mesh of the same
    shape, dim names and device type, so a later mesh in this process, or in a rank forked from it
    (``tests/_ranks.py``), would get back a cached output spec whose mesh names an earlier run's
    destroyed groups: ``RuntimeError: Could not resolve the process group registered under the name 3`` in the
    first collective of a DTensor op.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _sharded(
    case: Case,
    reduction: Reduction = parallel.data_parallel_reduction,
    repeated_blocks: tuple = (),
    donate: bool = False,
    trainable: Any = None,
    optimizer_of: Callable[[Case], Any] = _optimizer,
) -> tuple[Any, Any, list]:
    """``NUM_STEPS`` data-parallel steps on ``case``'s mesh, every rank simulated in this process; ``donate``: the
    step updates each rank's shards in place (``make_train_step(donate=True)``).

    Returns what every rank agrees on: gathered params and optimizer state, and per step the global
    (loss, Σw, grad norm).
    """
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, task = _model(case), CausalLMTask()
    batches = _global_batches(case)
    _forget_meshes()  # in case an earlier test in this process left DTensor specs of its own meshes behind
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.num_ranks)
    try:
        mesh = init_data_parallel_mesh(case.replicate, case.shard, device_type="cpu")
        step = make_train_step(
            model,
            task,
            optimizer_of(case),
            num_microbatches=case.num_microbatches,
            max_grad_norm=case.max_grad_norm,
            plan=parallel.plan_for(model, mesh),
            data_parallel=DataParallel(reduction(mesh)),
            compile=False,
            repeated_blocks=repeated_blocks,
            donate=donate,
        )
        with LocalTensorMode(case.num_ranks) as mode:
            state = init_train_state(model, optimizer_of(case), task=task, mesh=mesh, trainable=trainable)
            _check_placements(state, mesh)
            outputs = []
            for batch in batches:
                local = {
                    key: mode.rank_map(
                        lambda rank, value=value: value[rank * case.rows_per_rank :][: case.rows_per_rank]
                    )
                    for key, value in batch.items()
                }
                state, out = step(state, local)
                _check_placements(state, mesh)
                outputs.append(tuple(_agreed(t) for t in (out.loss, out.loss_weight, out.grad_norm)))
            return tree_map(_agreed, state.params), tree_map(_agreed, state.opt_state), outputs
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _assert_same_run(actual: tuple[Any, Any, list], expected: tuple[Any, Any, list]) -> None:
    (params, opt_state, outputs), (ref_params, ref_opt_state, ref_outputs) = actual, expected
    assert_trees_close(params, ref_params, **TOL)
    assert_trees_close(opt_state, ref_opt_state, **TOL)
    for index, ((loss, weight, norm), (ref_loss, ref_weight, ref_norm)) in enumerate(
        zip(outputs, ref_outputs, strict=True)
    ):
        torch.testing.assert_close(weight, ref_weight, rtol=0, atol=0, msg=lambda m, i=index: f"step {i} Σw: {m}")
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, i=index: f"step {i} loss: {m}")
        torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m, i=index: f"step {i} grad norm: {m}")


# --- the property -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=[f"{r}x{s}" for r, s in MESHES])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_sharded_step_matches_single_process_step(mesh: tuple[int, int], data: st.DataObject) -> None:
    case = data.draw(cases([mesh]), label="case")
    event(f"{case.optimizer}, clip {case.max_grad_norm}")
    if any(len(torch.arange(size).chunk(case.shard)) < case.shard for size in (case.vocab, case.hidden or case.vocab)):
        event("a rank holds an empty shard")
    if case.silent_rank is not None:
        event("a rank has no tokens")
    _assert_same_run(_sharded(case), _reference(case))


# --- the property can fail: deliberately wrong reductions ----------------------------------------------------------

# A fixed 2×2 hybrid case with uneven token counts (rank 1 has none), SGD and no clipping, so any error in
# Σw or in the gradient reaches the params unscaled.
WRONG = Case(
    replicate=2,
    shard=2,
    vocab=5,
    width=3,
    hidden=3,
    bias=True,
    scale=True,
    seq=3,
    rows_per_microbatch=1,
    num_microbatches=2,
    mask_rate=0.3,
    silent_rank=1,
    optimizer="sgd",
    max_grad_norm=None,
    seed=7,
)


def test_repeated_blocks_step_matches_single_process_step_on_a_2x2_mesh() -> None:
    """``repeated_blocks`` swaps the gathered full params in and takes autograd's gradient: the same reduction
    to the params' placements as the default piece (here on the two ``nn.Linear``, run as regions)."""
    _assert_same_run(_sharded(WRONG, repeated_blocks=(nn.Linear,)), _reference(WRONG))


def _frozen_base(name: str, _: torch.Tensor) -> bool:
    """The embedding and the hidden layer's weight frozen (its bias trained: one block holds both kinds)."""
    return name not in ("embed.weight", "hidden.weight")


@pytest.mark.parametrize("blocks", [(), (nn.Linear,)], ids=["whole", "blockwise"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donating"])
def test_frozen_params_are_sharded_and_the_step_matches_single_process_step(blocks: tuple, donate: bool) -> None:
    """Frozen params stay params: ``Shard(0)`` over ``dp_shard`` like the others (``_check_placements``, before and
    after every step), gathered in the head or per block with the trainable ones, unchanged, without optimizer
    state; the sharded step equals the one-process step on the 2×2 hybrid mesh."""
    case = WRONG._replace(optimizer="adamw", max_grad_norm=0.05)
    params, opt_state, outputs = _sharded(case, repeated_blocks=blocks, donate=donate, trainable=_frozen_base)
    expected = _reference(case, trainable=_frozen_base)
    _assert_same_run((params, opt_state, outputs), expected)
    model = _model(case)
    for name in ("embed.weight", "hidden.weight"):
        assert torch.equal(params[name], dict(model.named_parameters())[name]), name  # unchanged
        assert name not in opt_state.mu
    assert not torch.equal(params["hidden.bias"], model.hidden.bias)


@pytest.mark.parametrize("blocks", [(), (nn.Linear,)], ids=["whole", "blockwise"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_donating_sharded_step_equals_the_pure_one_bitwise(optimizer: str, blocks: tuple) -> None:
    """Every simulated rank's shards updated in place (the whole-tree tail, or each ``nn.Linear``'s leaves through
    one region), on the 2×2 hybrid mesh with uneven tokens: bitwise the pure step, clipped or not."""
    case = WRONG._replace(optimizer=optimizer, max_grad_norm=0.05 if optimizer == "adamw" else None)
    params, opt_state, outputs = _sharded(case, repeated_blocks=blocks, donate=True)
    ref_params, ref_opt_state, ref_outputs = _sharded(case, repeated_blocks=blocks)
    assert_trees_close((params, opt_state, outputs), (ref_params, ref_opt_state, ref_outputs), rtol=0, atol=0)


def _not_leafwise(case: Case) -> Any:
    """The case's optimizer without its ``leafwise`` mark: the whole-tree tail then runs it on the ``DTensor``s."""
    return optim.Transform(_optimizer(case).init, _optimizer(case).update)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_leafwise_update_on_the_local_shards_equals_the_dtensor_ops_bitwise(optimizer: str) -> None:
    """The whole-tree tail updates a ``leafwise`` optimizer's params and moments on the ``DTensor``s' local shards,
    skipping torch's sharding propagation (seconds per mesh for the foreach ops): bitwise what the same optimizer
    computes on the ``DTensor``s, on the 2×2 hybrid mesh (sharded and replicated params), clipped or not."""
    case = WRONG._replace(optimizer=optimizer, max_grad_norm=0.05 if optimizer == "adamw" else None)
    assert _optimizer(case).leafwise
    local = _sharded(case)
    assert_trees_close(local, _sharded(case, optimizer_of=_not_leafwise), rtol=0, atol=0)


def _local_weight(mesh: Any) -> Callable:
    """Reduces the loss and gradients but divides by the rank's own Σw (the mean-of-per-rank-means bug)."""
    reduce = parallel.data_parallel_reduction(mesh)

    def hook(grad_sum: Any, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> tuple:
        grad_sum, loss_sum, _ = reduce(grad_sum, loss_sum, weight_sum)
        return grad_sum, loss_sum, weight_sum

    return hook


def _shard_axis_only(mesh: Any) -> Callable:
    """Sums Σw over the ``dp_shard`` axis only: the HSDP bug of reducing over the wrong group."""
    return parallel.data_parallel_reduction(mesh[parallel.SHARD_AXIS])


def _counted_twice(mesh: Any) -> Callable:
    """Σw summed as over a group that holds every sample twice (d9d's WORLD-instead-of-DP bug, docs/design/metrics.md).

    Unlike the two above, every rank still agrees with the others, so only the comparison with the
    single-process step can catch it.
    """
    reduce = parallel.data_parallel_reduction(mesh)

    def hook(grad_sum: Any, loss_sum: torch.Tensor, weight_sum: torch.Tensor) -> tuple:
        grad_sum, loss_sum, weight_sum = reduce(grad_sum, loss_sum, weight_sum)
        return grad_sum, loss_sum, weight_sum * 2

    return hook


def test_sharded_step_property_holds_for_the_mutation_case() -> None:
    _assert_same_run(_sharded(WRONG), _reference(WRONG))


def test_sharded_step_replicated_scalar_param_over_two_microbatches() -> None:
    # Found by the property above under random examples: in-place accumulation of the microbatch sums gave the
    # replicated 0-d `scale` the wrong gradient on a 2x1 mesh with 2 microbatches (scale 1.4522 vs 1.4426).
    case = Case(
        replicate=2,
        shard=1,
        vocab=2,
        width=1,
        hidden=0,
        bias=False,
        scale=True,
        seq=1,
        rows_per_microbatch=1,
        num_microbatches=2,
        mask_rate=0.0,
        silent_rank=None,
        optimizer="sgd",
        max_grad_norm=None,
        seed=0,
    )
    _assert_same_run(_sharded(case), _reference(case))


@pytest.mark.parametrize(
    ("reduction", "error"),
    [
        # Ranks that divide by different Σw no longer agree on the global loss (nor, later, on their replicas).
        (_local_weight, r"rank \d holds"),
        (_shard_axis_only, r"rank \d holds"),
        # Consistent across ranks, but every SGD move is halved.
        (_counted_twice, r"trees differ at leaf \['[a-z.]+'\]"),
    ],
    ids=["local_weight", "shard_axis_only", "counted_twice"],
)
def test_sharded_step_property_fails_for_a_wrong_reduction(reduction: Reduction, error: str) -> None:
    with pytest.raises(AssertionError, match=error):
        _assert_same_run(_sharded(WRONG, reduction), _reference(WRONG))
