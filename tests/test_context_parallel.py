"""The oracle of context parallelism (issue 42): the step at ``cp = 2`` (and ``cp × dp_shard = 2 × 2``) on this
rank's part of every sequence (``parallel.split_context``, head-tail load balancing) equals the one-process step.

Every rank is simulated in this process (``LocalTensorMode`` over the fake process group, as
``tests/test_tensor_parallel.py`` does). Eager, float32, 3 steps of SGD with momentum (comparing its buffer at every
step compares every gradient of every step): the loss, ``Σw`` (exactly: the context axis is a token axis, summed
once), the gradient norm, every gradient and the params after each step.

**Tolerance** rtol = atol = 1e-5 (float32): each rank's softmax runs over all ``T`` keys in the gathered order
(chunks ``0, 3, 1, 2`` at cp=2) under an explicit mask, where one process runs SDPA's causal kernel over keys in
order; each rank's gradients are partial sums over its tokens, added by the tail's all-reduce: the same terms in
another order. Measured max |Δ|: ``test_context_parallel_step_equals_the_one_process_step`` prints them (``-s``).

**Collectives** per step, counted as the eager step dispatches them (``test_tensor_parallel.Collectives``): per
microbatch the rank (1 tiny reduce-scatter) and per decoder block one all-gather of the keys and values forward and
its adjoint reduce-scatter backward, plus the tail's (``EXPECTED`` explains each).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from test_parallel_properties import _agreed, _forget_meshes
from test_tensor_parallel import (
    CONFIG,
    EXPECTED_VOCAB,
    MICROBATCHES,
    NUM_STEPS,
    ROWS,
    Collectives,
    Run,
    _collectives,
    _grads,
    _model,
    _optimizer,
    _rules,
    assert_same_run,
    block_all_reduces,
    max_differences,
    sequence_parallel_collectives,
    tensor_parallel_plan,
    vocab_parallel_collectives,
)

import d9dfn
from d9dfn import parallel
from d9dfn.loop import init_mesh
from d9dfn.models import Qwen3LM, bind_context_parallel, bind_tensor_parallel
from d9dfn.pipeline import PipelineStageInfo
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask

SEQ = 8  # 2·cp = 4 chunks of 2 positions at cp = 2


def _batches(num_data: int, packed: bool = False) -> list[dict[str, torch.Tensor]]:
    """``packed``: rows of several documents (``document_ids``, and ``position_ids`` restarting at 0 in each), as
    ``d9dfn.data.PackedDataset`` makes them."""
    gen = torch.Generator().manual_seed(0)
    rows = num_data * MICROBATCHES * ROWS
    out = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
        batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}
        if packed:
            starts = torch.rand(rows, SEQ, generator=gen) < 0.3  # a document starts here
            starts[:, 0] = True
            index = torch.arange(SEQ).expand(rows, SEQ)
            first = torch.where(starts, index, 0).cummax(dim=1).values  # each position's document's first position
            batch |= {"document_ids": starts.cumsum(dim=1), "position_ids": index - first}
        out.append(batch)
    return out


def reference(num_data: int, packed: bool = False) -> Run:
    """One process, the whole batch in ``num_data × MICROBATCHES`` microbatches, eager."""
    model, task = _model(), CausalLMTask()
    state = d9dfn.init_train_state(model, _optimizer(), task=task)
    step = d9dfn.make_train_step(
        model, task, _optimizer(), num_microbatches=num_data * MICROBATCHES, compile=False, max_grad_norm=None
    )
    params, buffers, outs = [], [], []
    for batch in _batches(num_data, packed):
        state, out = step(state, batch)
        params.append({k: v.clone() for k, v in state.params.items()})
        buffers.append({k: v.clone() for k, v in state.opt_state.momentum_buffer.items()})
        outs.append((out.loss, out.loss_weight, out.grad_norm))
    return list(zip(params, _grads(buffers), outs, strict=True))


def _axes(context: int, shard: int, tensor: int) -> parallel.MeshAxes:
    """``(dp_replicate, dp_shard, cp)`` as the loop builds it; with ``tensor > 1`` and one data-parallel rank
    ``(cp, tp)`` only: DTensor's sharding propagation of the optimizer's foreach ops grows with the mesh's number of
    dimensions (about 20 s per step at 4 dimensions on the 2-core machine, 1 s at 2), and axes of one rank change no
    collective (the tail skips them)."""
    if tensor == 1:
        return parallel.MeshAxes.of(data_shard=shard, context=context)
    data = (parallel.MeshAxis("dp_shard", "data_shard", shard),) if shard > 1 else ()
    return parallel.MeshAxes(
        (*data, parallel.MeshAxis("cp", "context", context), parallel.MeshAxis("tp", "tensor", tensor))
    )


def simulated(
    context: int,
    shard: int,
    counts: list[dict[str, int]] | None = None,
    packed: bool = False,
    tensor: int = 1,
    sequence: bool = False,
    vocab: bool = False,
    **options: Any,
) -> Run:
    """``NUM_STEPS`` steps on a simulated ``(dp_replicate=1, dp_shard, cp[, tp])`` mesh (tp innermost, then cp: global
    rank ``g`` is tensor rank ``g % tensor``, context rank ``g // tensor % context`` and data-parallel rank
    ``g // (tensor · context)``). With ``tensor > 1`` the model is bound to the tensor group too (with sequence,
    vocabulary parallelism: ``test_tensor_parallel.build``'s plan), then to the context group (the loop's order)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = context * shard * tensor
    batches = _batches(shard, packed)  # outside LocalTensorMode: its random draws would become per-rank
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_mesh(_axes(context, shard, tensor), device_type="cpu")
        model, task = _model(), CausalLMTask()
        if tensor > 1:
            plan = tensor_parallel_plan(model, mesh, sequence, vocab)
            tp = parallel.tensor_parallel_of(plan, _rules(sequence, vocab))
            assert tp is not None
            assert (tp.size, tp.sequence, tp.vocab) == (tensor, sequence, vocab)
            assert bind_tensor_parallel(model, tp) == 2 * CONFIG.num_layers
        else:
            plan = parallel.plan_for(model, mesh)
        cp = parallel.context_parallel_of(plan)
        assert cp is not None
        assert cp.size == context
        assert bind_context_parallel(model, cp) == CONFIG.num_layers
        step = d9dfn.make_train_step(
            model,
            task,
            _optimizer(),
            num_microbatches=MICROBATCHES,
            plan=plan,
            max_grad_norm=None,
            compile=False,
            **options,
        )
        assert ("stages" in step.pieces) == ("repeated_blocks" in options)  # "stages": the per-block runner
        rows = MICROBATCHES * ROWS
        run: Run = []
        buffers = []
        with LocalTensorMode(world) as mode:
            state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            for batch in batches:
                local = {
                    key: mode.rank_map(
                        lambda rank, key=key, value=batch[key]: parallel.split_context(
                            {key: value[(rank // (tensor * context)) * rows :][:rows]},
                            context,
                            rank // tensor % context,
                        )[key]
                    )
                    for key in batch
                }
                with Collectives() as seen:
                    state, out = step(state, local)
                if counts is not None:
                    counts.append(_collectives(dict(seen.counts)))
                run.append(
                    (
                        d9dfn.tree_map(_agreed, state.params),
                        {},
                        tuple(_agreed(t) for t in (out.loss, out.loss_weight, out.grad_norm)),
                    )
                )
                buffers.append(d9dfn.tree_map(_agreed, state.opt_state.momentum_buffer))
        return [(p, g, o) for (p, _, o), g in zip(run, _grads(buffers), strict=True)]
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def context_collectives(num_layers: int = CONFIG.num_layers) -> dict[str, int]:
    """Context parallelism's collectives per step, before the tail's: per microbatch the rank (1 tiny
    reduce-scatter), and per block the keys and values all-gathered forward (1) and reduce-scattered backward (1)."""
    return {
        "all_gather_into_tensor": MICROBATCHES * num_layers,
        "reduce_scatter_tensor": MICROBATCHES * (1 + num_layers),
    }


NUM_PARAMS = 15 * CONFIG.num_layers + 3  # per block: 2 norms, q/k/v/o weights and biases, q/k norms, 3 MLP; + 3


def _plus(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for count in counts:
        for op, n in count.items():
            out[op] = out.get(op, 0) + n
    return out


# Per step, measured and explained: context parallelism's, then the tail's.
EXPECTED = {
    # cp2: every param is replicated and its gradient partial over cp (a token axis): 1 bucket all-reduced over cp,
    # + 1 Σw and loss sums; the global norm of replicated gradients needs no collective.
    (2, 1): _plus(context_collectives(), {"all_reduce": 2}),
    (4, 1): _plus(context_collectives(), {"all_reduce": 2}),  # the same count over 4 ranks
    # cp2 x fsdp2: every param FSDP-stored over dp_shard, gathered whole in the head (1 all-gather each) and its
    # gradient reduce-scattered over dp_shard then all-reduced over cp, one param at a time (the tail's generic path
    # for a gradient partial over a storage-sharded axis and another axis: HSDP's too), + 1 Σw, + 1 global norm.
    (2, 2): _plus(
        context_collectives(),
        {"all_gather_into_tensor": NUM_PARAMS, "reduce_scatter_tensor": NUM_PARAMS, "all_reduce": NUM_PARAMS + 2},
    ),
}


@pytest.mark.parametrize(
    ("context", "shard", "options"),
    [
        pytest.param(2, 1, {}, id="cp2"),
        pytest.param(2, 2, {}, id="cp2xfsdp2", marks=pytest.mark.slow),
        pytest.param(2, 1, {"repeated_blocks": "auto"}, id="cp2-per-block", marks=pytest.mark.slow),
        pytest.param(2, 1, {"packed": True}, id="cp2-packed"),
        pytest.param(4, 1, {"packed": True}, id="cp4-packed", marks=pytest.mark.slow),  # chunks of 1 position
    ],
)
def test_context_parallel_step_equals_the_one_process_step(context: int, shard: int, options: Any) -> None:
    """And with packed rows: each document attends only to itself, its positions restart (the mask's documents from
    every rank: one more all-gather per microbatch)."""
    counts: list[dict[str, int]] = []
    packed = options.get("packed", False)
    actual, expected_run = simulated(context, shard, counts, **options), reference(shard, packed)
    found = max_differences(actual, expected_run)
    print(f"simulated cp={context} dp_shard={shard} {options}: max |Δ| {found}; collectives per step {counts[0]}")
    assert_same_run(actual, expected_run)
    assert all(delta <= 1e-5 for delta in found.values()), found
    expected = _plus(EXPECTED[context, shard], {"all_gather_into_tensor": MICROBATCHES if packed else 0})
    assert counts == [expected] * NUM_STEPS


# --- context × tensor parallelism (cp × tp) ---------------------------------------------------------------------------

# Per step at cp 2 × tp 2 (MICROBATCHES = 2 per rank, CONFIG.num_layers = 2), derived: tensor parallelism's on the
# cp-local sequence (the same count as tp alone: it runs on T/cp positions, which change the bytes, not the number),
# plus context parallelism's (per microbatch its rank, per block the K/V all-gather of this rank's kv-heads and its
# reduce-scatter backward), plus the tail's:
#   all_reduce 6 = 1 bucket of the replicated gradients (the final norm; without SP the blocks' norms and o's bias
#     too; without vocabulary parallelism the embedding and the head too) partial over cp,
#   + 2 for the gradients partial over cp and tp (the q/k norms; with SP the blocks' norms and o's bias): their
#     bucket goes Partial → Replicate one axis at a time,
#   + 1 bucket of the tp-split gradients (their local shards, row-parallel ones included) partial over cp,
#   + 1 Σw and loss sums over the token group (cp),
#   + 1 global norm of the tp-split pattern (its squares summed over tp).
CONTEXT_TENSOR_TAIL = {"all_reduce": 6}
EXPECTED_CONTEXT_TENSOR = {
    # (sequence, vocab, packed)
    (False, True, False): _plus(
        {"all_reduce": block_all_reduces()},
        vocab_parallel_collectives(False),
        context_collectives(),
        CONTEXT_TENSOR_TAIL,
    ),
    (False, False, False): _plus({"all_reduce": block_all_reduces()}, context_collectives(), CONTEXT_TENSOR_TAIL),
    (True, True, False): _plus(
        sequence_parallel_collectives(), vocab_parallel_collectives(True), context_collectives(), CONTEXT_TENSOR_TAIL
    ),
    # packed rows: + the keys' document ids all-gathered over cp once per microbatch.
    (True, True, True): _plus(
        sequence_parallel_collectives(),
        vocab_parallel_collectives(True),
        context_collectives(),
        CONTEXT_TENSOR_TAIL,
        {"all_gather_into_tensor": MICROBATCHES},
    ),
}


@pytest.mark.parametrize(
    ("sequence", "vocab", "packed"),
    [
        pytest.param(False, True, False, id="cp2xtp2-vocab"),
        pytest.param(False, False, False, id="cp2xtp2-whole-vocab", marks=pytest.mark.slow),
        pytest.param(True, True, False, id="cp2xtp2-sp-vocab", marks=pytest.mark.slow),
        pytest.param(True, True, True, id="cp2xtp2-sp-vocab-packed", marks=pytest.mark.slow),
    ],
)
def test_context_and_tensor_parallel_step_equals_the_one_process_step(
    sequence: bool, vocab: bool, packed: bool
) -> None:
    """cp 2 × tp 2 (4 simulated ranks): each context rank's part of every sequence, its heads and MLP split over tp
    (with SP its part split further over tp between the blocks), K/V of its kv-heads gathered over cp, RoPE and the
    mask at the global positions, the vocab-parallel cross-entropy on its rows. Loss, grad norm, every gradient and
    param after each of 3 steps within 1e-5 of one process; ``Σw`` exactly one process's, the count of the labels
    that are not ignored (summed once over cp, never over tp: pytorch/torchtitan#3280 halved the loss there)."""
    counts: list[dict[str, int]] = []
    actual = simulated(2, 1, counts, packed, tensor=2, sequence=sequence, vocab=vocab)
    expected_run = reference(1, packed)
    found = max_differences(actual, expected_run)
    print(f"simulated cp=2 tp=2 sp={sequence} vocab={vocab} packed={packed}: max |Δ| {found}; per step {counts[0]}")
    assert_same_run(actual, expected_run)
    assert all(delta <= 1e-5 for delta in found.values()), found
    labels = [int((batch["labels"] != IGNORE_INDEX).sum()) for batch in _batches(1, packed)]
    assert [int(outs[1]) for _, _, outs in actual] == labels
    assert counts == [EXPECTED_CONTEXT_TENSOR[sequence, vocab, packed]] * NUM_STEPS


@pytest.mark.slow
def test_context_tensor_and_fsdp_step_equals_the_one_process_step() -> None:
    """cp 2 × tp 2 × dp_shard 2 (8 simulated ranks, vocabulary parallelism): the same oracle; the collectives are
    tp 2 × fsdp 2's with vocabulary parallelism (``test_tensor_parallel.EXPECTED_VOCAB``) plus context parallelism's,
    and in the tail + 15 all-reduces over cp (each FSDP-stored param's gradient, reduce-scattered over dp_shard, then
    all-reduced over cp: the generic path, as at cp × fsdp) + 1 (the column-parallel bucket summed over cp after
    dp_shard)."""
    counts: list[dict[str, int]] = []
    actual, expected_run = simulated(2, 2, counts, tensor=2, vocab=True), reference(2)
    found = max_differences(actual, expected_run)
    print(f"simulated cp=2 tp=2 dp_shard=2 vocab: max |Δ| {found}; per step {counts[0]}")
    assert_same_run(actual, expected_run)
    assert all(delta <= 1e-5 for delta in found.values()), found
    fsdp_stored = 7 * CONFIG.num_layers + 1  # per block 2 norms, o's weight and bias, q/k norms, down; + the final norm
    expected = _plus(EXPECTED_VOCAB[2, False], context_collectives(), {"all_reduce": fsdp_stored + 1})
    assert counts == [expected] * NUM_STEPS


def test_a_row_parallel_gradient_stored_split_over_a_one_rank_data_axis_is_a_local_shard() -> None:
    """On the loop's mesh of cp 2 × tp 2, ``(dp_replicate, dp_shard, cp, tp)`` with 1-rank data axes, o's weight is
    stored FSDP ``S(0)`` over ``dp_shard`` (1 rank: whole) and ``S(1)`` over ``tp``: its gradient is already this
    rank's stored shard, so the tail bucket-sums it over ``cp`` with the other tp shards (4 fewer all-reduces per step
    there than one each: 38 → 34 per step, measured once on that 4-dimensional simulated mesh, too slow for the suite);
    over 2 ``dp_shard`` ranks it is reduce-scattered first."""
    from torch.distributed.tensor import Partial

    from d9dfn.models import logical_dims
    from d9dfn.models._decoder import DECODER_PLAN
    from d9dfn.parallel._grads import _stored_as_computed
    from d9dfn.parallel._plan import placement

    axes = parallel.MeshAxes.of(context=2, tensor=2)
    assert axes.names == ("dp_replicate", "dp_shard", "cp", "tp")
    params = dict(_model().named_parameters())
    plan = parallel.make_plan(
        params, axes, dims=logical_dims(DECODER_PLAN, params), rules=parallel.TENSOR_PARALLEL_RULES
    )
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        layout = plan.params[name]
        assert (layout.storage, layout.partial) == (("R", "S(0)", "R", "S(1)"), ("dp_replicate", "dp_shard", "cp"))
        stored = [placement(p) for p in layout.storage]
        partial = [
            Partial() if axis in layout.partial else placement(p)
            for axis, p in zip(axes.names, layout.compute, strict=True)
        ]
        assert _stored_as_computed(stored, partial, axes.sizes), name
        assert not _stored_as_computed(stored, partial, (1, 2, 2, 2)), name


@st.composite
def _split_cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], int]:
    size = draw(st.integers(1, 4))
    length = 2 * size * draw(st.integers(1, 4))
    rows = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(0, 100, (rows, length), generator=gen),
        "labels": torch.randint(-100, 100, (rows, length), generator=gen),
        "position_ids": torch.arange(length).expand(rows, length),
        "features": torch.randn(rows, length, 3, generator=gen),  # not per-token by name: passes whole
    }
    return batch, size


@given(_split_cases())
def test_split_context_then_unsplit_is_the_identity_and_balances_the_causal_work(
    case: tuple[dict[str, torch.Tensor], int],
) -> None:
    batch, size = case
    parts = [parallel.split_context(batch, size, rank) for rank in range(size)]
    whole = parallel.unsplit_context(parts)
    assert whole.keys() == batch.keys()
    for key, value in batch.items():
        assert torch.equal(whole[key], value), key
    for rank, part in enumerate(parts):  # and split ∘ unsplit: each rank's part again
        again = parallel.split_context(whole, size, rank)
        assert all(torch.equal(again[key], part[key]) for key in part), rank
    length = batch["input_ids"].shape[1]
    for rank, part in enumerate(parts):
        assert part["input_ids"].shape[1] == length // size
        assert torch.equal(part["features"], batch["features"])  # untouched
        positions = part["position_ids"][0]
        assert torch.equal(positions, parallel.context_indices(length, size, rank))
        # Head-tail: every rank's queries see the same number of keys under the causal mask.
        assert int((positions + 1).sum()) == (length * (length + 1) // 2) // size
    # Every position held exactly once.
    held = torch.cat([parallel.context_indices(length, size, rank) for rank in range(size)])
    assert torch.equal(held.sort().values, torch.arange(length))


def test_split_context_refuses_a_length_that_two_cp_does_not_divide_in_one_line() -> None:
    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"^mesh.context_parallel_shard=2 cuts each sequence into 4 chunks") as error:
        parallel.split_context(batch, 2, 0)
    assert "--set data.seq_len to a multiple of 4 (e.g. [4, 8])" in str(error.value)
    assert "--set mesh.context_parallel_shard" in str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"split_context: rank=2; pass this rank's index"):
        parallel.split_context(batch, 2, 2)


def test_context_mask_is_the_causal_mask_of_the_global_positions() -> None:
    """Rank 1 of 2 at T = 8 holds positions 2..5; the gathered keys are (0, 1, 6, 7, 2, 3, 4, 5)."""
    mask = parallel.context_mask(parallel.context_indices(8, 2, 1), 2)[0, 0].int()
    assert mask.tolist() == [
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 0],
        [1, 1, 0, 0, 1, 1, 1, 1],
    ]


def test_bind_context_parallel_refuses_what_is_not_built_in_one_line() -> None:
    cp = parallel.ContextParallel("unused", 2)
    dropped = Qwen3LM(dataclasses.replace(CONFIG, dropout=0.1))
    with pytest.raises(ValueError, match=r"model.dropout=0.1: .*; set --set model.dropout=0 or mesh.context_paral"):
        bind_context_parallel(dropped, cp)
    stage = Qwen3LM(CONFIG, PipelineStageInfo(0, 2), last_stage_cost=0)
    with pytest.raises(ValueError, match=r"pipeline stage 0 of 2; .* set --set mesh.pipeline_parallel=1"):
        bind_context_parallel(stage, cp)
    # A tensor group beside is no refusal any more: either order binds both (the oracle of the pair:
    # test_context_and_tensor_parallel_step_equals_the_one_process_step).
    tp = parallel.TensorParallel("unused", 2, sequence=True, vocab=True)
    for tensor_first in (True, False):
        model = _model()
        if tensor_first:
            assert bind_tensor_parallel(model, tp) == 2 * CONFIG.num_layers
        assert bind_context_parallel(model, cp) == CONFIG.num_layers
        if not tensor_first:
            assert bind_tensor_parallel(model, tp) == 2 * CONFIG.num_layers
        assert (model.tensor_parallel, model.context_parallel) == (tp, cp)
        attention = model.layers["0"].self_attn
        assert (attention.tensor_parallel, attention.context_parallel) == (tp, cp)
    from d9dfn.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeLM

    moe = Qwen3MoeLM(Qwen3MoeConfig.tiny())
    with pytest.raises(ValueError, match=r"qwen3_moe family.*; set --set mesh.context_parallel_shard=1"):
        bind_context_parallel(moe, cp)
    with pytest.raises(ValueError, match=r"holds no shared decoder"):
        bind_context_parallel(torch.nn.Linear(2, 2), cp)


def test_unbinding_context_parallelism_restores_the_whole_model() -> None:
    model = _model()
    x = torch.zeros(1, SEQ, dtype=torch.long)
    whole = model(x)["logits"]
    assert bind_context_parallel(model, parallel.ContextParallel("unused", 2)) == CONFIG.num_layers
    assert bind_context_parallel(model, None) == CONFIG.num_layers
    torch.testing.assert_close(model(x)["logits"], whole, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        # Dynamo tracing an autograd.Function under torch.func's grad_and_value in one whole graph instantiates the
        # Function itself, and torch warns about it (torch 2.13; not d9dfn's call): named here, an error elsewhere.
        pytest.param(
            {},
            id="whole",
            marks=pytest.mark.filterwarnings(
                "ignore:<class 'torch.autograd.function.Function'> should not be instantiated:DeprecationWarning"
            ),
        ),
        pytest.param({"repeated_blocks": "auto"}, id="per-block"),
    ],
)
def test_the_context_parallel_step_compiles_as_it_runs_eagerly(options: dict[str, Any]) -> None:
    """The step with context parallelism traced by dynamo (the rank's reduce-scatter, the positions and mask from it,
    the keys' gather and its adjoint in the graph), whole and per block, with the ``aot_eager`` backend: the same
    losses and params as eagerly, on rank 1 of a fake process group of 2, whose collectives return their input
    unchanged (so this checks the trace, not the arithmetic across ranks: the simulated-rank oracle does)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(context=2), device_type="cpu")
        runs = []
        for compile_ in (False, "aot_eager"):
            model, task = _model(), CausalLMTask()
            plan = parallel.plan_for(model, mesh)
            bind_context_parallel(model, parallel.context_parallel_of(plan))
            step = d9dfn.make_train_step(
                model, task, _optimizer(), num_microbatches=MICROBATCHES, plan=plan, max_grad_norm=None,
                compile=compile_, **options,
            )  # fmt: skip
            state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            losses = []
            for batch in _batches(1):
                state, out = step(state, parallel.split_context(batch, 2, 1))
                losses.append(out.loss)
            local = {name: p.to_local() for name, p in state.params.items()}  # type: ignore[attr-defined]  # DTensors
            runs.append((torch.stack(losses), local))
        (eager, eager_params), (compiled, compiled_params) = runs
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        torch.testing.assert_close(compiled_params, eager_params, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def test_the_context_axis_is_a_token_axis_with_params_replicated_over_it() -> None:
    """What makes the step sum over ``cp``: its ranks see other tokens (``Σw``, the loss, metrics summed), not other
    rows (the data-parallel size and rank ignore it), and the plan stores and computes every param whole on it, its
    gradient partial over it (and FSDP-sharded over ``dp_shard`` beside it)."""
    axes = parallel.MeshAxes.of(data_shard=2, context=2)
    assert axes.names == ("dp_replicate", "dp_shard", "cp")
    assert axes.token_axes == ("dp_replicate", "dp_shard", "cp")
    assert axes.sample_axes == ("dp_replicate", "dp_shard")
    assert axes.data_parallel_size == 2
    assert axes.data_parallel_rank({"dp_replicate": 0, "dp_shard": 1, "cp": 1}) == 1
    params = dict(_model().named_parameters())
    plan = parallel.make_plan(params, axes)
    for name, layout in plan.params.items():
        assert layout.compute == ("R", "R", "R"), name
        assert layout.storage == ("R", "S(0)", "R"), name
        assert "cp" in layout.partial, name


def test_the_job_refuses_what_context_parallelism_does_not_build_in_one_line(tmp_path: Any) -> None:
    """``mesh.context_parallel_shard`` through the LM job: its mesh has a ``cp`` token axis, and what the step does not
    build with it (a pipeline, MoE, dropout) or a ``data.seq_len`` that ``2·cp`` (with sequence parallelism beside,
    ``cp · tp`` too) does not divide is refused before anything is built, in one line naming the ``--set`` paths (the
    torchrun run of a cp=2 job:
    ``tests/test_train_distributed.py::test_torchrun_two_ranks_train_like_one_process[context]``)."""
    from test_train import tiny_job

    from d9dfn.config import DeviceMeshParameters
    from d9dfn.jobs import train_lm
    from d9dfn.loop import mesh_axes

    axes = mesh_axes(DeviceMeshParameters(data_parallel_shard=2, context_parallel_shard=2))
    assert axes.names == ("dp_replicate", "dp_shard", "cp")
    assert axes.size_of("context") == 2
    cp = DeviceMeshParameters(context_parallel_shard=2)
    cases = [
        (["data.seq_len=18"], cp, r"data.seq_len=18 does not divide by 4; set --set data.seq_len to a multiple of 4"),
        (  # SP splits each rank's 20 / 2 = 10 positions over tp = 4: refused; without SP they need not divide
            ["model.num_heads=4", "model.num_kv_heads=4", "data.seq_len=20"],
            DeviceMeshParameters(context_parallel_shard=2, tensor_parallel=4, sequence_parallel=True),
            r"with mesh.sequence_parallel=true splits each rank's data.seq_len/2=10 positions over "
            r"mesh.tensor_parallel=4 ranks, .*; set --set data.seq_len to a multiple of 8 or --set "
            r"mesh.sequence_parallel=false$",
        ),
        ([], DeviceMeshParameters(context_parallel_shard=2, pipeline_parallel=2), r"with mesh.pipeline_parallel=2"),
        (["model.dropout=0.1"], cp, r"with model.dropout=0.1 is not built yet .* set --set model.dropout=0 or"),
        (["model.family=qwen3_moe"], cp, r"with model.family=qwen3_moe is not built yet"),
    ]
    for overrides, mesh, match in cases:
        job = tiny_job(tmp_path, *overrides).model_copy(update={"mesh": mesh})
        with pytest.raises(ValueError, match=r"^mesh.context_parallel_shard=2 .*" + match) as error:
            train_lm(job)
        assert "\n" not in str(error.value)
        assert not (tmp_path / "stdlib-lm").exists()  # refused before the run directory is made
    # Tensor parallelism beside (with SP where the positions divide, with vocabulary parallelism by default) passes.
    from d9dfn.jobs._checks import check_context_degree, check_tensor_degree

    both = tiny_job(tmp_path, "model.num_kv_heads=2")
    for sequence in (False, True):
        mesh = DeviceMeshParameters(context_parallel_shard=2, tensor_parallel=2, sequence_parallel=sequence)
        check_tensor_degree(both, mesh)
        check_context_degree(both, mesh)
    four = tiny_job(tmp_path, "model.num_heads=4", "model.num_kv_heads=4", "data.seq_len=20")
    check_context_degree(four, DeviceMeshParameters(context_parallel_shard=2, tensor_parallel=4))
