"""The reference executor and the step's pieces: a pipeline program equals the one-stage step bitwise; the
pieces compile once whatever the microbatch count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

import d9dfn.optim as optim
from d9dfn import (
    BuildForwardInputsResult,
    ComputeLossResult,
    InferenceState,
    InferenceTask,
    Sequential,
    TrainTask,
    init_train_state,
    make_eval_step,
    make_inference_step,
    make_train_step,
    pipeline,
    prng,
)
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.step import find_repeated_blocks
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

TRAIN_SCHEDULES = sorted(name for name in pipeline.SCHEDULES if name != "inference")


class _Block(nn.Module):
    """Linear → (BatchNorm) → tanh → dropout keyed by the block's global index (same mask staged or not)."""

    def __init__(self, index: int, dim_in: int, dim_out: int, norm: bool, dropout: float) -> None:
        super().__init__()
        self.index, self.dropout = index, dropout
        self.linear = nn.Linear(dim_in, dim_out)
        self.norm = nn.BatchNorm1d(dim_out) if norm else nn.Identity()

    def forward(self, hidden: torch.Tensor, key: torch.Tensor | None) -> torch.Tensor:
        hidden = torch.tanh(self.norm(self.linear(hidden)))
        if key is not None and self.dropout:
            keep = ~prng.bernoulli(prng.fold_in(key, self.index), self.dropout, hidden.shape)
            hidden = torch.where(keep, hidden / (1 - self.dropout), torch.zeros_like(hidden))
        return hidden


class _Net(nn.Module):
    """Named blocks in a ModuleDict: ``split_stages`` cuts it anywhere, names unchanged."""

    def __init__(self, dims: list[int], norms: list[bool], dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {str(i): _Block(i, dims[i], dims[i + 1], norms[i], dropout) for i in range(len(dims) - 1)}
        )

    def forward(self, hidden: torch.Tensor, dropout_key: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        for block in self.blocks.values():
            hidden = block(hidden, dropout_key)
        return {"hidden": hidden}


class _Regression(TrainTask):
    """Masked squared error; the weight is the number of unmasked rows; a logged value."""

    def build_forward_inputs(self, batch, state):
        state = state.set("y", batch["y"]).set("mask", batch["mask"])
        return BuildForwardInputsResult(inputs={"hidden": batch["x"]}), state

    def compute_loss(self, outputs, state, step):
        mask = state["mask"]
        error = ((outputs["hidden"] - state["y"]) ** 2).sum(-1) * mask
        weight = mask.sum()
        loss = error.sum() / weight.clamp(min=1)
        return ComputeLossResult(loss=loss, loss_weight=weight, logs={"mean_abs": outputs["hidden"].abs().mean()})


class _SumOutputs(InferenceTask):
    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"hidden": batch["x"]}), state

    def process_outputs(self, task_state, outputs, state):
        return task_state + outputs["hidden"].sum(0)


def _setup(num_layers: int, dim: int, norm: bool, dropout: float, seed: int = 0, fused: bool = False):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    dims = [dim + (i % 2) for i in range(num_layers)] + [3]
    model = _Net(dims, [norm and i % 2 == 0 for i in range(num_layers)], dropout)
    # The compiled tail by default: these tests count its graph and compare it bitwise with the unrolled step (one
    # graph, where the fused kernel cannot run); the fused tail: tests/test_fused_optim.py.
    opt = optim.adamw(1e-2, weight_decay=0.1, fused=fused)
    state = init_train_state(model, opt, seed=seed)
    batches = [
        {
            "x": torch.randn(8, dims[0], generator=gen),
            "y": torch.randn(8, 3, generator=gen),
            "mask": (torch.rand(8, generator=gen) > 0.3).float(),
        }
        for _ in range(2)
    ]
    return model, opt, state, batches


def _contiguous_split(num_layers: int, num_stages: int) -> list[list[str]]:
    bounds = [round(s * num_layers / num_stages) for s in range(num_stages + 1)]
    return [[f"blocks.{i}" for i in range(bounds[s], bounds[s + 1])] for s in range(num_stages)]


def _assert_trees_equal(actual, expected) -> None:
    assert_trees_close(actual, expected, rtol=0, atol=0)


def _build(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> pipeline.Program:
    try:
        return pipeline.SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches)
    except ValueError:  # e.g. the V schedules need 2 stages per rank, dual_pipe_v m >= 2p
        assume(False)
        raise


@pytest.mark.parametrize("name", TRAIN_SCHEDULES)
@settings(max_examples=4, deadline=None)
@given(
    num_ranks=st.integers(1, 3),
    stages_per_rank=st.integers(1, 2),
    num_microbatches=st.sampled_from([1, 2, 4]),
    extra_layers=st.integers(0, 1),
    norm=st.booleans(),
    clip=st.sampled_from([None, 0.5]),
)
def test_run_program_equals_the_one_stage_step_bitwise(
    name, num_ranks, stages_per_rank, num_microbatches, extra_layers, norm, clip
):
    program = _build(name, num_ranks, stages_per_rank, num_microbatches)
    num_layers = program.num_stages + extra_layers
    model, opt, state, batches = _setup(num_layers, 5, norm, dropout=0.25)
    stages = pipeline.split_stages(model, _contiguous_split(num_layers, program.num_stages))
    options = {"num_microbatches": num_microbatches, "rng_kwarg": "dropout_key", "max_grad_norm": clip}
    reference = make_train_step(model, _Regression(), opt, compile=False, **options)
    piped = make_train_step(
        model, _Regression(), opt, executor=pipeline.Pipeline(program, stages), compile=False, **options
    )
    expected, actual = state, state
    for batch in batches:
        expected, expected_out = reference(expected, batch)
        actual, actual_out = piped(actual, batch)
        _assert_trees_equal(actual_out, expected_out)
    _assert_trees_equal(actual.params, expected.params)
    _assert_trees_equal(actual.opt_state, expected.opt_state)
    _assert_trees_equal(actual.buffers, expected.buffers)


@pytest.mark.parametrize("name", ["inference", "one_f_one_b"])
def test_pipelined_eval_and_inference_steps_equal_the_one_stage_steps_bitwise(name):
    model, _, state, batches = _setup(4, 5, norm=True, dropout=0.25)
    program = pipeline.SCHEDULES[name](2, 1, 2)
    stages = pipeline.split_stages(model, _contiguous_split(4, 2))
    ev = {"num_microbatches": 2, "compile": False}
    one = make_eval_step(model, _Regression(), **ev)(state, None, batches[0])
    piped = make_eval_step(model, _Regression(), executor=pipeline.Pipeline(program, stages), **ev)(
        state, None, batches[0]
    )
    _assert_trees_equal(piped, one)
    task = _SumOutputs()
    infer_state = InferenceState(
        params=state.params, buffers=state.buffers, step=state.step, rng=state.rng, task_state=torch.zeros(3)
    )
    inf = {"num_microbatches": 2, "rng_kwarg": "dropout_key", "compile": False}
    one = make_inference_step(model, task, **inf)(infer_state, batches[0])
    piped = make_inference_step(model, task, executor=pipeline.Pipeline(program, stages), **inf)(
        infer_state, batches[0]
    )
    _assert_trees_equal(piped, one)


def test_zero_bubble_program_holds_weight_gradients_from_i_to_w():
    model, opt, state, batches = _setup(2, 4, norm=False, dropout=0.0)
    stages = pipeline.split_stages(model, _contiguous_split(2, 2))
    program = pipeline.Program.from_strings(
        ["0F0 0F1 0I0 0I1 0W1 0W0", "1F0 1I0 1F1 1W0 1I1 1W1"], num_microbatches=2, stage_to_rank=(0, 1)
    )
    base = make_train_step(model, _Regression(), opt, num_microbatches=2, compile=False)
    piped = make_train_step(
        model, _Regression(), opt, num_microbatches=2, executor=pipeline.Pipeline(program, stages), compile=False
    )
    # Stage 0 adds its W in decreasing microbatch order here: equal up to rounding, not bitwise.
    expected, actual = base(state, batches[0]), piped(state, batches[0])
    assert_trees_close(actual, expected, rtol=1e-6, atol=1e-7)


def test_a_pipeline_step_called_under_no_grad_equals_the_one_stage_step_bitwise():
    # SiLU's backward is one of autograd's formulas that follow the grad mode: the first-order silu_backward kernel
    # with it off, the double-differentiable form (sigmoid, mul, add) with it on, which torch.func.grad_and_value
    # (the one-stage step) always runs; the two round differently on AVX2/AVX-512 kernels (equal on scalar ones).
    # A caller's no_grad must not reach the stages' backward: this failed here (AVX-512) before the stages' vjp
    # pinned create_graph (docs/design/pipeline.md, "Which backward formulas"). The I/W split traces under
    # enable_grad, so it never depended on the caller (its Qwen3 tests are in test_pipeline_split_backward.py).
    config = Qwen3Config.tiny(num_layers=4, tie_word_embeddings=False, dropout=0.0)
    torch.manual_seed(0)
    model = Qwen3LM(config)
    stages = pipeline.build_stages(lambda info: Qwen3LM(config, stage=info), 2)
    ids = torch.randint(0, config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    opt = optim.adamw(1e-3)
    state = init_train_state(model, opt, seed=0)
    options = {"num_microbatches": 4, "compile": False}
    expected = make_train_step(model, CausalLMTask(), opt, **options)(state, batch)
    program = pipeline.one_f_one_b(2, 1, 4)
    piped = make_train_step(model, CausalLMTask(), opt, executor=pipeline.Pipeline(program, stages), **options)
    with torch.no_grad():
        actual = piped(state, batch)
    _assert_trees_equal(actual, expected)


def test_execution_order_names_the_blocked_actions_on_a_deadlock():
    program = pipeline.Program.from_strings(["0F0 0B0", "1B0 1F0"], num_microbatches=1, stage_to_rank=(0, 1))
    with pytest.raises(ValueError, match="runs before 1F0"):
        pipeline.execution_order(program)
    crossed = pipeline.Program.from_strings(
        ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], num_microbatches=2, stage_to_rank=(0, 1)
    )
    with pytest.raises(ValueError, match=r"deadlock\); blocked at r0: 0B0, r1: 1F1"):
        pipeline.execution_order(crossed)


def test_make_train_step_rejects_a_program_of_another_microbatch_count():
    model, opt, _, _ = _setup(2, 4, norm=False, dropout=0.0)
    stages = pipeline.split_stages(model, _contiguous_split(2, 2))
    with pytest.raises(ValueError, match="program runs 4 microbatches but num_microbatches=2"):
        make_train_step(
            model, _Regression(), opt, num_microbatches=2, executor=pipeline.Pipeline(pipeline.gpipe(2, 1, 4), stages)
        )


def test_make_train_step_refuses_repeated_blocks_where_regions_cannot_run():
    model, opt, _, _ = _setup(2, 4, norm=False, dropout=0.0)
    stages = pipeline.split_stages(model, _contiguous_split(2, 2))
    zero_bubble = pipeline.Pipeline(pipeline.zero_bubble_1f1b(2, 1, 2), stages)
    blocks = {"repeated_blocks": (type(model.blocks["0"]),), "compile": False}
    with pytest.raises(ValueError, match=r"Sequential\(unroll=True\) traces the whole step.*repeated_blocks=\(\)"):
        make_train_step(model, _Regression(), opt, executor=Sequential(unroll=True), **blocks)
    with pytest.raises(ValueError, match=r"splits each stage's backward into I and W.*repeated_blocks=\(\)"):
        make_train_step(model, _Regression(), opt, executor=zero_bubble, **blocks)
    # "auto" finds the blocks but leaves them out where they cannot run: the traced stages.
    assert find_repeated_blocks(model) == blocks["repeated_blocks"]
    auto = make_train_step(model, _Regression(), opt, executor=zero_bubble, repeated_blocks="auto", compile=False)
    assert isinstance(auto.pieces["stages"], pipeline.TracedStages)
    # The forward-only steps run no I/W actions: the same program takes the blocks there.
    evaluate = make_eval_step(model, _Regression(), executor=zero_bubble, **blocks)
    assert not isinstance(evaluate.pieces["stages"], pipeline.TracedStages)


# --- compiled pieces ---------------------------------------------------------------------------------


def _counting_backend(graphs: list):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _counting_aot_eager(graphs: list):
    """Records every graph dynamo hands over, then compiles it with ``aot_eager`` (the same aten ops: bitwise)."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


@pytest.mark.slow  # compiles (aot_eager) several steps: tens of seconds on 2 cores
@pytest.mark.parametrize("unroll", [False, True], ids=["pieces", "unrolled"])
def test_make_train_step_compiled_equals_eager_and_its_graph_count_does_not_grow_with_microbatches(unroll):
    """One compiled run per microbatch count checks both properties: the graphs dynamo hands over (counted) are the
    ones that run, bitwise equal to eager (so the pieces equal the unrolled step too), and steps 2..N reuse them."""
    model, opt, state, batches = _setup(3, 4, norm=True, dropout=0.25)
    options = {"rng_kwarg": "dropout_key", "max_grad_norm": 1.0}
    counts = {}
    for num_microbatches in (1, 2, 4):
        torch._dynamo.reset()
        graphs: list = []
        eager = make_train_step(model, _Regression(), opt, compile=False, num_microbatches=num_microbatches, **options)
        # aot_eager where compiled equals eager is asserted (1 and 4); 2 only counts (the same sizes as 4)
        backend = _counting_aot_eager(graphs) if num_microbatches != 2 else _counting_backend(graphs)
        step = make_train_step(
            model,
            _Regression(),
            opt,
            num_microbatches=num_microbatches,
            executor=Sequential(unroll=unroll),
            compile=backend,
            **options,
        )
        expected = actual = state
        for index, batch in enumerate(batches * 3):
            expected, expected_out = eager(expected, batch)
            with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
                actual, actual_out = step(actual, batch)
            # aot_eager replays the same aten ops: identical here; inductor is checked (looser) below.
            _assert_trees_equal(actual_out, expected_out)
        _assert_trees_equal(actual, expected)
        nodes = sum(len(gm.graph.nodes) for gm in graphs)
        counts[num_microbatches] = (len(graphs), nodes)
    if unroll:  # one graph, whose size grows with the count
        assert [c for c, _ in counts.values()] == [1, 1, 1]
        assert counts[4][1] > counts[2][1] > counts[1][1]
    else:  # head, per-microbatch piece, tail; the same size for 2 and 4 microbatches
        assert [c for c, _ in counts.values()] == [3, 3, 3]
        assert counts[2][1] == counts[4][1] or abs(counts[4][1] - counts[2][1]) < 0.2 * counts[2][1]


@pytest.mark.slow
@pytest.mark.compiled
def test_make_train_step_inductor_pieces_match_eager_within_tolerance():
    model, _, _, batches = _setup(3, 8, norm=True, dropout=0.25)
    # SGD, not Adam: Adam's first updates are about lr·sign(g), so a gradient within rounding of 0 flips a whole
    # lr-sized step and params cannot be compared to a tolerance; SGD's update is linear in the gradient.
    opt = optim.sgd(0.1, momentum=0.9)
    state = init_train_state(model, opt, seed=0)
    options = {"num_microbatches": 4, "rng_kwarg": "dropout_key", "max_grad_norm": 1.0}
    eager = make_train_step(model, _Regression(), opt, compile=False, **options)
    compiled = make_train_step(model, _Regression(), opt, **options)
    expected, actual = state, state
    for index in range(6):
        expected, expected_out = eager(expected, batches[index % 2])
        actual, actual_out = compiled(actual, batches[index % 2])
        torch.testing.assert_close(actual_out.loss, expected_out.loss, rtol=1e-5, atol=1e-6)
    assert_trees_close(actual.params, expected.params, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles (aot_eager) several steps: tens of seconds on 2 cores
def test_make_train_step_pipeline_compiles_head_and_tail_without_recompiles():
    model, opt, state, batches = _setup(4, 4, norm=True, dropout=0.25)
    stages = pipeline.split_stages(model, _contiguous_split(4, 2))
    program = pipeline.one_f_one_b(2, 1, 2)
    options = {"num_microbatches": 2, "rng_kwarg": "dropout_key", "executor": pipeline.Pipeline(program, stages)}
    eager = make_train_step(model, _Regression(), opt, compile=False, **options)
    compiled = make_train_step(model, _Regression(), opt, compile="aot_eager", **options)
    expected, _ = eager(state, batches[0])
    actual, _ = compiled(state, batches[0])
    with torch.compiler.set_stance("fail_on_recompile"):
        expected, expected_out = eager(expected, batches[1])
        actual, actual_out = compiled(actual, batches[1])
    _assert_trees_equal(actual_out, expected_out)
    _assert_trees_equal(actual, expected)
