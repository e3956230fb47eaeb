"""Property: the step's features compose. Every drawn combination equals the single-process sequential step.

Hypothesis draws the executor (sequential, sequential unrolled, a pipeline program over 2 stages in one process:
GPipe, 1F1B, zero-bubble 1F1B), per-block compilation (off, found automatically, named), the precision policy
(float32, bf16 mixed), the data-parallel mesh (1 rank, 2 replicated, 2 sharded, 2×2 hybrid; every rank simulated in
this process as in ``tests/test_parallel_properties.py``), the microbatch count and clipping. The reference is the
traced sequential step, eager, on one process, with the same precision and the whole global batch.

- **Bitwise** where the arithmetic is the same: the traced step on one process, whatever the executor (the
  pipeline's stages compute the same aten ops in the same order, and the sums add in microbatch order).
- **rtol = atol = 1e-5** (float32) otherwise: per-block compilation differentiates with autograd instead of
  ``torch.func`` (SDPA's fused backward against its decomposition), and data parallelism adds per rank first.
- **rtol = atol = 2e-3** for bf16 mixed with per-block compilation or data parallelism: the same differences
  rounded to bf16 (8 bits of mantissa) inside the model; params, gradients and the optimizer stay float32.

Combinations that cannot run are checked to be refused with their reason. Zero-bubble programs are drawn on one
process only: their stages are traced by ``make_fx``, which cannot trace the simulated ranks' tensors (on real ranks
they run beside data parallelism: ``tests/test_pipeline_distributed.py``). The compiled forms (``aot_eager``:
bitwise the eager graphs; inductor: rounding) are checked on fixed combinations below, not drawn: each costs a
compile. Pipeline ranks across processes: ``tests/test_pipeline_distributed.py``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_parallel_properties import _agreed, _forget_meshes

import d9dfn
from d9dfn import optim, parallel, pipeline
from d9dfn.config import DeviceMeshParameters
from d9dfn.loop import init_data_parallel_mesh
from d9dfn.models import Qwen3Config, Qwen3LM, Qwen3MoeConfig, logical_dims
from d9dfn.models._decoder import Qwen3DecoderLayer
from d9dfn.models.qwen3_moe import QWEN3_MOE_PLAN, Qwen3MoeLM
from d9dfn.pipeline import TracedStages
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask
from d9dfn.testing import assert_trees_close

NUM_STEPS = 2
MESHES = [(1, 1), (2, 1), (1, 2), (2, 2)]
SCHEDULES = {"gpipe": pipeline.gpipe, "1f1b": pipeline.one_f_one_b, "zb1p": pipeline.zero_bubble_1f1b}
CONFIG = Qwen3Config.tiny(num_layers=4, tie_word_embeddings=False, hidden_size=16, head_dim=4, intermediate_size=24)


class Combo(NamedTuple):
    executor: str  # "sequential", "unrolled", or a SCHEDULES name
    blocks: str  # "off", "auto", "named"
    precision: str  # "fp32", "bf16"
    replicate: int
    shard: int
    num_microbatches: int
    max_grad_norm: float | None
    seed: int

    @property
    def num_ranks(self) -> int:
        return self.replicate * self.shard

    @property
    def pipelined(self) -> bool:
        return self.executor in SCHEDULES


@st.composite
def combos(draw: st.DrawFn) -> Combo:
    executor = draw(st.sampled_from(["sequential", "unrolled", *SCHEDULES]))
    # Zero-bubble stages are traced by make_fx, which cannot trace the simulated ranks' per-rank tensors; on real
    # ranks it runs beside data parallelism (tests/test_pipeline_distributed.py).
    replicate, shard = draw(st.sampled_from([(1, 1)] if executor == "zb1p" else MESHES))
    return Combo(
        executor=executor,
        blocks=draw(st.sampled_from(["off", "auto", "named"])),
        precision=draw(st.sampled_from(["fp32", "bf16"])),
        replicate=replicate,
        shard=shard,
        num_microbatches=draw(st.sampled_from([2, 4] if executor in SCHEDULES else [1, 2, 3])),
        max_grad_norm=draw(st.sampled_from([None, 0.05])),
        seed=draw(st.integers(0, 2**16)),
    )


ROWS_PER_MICROBATCH, SEQ = 1, 6


def _batches(combo: Combo) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(combo.seed)
    rows = combo.num_ranks * combo.num_microbatches * ROWS_PER_MICROBATCH
    batches = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return batches


def _model(combo: Combo) -> Qwen3LM:
    torch.manual_seed(combo.seed)
    return Qwen3LM(CONFIG)


def _optimizer() -> d9dfn.Transform:
    return optim.adamw(0.02, eps=1e-3, weight_decay=0.1)  # eps: see test_parallel_properties' docstring


def _precision(combo: Combo) -> d9dfn.Precision | None:
    return d9dfn.Precision.bf16_mixed() if combo.precision == "bf16" else None


def _options(combo: Combo, model: Qwen3LM) -> dict[str, Any]:
    executor: Any = d9dfn.Sequential(unroll=combo.executor == "unrolled")
    if combo.pipelined:
        stages = pipeline.build_stages(lambda info: Qwen3LM(CONFIG, info), 2)
        executor = pipeline.Pipeline(SCHEDULES[combo.executor](2, 1, combo.num_microbatches), stages)
    blocks = {"off": (), "auto": "auto", "named": (Qwen3DecoderLayer,)}[combo.blocks]
    return {"executor": executor, "repeated_blocks": blocks, "precision": _precision(combo)}


def _why_refused(combo: Combo) -> str | None:
    """The reason a combination is refused, as the step's message words it; ``None`` when it runs."""
    if combo.blocks != "named":
        return None
    if combo.executor == "unrolled":
        return "Sequential(unroll=True) traces the whole step as one graph"
    if combo.executor == "zb1p":
        return "splits each stage's backward into I and W"
    return None


def _runs_per_block(combo: Combo) -> bool:
    return combo.blocks != "off" and combo.executor not in ("unrolled", "zb1p")


def _reference(combo: Combo) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """The traced sequential step, eager, one process, the whole batch in ``num_ranks × m`` microbatches."""
    model, task = _model(combo), CausalLMTask()
    state = d9dfn.init_train_state(model, _optimizer(), task=task)
    step = d9dfn.make_train_step(
        model,
        task,
        _optimizer(),
        num_microbatches=combo.num_ranks * combo.num_microbatches,
        precision=_precision(combo),
        max_grad_norm=combo.max_grad_norm,
        compile=False,
    )
    outputs = []
    for batch in _batches(combo):
        state, out = step(state, batch)
        outputs.append((out.loss, out.loss_weight, out.grad_norm))
    return state.params, outputs


def _run(combo: Combo) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """``NUM_STEPS`` steps of ``combo``, on its simulated data-parallel mesh when it has more than one rank."""
    model, task = _model(combo), CausalLMTask()
    options = _options(combo, model)
    if combo.num_ranks == 1:
        step = d9dfn.make_train_step(
            model,
            task,
            _optimizer(),
            num_microbatches=combo.num_microbatches,
            max_grad_norm=combo.max_grad_norm,
            compile=False,
            **options,
        )
        state = d9dfn.init_train_state(model, _optimizer(), task=task)
        outputs = []
        for batch in _batches(combo):
            state, out = step(state, batch)
            outputs.append((out.loss, out.loss_weight, out.grad_norm))
        return state.params, outputs
    return _run_simulated(combo, model, task, options)


def _run_simulated(combo: Combo, model: Qwen3LM, task: CausalLMTask, options: dict[str, Any]) -> tuple[Any, list]:
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    batches = _batches(combo)  # outside LocalTensorMode: its random draws would become per-rank
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=combo.num_ranks)
    try:
        mesh = init_data_parallel_mesh(combo.replicate, combo.shard, device_type="cpu")
        step = d9dfn.make_train_step(
            model,
            task,
            _optimizer(),
            num_microbatches=combo.num_microbatches,
            max_grad_norm=combo.max_grad_norm,
            plan=parallel.plan_for(model, mesh),
            data_parallel=d9dfn.DataParallel(parallel.data_parallel_reduction(mesh)),
            compile=False,
            **options,
        )
        rows = combo.num_microbatches * ROWS_PER_MICROBATCH
        with LocalTensorMode(combo.num_ranks) as mode:
            state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh)
            outputs = []
            for batch in batches:
                local = {
                    key: mode.rank_map(lambda rank, value=value: value[rank * rows :][:rows])
                    for key, value in batch.items()
                }
                state, out = step(state, local)
                outputs.append(tuple(_agreed(t) for t in (out.loss, out.loss_weight, out.grad_norm)))
            return d9dfn.tree_map(_agreed, state.params), outputs
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _tolerance(combo: Combo) -> dict[str, float]:
    if not _runs_per_block(combo) and combo.num_ranks == 1:
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 2e-3, "atol": 2e-3} if combo.precision == "bf16" else {"rtol": 1e-5, "atol": 1e-5}


def _assert_same_run(combo: Combo, actual: tuple[Any, list], expected: tuple[Any, list]) -> None:
    _assert_same_run_with(_tolerance(combo), actual, expected)


def _assert_same_run_with(tolerance: dict[str, float], actual: tuple[Any, list], expected: tuple[Any, list]) -> None:
    (params, outputs), (ref_params, ref_outputs) = actual, expected
    assert_trees_close(params, ref_params, **tolerance)
    for index, ((loss, weight, norm), (ref_loss, ref_weight, ref_norm)) in enumerate(
        zip(outputs, ref_outputs, strict=True)
    ):
        torch.testing.assert_close(weight, ref_weight, rtol=0, atol=0, msg=lambda m, i=index: f"step {i} Σw: {m}")
        torch.testing.assert_close(loss, ref_loss, **tolerance, msg=lambda m, i=index: f"step {i} loss: {m}")
        torch.testing.assert_close(norm, ref_norm, **tolerance, msg=lambda m, i=index: f"step {i} norm: {m}")


# The issue's table, every cell once (eager; pipeline ranks across processes and compiled cells are below and in
# tests/test_step_compose_ranks.py): {traced, per-block} × {sequential, a 1F1B pipeline in one process} × {fp32,
# bf16 mixed} × {one rank, replicate, shard, hybrid}.
TABLE = [
    Combo(executor, blocks, precision, replicate, shard, 2, 0.05, seed)
    for seed, (executor, blocks, precision, (replicate, shard)) in enumerate(
        (e, b, p, m) for e in ("sequential", "1f1b") for b in ("off", "auto") for p in ("fp32", "bf16") for m in MESHES
    )
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "combo", TABLE, ids=[f"{c.executor}-{c.blocks}-{c.precision}-{c.replicate}x{c.shard}" for c in TABLE]
)
def test_each_cell_of_the_table_equals_the_sequential_step(combo: Combo) -> None:
    _assert_same_run(combo, _run(combo), _reference(combo))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(combo=combos())
def test_every_combination_equals_the_sequential_step_or_is_refused(combo: Combo) -> None:
    event(f"{combo.executor}, blocks {combo.blocks}, {combo.precision}, mesh {combo.replicate}x{combo.shard}")
    why = _why_refused(combo)
    if why is not None:
        with pytest.raises(ValueError, match=re.escape(why)):
            d9dfn.make_train_step(_model(combo), CausalLMTask(), _optimizer(), **_options(combo, _model(combo)))
        return
    _assert_same_run(combo, _run(combo), _reference(combo))


def test_auto_blocks_find_the_decoder_layer_and_fall_back_where_they_cannot_run() -> None:
    model = _model(Combo("sequential", "auto", "fp32", 1, 1, 2, None, 0))
    assert d9dfn.step.find_repeated_blocks(model) == (Qwen3DecoderLayer,)
    task = CausalLMTask()
    regional = d9dfn.make_train_step(model, task, _optimizer(), repeated_blocks="auto", compile=False)
    assert "stages" in regional.pieces
    assert "microbatch" not in regional.pieces
    unrolled = d9dfn.make_train_step(
        model, task, _optimizer(), executor=d9dfn.Sequential(unroll=True), repeated_blocks="auto", compile=False
    )
    assert set(unrolled.pieces) == {"step"}
    stages = pipeline.build_stages(lambda info: Qwen3LM(CONFIG, info), 2)
    zero_bubble = pipeline.Pipeline(pipeline.zero_bubble_1f1b(2, 1, 2), stages)
    traced = d9dfn.make_train_step(model, task, _optimizer(), executor=zero_bubble, repeated_blocks="auto")
    assert isinstance(traced.pieces["stages"], TracedStages)


def _steps(combo: Combo, compile: bool | str) -> tuple[Any, list[tuple[torch.Tensor, ...]]]:
    """``NUM_STEPS`` steps of ``combo`` on one process, compiled with ``compile``; SGD, so that a gradient's rounding
    moves its param by ``lr × error`` (AdamW's ``g / (|g| + eps)`` turns a near-zero gradient's sign into a full
    step)."""
    model, task, sgd = _model(combo), CausalLMTask(), optim.sgd(0.1, momentum=0.9)
    options = _options(combo, model)
    step = d9dfn.make_train_step(
        model,
        task,
        sgd,
        num_microbatches=combo.num_microbatches,
        max_grad_norm=combo.max_grad_norm,
        compile=compile,
        **options,
    )
    state = d9dfn.init_train_state(model, sgd, task=task)
    outputs = []
    for batch in _batches(combo):
        state, out = step(state, batch)
        outputs.append((out.loss, out.loss_weight, out.grad_norm))
    return state.params, outputs


COMPILED = [
    Combo("sequential", "auto", "fp32", 1, 1, 2, 0.05, 1),
    Combo("1f1b", "auto", "bf16", 1, 1, 2, None, 2),
    Combo("zb1p", "off", "fp32", 1, 1, 2, 0.05, 3),
    Combo("unrolled", "off", "bf16", 1, 1, 2, None, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMPILED, ids=[f"{c.executor}-{c.blocks}-{c.precision}" for c in COMPILED])
@pytest.mark.compiled
def test_compiled_combination_equals_its_eager_run(combo: Combo) -> None:
    """``aot_eager`` runs the traced graphs' aten ops as eager does: bitwise; inductor fuses and reorders: float32
    rounding (1e-5), or bf16's where the model computes in bf16 (2e-3)."""
    eager = _steps(combo, False)
    _assert_close_runs(_steps(combo, "aot_eager"), eager, {"rtol": 0.0, "atol": 0.0})
    # Inductor for the pipeline cell only (a minute and a half of compiling): the sequential per-block step under
    # inductor is the loop's default, which every compiled README command runs against one eager process.
    if combo.executor == "1f1b":
        tolerance = {"rtol": 2e-3, "atol": 2e-3} if combo.precision == "bf16" else {"rtol": 1e-5, "atol": 1e-5}
        _assert_close_runs(_steps(combo, True), eager, tolerance)


def _assert_close_runs(actual: tuple[Any, list], expected: tuple[Any, list], tolerance: dict[str, float]) -> None:
    (params, outputs), (ref_params, ref_outputs) = actual, expected
    assert_trees_close(params, ref_params, **tolerance)
    for got, want in zip(outputs, ref_outputs, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tolerance)


# --- mixture of experts: the MoE model with its experts split over simulated ranks ------------------------------------

MOE_CONFIG = Qwen3MoeConfig.tiny(vocab_size=64, num_layers=2)


class MoeCell(NamedTuple):
    placement: (
        str  # "one" (one process), "replicate" or "shard": 2 simulated data-parallel ranks, the experts over both;
        # "fsdp": 2 sharded data-parallel ranks without expert parallelism (each block, experts too, gathered whole)
    )
    blocks: str  # "off" (the traced step) or "checkpointed" (per-block, every block recomputed in the backward)
    precision: str  # "fp32", "bf16" (the experts on torch._grouped_mm)

    @property
    def num_ranks(self) -> int:
        return 1 if self.placement == "one" else 2


MOE_CELLS = [
    *(
        MoeCell(m, b, p)
        for m in ("one", "replicate", "shard")
        for b in ("off", "checkpointed")
        for p in ("fp32", "bf16")
    ),
    *(MoeCell("fsdp", b, "fp32") for b in ("off", "checkpointed")),
]


def _moe_tolerance(cell: MoeCell) -> dict[str, float]:
    """fp32: the step's data-parallel and per-block tolerance (the experts computed over each rank's rows, added per
    rank); bf16: its bf16 one, for the grouped matmul over other rows too; the traced step on one process: bitwise."""
    if cell.placement == "one" and cell.blocks == "off":
        return {"rtol": 0.0, "atol": 0.0}
    return {"rtol": 2e-3, "atol": 2e-3} if cell.precision == "bf16" else {"rtol": 1e-5, "atol": 1e-5}


def _moe_batches(rows: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(NUM_STEPS):
        tokens = torch.randint(0, MOE_CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return batches


def _moe_steps(cell: MoeCell, reference: bool) -> tuple[Any, list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """(params, per-step (loss, Σw, grad norm), expert counts) of ``NUM_STEPS`` eager steps: the cell's, or with
    ``reference`` the traced sequential step on one process over the whole batch in ``num_ranks × 2`` microbatches.
    SGD with momentum: a rounding difference moves a param by ``lr × error`` (AdamW would turn a near-zero gradient's
    sign into a whole step)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn.loop import init_mesh, mesh_axes

    torch.manual_seed(0)
    model, task, sgd = Qwen3MoeLM(MOE_CONFIG), CausalLMTask(aux_loss_weight=0.01, num_experts=4), optim.sgd(0.1, 0.9)
    precision = d9dfn.Precision.bf16_mixed() if cell.precision == "bf16" else None
    batches = _moe_batches(2 * cell.num_ranks)  # 2 rows per rank
    options: dict[str, Any] = {"num_microbatches": 2, "precision": precision, "max_grad_norm": 0.05, "compile": False}
    if reference or cell.num_ranks == 1:
        if reference:
            options["num_microbatches"] = 2 * cell.num_ranks
        elif cell.blocks == "checkpointed":
            options.update(repeated_blocks="auto", activation_checkpointing=d9dfn.step.ActivationCheckpointing())
        step = d9dfn.make_train_step(model, task, sgd, **options)
        state = d9dfn.init_train_state(model, sgd, task=task)
        outputs = []
        for batch in batches:
            state, out = step(state, batch)
            outputs.append((out.loss, out.loss_weight, out.grad_norm))
        return state.params, outputs, state.metric_state["experts"]
    if cell.blocks == "checkpointed":
        options.update(repeated_blocks="auto", activation_checkpointing=d9dfn.step.ActivationCheckpointing())
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cell.num_ranks)
    try:
        degrees = {"data_parallel_replicate" if cell.placement == "replicate" else "data_parallel_shard": 2}
        experts = 1 if cell.placement == "fsdp" else 2
        mesh = init_mesh(mesh_axes(DeviceMeshParameters(**degrees, expert_parallel=experts)), device_type="cpu")
        params = dict(model.named_parameters())
        plan = parallel.plan_for(
            model, mesh, dims=logical_dims(QWEN3_MOE_PLAN, params), rules=parallel.EXPERT_PARALLEL_RULES
        )
        ep = parallel.expert_parallel_of(plan)
        assert (ep is None) == (cell.placement == "fsdp")
        if ep is not None:
            parallel.bind_expert_parallel(model, ep)
        step = d9dfn.make_train_step(model, task, sgd, plan=plan, **options)
        with LocalTensorMode(cell.num_ranks) as mode:
            state = d9dfn.init_train_state(model, sgd, task=task, mesh=mesh, placements=plan.placements)
            outputs = []
            for batch in batches:
                local = {
                    key: mode.rank_map(lambda rank, value=value: value[2 * rank :][:2]) for key, value in batch.items()
                }
                state, out = step(state, local)
                outputs.append(tuple(_agreed(t) for t in (out.loss, out.loss_weight, out.grad_norm)))
            counts = sum(state.metric_state["experts"]._local_tensors.values())  # the ranks' counts, summed
            return d9dfn.tree_map(_agreed, state.params), outputs, counts
    finally:
        dist.destroy_process_group()
        _forget_meshes()


@pytest.mark.slow
@pytest.mark.parametrize("cell", MOE_CELLS, ids=["-".join(c) for c in MOE_CELLS])
def test_each_moe_cell_equals_the_sequential_step(cell: MoeCell) -> None:
    """The MoE model × {one process, 2 ranks replicated, 2 sharded, the experts split over both} × {traced, per-block
    with every block checkpointed} × {fp32, bf16}: params, loss, Σw and the gradient norm after 2 steps equal the
    one-process traced step's within :func:`_moe_tolerance`, and every token copy is counted once (the recompute
    counts none: the counts of the whole batch, exactly)."""
    params, outputs, counts = _moe_steps(cell, reference=False)
    ref_params, ref_outputs, ref_counts = _moe_steps(cell, reference=True)
    _assert_same_run_with(_moe_tolerance(cell), (params, outputs), (ref_params, ref_outputs))
    assert float(counts.sum()) == float(ref_counts.sum()) == NUM_STEPS * 2 * cell.num_ranks * SEQ * 2 * 2


# --- mixture of experts in pipeline stages --------------------------------------------------------------------------


def _moe_pipelined(executor: str, blocks: str, precision: str = "fp32") -> tuple[Any, list, torch.Tensor, dict]:
    """``NUM_STEPS`` eager steps of the 4-layer MoE model (the aux loss weighted in) on one process, in 2 pipeline
    stages (``executor``: a schedule's name) or whole (``"one"``); params, per-step outputs, expert counts, the last
    step's recorded gradients."""
    from test_expert_parallel import _record

    config = Qwen3MoeConfig.tiny(vocab_size=64, num_layers=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model, task = Qwen3MoeLM(config), CausalLMTask(aux_loss_weight=0.1, num_experts=4)
    opt = optim.chain(_record(), optim.sgd(0.1, momentum=0.9))
    options: dict[str, Any] = {"num_microbatches": 2, "compile": False, "precision": _precision_named(precision)}
    if executor != "one":
        stages = pipeline.build_stages(lambda info: Qwen3MoeLM(config, info), 2)
        options["executor"] = pipeline.Pipeline(SCHEDULES[executor](2, 1, 2), stages)
    if blocks == "checkpointed":
        options.update(repeated_blocks="auto", activation_checkpointing=d9dfn.step.ActivationCheckpointing())
    step = d9dfn.make_train_step(model, task, opt, **options)
    state = d9dfn.init_train_state(model, opt, task=task)
    outputs = []
    for batch in _moe_batches(4):
        state, out = step(state, batch)
        outputs.append((out.loss, out.loss_weight, out.grad_norm))
    return state.params, outputs, state.metric_state["experts"], dict(state.opt_state[0])


def _precision_named(name: str) -> d9dfn.Precision | None:
    return d9dfn.Precision.bf16_mixed() if name == "bf16" else None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("blocks", "executor"), [("off", "1f1b"), ("checkpointed", "1f1b"), ("off", "gpipe"), ("off", "zb1p")]
)
def test_moe_in_two_pipeline_stages_equals_the_one_stage_step(blocks: str, executor: str) -> None:
    """The earlier stage's expert load travels with its hidden states (``Qwen3MoeLM.forward``): the last stage's aux
    loss pools every layer, its gradient reaches the first stage's routers, and the counts cover every layer. Traced
    stages: bitwise the one-stage traced step (the same ops in the same order); per-block with every block
    checkpointed: the step's per-block tolerance (1e-5; gradients from autograd). Zero-bubble 1F1B (the backward
    split into I and W, traced once and replayed: the experts' static-shape path, every expert on every token, where
    the one-stage step runs the reference path): 1e-6 (measured 6e-8 on gradients, 7.5e-9 on params)."""
    params, outputs, counts, grads = _moe_pipelined(executor, blocks)
    ref_params, ref_outputs, ref_counts, ref_grads = _moe_pipelined("one", blocks)
    tolerance = {"rtol": 0.0, "atol": 0.0} if blocks == "off" else {"rtol": 1e-5, "atol": 1e-5}
    if executor == "zb1p":
        tolerance = {"rtol": 1e-6, "atol": 1e-6}
    _assert_same_run_with(tolerance, (params, outputs), (ref_params, ref_outputs))
    assert_trees_close(grads, ref_grads, **tolerance)
    assert torch.equal(counts, ref_counts)
    assert float(counts.sum()) == NUM_STEPS * 4 * SEQ * 2 * 4  # steps x rows x tokens x top-2 x MoE layers
    assert float(grads["layers.0.mlp.gate.weight"].abs().max()) > 0  # the first stage's router learns


def test_moe_in_pipeline_stages_refuses_a_casting_precision_in_one_line() -> None:
    """bf16 mixed casts what crosses the stages, the expert counts too (integers above 256 round): refused by the
    stage that receives them, naming the setting."""
    with pytest.raises(ValueError, match=r"stage 1 received .* in torch.bfloat16.*trainer.precision.compute_dtype"):
        _moe_pipelined("1f1b", "off", "bf16")
