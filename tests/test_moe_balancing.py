"""Block-owned state in the train state, and what qwen3_moe does with it: the auxiliary-loss-free balancing bias
(``load_balance_bias_rate``: a buffer the step carries, updated after the optimizer from the step's expert counts)
and the capacity factor (``capacity_factor``: copies over an expert's capacity dropped, static shapes)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import d9dfn.optim as optim
from d9dfn import StateUpdate, init_train_state, make_train_step, parallel, tree_map
from d9dfn.models.qwen3_moe import (
    Qwen3MoeConfig,
    Qwen3MoeDecoderLayer,
    Qwen3MoeLM,
    SparseMoeBlock,
    balance_bias,
    drop_over_capacity,
    expert_capacity,
    route,
    router_load,
)
from d9dfn.models.qwen3_moe import _model as moe_model
from d9dfn.models.qwen3_moe._moe import experts
from d9dfn.step import ActivationCheckpointing, find_repeated_blocks
from d9dfn.tasks import CausalLMTask

BIAS = "layers.0.mlp.expert_bias"


def _model(**fields) -> Qwen3MoeLM:
    torch.manual_seed(0)
    return Qwen3MoeLM(Qwen3MoeConfig.tiny(vocab_size=64, num_layers=4, **fields))


def _batches(n: int, rows: int = 4) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tokens = torch.randint(0, 64, (rows, 9), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def _run(model, batches, state=None, *, compile=False, opt=None, **step_options):
    opt = optim.adamw(3e-3) if opt is None else opt
    task = CausalLMTask(num_experts=4)
    state = init_train_state(model, opt, task=task) if state is None else state
    step = make_train_step(model, task, opt, compile=compile, **step_options)
    outs = []
    for index, batch in enumerate(batches):
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):  # the bias changes: no recompile
            state, out = step(state, batch)
        outs.append(out)
    return state, outs


def _bits(tree):
    return tree_map(lambda t: t.clone(), tree)


# --- the pure functions --------------------------------------------------------------------------------------------


def test_route_with_a_bias_chooses_by_the_biased_scores_and_weights_by_the_plain_ones():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    plain = route(logits, 2, normalize=False)
    biased = route(logits, 2, normalize=False, bias=torch.tensor([-5.0, 0.0, 0.0, 5.0]))
    assert plain.experts.tolist() == [[0, 1], [1, 2]]
    assert biased.experts.tolist() == [[3, 1], [3, 1]]
    scores = logits.softmax(-1)
    torch.testing.assert_close(biased.weights, scores.gather(-1, biased.experts), rtol=0, atol=0)
    zero = route(logits, 2, normalize=True, bias=torch.zeros(4))  # a zero bias: bitwise the plain routing
    for a, b in zip(zero, route(logits, 2, normalize=True), strict=True):
        assert torch.equal(a, b)


def test_route_bias_gets_no_gradient_and_the_router_keeps_its_own():
    logits = torch.randn(6, 4, requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    route(logits, 2, bias=bias).weights.sum().backward()
    assert bias.grad is None
    assert logits.grad is not None
    assert logits.grad.abs().sum() > 0


@settings(max_examples=50, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=2, max_size=8), rate=st.sampled_from([1e-3, 0.1, 1.0]))
def test_balance_bias_moves_each_expert_toward_the_mean_load_and_keeps_the_bias_mean(counts, rate):
    load = torch.tensor(counts, dtype=torch.float32)
    bias = torch.linspace(-1, 1, len(counts))
    moved = balance_bias(bias, load, rate) - bias
    over, under = load > load.mean(), load < load.mean()
    if over.any() and under.any():  # every busier-than-mean expert moves down relative to every idler one
        assert float(moved[over].max()) < float(moved[under].min())
    torch.testing.assert_close(moved.mean(), torch.tensor(0.0), rtol=0, atol=1e-6)  # the delta's mean taken off
    assert float(moved.abs().max()) <= 2 * rate + 1e-6


def test_a_skewed_router_is_balanced_by_the_bias_alone():
    # Fixed skewed logits (expert 0 favoured by 2 for every token): route, count, update, as the step does.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 8, generator=gen) + torch.tensor([2.0, 1.0, 0, 0, 0, 0, 0, -1.0])
    bias, imbalances = torch.zeros(8), []
    for _ in range(200):
        counts = router_load(route(logits, 2, bias=bias), 8).counts
        imbalances.append(float(counts.max() / counts.mean()))
        bias = balance_bias(bias, counts, 0.01)
    assert imbalances[0] > 2.5
    assert max(imbalances[-20:]) < 1.3  # near balance, and it stays there


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 12),
    num_experts=st.integers(1, 6),
    data=st.data(),
)
def test_drop_over_capacity_keeps_at_most_capacity_copies_per_expert_first_choices_first(tokens, num_experts, data):
    top_k = data.draw(st.integers(1, num_experts))
    capacity = data.draw(st.integers(1, tokens * top_k))
    skew = data.draw(st.booleans())
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(tokens * 31 + num_experts))
    if skew:
        logits[:, 0] += 10.0  # every token's first choice: expert 0
    routing = route(logits, top_k)
    kept, dropped = drop_over_capacity(routing, num_experts, capacity)
    assert kept.weights.shape == routing.weights.shape
    assert kept.experts is routing.experts
    counts = router_load(routing, num_experts).counts
    torch.testing.assert_close(dropped, (counts - capacity).clamp(min=0), rtol=0, atol=0)
    live = kept.weights != 0
    per_expert = torch.zeros(num_experts).index_add_(0, routing.experts[live], torch.ones(int(live.sum())))
    assert torch.all(per_expert == torch.minimum(counts, torch.tensor(float(capacity))))
    # Priority: a second choice is dropped only where no first choice of that expert was.
    for expert in range(num_experts):
        first = (routing.experts[:, 0] == expert) & ~live[:, 0]
        later = (routing.experts[:, 1:] == expert) & live[:, 1:]
        assert not (first.any() and later.any())
    # In token order within a slot: a dropped first choice comes after every kept one of its expert.
    for expert in range(num_experts):
        rows = (routing.experts[:, 0] == expert).nonzero().flatten().tolist()
        flags = [bool(live[r, 0]) for r in rows]
        assert flags == sorted(flags, reverse=True)


def test_expert_capacity_is_static_and_at_least_one():
    assert expert_capacity(16, 2, 4, 1.0) == 8
    assert expert_capacity(16, 2, 4, 1.1) == 9  # ceil
    assert expert_capacity(1, 1, 64, 0.01) == 1


def test_drop_over_capacity_compiles_without_a_graph_break():
    routing = route(torch.randn(10, 4), 2)
    compiled = torch.compile(drop_over_capacity, fullgraph=True, backend="aot_eager")  # no host sync, no break
    for a, b in zip(compiled(routing, 4, 3), drop_over_capacity(routing, 4, 3), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- the block and the model ---------------------------------------------------------------------------------------


def test_capacity_drops_give_a_zero_expert_output_and_the_count_of_drops():
    torch.manual_seed(0)
    config = Qwen3MoeConfig.tiny(capacity_factor=0.25, num_experts_per_tok=1)  # 12 tokens, 4 experts: capacity 1
    block = SparseMoeBlock(config)
    block.reset_parameters()
    x = torch.randn(2, 6, 16)
    out, load = block(x)
    assert out.shape == x.shape
    assert load.dropped is not None
    assert load.dropped.shape == (4,)
    assert float(load.dropped.sum()) == float((load.counts - 1).clamp(min=0).sum())
    served = out.reshape(12, 16).abs().sum(-1) != 0
    assert int(served.sum()) == int((load.counts > 0).sum())  # one token per expert that got any: the rest zero
    roomy = SparseMoeBlock(dataclasses.replace(config, capacity_factor=100.0))  # nothing dropped
    dropless = SparseMoeBlock(dataclasses.replace(config, capacity_factor=None))
    for other in (roomy, dropless):
        other.load_state_dict(block.state_dict())
    (kept, roomy_load), (reference, dropless_load) = roomy(x), dropless(x)
    assert float(roomy_load.dropped.sum()) == 0
    assert dropless_load.dropped is None
    assert torch.equal(kept, reference)  # a capacity nobody reaches: bitwise the dropless block


def test_the_model_reports_the_drops_per_layer_and_the_task_logs_their_share():
    model = _model(capacity_factor=0.5)
    out = model(torch.randint(0, 64, (2, 8)))
    assert out["expert_dropped"].shape == (4, 4)  # (MoE layers, E)
    capacity = expert_capacity(16, 2, 4, 0.5)
    torch.testing.assert_close(out["expert_dropped"], (out["expert_counts"] - capacity).clamp(min=0), rtol=0, atol=0)
    assert "expert_dropped" not in _model()(torch.randint(0, 64, (2, 8)))
    _, outs = _run(_model(capacity_factor=0.5), _batches(1))
    assert 0 < float(outs[0].logs["dropped_fraction"]) < 1


def test_bias_is_a_buffer_only_when_the_rate_is_set_and_the_block_is_still_found_repeated():
    assert not dict(_model().named_buffers())
    model = _model(load_balance_bias_rate=0.01)
    assert sorted(dict(model.named_buffers())) == [f"layers.{i}.mlp.expert_bias" for i in range(4)]
    assert Qwen3MoeDecoderLayer in find_repeated_blocks(model)  # a read-only buffer: still one region per class
    assert _model().state_update() is None
    assert isinstance(model.state_update(), StateUpdate)


def test_bad_rates_and_capacity_factors_are_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"load_balance_bias_rate=-0.1 must be a finite number >= 0; pass e.g."):
        Qwen3MoeConfig.tiny(load_balance_bias_rate=-0.1)
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be a finite number > 0; pass e.g. 1.25, or None"):
        Qwen3MoeConfig.tiny(capacity_factor=0)


def test_a_model_with_a_bias_or_a_capacity_has_no_hugging_face_export():
    from d9dfn.models import to_hf_config

    for field, value in (("load_balance_bias_rate", 0.01), ("capacity_factor", 1.25)):
        with pytest.raises(ValueError, match=rf"the model has {field}={value}, which Qwen3MoeForCausalLM does not"):
            to_hf_config(Qwen3MoeConfig.tiny(**{field: value}), family="qwen3_moe")


# --- in the train step ---------------------------------------------------------------------------------------------


def test_the_step_moves_the_bias_toward_balance_and_the_imbalance_falls():
    """A skewed router (every token's hidden state shares a component that favours expert 0) and a frozen model
    (lr 0): only the bias moves, and every MoE layer's load imbalance (busiest expert over the mean) falls."""
    model = _model(load_balance_bias_rate=0.02)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] += 0.05
        for layer in model.layers.values():
            layer.mlp.gate.weight.copy_(torch.randn(4, 16, generator=gen))
            layer.mlp.gate.weight[:, 0] += torch.tensor([3.0, 1.0, 0.0, -1.0])
    batch = _batches(1, rows=8)[0]

    def imbalance(state) -> torch.Tensor:  # (MoE layers,) on the batch, with the state's bias
        out = torch.func.functional_call(model, {**state.params, **state.buffers}, (batch["input_ids"],))
        return out["expert_counts"].amax(-1) / out["expert_counts"].mean(-1)

    before = imbalance(init_train_state(model, optim.sgd(0.0)))
    state, outs = _run(model, [batch] * 30, opt=optim.sgd(0.0))
    after = imbalance(state)
    assert float(before.mean()) > 1.6  # skewed
    assert float(after.mean()) < 0.9 * float(before.mean()), (before, after)
    assert bool((after < before).all()), (before, after)
    assert float(outs[-1].logs["load_imbalance"]) < float(outs[0].logs["load_imbalance"])
    assert all(torch.equal(state.params[n], p) for n, p in init_train_state(model, optim.sgd(0.0)).params.items())


def test_rate_zero_is_the_dropless_unbiased_step_and_a_zero_bias_changes_nothing_at_the_first_step():
    batches = _batches(2)
    off, off_outs = _run(_model(), batches)
    assert not off.buffers
    _, on_outs = _run(_model(load_balance_bias_rate=0.05), batches)
    # Step 1 routes with a zero bias: the same loss, the same gradients, the same params after it.
    assert torch.equal(on_outs[0].loss, off_outs[0].loss)
    assert torch.equal(on_outs[0].grad_norm, off_outs[0].grad_norm)
    first_on, _ = _run(_model(load_balance_bias_rate=0.05), batches[:1])
    first_off, _ = _run(_model(), batches[:1])
    assert all(torch.equal(first_on.params[n], first_off.params[n]) for n in first_off.params)
    assert any(float(b.abs().sum()) > 0 for b in first_on.buffers.values())  # and the bias moved after it
    assert not torch.equal(on_outs[1].loss, off_outs[1].loss)  # which step 2's routing sees


def test_resume_from_a_checkpoint_continues_bitwise_with_the_bias(tmp_path):
    from d9dfn.checkpoint import CheckpointStore

    batches = _batches(4)
    straight, straight_outs = _run(_model(load_balance_bias_rate=0.05), batches)
    half, _ = _run(_model(load_balance_bias_rate=0.05), batches[:2])
    with CheckpointStore(tmp_path / "ckpt", keep=None) as store:
        store.save(2, half, {})
        template = init_train_state(
            _model(load_balance_bias_rate=0.05), optim.adamw(3e-3), task=CausalLMTask(num_experts=4)
        )
        restored, _ = store.restore(2, like=template)
    assert all(torch.equal(restored.buffers[name], b) for name, b in half.buffers.items())
    assert any(float(b.abs().sum()) > 0 for b in half.buffers.values())  # the bias the checkpoint holds is not zero
    resumed, resumed_outs = _run(_model(load_balance_bias_rate=0.05), batches[2:], state=restored)
    for name in straight.buffers:
        assert torch.equal(resumed.buffers[name], straight.buffers[name]), name
    for name in straight.params:
        assert torch.equal(resumed.params[name], straight.params[name]), name
    assert [float(o.loss) for o in resumed_outs] == [float(o.loss) for o in straight_outs[2:]]


def test_counts_are_summed_over_microbatches_and_not_double_counted_under_activation_checkpointing():
    batches = _batches(3)
    blocks = {"repeated_blocks": (Qwen3MoeDecoderLayer,)}
    one, _ = _run(_model(load_balance_bias_rate=0.05), batches, num_microbatches=1)
    two, _ = _run(_model(load_balance_bias_rate=0.05), batches, num_microbatches=2)
    recomputed, _ = _run(
        _model(load_balance_bias_rate=0.05),
        batches,
        num_microbatches=2,
        activation_checkpointing=ActivationCheckpointing(),
        **blocks,
    )
    plain, _ = _run(_model(load_balance_bias_rate=0.05), batches, num_microbatches=2, **blocks)
    # The bias is a sign of integer counts: equal whatever the split, exactly, and the recompute adds no count.
    for name in one.buffers:
        assert torch.equal(two.buffers[name], one.buffers[name]), name
        assert torch.equal(recomputed.buffers[name], plain.buffers[name]), name
    assert torch.equal(recomputed.metric_state["experts"], plain.metric_state["experts"])
    assert float(plain.metric_state["experts"].sum()) == 3 * 4 * 8 * 2 * 4  # steps x rows x tokens x top-2 x layers


@pytest.mark.slow  # aot_eager compiles of the step: ~10 s on 2 shared cores
def test_the_moe_layer_with_its_bias_is_one_region_and_the_step_does_not_recompile():
    from test_blocks import _region_uses
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    batches = _batches(3)
    state, _ = _run(
        _model(load_balance_bias_rate=0.05), batches, compile=counter, repeated_blocks=(Qwen3MoeDecoderLayer,)
    )
    assert _region_uses(counter)[:2] == [[], [4]]  # the head: none; the forward: one traced MoE layer, four calls
    eager, _ = _run(_model(load_balance_bias_rate=0.05), batches, repeated_blocks=(Qwen3MoeDecoderLayer,))
    # Compiled fp32 runs the dense expert path, eager the reference one: the same choices, so the same bias.
    for name in eager.buffers:
        assert torch.equal(state.buffers[name], eager.buffers[name]), name
    assert float(state.buffers[BIAS].abs().sum()) > 0


def test_a_state_update_without_its_shapes_under_pipeline_ranks_is_refused_by_name():
    from d9dfn.pipeline import Pipeline, PipelineRank
    from d9dfn.step._train import model_state_update

    ranks, one = PipelineRank.__new__(PipelineRank), Pipeline.__new__(Pipeline)  # the check reads the kind only
    model = _model(load_balance_bias_rate=0.05)
    update = model_state_update("make_train_step", model, ranks)  # the MoE model's carries its outputs' shapes
    assert update is not None
    assert update.shapes == {"expert_counts": (len(model.config.moe_layers()), model.config.num_experts)}
    model.state_update = lambda: update._replace(shapes=None)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"its outputs \['expert_counts'\] \(state_update\(\)\) without their shapes"):
        model_state_update("make_train_step", model, ranks)
    assert model_state_update("make_train_step", model, one) is not None  # one process runs every stage: no sums cross
    assert model_state_update("make_train_step", _model(), ranks) is None


# --- simulated data parallelism ------------------------------------------------------------------------------------


def test_two_simulated_data_parallel_ranks_hold_the_bias_of_one_process(monkeypatch):
    """Each rank routes its own half of the batch; the counts are summed over the ranks before the update, so both
    ranks hold one bias, bitwise the one a single process computes on the whole batch."""
    import torch.distributed as dist
    from test_parallel_properties import _agreed, _forget_meshes
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn.loop import init_data_parallel_mesh

    # The reference path finds each expert's tokens with a host sync, which differs per simulated rank: dense.
    monkeypatch.setattr(moe_model, "experts", functools.partial(experts, path="dense"))
    batches = _batches(2, rows=4)
    single, _ = _run(_model(load_balance_bias_rate=0.05), batches, opt=optim.sgd(0.5))
    task = CausalLMTask(num_experts=4)
    model = _model(load_balance_bias_rate=0.05)
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_data_parallel_mesh(2, 1, device_type="cpu")
        plan = parallel.plan_for(model, mesh)
        assert plan.buffers[BIAS] == ("R", "R")  # replicated: one plain tensor a rank
        assert not plan.split_buffers()
        step = make_train_step(model, task, optim.sgd(0.5), plan=plan, compile=False)
        with LocalTensorMode(2) as mode:
            state = init_train_state(model, optim.sgd(0.5), task=task, mesh=mesh)
            local_counts = []
            for batch in batches:
                local = {k: mode.rank_map(lambda rank, v=v: v[rank * 2 : rank * 2 + 2]) for k, v in batch.items()}
                local_counts.append(model_counts(model, state, local))
                state, _ = step(state, local)
            biases = {name: _agreed(b) for name, b in state.buffers.items()}  # every rank the same, bitwise
    finally:
        dist.destroy_process_group()
        _forget_meshes()
    assert any(not torch.equal(c._local_tensors[0], c._local_tensors[1]) for c in local_counts)  # the ranks differ
    for name, bias in biases.items():
        assert torch.equal(bias, single.buffers[name]), name


def model_counts(model, state, batch):
    """This rank's expert counts of layer 0 for ``batch`` (the step's routing before its update)."""
    params = {name: p.full_tensor() for name, p in state.params.items()}
    out = torch.func.functional_call(model, {**params, **state.buffers}, (batch["input_ids"],))
    return out["expert_counts"][0]


# --- the job's settings --------------------------------------------------------------------------------------------


def test_the_job_settings_reach_the_model_and_bad_ones_are_one_line_naming_the_set_path(tmp_path):
    from _jobs import tiny_job

    from d9dfn.config import ConfigError

    moe = ("model.family=qwen3_moe", "model.num_layers=2")
    config = tiny_job(tmp_path, *moe, "model.moe.load_balance_bias_rate=0.001", "model.moe.capacity_factor=1.25")
    model_config = config.model.to_qwen3(16)
    assert (model_config.load_balance_bias_rate, model_config.capacity_factor) == (0.001, 1.25)
    assert Qwen3MoeLM(model_config).state_update() is not None
    defaults = tiny_job(tmp_path, *moe).model.to_qwen3(16)
    assert (defaults.load_balance_bias_rate, defaults.capacity_factor) == (0.0, None)
    for setting, message in (
        (
            "model.moe.load_balance_bias_rate=-1",
            r"model.moe.load_balance_bias_rate=-1: Input should be greater than or",
        ),
        ("model.moe.capacity_factor=0", r"model.moe.capacity_factor=0: Input should be greater than 0; fix it in the"),
    ):
        with pytest.raises(ConfigError, match=message) as raised:
            tiny_job(tmp_path, *moe, setting)
        assert "\n" not in str(raised.value)


def test_the_plan_replicates_buffers_and_the_step_refuses_one_a_rule_splits():
    from d9dfn.parallel import MeshAxes, make_plan
    from d9dfn.step._options import check_state

    model = _model(load_balance_bias_rate=0.05)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    axes = MeshAxes.of(data_replicate=2, data_shard=2)
    plain = make_plan(params, axes, buffers=buffers)
    assert plain.buffers[BIAS] == ("R", "R")  # never sharded for storage, unlike a param
    assert plain.to_json()["buffers"][BIAS] == ["R", "R"]
    assert "buffers" not in make_plan(params, axes).to_json()  # a model without buffers: the golden files unchanged
    dims = dict.fromkeys(buffers, ("experts",))
    split = make_plan(params, axes, buffers=buffers, dims=dims, rules=(("experts", ("data_shard",)),))
    assert split.buffers[BIAS] == ("R", "S(0)")
    check_state("make_train_step", {}, plain)
    with pytest.raises(ValueError, match=r"the plan splits buffer 'layers.0.mlp.expert_bias' as \('R', 'S\(0\)'\)"):
        check_state("make_train_step", {}, split)
