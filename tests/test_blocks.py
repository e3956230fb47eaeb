"""``make_train_step(repeated_blocks=...)`` (issue 15 item 3): each decoder layer is compiled once as a nested
region; the step equals the default one to rounding, traces one region for every layer, does not recompile, and
with inductor gets the gradients right (torch 2.13 needs buffer reuse off for that: ``d9dfn._blocks``)."""

from __future__ import annotations

import pytest
import torch
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, tiny_job
from torch._dynamo.testing import CompileCounterWithBackend

import d9dfn.optim as optim
from d9dfn import (
    BuildForwardInputsResult,
    ComputeLossResult,
    Precision,
    TrainTask,
    init_train_state,
    make_train_step,
    pipeline,
)
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.models._qwen3 import Qwen3DecoderLayer
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

LAYER = (Qwen3DecoderLayer,)


def _model(layers: int = 3, dropout: float = 0.1) -> Qwen3LM:
    torch.manual_seed(0)
    return Qwen3LM(Qwen3Config.tiny(vocab_size=64, num_layers=layers, dropout=dropout))


def _batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def _run(model, *, steps: int = 3, opt=None, **options):
    opt = opt if opt is not None else optim.adamw(3e-3, weight_decay=0.01)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, num_microbatches=2, rng_kwarg="dropout_key", **options)
    outs = []
    for index, batch in enumerate(_batches(steps)):
        if index == 0:
            state, out = step(state, batch)
        else:
            with torch.compiler.set_stance("fail_on_recompile"):  # steps 2..N reuse the compiled pieces
                state, out = step(state, batch)
        outs.append(out)
    return state, outs


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_repeated_blocks_step_equals_the_default_step(compile):
    model = _model()
    expected_state, expected = _run(model, compile=compile, backend="aot_eager")
    state, outs = _run(model, compile=compile, backend="aot_eager", repeated_blocks=LAYER)
    # Autograd sums a gradient's contributions in its own order: equal to rounding, not bitwise.
    assert_trees_close(outs, expected, rtol=1e-5, atol=1e-7)
    assert_trees_close(state, expected_state, rtol=1e-5, atol=1e-6)  # Adam amplifies rounding near 0
    assert float(outs[-1].loss) != float(outs[0].loss)  # the steps trained
    assert all(type(layer) is Qwen3DecoderLayer for layer in model.layers.values())  # the caller's model untouched


def test_repeated_blocks_trace_one_region_for_every_layer():
    counter = CompileCounterWithBackend("aot_eager")
    _run(_model(layers=4), steps=1, backend=counter, repeated_blocks=LAYER)
    calls = [
        node
        for graph in counter.graphs
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
    ]
    assert len(calls) == 4  # every layer runs as a region ...
    assert len({node.args[0].target for node in calls}) == 1  # ... and all four run the one traced subgraph


@pytest.mark.slow  # one inductor compile of each step (tens of seconds on 2 cores)
def test_repeated_blocks_with_inductor_get_the_gradients_right():
    model = _model(layers=4)
    expected_state, expected = _run(model, steps=2, compile=False)
    state, outs = _run(model, steps=2, repeated_blocks=LAYER)
    # Buffer reuse on, the same step's gradients were wrong by 1e6 and more (docs/design/step.md): the gradient
    # norm and the second loss (after an update) would be far off. Adam amplifies inductor's rounding near 0.
    assert_trees_close(outs, expected, rtol=1e-4, atol=1e-6)
    assert_trees_close(state, expected_state, rtol=1e-3, atol=1e-5)


class _Bf16Logits(CausalLMTask):
    """Fails unless the model's logits come out in bf16: the policy's compute dtype really reached the model."""

    def compute_loss(self, outputs, state, step):
        assert outputs["logits"].dtype == torch.bfloat16, outputs["logits"].dtype
        return super().compute_loss(outputs, state, step)


def test_repeated_blocks_keep_the_precision_policy():
    model, policy = _model(dropout=0.0), Precision.bf16_mixed()
    runs = []
    for blocks in ((), LAYER):
        opt = optim.sgd(0.1)  # Adam would turn bf16 rounding in a near-zero gradient into a whole lr-sized step
        state = init_train_state(model, opt)
        step = make_train_step(
            model, _Bf16Logits(), opt, num_microbatches=2, precision=policy, compile=False, repeated_blocks=blocks
        )
        outs = []
        for batch in _batches(2):
            state, out = step(state, batch)
            outs.append(out)
        runs.append((state, outs))
    (expected_state, expected), (state, outs) = runs
    assert all(p.dtype == torch.float32 for p in state.params.values())  # fp32 master weights
    # Both run the model in bf16 from the same casts; autograd's backward and grad_and_value's do not run the
    # same ops in the same order, so the bf16 gradients differ by rounding (a bf16 ulp is 0.4%).
    assert_trees_close(outs, expected, rtol=1e-3, atol=1e-5)
    assert_trees_close(state, expected_state, rtol=0, atol=1e-3)


def test_repeated_blocks_refuse_a_class_the_model_lacks_and_pipelines():
    model = _model()
    opt = optim.adamw(1e-3)
    with pytest.raises(
        ValueError, match=r"names torch.nn.modules.linear.Linear, but no module of Qwen3LM.*'Qwen3DecoderLayer'"
    ):
        make_train_step(model, CausalLMTask(), opt, repeated_blocks=(torch.nn.Linear,))
    with pytest.raises(ValueError, match="pass repeated_blocks=\\(\\) with pipeline= or unroll=True"):
        make_train_step(model, CausalLMTask(), opt, unroll=True, repeated_blocks=LAYER)
    program = pipeline.SCHEDULES["gpipe"](1, 1, 1)
    stages = pipeline.split_stages(model, [["embed_tokens", "layers", "norm"]])
    with pytest.raises(ValueError, match="repeated_blocks"):
        make_train_step(model, CausalLMTask(), opt, pipeline=(program, stages), repeated_blocks=LAYER)


# --- the loop: trainer.repeated_blocks ------------------------------------------------------------------------------

LOOP = (
    *TINY_TRAINER,
    "trainer.batching.global_batch_size=4",
    "trainer.total_steps=3",
    *TINY_MODEL,
    "model.num_layers=2",
    *TINY_DATA,
)


def test_the_loop_compiles_trainer_repeated_blocks_and_trains_the_same(tmp_path, monkeypatch):
    import d9dfn.loop._train as train_module
    from d9dfn.jobs import train_lm

    built = []

    def recording(*args, **kwargs):
        built.append(kwargs["repeated_blocks"])
        return make_train_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "make_train_step", recording)
    plain = train_lm(tiny_job(tmp_path / "a", base=LOOP))
    blocks = train_lm(tiny_job(tmp_path / "b", 'trainer.repeated_blocks=["Qwen3DecoderLayer"]', base=LOOP))
    assert built == [(), (Qwen3DecoderLayer,)]  # the setting reaches the step as the model's class
    assert_trees_close(blocks.state.params, plain.state.params, rtol=1e-5, atol=1e-6)


def test_trainer_repeated_blocks_refuse_an_unknown_class_and_pipelining(tmp_path):
    from d9dfn.jobs import train_lm

    with pytest.raises(ValueError, match=r"trainer.repeated_blocks: 'Block' is not .* \[.*'Qwen3DecoderLayer'"):
        train_lm(tiny_job(tmp_path / "a", 'trainer.repeated_blocks=["Block"]', base=LOOP))
    with pytest.raises(ValueError, match="set repeated_blocks=\\[\\] to pipeline"):
        tiny_job(
            tmp_path / "b",
            'trainer.repeated_blocks=["Qwen3DecoderLayer"]',
            'trainer.pipelining={"schedule": {"schedule": "1f1b"}}',
            base=LOOP,
        )


class _NormBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)  # writes its running statistics in place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


class _NormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_NormBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        return {"y": x}


class _SquareTask(TrainTask):
    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"x": batch}), state

    def compute_loss(self, outputs, state, step):
        return ComputeLossResult(loss=outputs["y"].square().mean())


def test_repeated_blocks_refuse_a_block_with_buffers():
    # torch 2.13: "invoke_subgraph ... does not currently support training with in-place input or buffer mutations".
    with pytest.raises(ValueError, match=r"includes _NormBlock, but blocks.0.norm.running_mean is a buffer"):
        make_train_step(_NormNet(), _SquareTask(), optim.sgd(0.1), repeated_blocks=(_NormBlock,))
