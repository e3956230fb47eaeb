"""``make_train_step(repeated_blocks=...)`` (issue 15 item 3): each decoder layer is compiled once as a nested
region; the step equals the default one to rounding, traces one region for every layer, does not recompile, and
with inductor gets the gradients right (torch 2.13 needs buffer reuse off for that: ``d9dfn.step._blocks``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, tiny_job
from torch._dynamo.testing import CompileCounterWithBackend

import d9dfn
import d9dfn.optim as optim
from d9dfn import (
    BuildForwardInputsResult,
    ComputeLossResult,
    PipelineState,
    Precision,
    Sequential,
    Sums,
    TrainTask,
    Transform,
    init_train_state,
    make_train_step,
)
from d9dfn._pytree import pytree_dataclass
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.models._decoder import Qwen3DecoderLayer
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

LAYER = (Qwen3DecoderLayer,)


def _compile(compile: bool) -> str | bool:
    return "aot_eager" if compile else False


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
def test_repeated_blocks_step_equals_the_default_step_and_builds_each_regions_schema_once(compile, monkeypatch):
    """aot_eager: one compiled run of the step per block setting also checks what the regions trace (one region for
    every layer) and that a region's schema is built once for all its calls."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP, invoke_subgraph

    # AOTAutograd asks for the schema of every region call that needs gradients; torch builds it by tracing the
    # region again. The step remembers it per region and inputs' metadata
    # (d9dfn._torch._regions.remembered_schemas).
    built: list[str] = []
    original = InvokeSubgraphHOP.gen_schema

    def counted(self, subgraph, identifier, *operands):
        built.append(identifier)
        return original(self, subgraph, identifier, *operands)

    monkeypatch.setattr(InvokeSubgraphHOP, "gen_schema", counted)
    model = _model(layers=4)
    counter = CompileCounterWithBackend("aot_eager")
    expected_state, expected = _run(model, compile=_compile(compile))
    state, outs = _run(model, compile=counter if compile else False, repeated_blocks=LAYER)
    # Autograd sums a gradient's contributions in its own order: equal to rounding, not bitwise.
    assert_trees_close(outs, expected, rtol=1e-5, atol=1e-7)
    assert_trees_close(state, expected_state, rtol=1e-5, atol=1e-6)  # Adam amplifies rounding near 0
    assert float(outs[-1].loss) != float(outs[0].loss)  # the steps trained
    assert all(type(layer) is Qwen3DecoderLayer for layer in model.layers.values())  # the caller's model untouched
    if compile:
        # on the CPU the default runs AdamW's fused kernel: no tail graph; forward: one traced layer for all four
        assert _region_uses(counter) == [[], [4]]
        _, eager = _run(model, steps=1, compile=False, repeated_blocks=LAYER)
        assert_trees_close(outs[0].loss, eager[0].loss, rtol=1e-6, atol=1e-6)
        # The forward's region (subgraph_0, four layers, two microbatches: eight calls): one schema for its calls;
        # the tail's first region has the same name in its own graph, without gradients.
        assert 1 <= built.count("subgraph_0") <= 2, built
    assert "gen_schema" not in invoke_subgraph.__dict__  # nothing left patched after the step


def test_repeated_blocks_trace_one_region_for_every_layer_and_each_layers_tail():
    counter = CompileCounterWithBackend("aot_eager")
    opt = optim.adamw(3e-3, weight_decay=0.01, fused=False)  # the compiled tail (fused: the kernel, not compiled)
    _run(_model(layers=4), steps=1, opt=opt, compile=counter, repeated_blocks=LAYER)
    uses = _region_uses(counter)
    # head: none; forward: one traced layer for all four; tail (a leafwise optimizer: blockwise): each layer's
    # gradient norms and each layer's update, two subgraphs for four layers. The fused default (no tail graph):
    # test_repeated_blocks_step_equals_the_default_step_and_builds_each_regions_schema_once[aot_eager].
    assert uses == [[], [4], [4, 4]]


@pytest.mark.parametrize(
    ("blocks", "backend"),
    [pytest.param(LAYER, "aot_eager", marks=pytest.mark.slow), ((), "eager")],  # regions need AOTAutograd (~17 s)
    ids=["repeated_blocks", "whole_model"],
)
def test_steps_built_one_after_another_in_a_process_never_reach_dynamos_recompile_limit(blocks, backend):
    # dynamo keeps its entries on a compiled function's code object and counts them against recompile_limit; every
    # step compiles the same builder functions, and a dead step's entries still counted: the ninth step built in a
    # process (a sweep, a notebook) failed with FailOnRecompileLimitHit. Each piece is now compiled under a code
    # object of its own (d9dfn._torch._compiled.own_code). With a limit of 1, the second model is the one that failed.
    with torch._dynamo.config.patch(recompile_limit=1):
        for layers in (1, 2):
            _, compiled = _run(_model(layers=layers), steps=1, compile=backend, repeated_blocks=blocks)
            _, eager = _run(_model(layers=layers), steps=1, compile=False, repeated_blocks=blocks)
            assert_trees_close(compiled[0].loss, eager[0].loss, rtol=1e-6, atol=1e-6)


def _region_uses(counter: CompileCounterWithBackend) -> list[list[int]]:
    """Per compiled graph, how many times each traced region is called, sorted (``[4]``: one region, 4 calls)."""
    uses = [
        Counter(
            node.args[0].target
            for node in graph.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
        )
        for graph in counter.graphs
        if graph.graph.nodes  # dynamo hands the backend an empty graph before it restarts a trace (float scalars)
    ]
    return [sorted(use.values()) for use in uses]


@pytest.mark.slow  # one inductor compile of each step (tens of seconds on 2 cores)
@pytest.mark.parametrize("leafwise", [False, True], ids=["whole_tail", "blockwise_tail"])
@pytest.mark.compiled
def test_repeated_blocks_with_inductor_get_the_gradients_right(leafwise):
    model = _model(layers=4)
    # A weight-decay mask makes adamw not leafwise: the tail then updates the whole tree at once.
    mask = None if leafwise else (lambda name, leaf: leaf.ndim > 1)
    opt = optim.adamw(3e-3, weight_decay=0.01, weight_decay_mask=mask)
    assert opt.leafwise == leafwise
    expected_state, expected = _run(model, steps=2, opt=opt, compile=False)
    state, outs = _run(model, steps=2, opt=opt, repeated_blocks=LAYER)
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


def test_repeated_blocks_refuse_a_class_the_model_lacks():
    with pytest.raises(
        ValueError, match=r"names torch.nn.modules.linear.Linear, but no module of Qwen3LM.*'Qwen3DecoderLayer'"
    ):
        make_train_step(_model(), CausalLMTask(), optim.adamw(1e-3), repeated_blocks=(torch.nn.Linear,))


def test_repeated_blocks_refuse_the_unrolled_step():
    model = _model()
    opt = optim.adamw(1e-3)
    with pytest.raises(ValueError, match=r"but Sequential\(unroll=True\) traces the whole step.*repeated_blocks=\(\)"):
        make_train_step(model, CausalLMTask(), opt, executor=Sequential(unroll=True), repeated_blocks=LAYER)
    # "auto" leaves the blocks out there: the unrolled step, one graph.
    unrolled = make_train_step(model, CausalLMTask(), opt, executor=Sequential(unroll=True), repeated_blocks="auto")
    assert list(unrolled.pieces) == ["step"]


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
        step = make_train_step(*args, **kwargs)
        built.append((kwargs["repeated_blocks"], "stages" in step.pieces))  # "stages": the per-block runner
        return step

    monkeypatch.setattr(train_module, "make_train_step", recording)
    plain_job = tiny_job(tmp_path / "a", "trainer.repeated_blocks=[]", base=LOOP)
    blocks_job = tiny_job(tmp_path / "b", 'trainer.repeated_blocks=["Qwen3DecoderLayer"]', base=LOOP)
    plain, blocks, auto = train_lm(plain_job), train_lm(blocks_job), train_lm(tiny_job(tmp_path / "c", base=LOOP))
    # the settings reach the step (the block as the model's class; the default, null, finds it)
    assert built == [((), False), (LAYER, True), ("auto", True)]
    assert_trees_close(blocks.state.params, plain.state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(auto.state.params, blocks.state.params, rtol=0, atol=0)

    # The evaluation after training (d9dfn infer) compiles the block once too: InferenceConfig.repeated_blocks.
    import d9dfn.loop._inference as inference_module
    from d9dfn import make_inference_step
    from d9dfn.jobs import evaluate_lm

    inferred = []

    def recording_inference(*args, **kwargs):
        inferred.append(kwargs["repeated_blocks"])
        return make_inference_step(*args, **kwargs)

    monkeypatch.setattr(inference_module, "make_inference_step", recording_inference)
    plain_eval, blocks_eval = evaluate_lm(plain_job), evaluate_lm(blocks_job)
    assert inferred == [(), (), LAYER, LAYER]  # the full-batch step and the tail batch's, per run
    assert blocks_eval["perplexity"] == pytest.approx(plain_eval["perplexity"], rel=1e-5)


def test_trainer_repeated_blocks_refuse_an_unknown_class(tmp_path):
    from d9dfn.jobs import train_lm

    with pytest.raises(ValueError, match=r"trainer.repeated_blocks: 'Block' is not .* \[.*'Qwen3DecoderLayer'"):
        train_lm(tiny_job(tmp_path / "a", 'trainer.repeated_blocks=["Block"]', base=LOOP))


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


# --- the tail: a leafwise optimizer updates each block's leaves through one region ----------------------------------


@pytree_dataclass
class _WrappedState:
    inner: Any
    scale: torch.Tensor


def _wrapped_sgd() -> Transform:
    """A hand-made leafwise transform whose state is a registered node type (the tail walks it with optree)."""
    base = optim.sgd(0.1, momentum=0.9)

    def init(params):
        return _WrappedState(inner=base.init(params), scale=torch.tensor(0.5))

    def update(grads, state, params=None):
        updates, inner = base.update(grads, state.inner, params)
        return {name: u * state.scale for name, u in updates.items()}, state.replace(inner=inner)

    return Transform(init, update, leafwise=True)


LEAFWISE = {
    "adamw_amsgrad": lambda: optim.adamw(3e-3, weight_decay=0.1, amsgrad=True),
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "chain": lambda: optim.chain(optim.sgd(0.5), optim.adam(1e-2)),
    "dataclass_state": _wrapped_sgd,
}


def _tail_inputs(model, opt, poison: str | None = None):
    """A train state after one update (moments not zero) and gradient sums; ``poison`` makes one leaf's inf."""
    state = init_train_state(model, opt)
    generator = torch.Generator().manual_seed(1)
    grads = {name: torch.randn(p.shape, generator=generator) for name, p in state.params.items()}
    state, _ = train_tail_with(model, opt, state, grads, blockwise=False)
    grads = {name: torch.randn(p.shape, generator=generator) for name, p in state.params.items()}
    if poison is not None:
        grads[poison] = grads[poison].clone().index_fill_(0, torch.tensor([0]), float("inf"))
    return state, grads


def train_tail_with(model, opt, state, grads, *, blockwise: bool, max_grad_norm=None, skip_nonfinite=False):
    from d9dfn.step._blockwise_tail import BlockwiseTail

    tail = _tail(opt, BlockwiseTail((model,), LAYER, opt) if blockwise else None, max_grad_norm, skip_nonfinite)
    return tail(state, grads)


def _tail(opt, blockwise, max_grad_norm, skip_nonfinite):
    from d9dfn.pipeline import ProgramResult
    from d9dfn.step._microbatches import MicrobatchOut
    from d9dfn.step._tail import Tail

    train_tail = Tail(
        CausalLMTask(),
        opt,
        max_grad_norm=max_grad_norm,
        skip_nonfinite=skip_nonfinite,
        reduce_gradients=None,
        pipeline=None,
        precision=None,
        blockwise=blockwise,
    )

    def tail(state, grads):
        if not torch.compiler.is_compiling():
            train_tail.prepare(state)
        sums = Sums(grads, torch.tensor(6.0), torch.tensor(4.0))
        outs = [MicrobatchOut(PipelineState(), {}, {}, torch.tensor(4.0))]
        return train_tail(state, ProgramResult(sums, state.buffers, outs))

    return tail


@pytest.mark.parametrize("name", sorted(LEAFWISE))
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize("poison", [None, "layers.1.mlp.up_proj.weight", "embed_tokens.weight"])
def test_the_blockwise_tail_equals_the_whole_tree_tail_bitwise(name, max_grad_norm, poison):
    model, opt = _model(), LEAFWISE[name]()
    assert opt.leafwise
    state, grads = _tail_inputs(model, opt, poison)
    expected = train_tail_with(
        model, opt, state, grads, blockwise=False, max_grad_norm=max_grad_norm, skip_nonfinite=True
    )
    got = train_tail_with(model, opt, state, grads, blockwise=True, max_grad_norm=max_grad_norm, skip_nonfinite=True)
    assert_trees_close(got, expected, rtol=0, atol=0)  # the same ops on the same leaves, in the same order
    if poison is not None:  # a non-finite step leaves params and the optimizer's state as they were
        assert bool(got[1].skipped)
        assert_trees_close(got[0].opt_state, state.opt_state, rtol=0, atol=0)
        assert_trees_close(got[0].params, state.params, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["adamw_amsgrad", "dataclass_state"])
def test_the_blockwise_tail_compiles_to_the_eager_result(name):
    model, opt = _model(), LEAFWISE[name]()
    state, grads = _tail_inputs(model, opt)
    expected = train_tail_with(model, opt, state, grads, blockwise=False, max_grad_norm=0.5, skip_nonfinite=True)
    from d9dfn.step._blockwise_tail import BlockwiseTail

    tail = _tail(opt, BlockwiseTail((model,), LAYER, opt), max_grad_norm=0.5, skip_nonfinite=True)
    tail(state, grads)  # eager first: the layout is fixed outside the trace
    got = torch.compile(tail, backend="aot_eager", fullgraph=True)(state, grads)
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(LEAFWISE))
def test_the_tails_state_walk_agrees_with_optree(name):
    from d9dfn._pytree import tree_flatten
    from d9dfn.step._state_slots import flatten_state, is_slot_of

    model, opt = _model(), LEAFWISE[name]()
    state, _ = _tail_inputs(model, opt)
    slot = is_slot_of(state.params.keys())
    leaves, spec = flatten_state(state.opt_state, slot)
    expected_leaves, expected_spec = tree_flatten(state.opt_state, is_leaf=slot)
    assert [id(leaf) for leaf in leaves] == [id(leaf) for leaf in expected_leaves]
    assert sum(map(slot, leaves)) >= 1  # the moments are found as whole dicts
    rebuilt = spec.unflatten(leaves)
    assert type(rebuilt) is type(state.opt_state)
    assert tree_flatten(rebuilt, is_leaf=slot)[1] == expected_spec
    assert_trees_close(rebuilt, state.opt_state, rtol=0, atol=0)


def test_a_state_of_another_structure_from_the_update_is_refused_by_name():
    base = optim.sgd(0.1, momentum=0.9)

    def update(grads, state, params=None):  # drops the momentum buffers: not the structure it was given
        updates, new = base.update(grads, state, params)
        return updates, new._replace(momentum_buffer={})

    opt = Transform(base.init, update, leafwise=True)
    model = _model()
    state, grads = _tail_inputs(model, optim.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"the step's tail: the optimizer's update returned a state whose per-param"):
        train_tail_with(model, opt, state, grads, blockwise=True)


def test_the_blockwise_tail_runs_only_with_a_leafwise_optimizer():
    mask = lambda name, leaf: leaf.ndim > 1  # noqa: E731  # a name predicate: the block's own names would differ
    assert all(opt.leafwise for opt in (optim.adamw(1e-3), optim.adam(1e-3), optim.sgd(1e-3, momentum=0.9)))
    assert optim.chain(optim.sgd(0.1), optim.adamw(1e-3)).leafwise
    assert not optim.adamw(1e-3, weight_decay_mask=mask).leafwise
    assert not optim.masked(optim.sgd(0.1), mask).leafwise
    assert not optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)).leafwise  # a global norm
    assert not optim.stochastic_adamw(1e-3, key=0).leafwise  # a random stream per leaf index
    counter = CompileCounterWithBackend("aot_eager")
    _run(
        _model(layers=4),
        steps=1,
        opt=optim.adamw(3e-3, weight_decay_mask=mask, fused=False),
        compile=counter,
        repeated_blocks=LAYER,
    )
    # the layers compile once; the optimizer is not leafwise, so the tail takes the whole tree
    assert _region_uses(counter) == [[], [4], []]


# --- forward-only steps: evaluation and inference compile the block once too ---------------------------------------


def _inference_state(state):
    from d9dfn import InferenceState
    from d9dfn.tasks import PerplexityTask

    return InferenceState(
        params=state.params,
        buffers=state.buffers,
        step=state.step,
        rng=state.rng,
        task_state=PerplexityTask().init_state(),
    )


def _eval_and_infer(model, **options):
    """Eval (loss, logs, metrics) and inference (summed NLL) of three batches from one trained state."""
    from d9dfn import make_eval_step, make_inference_step
    from d9dfn.tasks import PerplexityTask

    state, _ = _run(model, steps=1, compile=False)
    task = CausalLMTask()
    evaluate = make_eval_step(model, task, num_microbatches=2, **options)
    infer = make_inference_step(model, PerplexityTask(), num_microbatches=2, **options)
    metric_state, inference = task.create_metrics().init(), _inference_state(state)
    outs = []
    for index, batch in enumerate(_batches(3)):
        stance = "fail_on_recompile" if index else "default"  # batches 2..3 reuse the compiled pieces
        with torch.compiler.set_stance(stance):
            metric_state, out = evaluate(state, metric_state, batch)
            inference = infer(inference, batch)
        outs.append(out)
    return outs, metric_state, inference.task_state


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "aot_eager"])
def test_eval_and_inference_steps_with_repeated_blocks_equal_the_default_ones_and_trace_one_region(compile):
    model = _model(layers=4)
    counter = CompileCounterWithBackend("aot_eager")
    expected = _eval_and_infer(model, compile=_compile(compile))
    got = _eval_and_infer(model, compile=counter if compile else False, repeated_blocks=LAYER)
    # The same forward, op for op: the region is the layer's own forward.
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
    assert float(expected[2]["num_tokens"]) == 3 * 4 * 16  # every batch's tokens were counted
    if compile:  # each step: head (none), the microbatch piece (one traced layer called four times), tail (none)
        assert _region_uses(counter) == [[], [4], [], [], [4], []]


# --- finding the blocks: layer stacks, not a wrapper's tables ------------------------------------------------------


class _LoraLinear(torch.nn.Linear):
    """Shaped like peft's LoRA ``Linear``: the wrapped projection (``base_layer``) and each adapter's ``A`` and ``B``
    in ``ModuleDict``s keyed by the adapter's name (one ``nn.Linear`` each, in every wrapped projection)."""

    def __init__(self, base: torch.nn.Module, in_features: int, out_features: int, rank: int = 2) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(in_features, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, out_features, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_find_repeated_blocks_takes_layer_stacks_not_lora_adapter_tables():
    from d9dfn.step import find_repeated_blocks

    model = Qwen3LM(Qwen3Config.tiny(num_layers=3, tie_word_embeddings=False))
    for layer in model.layers.values():
        attention = layer.self_attn
        for name in ("q_proj", "v_proj"):
            base = getattr(attention, name)
            setattr(attention, name, _LoraLinear(base, base.weight.shape[1], base.weight.shape[0]))
    model.lm_head = _LoraLinear(model.lm_head, *reversed(model.lm_head.weight.shape))  # outside the layers
    # Each adapter table holds one nn.Linear, but there are 14 of them: summed over every ModuleDict, they looked
    # like a stack of layers (issue 43: peft's Qwen3 gave (Qwen3DecoderLayer, Linear)).
    assert find_repeated_blocks(model) == LAYER
    # A stack keyed by index is still one, in a ModuleDict (Qwen3LM's) as in a ModuleList or a Sequential.
    stacks = torch.nn.ModuleDict({"blocks": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))})
    assert find_repeated_blocks(stacks) == (torch.nn.Linear,)
    named = torch.nn.ModuleDict({"up": torch.nn.Linear(2, 2), "down": torch.nn.Linear(2, 2)})
    assert find_repeated_blocks(named) == ()


@pytest.mark.slow
# peft 0.21 calls transformers 5's deprecated alias when it wraps the model: theirs, nothing d9dfn calls.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_model_finds_only_the_decoder_layer_and_compiles_per_block():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from d9dfn.step import find_repeated_blocks

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(config)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    layer = type(base.model.layers[0])
    assert find_repeated_blocks(model) == (layer,)
    opt = optim.adamw(1e-3)
    batch = _batches(1)[0]
    losses = []
    for compile in (False, "aot_eager"):  # the default "auto" blocks, eager and compiled
        step = make_train_step(model, CausalLMTask(), opt, repeated_blocks="auto", compile=compile)
        state = init_train_state(model, opt)
        # peft's frozen base stays in params, named frozen (docs/design/layout.md "Frozen params are params")
        trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        assert sorted(d9dfn.step.trainable_params(state)) == trained
        assert sorted(state.frozen) == sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        assert sorted(state.params) == sorted(n for n, _ in model.named_parameters())
        _, out = step(state, batch)
        losses.append(out.loss)
    assert torch.isfinite(losses[0])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
