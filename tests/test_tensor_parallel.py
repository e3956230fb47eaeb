"""The oracle of tensor parallelism (issue 42): the step at ``tp = 2`` (with sequence parallelism too, and
``tp × dp_shard = 2 × 2``; and each with vocabulary parallelism, ``parallel.VOCAB_PARALLEL_RULES``) equals the
one-process step.

Every rank is simulated in this process (``LocalTensorMode`` over the fake process group, as
``tests/test_step_compose.py`` does), and the same runs on 2 forked gloo ranks (marker ``ranks``: eager, per-block,
per-block inductor; vocabulary parallelism eager).
Eager, float32, 3 steps of SGD with momentum (its buffer after step ``t`` is ``0.9·b(t-1) + g(t)``, so comparing it
at every step compares every gradient of every step): the loss, ``Σw``, the gradient norm, every gradient and the
params after each step.

**Tolerance** rtol = atol = 1e-5 (float32): the row-parallel all-reduce adds the ranks' partial products of o and
down (a sum over the heads / the MLP width split in ``n`` parts, then added), where one process sums them in one
matmul: the same terms in another order, so not bitwise. Measured max |Δ|:
``test_tensor_parallel_step_equals_the_one_process_step`` prints them (``-s``).

**Collectives** per step, counted as the eager step dispatches them (:class:`Collectives`): 2 all-reduces forward
and 2 backward per decoder block per microbatch (``enter_tensor_parallel`` / ``leave_tensor_parallel``), plus the
tail's (``EXPECTED`` explains each).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_parallel_properties import _agreed, _forget_meshes
from torch.utils._python_dispatch import TorchDispatchMode

import d9dfn
from d9dfn import optim, parallel
from d9dfn.loop import init_mesh
from d9dfn.models import LoRA, Qwen3Config, Qwen3LM, adapter_plan, apply_peft, logical_dims, peft_trainable, summed_dims
from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER, bind_tensor_parallel
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask

NUM_STEPS, SEQ, MICROBATCHES, ROWS = 3, 6, 2, 2
CONFIG = Qwen3Config.tiny(
    num_layers=2, tie_word_embeddings=False, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4,
    intermediate_size=24, qkv_bias=True, o_proj_bias=True,
)  # fmt: skip
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
MOMENTUM = 0.9


def _batches(num_data: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = num_data * MICROBATCHES * ROWS
    out = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return out


Peft = tuple[LoRA, ...]
"""LoRA methods the model is adapted with (empty: full training)."""


def _model(config: Qwen3Config = CONFIG, peft: Peft = ()) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen3LM(config)
    return apply_peft(model, peft) if peft else model


def _trainable(peft: Peft) -> Any:
    return peft_trainable(peft) if peft else None


def _rng(peft: Peft) -> str | None:
    """Adapters with dropout draw their masks from the step's keys."""
    return "dropout_key" if any(method.dropout > 0 for method in peft) else None


def _optimizer() -> d9dfn.Transform:
    return optim.sgd(0.5, momentum=MOMENTUM)


Run = list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[torch.Tensor, ...]]]
"""Per step: (params, gradients, (loss, Σw, grad norm))."""


class Collectives(TorchDispatchMode):
    """Counts the functional collectives an eager step runs, by op (``all_reduce``, ``reduce_scatter_tensor``, ...).

    torch's ``CommDebugMode`` cannot count a ``torch.func`` step: it installs module hooks, whose backward hook is an
    ``autograd.Function`` without ``setup_context``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.largest = 0
        """The most elements one collective's input activation held (a tensor of 2 dims or more: the tail's gradient
        buckets are flat), what shows that the logits are never gathered."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            self.counts[func._opname.rstrip("_")] += 1
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor) and a.ndim >= 2]
            self.largest = max([self.largest, *sizes])
        return func(*args, **(kwargs or {}))


def _grads(buffers: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each step's gradients from the momentum buffers after each step: ``g(t) = b(t) - 0.9·b(t-1)``."""
    previous = {name: torch.zeros_like(b) for name, b in buffers[0].items()}
    out = []
    for buffer in buffers:
        out.append({name: b - MOMENTUM * previous[name] for name, b in buffer.items()})
        previous = buffer
    return out


def reference(num_data: int, config: Qwen3Config = CONFIG, peft: Peft = ()) -> Run:
    """One process, the whole batch in ``num_data × MICROBATCHES`` microbatches, eager."""
    model, task = _model(config, peft), CausalLMTask()
    state = d9dfn.init_train_state(model, _optimizer(), task=task, trainable=_trainable(peft))
    step = d9dfn.make_train_step(
        model,
        task,
        _optimizer(),
        num_microbatches=num_data * MICROBATCHES,
        compile=False,
        max_grad_norm=None,
        rng_kwarg=_rng(peft),
    )
    params, buffers, outs = [], [], []
    for batch in _batches(num_data):
        state, out = step(state, batch)
        params.append({k: v.clone() for k, v in state.params.items()})
        buffers.append({k: v.clone() for k, v in state.opt_state.momentum_buffer.items()})
        outs.append((out.loss, out.loss_weight, out.grad_norm))
    return list(zip(params, _grads(buffers), outs, strict=True))


def _rules(sequence: bool, vocab: bool = False) -> parallel.Rules:
    rules = parallel.SEQUENCE_PARALLEL_RULES if sequence else parallel.TENSOR_PARALLEL_RULES
    return (*rules, *parallel.VOCAB_PARALLEL_RULES) if vocab else rules


def tensor_parallel_plan(
    model: torch.nn.Module, mesh: Any, sequence: bool = False, vocab: bool = False
) -> parallel.ParallelPlan:
    """The plan of the shared decoder on ``mesh`` under the tensor-parallel rules (with sequence parallelism's, with
    vocabulary parallelism's), LoRA adapters' rows included (``d9dfn.models.adapter_plan``, as the job's provider)."""
    params = dict(model.named_parameters())
    adapters, adapter_sums = adapter_plan(DECODER_PLAN)
    return parallel.plan_for(
        model,
        mesh,
        dims=logical_dims({**DECODER_PLAN, **adapters}, params),
        rules=_rules(sequence, vocab),
        sums_over=summed_dims({**DECODER_SUMS_OVER, **adapter_sums}, params),
    )


def build(
    mesh: Any,
    sequence: bool = False,
    vocab: bool = False,
    config: Qwen3Config = CONFIG,
    peft: Peft = (),
    **options: Any,
) -> tuple[Any, Any, torch.nn.Module, CausalLMTask]:
    """The model bound to the plan's tensor group and the step built against the plan (eager unless ``options``
    say otherwise: ``compile``, ``repeated_blocks``)."""
    model, task = _model(config, peft), CausalLMTask()
    plan = tensor_parallel_plan(model, mesh, sequence, vocab)
    tp = parallel.tensor_parallel_of(plan, _rules(sequence, vocab))
    assert tp is not None
    assert (tp.sequence, tp.vocab) == (sequence, vocab)
    assert bind_tensor_parallel(model, tp) == 2 * config.num_layers
    options = {"compile": False, "rng_kwarg": _rng(peft), **options}
    step = d9dfn.make_train_step(
        model, task, _optimizer(), num_microbatches=MICROBATCHES, plan=plan, max_grad_norm=None, **options
    )
    return plan, step, model, task


def simulated(
    tensor: int,
    shard: int,
    counts: list[dict[str, int]] | None = None,
    sequence: bool = False,
    vocab: bool = False,
    config: Qwen3Config = CONFIG,
    largest: list[int] | None = None,
    peft: Peft = (),
) -> Run:
    """``NUM_STEPS`` steps on a simulated ``(dp_replicate=1, dp_shard, tp)`` mesh (tp innermost: global rank ``g`` is
    data-parallel rank ``g // tensor``)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = tensor * shard
    batches = _batches(shard)  # outside LocalTensorMode: its random draws would become per-rank
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(data_shard=shard, tensor=tensor), device_type="cpu")
        plan, step, model, task = build(mesh, sequence, vocab, config, peft)
        rows = MICROBATCHES * ROWS
        run: Run = []
        buffers = []
        with LocalTensorMode(world) as mode:
            state = d9dfn.init_train_state(
                model, _optimizer(), task=task, mesh=mesh, placements=plan.placements, trainable=_trainable(peft)
            )
            for batch in batches:
                local = {
                    key: mode.rank_map(lambda rank, value=value: value[(rank // tensor) * rows :][:rows])
                    for key, value in batch.items()
                }
                with Collectives() as seen:
                    state, out = step(state, local)
                if counts is not None:
                    counts.append(dict(seen.counts))
                if largest is not None:
                    largest.append(seen.largest)
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


def max_differences(actual: Run, expected: Run) -> dict[str, float]:
    """max |Δ| of the loss, Σw, grad norm, every gradient and every param over all steps."""
    out = {"loss": 0.0, "weight": 0.0, "norm": 0.0, "grads": 0.0, "params": 0.0}
    for (params, grads, outs), (ref_params, ref_grads, ref_outs) in zip(actual, expected, strict=True):
        for key, a, b in zip(("loss", "weight", "norm"), outs, ref_outs, strict=True):
            out[key] = max(out[key], (a.double() - b.double()).abs().item())
        for key, tree, ref in (("grads", grads, ref_grads), ("params", params, ref_params)):
            assert tree.keys() == ref.keys()
            for name in ref:
                out[key] = max(out[key], (tree[name] - ref[name]).abs().max().item())
    return out


def assert_same_run(actual: Run, expected: Run) -> None:
    for index, ((params, grads, outs), (ref_params, ref_grads, ref_outs)) in enumerate(
        zip(actual, expected, strict=True)
    ):
        torch.testing.assert_close(outs[1], ref_outs[1], rtol=0, atol=0, msg=lambda m, i=index: f"step {i} Σw: {m}")
        for what, a, b in (("loss", outs[0], ref_outs[0]), ("grad norm", outs[2], ref_outs[2])):
            torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, i=index, w=what: f"step {i} {w}: {m}")
        assert grads.keys() == ref_grads.keys()
        assert params.keys() == ref_params.keys()
        for name in ref_grads:  # the trainable params' (every param's, without adapters)
            torch.testing.assert_close(
                grads[name], ref_grads[name], **TOLERANCE, msg=lambda m, i=index, n=name: f"step {i} grad {n}: {m}"
            )
        for name in ref_params:
            torch.testing.assert_close(
                params[name], ref_params[name], **TOLERANCE, msg=lambda m, i=index, n=name: f"step {i} param {n}: {m}"
            )


def block_all_reduces(num_layers: int = CONFIG.num_layers) -> int:
    """The block collectives per step: per microbatch, per block, attention and MLP each one all-reduce forward
    (``leave_tensor_parallel``) and one backward (``enter_tensor_parallel`` 's adjoint)."""
    return MICROBATCHES * num_layers * 2 * 2


# Per step, measured and explained: the blocks' all-reduces, then the tail's.
EXPECTED = {
    # tp2: + 1 bucket of the q/k-norm gradients over tp (partial there) + 1 Σw and loss sums (over the 1-rank data
    # axes) + 1 global norm of the tp-split gradients; nothing else is partial over an axis of more than 1 rank.
    (2, 1): {"all_reduce": block_all_reduces() + 3},
    # tp2 x fsdp2: 17 FSDP-stored params gathered in the head (all-gather) and reduce-scattered in the tail; + 1
    # bucket of the column-parallel gradients (local shards) over dp_shard, + 4 q/k-norm shards over tp, + 1 Σw, + 4
    # norm patterns (split over dp_shard, tp, both, and the q/k-norm shards).
    (2, 2): {"all_reduce": block_all_reduces() + 10, "all_gather_into_tensor": 17, "reduce_scatter_tensor": 17},
}


def _collectives(counts: dict[str, int]) -> dict[str, int]:
    return {op: n for op, n in counts.items() if not op.startswith("_")}  # _wrap_tensor_autograd: no collective


def sequence_parallel_collectives(num_layers: int = CONFIG.num_layers) -> dict[str, int]:
    """Sequence parallelism's collectives per step, before the tail's: per microbatch, the rank (1 tiny
    reduce-scatter), the split's backward and the final unsplit (2 all-gathers), and per block, attention and MLP
    each an all-gather and a reduce-scatter forward and the same backward."""
    per_block = 2 * 2
    return {
        "all_gather_into_tensor": MICROBATCHES * (2 + num_layers * per_block),
        "reduce_scatter_tensor": MICROBATCHES * (1 + num_layers * per_block),
    }


EXPECTED_SEQUENCE = {
    # + 1 bucket of the gradients partial over tp (q/k norms, the blocks' norms, o's bias), 1 Σw, 1 global norm.
    (2, 1): {**sequence_parallel_collectives(), "all_reduce": 3},
}


def vocab_parallel_collectives(sequence: bool) -> dict[str, int]:
    """What vocabulary parallelism adds per step: per microbatch, the rank (1 tiny reduce-scatter, which sequence
    parallelism already runs), the embedding's sum (1 all-reduce forward; with SP a reduce-scatter onto the sequence
    in place of the split, whose all-gather backward stays), the head's input gradient (1 all-reduce backward), the
    cross-entropy (the max, then Σexp with the target logit: 2 all-reduces forward, none backward) and the accuracy
    (the best value, then its id: 2 all-reduces)."""
    if sequence:
        return {"reduce_scatter_tensor": MICROBATCHES, "all_reduce": MICROBATCHES * (1 + 2 + 2)}
    return {"reduce_scatter_tensor": MICROBATCHES, "all_reduce": MICROBATCHES * (1 + 1 + 2 + 2)}


def _plus(*counts: dict[str, int]) -> dict[str, int]:
    total: collections.Counter[str] = collections.Counter()
    for count in counts:
        total.update(count)  # update keeps negative counts (a sum of Counters would drop them)
    return {op: n for op, n in total.items() if n}


EXPECTED_VOCAB = {
    # (shard, sequence). The tail's are tp2's (the embedding's and head's gradients are local shards, complete: no
    # bucket over tp).
    (1, False): _plus(EXPECTED[2, 1], vocab_parallel_collectives(False)),
    (1, True): _plus(EXPECTED_SEQUENCE[2, 1], vocab_parallel_collectives(True)),
    # tp2 x fsdp2: the embedding and the head no longer FSDP-stored (their dim 0 is taken by tp, as the
    # column-parallel weights'): 2 fewer gathers in the head and reduce-scatters in the tail; their gradients join
    # the column-parallel bucket over dp_shard (no more all-reduces).
    (2, False): _plus(
        EXPECTED[2, 2],
        vocab_parallel_collectives(False),
        {"all_gather_into_tensor": -2, "reduce_scatter_tensor": -2},
    ),
}


@pytest.mark.parametrize(
    ("tensor", "shard", "sequence"),
    [
        pytest.param(2, 1, False, id="tp2"),
        pytest.param(2, 2, False, id="tp2xfsdp2", marks=pytest.mark.slow),
        pytest.param(2, 1, True, id="tp2-sp", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_step_equals_the_one_process_step(tensor: int, shard: int, sequence: bool) -> None:
    counts: list[dict[str, int]] = []
    actual, expected_run = simulated(tensor, shard, counts, sequence), reference(shard)
    assert_same_run(actual, expected_run)
    # The oracle table's row (run with -s): max |Δ| per quantity, within 1e-5 absolute too.
    found = max_differences(actual, expected_run)
    print(f"simulated tp={tensor} dp_shard={shard} sequence_parallel={sequence}: max |Δ| {found}")
    assert all(delta <= 1e-5 for delta in found.values()), found
    expected = (EXPECTED_SEQUENCE if sequence else EXPECTED)[tensor, shard]
    assert [_collectives(c) for c in counts] == [expected] * NUM_STEPS


@pytest.mark.parametrize(
    ("shard", "sequence", "tied"),
    [
        pytest.param(1, False, False, id="tp2-vocab"),
        pytest.param(1, True, False, id="tp2-sp-vocab", marks=pytest.mark.slow),
        pytest.param(1, False, True, id="tp2-vocab-tied", marks=pytest.mark.slow),
        pytest.param(2, False, False, id="tp2xfsdp2-vocab", marks=pytest.mark.slow),
    ],
)
def test_vocab_parallel_step_equals_the_one_process_step_and_never_gathers_the_logits(
    shard: int, sequence: bool, tied: bool
) -> None:
    """The embedding, the LM head (tied or not) and the cross-entropy split over the vocabulary
    (``parallel.VOCAB_PARALLEL_RULES``): the same oracle as above, the collectives counted exactly, and none of them
    moves an activation of more than ``B·T·D`` elements (the residual stream), where gathering the logits would move
    ``B·T·V/n``."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    counts: list[dict[str, int]] = []
    largest: list[int] = []
    actual = simulated(2, shard, counts, sequence, vocab=True, config=config, largest=largest)
    expected_run = reference(shard, config)
    assert_same_run(actual, expected_run)
    found = max_differences(actual, expected_run)
    print(f"simulated tp=2 dp_shard={shard} vocab sequence_parallel={sequence} tied={tied}: max |Δ| {found}")
    assert all(delta <= 1e-5 for delta in found.values()), found
    assert [_collectives(c) for c in counts] == [EXPECTED_VOCAB[shard, sequence]] * NUM_STEPS
    tokens = ROWS * SEQ  # B·T of one microbatch
    assert max(largest) <= tokens * CONFIG.hidden_size < tokens * CONFIG.vocab_size // 2, largest


# --- LoRA adapters split with their bases -----------------------------------------------------------------------------

EVERY_LINEAR = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head"
COLUMN_PARALLEL = "q_proj|k_proj|v_proj|gate_proj|up_proj"


@pytest.mark.parametrize(
    ("shard", "sequence", "vocab", "peft"),
    [
        pytest.param(1, False, True, (LoRA(EVERY_LINEAR, rank=2, alpha=4.0),), id="tp2-vocab"),
        pytest.param(
            1, True, True, (LoRA(EVERY_LINEAR, rank=2, alpha=4.0),), id="tp2-sp-vocab", marks=pytest.mark.slow
        ),
        pytest.param(2, False, False, (LoRA(EVERY_LINEAR, rank=2, alpha=4.0),), id="tp2xfsdp2", marks=pytest.mark.slow),
        # Dropout with one data-parallel rank only: the simulated ranks share one built step, whose first microbatch
        # key is data-parallel rank 0's (``make_train_step``'s ``data_parallel.rank``, a build-time number).
        pytest.param(
            1,
            False,
            False,
            (LoRA(COLUMN_PARALLEL, rank=2, alpha=4.0, dropout=0.25), LoRA("o_proj|down_proj", rank=2, alpha=4.0)),
            id="tp2-dropout",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_lora_adapters_split_with_their_bases_equal_the_one_process_step(
    shard: int, sequence: bool, vocab: bool, peft: Peft
) -> None:
    """LoRA on every Linear (the LM head's too, vocabulary-parallel), the frozen base split over ``tp`` as in full
    training and each adapter split with it (``d9dfn.models.adapter_plan``): the whole factor's gradient summed over
    the group. Loss, the adapters' gradients and every param after 3 steps as one process's; with dropout on the
    column-parallel adapters, whose input is whole on every rank, the same masks."""
    counts: list[dict[str, int]] = []
    largest: list[int] = []
    config = dataclasses.replace(CONFIG, tie_word_embeddings=False)
    actual = simulated(2, shard, counts, sequence, vocab=vocab, config=config, largest=largest, peft=peft)
    expected_run = reference(shard, config, peft)
    assert all(name.endswith(("lora_A.weight", "lora_B.weight")) for name in expected_run[0][1])
    assert_same_run(actual, expected_run)
    found = max_differences(actual, expected_run)
    print(f"simulated LoRA tp=2 dp_shard={shard} sequence={sequence} vocab={vocab}: max |Δ| {found} {counts[0]}")
    assert all(delta <= 1e-5 for delta in found.values()), found
    assert [_collectives(c) for c in counts] == [_collectives(counts[0])] * NUM_STEPS  # the same program every step
    if vocab:  # the adapter on the vocabulary-parallel head never gathers the logits either
        assert max(largest) <= ROWS * SEQ * CONFIG.hidden_size < ROWS * SEQ * CONFIG.vocab_size // 2, largest


def test_a_row_parallel_adapter_with_dropout_is_refused_in_one_line() -> None:
    model = apply_peft(Qwen3LM(CONFIG), [LoRA("o_proj", rank=2, dropout=0.1)])
    tp = parallel.TensorParallel(group="unused", size=2)  # refused before any collective
    with pytest.raises(ValueError, match=r"^bind_tensor_parallel: layers\.0\.self_attn\.o_proj's LoRA adapter drops"):
        bind_tensor_parallel(model, tp)


# --- tensor parallelism inside pipeline stages (tp × pp) ------------------------------------------------------------

PIPELINE_CONFIG = dataclasses.replace(CONFIG, num_layers=3)
"""3 blocks over 2 stages (2, then 1 beside the final norm and the head), untied (a pipeline needs it)."""
PIPELINED = [
    pytest.param("1f1b", 1, False, True, id="1f1b-vocab"),
    pytest.param("gpipe", 1, True, True, id="gpipe-sp-vocab"),
    pytest.param("1f1b", 1, False, False, id="1f1b-whole-vocab", marks=pytest.mark.slow),
    pytest.param("1f1b", 2, False, True, id="1f1b-vocab-x-fsdp2", marks=pytest.mark.slow),
]


def pipelined(
    schedule: str, shard: int, sequence: bool, vocab: bool, counts: list[dict[str, int]] | None = None
) -> Run:
    """:func:`simulated`'s run with the model in 2 pipeline stages run by the one-process ``Pipeline`` executor (every
    pipeline rank's row in this process, as ``tests/test_expert_parallel.py::_pipelined``): every stage's blocks (and
    with vocabulary parallelism the first stage's embedding and the last stage's head) bound to the tensor group by
    the loop's own functions (``loop/_train.py``: ``_step_modules``, ``_bind_tensor_parallel``, ``_rules``)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn import pipeline
    from d9dfn.config import DeviceMeshParameters
    from d9dfn.loop._pipelining import PipelineLayout
    from d9dfn.loop._train import _bind_tensor_parallel, _step_modules
    from d9dfn.loop._train import _rules as loop_rules

    degrees = DeviceMeshParameters(
        pipeline_parallel=2, data_parallel_shard=shard, tensor_parallel=2, sequence_parallel=sequence,
        vocab_parallel=vocab,
    )  # fmt: skip
    world, rows, batches = 2 * shard, MICROBATCHES * ROWS, _batches(shard)
    model, task = _model(PIPELINE_CONFIG), CausalLMTask()
    program = pipeline.SCHEDULE_OPTIONS[schedule]().program(2, MICROBATCHES)
    stages = pipeline.build_stages(lambda info: Qwen3LM(PIPELINE_CONFIG, info), program.num_stages)
    layout = PipelineLayout(program=program, stages=stages, rank=0, modules=())
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:  # the pipeline rank's data-parallel sub-mesh: (dp_shard, tp), tp innermost
        mesh = init_mesh(parallel.MeshAxes.of(data_shard=shard, tensor=2), device_type="cpu")
        params = dict(model.named_parameters())
        plan = parallel.plan_for(
            model,
            mesh,
            dims=logical_dims(DECODER_PLAN, params),
            rules=loop_rules(degrees),
            sums_over=summed_dims(DECODER_SUMS_OVER, params),
        )
        _bind_tensor_parallel(plan, _step_modules(model, layout), degrees)
        for stage in stages:  # every stage's blocks bound, and its Qwen3LM when SP or the vocabulary reads the group
            lm = stage.module
            assert all(layer.self_attn.tensor_parallel is not None for layer in lm.layers.values())
            assert (lm.tensor_parallel is not None) == (sequence or vocab)
        step = d9dfn.make_train_step(
            model,
            task,
            _optimizer(),
            executor=pipeline.Pipeline(program, stages),
            plan=plan,
            max_grad_norm=None,
            compile=False,
        )
        run: Run = []
        buffers = []
        with LocalTensorMode(world) as mode:
            state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            for batch in batches:
                local = {
                    key: mode.rank_map(lambda rank, value=value: value[(rank // 2) * rows :][:rows])
                    for key, value in batch.items()
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
            if vocab:  # the first stage's embedding and the last stage's head hold half of the vocabulary each
                for name in ("embed_tokens.weight", "lm_head.weight"):
                    assert state.params[name].to_local().shape[0] == PIPELINE_CONFIG.vocab_size // 2
        return [(p, g, o) for (p, _, o), g in zip(run, _grads(buffers), strict=True)]
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def pipeline_collectives(sequence: bool, vocab: bool) -> dict[str, int]:
    """Per step at tp=2 with :data:`PIPELINE_CONFIG` in 2 stages: the unpipelined step's collectives (its blocks', the
    vocabulary's, the tail's), plus the boundary's per microbatch: the second stage's rank when its ``Qwen3LM`` is
    bound (1 tiny reduce-scatter, with SP or the vocabulary), and with SP the first stage's join of the sequence
    before it sends (an all-gather forward) and the second stage's split (an all-gather backward)."""
    layers = PIPELINE_CONFIG.num_layers
    blocks = sequence_parallel_collectives(layers) if sequence else {"all_reduce": block_all_reduces(layers)}
    boundary = {
        "reduce_scatter_tensor": MICROBATCHES if sequence or vocab else 0,
        "all_gather_into_tensor": 2 * MICROBATCHES if sequence else 0,
    }
    tail = {"all_reduce": 3}  # as EXPECTED[2, 1] and EXPECTED_SEQUENCE[2, 1]: q/k-norm bucket, Σw, global norm
    return _plus(blocks, vocab_parallel_collectives(sequence) if vocab else {}, boundary, tail)


@pytest.mark.parametrize(("schedule", "shard", "sequence", "vocab"), PIPELINED)
def test_tensor_parallel_in_pipeline_stages_equals_the_one_process_step(
    schedule: str, shard: int, sequence: bool, vocab: bool
) -> None:
    """``mesh.tensor_parallel=2`` with ``trainer.pipelining`` (2 stages, 2 microbatches per data-parallel rank): the
    stage boundaries carry the hidden states whole over tp (with SP a stage joins the sequence before it sends, the
    next splits it again), the loss is the last stage's ``token_nll`` on the vocab-split logits. Loss, Σw, grad norm,
    every gradient and the params after each of 3 steps equal the unpipelined one-process step within
    :data:`TOLERANCE`, and the collectives per step are the unpipelined step's plus the boundary's
    (:func:`pipeline_collectives`)."""
    counts: list[dict[str, int]] = []
    actual, expected = pipelined(schedule, shard, sequence, vocab, counts), reference(shard, PIPELINE_CONFIG)
    assert_same_run(actual, expected)
    if shard == 1:  # the collectives per step, counted exactly (with dp_shard: the FSDP gathers come in too)
        assert counts == [pipeline_collectives(sequence, vocab)] * NUM_STEPS, counts
    found = max_differences(actual, expected)
    print(f"simulated pp=2 {schedule} tp=2 dp_shard={shard} sp={sequence} vocab={vocab}: max |Δ| {found}")
    assert all(delta <= 1e-5 for delta in found.values()), found


@pytest.mark.parametrize(("sequence", "vocab"), [(False, False), (True, True)])
def test_the_boundary_shapes_of_tensor_parallel_stages_are_the_whole_hidden_states(sequence: bool, vocab: bool) -> None:
    """A pipeline rank finds its receive buffers by running every stage on its meta skeleton
    (``pipeline.stage_io_shapes``), with the whole model's param shapes: bound to a tensor group, the stages run their
    collectives on meta tensors (torch's functional collectives return meta tensors without a message between the
    ranks) and give the boundary an unbound stage gives, ``(B, T, D)`` whole (with SP too)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn import pipeline

    stages = pipeline.build_stages(lambda info: Qwen3LM(PIPELINE_CONFIG, info), 2)
    inputs = {"input_ids": torch.zeros(2 * ROWS, SEQ, dtype=torch.long)}
    whole = pipeline.stage_io_shapes(stages, inputs, {}, microbatch_size=ROWS)
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(tensor=2), device_type="cpu")
        plan = tensor_parallel_plan(_model(PIPELINE_CONFIG), mesh, sequence, vocab)
        tp = parallel.tensor_parallel_of(plan, _rules(sequence, vocab))
        assert sum(bind_tensor_parallel(stage.module, tp) for stage in stages) == 2 * PIPELINE_CONFIG.num_layers
        bound = pipeline.stage_io_shapes(stages, inputs, {}, microbatch_size=ROWS)
    finally:
        dist.destroy_process_group()
        _forget_meshes()
    sent = bound[0]["hidden_states"]
    assert (sent.device.type, sent.shape, sent.dtype) == ("meta", whole[0]["hidden_states"].shape, torch.float32)
    assert sent.shape == (ROWS, SEQ, PIPELINE_CONFIG.hidden_size)
    logits = bound[1]["logits"]  # the last stage's output is never sent: its loss is computed on its rank
    assert isinstance(logits, parallel.VocabParallelLogits) == vocab


def _rank_worker(rank: int, world_size: int, init_file: str, out_dir: str, options: dict[str, Any]) -> None:
    import json
    import os

    from _ranks import _init

    if options.get("compile"):  # a cache of its own per rank (pytorch#188390)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{out_dir}/inductor-{rank}"
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(tensor=world_size), device_type="cpu")
        plan, step, model, task = build(mesh, **options)
        counted = not options.get("compile") and "repeated_blocks" not in options
        expected_counts = (EXPECTED_SEQUENCE if options.get("sequence") else EXPECTED)[world_size, 1]
        if options.get("vocab"):
            expected_counts = EXPECTED_VOCAB[1, bool(options.get("sequence"))]
        assert ("stages" in step.pieces) == ("repeated_blocks" in options)  # "stages": the per-block runner
        state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
        run, buffers, counts = [], [], []
        for batch in _batches(1):
            if not counted:  # compiled regions: dynamo refuses a dispatch mode of the test's around them
                state, out = step(state, batch)
            else:
                with Collectives() as seen:
                    state, out = step(state, batch)
                counts.append(_collectives(dict(seen.counts)))
            whole = {name: p.full_tensor() for name, p in state.params.items()}
            buffers.append({name: b.full_tensor() for name, b in state.opt_state.momentum_buffer.items()})
            run.append((whole, {}, (out.loss, out.loss_weight, out.grad_norm)))
        actual = [(p, g, o) for (p, _, o), g in zip(run, _grads(buffers), strict=True)]
        expected = reference(1)
        assert_same_run(actual, expected)
        if counted:
            assert counts == [expected_counts] * NUM_STEPS, counts
        with open(f"{out_dir}/rank{rank}.json", "w") as file:
            json.dump({"max": max_differences(actual, expected), "counts": counts[0] if counts else None}, file)
    finally:
        dist.destroy_process_group()


RANK_CASES = {
    "eager": {},
    "per-block-eager": {"repeated_blocks": "auto"},
    "per-block-inductor": {"repeated_blocks": "auto", "compile": True},
    "sp-eager": {"sequence": True},
    "sp-per-block-inductor": {"sequence": True, "repeated_blocks": "auto", "compile": True},
    "vocab-eager": {"vocab": True},
}


@pytest.mark.ranks
@pytest.mark.parametrize("case", sorted(RANK_CASES))
def test_tensor_parallel_on_two_gloo_ranks_equals_the_one_process_step(tmp_path: Any, case: str) -> None:
    import json

    from _ranks import _run_ranks

    _forget_meshes()
    _run_ranks(_rank_worker, 2, tmp_path, str(tmp_path), RANK_CASES[case], timeout_s=600)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"gloo tp=2 {case} rank {rank}: max |Δ| {found['max']}, collectives per step {found['counts']}")
        assert all(delta <= 1e-5 for delta in found["max"].values())


def test_unbinding_restores_the_whole_model() -> None:
    """Binding is an attribute of the attention and MLP modules; ``None`` unbinds them and the model computes whole,
    bitwise as before it was bound (the bound model itself is checked by the oracles above)."""
    model = _model()
    x = torch.zeros(1, SEQ, dtype=torch.long)
    whole = model(x)["logits"]
    assert bind_tensor_parallel(model, parallel.TensorParallel("unused", 2)) == 2 * CONFIG.num_layers
    assert bind_tensor_parallel(model, None) == 2 * CONFIG.num_layers
    torch.testing.assert_close(model(x)["logits"], whole, rtol=0, atol=0)


def test_the_job_refuses_a_degree_that_does_not_divide_the_heads_in_one_line(tmp_path: Any) -> None:
    """And the other refusals of tensor and sequence parallelism, each one line naming the setting to change."""
    from test_train import tiny_job

    from d9dfn.config import DeviceMeshParameters
    from d9dfn.jobs import train_lm
    from d9dfn.jobs._checks import check_tensor_degree

    job = tiny_job(tmp_path)  # num_kv_heads=1
    job = job.model_copy(update={"mesh": DeviceMeshParameters(tensor_parallel=2)})
    with pytest.raises(ValueError, match=r"^mesh.tensor_parallel=2 does not divide model num_kv_heads=1: ") as error:
        train_lm(job)
    assert "--set mesh.tensor_parallel to one of [1]" in str(error.value)
    assert "\n" not in str(error.value)
    moe = job.model_copy(update={"model": job.model.model_copy(update={"family": "qwen3_moe"})})
    with pytest.raises(ValueError, match=r"model.family=qwen3_moe has no tensor-parallel path yet"):
        train_lm(moe)
    with pytest.raises(ValueError, match=r"mesh.sequence_parallel=true .* but mesh.tensor_parallel=1; set --set"):
        DeviceMeshParameters(sequence_parallel=True)
    odd = tiny_job(tmp_path, "model.num_kv_heads=2", "data.seq_len=15")
    odd = odd.model_copy(update={"mesh": DeviceMeshParameters(tensor_parallel=2, sequence_parallel=True)})
    with pytest.raises(ValueError, match=r"data.seq_len=15 does not divide by it; set --set data.seq_len"):
        train_lm(odd)
    # mesh.vocab_parallel (the default) splits the byte job's 256 ids: a degree of 3 is refused before anything is
    # built, naming the two fixes; with it turned off the same degree passes the check.
    three = tiny_job(tmp_path, "model.num_heads=3", "model.num_kv_heads=3", "model.intermediate_size=48")
    three = three.model_copy(update={"mesh": DeviceMeshParameters(tensor_parallel=3)})
    with pytest.raises(
        ValueError, match=r"^mesh.tensor_parallel=3 does not divide the model's vocab_size=256 "
    ) as error:
        train_lm(three)
    assert str(error.value).endswith(
        "--set mesh.vocab_parallel=false (the embedding and the LM head then computed whole)"
    )
    assert "a divisor of 256" in str(error.value)
    assert "\n" not in str(error.value)
    check_tensor_degree(three, DeviceMeshParameters(tensor_parallel=3, vocab_parallel=False))
    dropped = tiny_job(tmp_path, "model.num_kv_heads=2", "model.dropout=0.1")
    dropped = dropped.model_copy(update={"mesh": DeviceMeshParameters(tensor_parallel=2, sequence_parallel=True)})
    with pytest.raises(ValueError, match=r"model.dropout=0.1: .*; set --set model.dropout=0 or mesh.sequence_paral"):
        train_lm(dropped)
