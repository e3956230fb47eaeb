"""The I/W split of a stage's backward (``d9dfn/pipeline/_split_backward.py``): dI + dW do the full backward's
matmuls once (counted with a ``TorchDispatchMode``), equal ``vjp`` bitwise, and make the zero-bubble schedules
equal the one-stage step bitwise, on a residual+LayerNorm+GELU stack and on Qwen3 stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, vjp
from torch.utils._python_dispatch import TorchDispatchMode

import d9dfn.optim as optim
from d9dfn import BuildForwardInputsResult, ComputeLossResult, TrainTask, init_train_state, make_train_step, pipeline
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.pipeline._split_backward import SplitBackward
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

ZERO_BUBBLE = ["zero_bubble_1f1b", "zero_bubble_v", "dual_pipe_v"]
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in _MATMULS
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    """x + W2·gelu(W1·x) → LayerNorm: a residual, a norm and a GELU per block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), nn.LayerNorm(dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden + self.down(nn.functional.gelu(self.up(hidden))))


class _Net(nn.Module):
    def __init__(self, num_blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): _Block(dim) for i in range(num_blocks)})
        self.head = nn.Linear(dim, 3)

    def forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks.values():
            hidden = block(hidden)
        return {"hidden": hidden if self.head is None else self.head(hidden)}  # split_stages: None off-stage


class _Regression(TrainTask):
    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"hidden": batch["x"]}), state.set("y", batch["y"])

    def compute_loss(self, outputs, state, step):
        error = ((outputs["hidden"] - state["y"]) ** 2).sum()
        return ComputeLossResult(loss=error / 8, loss_weight=torch.tensor(8.0), logs={"e": error.detach()})


def _stage_fn(module: nn.Module):
    def fn(params, inputs, consts):
        out = functional_call(module, params, (inputs["hidden"],))["hidden"]
        return {"hidden": out}, {"sum": out.detach().sum(), "tag": consts}

    return fn


@pytest.mark.parametrize("with_input", [True, False], ids=["middle_stage", "first_stage"])
def test_split_equals_vjp_bitwise_and_does_not_duplicate_matmuls(with_input):
    torch.manual_seed(0)
    module = _Net(2, 8)
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(5, 8)
    fn = _stage_fn(module)
    inputs, consts = ({"hidden": x}, "c") if with_input else ({}, "c")
    call = fn if with_input else (lambda p, _, c: fn(p, {"hidden": x}, c))

    primal, split, aux = SplitBackward()(0, call, params, inputs, consts)
    gy = {"hidden": torch.randn(5, 3)}
    with CountMatmuls() as d_input:
        input_grads = split.input(gy)
    with CountMatmuls() as d_weight:
        weight_grads = split.weight()

    expected, closure = vjp(lambda p, i: call(p, i, consts)[0], params, inputs)
    with CountMatmuls() as full:
        expected_weight, expected_input = closure(gy)
    assert torch.equal(primal["hidden"], expected["hidden"])
    assert aux["tag"] == "c"
    assert torch.equal(aux["sum"], expected["hidden"].sum())
    assert_trees_close(weight_grads, expected_weight, rtol=0, atol=0)
    assert_trees_close(input_grads, expected_input, rtol=0, atol=0)
    # 5 linears: the full backward = 5 dX + 5 dW matmuls (the first dX only when the input is differentiated).
    assert d_input.count + d_weight.count == full.count
    if with_input:
        assert (d_input.count, d_weight.count) == (5, 5)
    else:
        assert (d_input.count, d_weight.count) == (0, full.count)


def test_split_traces_once_per_argument_structure():
    torch.manual_seed(0)
    module = _Net(1, 4)
    params = {k: v.detach() for k, v in module.named_parameters()}
    cache = SplitBackward()
    for _ in range(3):
        cache(0, _stage_fn(module), params, {"hidden": torch.randn(2, 4)}, "c")
    assert len(cache) == 1
    cache(0, _stage_fn(module), params, {"hidden": torch.randn(3, 4)}, "c")  # a new shape: a new trace
    cache(0, _stage_fn(module), params, {"hidden": torch.randn(2, 4)}, "d")  # a new constant: a new trace
    assert len(cache) == 3


def _contiguous_split(num_blocks: int, num_stages: int) -> list[list[str]]:
    bounds = [round(s * num_blocks / num_stages) for s in range(num_stages + 1)]
    names = [[f"blocks.{i}" for i in range(bounds[s], bounds[s + 1])] for s in range(num_stages)]
    names[-1].append("head")
    return names


def _equal_steps(model, task, opt, program, stages, batches, num_microbatches):
    state = init_train_state(model, opt, seed=0)
    options = {"num_microbatches": num_microbatches, "max_grad_norm": 0.5, "compile": False}
    reference = make_train_step(model, task, opt, **options)
    piped = make_train_step(model, task, opt, executor=pipeline.Pipeline(program, stages), **options)
    expected, actual = state, state
    for batch in batches:
        expected, expected_out = reference(expected, batch)
        actual, actual_out = piped(actual, batch)
        assert_trees_close(actual_out, expected_out, rtol=0, atol=0)
    assert_trees_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_zero_bubble_schedules_with_the_split_equal_the_one_stage_step_bitwise(name):
    num_microbatches = 4
    program = pipeline.SCHEDULES[name](2, 2 if name != "zero_bubble_1f1b" else 1, num_microbatches)
    assert any(a.kind == "I" for row in program.ranks for a in row)
    torch.manual_seed(0)
    model = _Net(program.num_stages + 1, 6)
    stages = pipeline.split_stages(model, _contiguous_split(program.num_stages + 1, program.num_stages))
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 6, generator=gen), "y": torch.randn(8, 3, generator=gen)} for _ in range(2)]
    _equal_steps(model, _Regression(), optim.adamw(1e-2, weight_decay=0.1), program, stages, batches, num_microbatches)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_zero_bubble_schedules_on_qwen3_stages_equal_the_one_stage_step_bitwise(name):
    num_microbatches = 4
    program = pipeline.SCHEDULES[name](2, 2 if name != "zero_bubble_1f1b" else 1, num_microbatches)
    assert any(a.kind == "I" for row in program.ranks for a in row)
    config = Qwen3Config.tiny(num_layers=2 * program.num_stages, tie_word_embeddings=False, dropout=0.0)
    torch.manual_seed(0)
    model = Qwen3LM(config)
    stages = pipeline.build_stages(lambda info: Qwen3LM(config, stage=info), program.num_stages)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (4, 6), generator=gen)
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}
    _equal_steps(model, CausalLMTask(), optim.adamw(1e-3), program, stages, [batch], num_microbatches)


class _StepScaledRegression(_Regression):
    """A loss that reads the step: a graph that kept the first step's tensor as a constant would diverge."""

    def compute_loss(self, outputs, state, step):
        result = super().compute_loss(outputs, state, step)
        return ComputeLossResult(loss=result.loss * (1.0 + step.float()), loss_weight=result.loss_weight)


def test_the_split_is_traced_once_per_stage_for_every_step_and_reads_the_step_each_step(monkeypatch):
    from d9dfn.pipeline._split_backward import SplitBackward

    traces = []
    trace = SplitBackward._trace
    monkeypatch.setattr(SplitBackward, "_trace", lambda self, *args: traces.append(1) or trace(self, *args))
    program = pipeline.zero_bubble_1f1b(2, 1, 2)
    torch.manual_seed(0)
    model = _Net(3, 6)
    stages = pipeline.split_stages(model, _contiguous_split(3, 2))
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 6, generator=gen), "y": torch.randn(8, 3, generator=gen)} for _ in range(3)]
    _equal_steps(model, _StepScaledRegression(), optim.sgd(0.05), program, stages, batches, 2)
    assert len(traces) == program.num_stages  # once per stage, not once per step
