"""The qwen3_moe family (``d9dfn/models/qwen3_moe/``): routing, the two expert paths, the auxiliary loss, the model
against transformers' ``Qwen3MoeForCausalLM`` in both expert layouts, and the catalogue entry."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d9dfn.models import FAMILIES, check_hf_config, from_hf_config, logical_dims, to_hf_config
from d9dfn.models.qwen3_moe import (
    GROUPED_BF16_TOLERANCE,
    Qwen3MoeConfig,
    Qwen3MoeDecoderLayer,
    Qwen3MoeLM,
    RouterLoad,
    experts,
    experts_dense,
    experts_grouped,
    experts_reference,
    from_hf_state,
    load_balancing_loss,
    route,
    router_load,
    to_hf_state,
)
from d9dfn.step import find_repeated_blocks

transformers = pytest.importorskip("transformers")


def _transformers_experts(x, routing, gate_up, down):
    """transformers' own ``Qwen3MoeExperts`` with these weights."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(
        hidden_size=gate_up.shape[2], moe_intermediate_size=down.shape[2], num_experts=gate_up.shape[0]
    )
    module = Qwen3MoeExperts(config).to(x.dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
        return module(x, routing.experts, routing.weights.to(x.dtype))


def _weights(num_experts=4, hidden=16, inter=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.3
    return gate_up.to(dtype), down.to(dtype)


# --- routing and the auxiliary loss --------------------------------------------------------------------------------


def test_route_softmax_top_k_renormalized_and_sigmoid_scoring():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    plain = route(logits, 2)
    probs = torch.softmax(logits, -1)
    assert plain.experts.tolist() == [[2, 1]]
    torch.testing.assert_close(plain.weights, probs[:, [2, 1]])
    normed = route(logits, 2, normalize=True)
    torch.testing.assert_close(normed.weights.sum(-1), torch.ones(1))
    sig = route(logits, 2, scoring="sigmoid")
    torch.testing.assert_close(sig.weights, logits.sigmoid()[:, [2, 1]])
    torch.testing.assert_close(sig.probs.sum(-1), torch.ones(1))
    assert route(logits.bfloat16(), 2).weights.dtype == torch.float32  # scored in fp32


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 12), num_experts=st.integers(1, 6), data=st.data())
def test_router_load_counts_every_copy_once(tokens, num_experts, data):
    top_k = data.draw(st.integers(1, num_experts))
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(tokens))
    load = router_load(route(logits, top_k), num_experts)
    assert load.counts.sum() == tokens * top_k
    assert torch.equal(
        load.counts, torch.bincount(route(logits, top_k).experts.flatten(), minlength=num_experts).float()
    )
    torch.testing.assert_close(load.prob_sums.sum(), torch.tensor(float(tokens)))


def test_load_balancing_loss_is_transformers_definition_pooled_over_layers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(10, 4, generator=g) for _ in range(3)]
    ours = load_balancing_loss(
        sum((router_load(route(lg, 2), 4) for lg in layers[1:]), router_load(route(layers[0], 2), 4))
    )
    theirs = load_balancing_loss_func(tuple(layers), 4, 2)
    torch.testing.assert_close(ours, theirs)
    uniform = RouterLoad(torch.full((4,), 5.0), torch.full((4,), 2.5), torch.tensor(10.0))
    torch.testing.assert_close(load_balancing_loss(uniform), torch.tensor(2.0))  # top_k when balanced


# --- the two expert paths ------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 24), top_k=st.integers(1, 4), skew=st.booleans())
def test_reference_path_equals_transformers_experts_bitwise_and_dense_is_close_in_fp32(tokens, top_k, skew):
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, 16, generator=g)
    logits = torch.randn(tokens, 4, generator=g)
    if skew:  # every token to expert 0 first: experts that get no tokens, one that gets all
        logits[:, 0] += 100.0
    routing = route(logits, top_k, normalize=True)
    gate_up, down = _weights()
    reference = experts_reference(x, routing, gate_up, down)
    assert torch.equal(reference, _transformers_experts(x, routing, gate_up, down))
    torch.testing.assert_close(experts_dense(x, routing, gate_up, down), reference, atol=1e-6, rtol=1e-6)


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 24), top_k=st.integers(1, 4), skew=st.booleans())
def test_grouped_path_equals_reference_in_bf16_within_the_stated_tolerance(tokens, top_k, skew):
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, 16, generator=g).bfloat16()
    logits = torch.randn(tokens, 4, generator=g)
    if skew:
        logits[:, 0] += 100.0
    routing = route(logits, top_k)
    gate_up, down = _weights(dtype=torch.bfloat16)
    grouped, reference = experts_grouped(x, routing, gate_up, down), experts_reference(x, routing, gate_up, down)
    torch.testing.assert_close(grouped, reference, **GROUPED_BF16_TOLERANCE)
    # and the tolerance is tight enough to catch a wrong routing weight
    wrong = routing._replace(weights=routing.weights.flip(-1))
    if top_k > 1 and not torch.equal(routing.weights, routing.weights.flip(-1)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(experts_grouped(x, wrong, gate_up, down), reference, **GROUPED_BF16_TOLERANCE)


def test_grouped_path_gradients_match_reference_in_bf16():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=g).bfloat16()
    routing = route(torch.randn(9, 4, generator=g), 2)
    grads = []
    for fn in (experts_grouped, experts_reference):
        gate_up, down = (w.clone().requires_grad_() for w in _weights(dtype=torch.bfloat16))
        fn(x, routing, gate_up, down).float().square().sum().backward()
        grads.append((gate_up.grad, down.grad))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=0.1, rtol=3e-2)


def test_experts_picks_grouped_for_bf16_dense_when_compiling_and_reference_in_eager_fp32(monkeypatch):
    import d9dfn.models.qwen3_moe._moe as moe

    called = []
    for name in ("grouped", "dense", "reference"):
        monkeypatch.setattr(moe, f"experts_{name}", lambda *a, name=name: called.append(name) or a[0])
    routing = route(torch.randn(3, 4), 2)
    for dtype in (torch.bfloat16, torch.float32):
        gate_up, down = _weights(dtype=dtype)
        moe.experts(torch.randn(3, 16, dtype=dtype), routing, gate_up, down)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    moe.experts(torch.randn(3, 16), routing, *_weights())
    gate_up, down = _weights(hidden=12, dtype=torch.bfloat16)  # a width grouped_mm refuses: not grouped
    moe.experts(torch.randn(3, 12, dtype=torch.bfloat16), routing, gate_up, down)
    assert called == ["grouped", "reference", "dense", "dense"]


@pytest.mark.compiled
def test_grouped_path_compiles_without_graph_breaks_in_bf16():
    torch._dynamo.reset()
    x = torch.randn(10, 16).bfloat16()
    routing = route(torch.randn(10, 4), 2)
    gate_up, down = _weights(dtype=torch.bfloat16)
    compiled = torch.compile(experts_grouped, fullgraph=True)  # fullgraph: a host sync would break the graph
    # inductor fuses silu(gate) * up in fp32 (eager rounds it to bf16 between): equal within the stated tolerance
    eager = experts_grouped(x, routing, gate_up, down)
    torch.testing.assert_close(compiled(x, routing, gate_up, down), eager, **GROUPED_BF16_TOLERANCE)
    dense = torch.compile(experts, fullgraph=True)  # fp32 under compile: the dense path, no graph break either
    x32, (gate_up32, down32) = x.float(), _weights()
    torch.testing.assert_close(
        dense(x32, routing, gate_up32, down32), experts_reference(x32, routing, gate_up32, down32)
    )


# --- the model against transformers --------------------------------------------------------------------------------

HF_FIELDS = {
    "vocab_size": 96,
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "rope_theta": 50_000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],  # a dense layer between two MoE layers
}


def _hf_model(experts_implementation="eager", **overrides):
    """A tiny ``Qwen3MoeForCausalLM``; ``eager``: transformers' reference loop over the experts (transformers 5.23
    defaults to its ``grouped_mm`` implementation, another order of rounding)."""
    config = transformers.AutoConfig.for_model("qwen3_moe", **{**HF_FIELDS, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation).eval()
    with torch.no_grad():  # perturb what HF inits to constants, so that a skipped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _ids():
    return torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(5))


def test_transformers_uses_the_fused_expert_layout():
    names = dict(_hf_model().named_parameters())
    assert names["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 16)
    assert names["model.layers.0.mlp.experts.down_proj"].shape == (4, 16, 32)
    assert "model.layers.1.mlp.gate_proj.weight" in names  # mlp_only_layers keeps a dense MLP


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_equal_transformers_bitwise_in_fp32_both_ways(norm_topk_prob):
    hf = _hf_model(norm_topk_prob=norm_topk_prob)
    config = from_hf_config(hf.config.to_dict())
    assert isinstance(config, Qwen3MoeConfig)
    assert config.moe_layers() == (0, 2)
    ours = Qwen3MoeLM(config).eval()
    ours.load_state_dict(from_hf_state(hf.state_dict(), config))
    ids = _ids()
    with torch.no_grad():
        theirs_out = hf(input_ids=ids, output_router_logits=True)
        ours_out = ours(ids)
    assert torch.equal(ours_out["logits"], theirs_out.logits)  # bitwise: fp32 on the CPU, the reference path
    default = _hf_model(experts_implementation=None, norm_topk_prob=norm_topk_prob)  # transformers' grouped_mm
    with torch.no_grad():
        torch.testing.assert_close(ours_out["logits"], default(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_out["aux_loss"], theirs_out.aux_loss, rtol=1e-6, atol=0)
    # back: our weights (trained elsewhere) into a fresh transformers model
    torch.manual_seed(1)
    fresh = Qwen3MoeLM(config).eval()
    back = _hf_model(norm_topk_prob=norm_topk_prob)
    back.load_state_dict(to_hf_state(fresh.state_dict(), config), strict=True)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, fresh(ids)["logits"])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_every_gradient_equals_transformers_with_the_weighted_aux_loss(norm_topk_prob):
    # The step trains on these gradients: the router's come from both the cross-entropy (through the renormalized
    # top-k weights) and the pooled auxiliary loss. A routing collapse in training (the MoE example's worst layer puts
    # every token on one expert) is then the dynamics transformers has too, not a wrong gradient.
    hf = _hf_model(norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.5)
    config = from_hf_config(hf.config.to_dict())
    ours = Qwen3MoeLM(config)
    ours.load_state_dict(from_hf_state(hf.state_dict(), config))
    ids = _ids()
    theirs = hf(input_ids=ids, labels=ids, output_router_logits=True).loss
    theirs.backward()
    out = ours(ids)
    logits = out["logits"][:, :-1].reshape(-1, out["logits"].shape[-1])
    loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1)) + 0.5 * out["aux_loss"]
    loss.backward()
    torch.testing.assert_close(loss, theirs, rtol=1e-6, atol=0)
    grads = to_hf_state({name: p.grad for name, p in ours.named_parameters()}, config)
    assert set(grads) == {name for name, _ in hf.named_parameters()}
    for name, p in hf.named_parameters():  # measured: at most 6.3e-7 of the largest element, routers 1.8e-7
        scale = p.grad.abs().max()
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=float(2e-6 * scale), msg=name)


def test_per_expert_layout_round_trips_through_the_mapping_to_the_same_logits():
    hf = _hf_model()
    config = from_hf_config(hf.config.to_dict())
    v4 = to_hf_state(from_hf_state(hf.state_dict(), config), config, layout="per_expert")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in v4
    assert "model.layers.0.mlp.experts.gate_up_proj" not in v4
    assert v4["model.layers.0.mlp.experts.2.gate_proj.weight"].shape == (32, 16)
    ours = Qwen3MoeLM(config).eval()
    ours.load_state_dict(from_hf_state(v4, config))  # a transformers 4 folder's names
    with torch.no_grad():
        assert torch.equal(ours(_ids())["logits"], hf(input_ids=_ids()).logits)
    # each per-expert triple is a transformers Qwen3MoeMLP (the module transformers 4 held per expert): expert 3
    # alone, weight 1, equals that module with the triple's weights
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    mlp = Qwen3MoeMLP(hf.config, intermediate_size=32)
    prefix = "model.layers.0.mlp.experts.3."
    mlp.load_state_dict({name.removeprefix(prefix): t for name, t in v4.items() if name.startswith(prefix)})
    x = torch.randn(5, 16)
    one = route(torch.zeros(5, 4).index_fill(1, torch.tensor([3]), 9.0), 1, normalize=True)
    layer = ours.layers["0"].mlp.experts
    with torch.no_grad():
        assert torch.equal(experts_reference(x, one, layer.gate_up_proj, layer.down_proj), mlp(x))
    del v4["model.layers.2.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts holds up_proj weights of experts \[0, 2, 3\]"):
        from_hf_state(v4, config)


def test_bf16_grouped_path_is_close_to_transformers():
    hf = _hf_model()
    config = from_hf_config(hf.config.to_dict())
    ours = Qwen3MoeLM(config).eval()
    ours.load_state_dict(from_hf_state(hf.state_dict(), config))
    with torch.no_grad():
        theirs = hf(input_ids=_ids()).logits
        got = ours.to(torch.bfloat16)(_ids())["logits"].float()
    assert (got - theirs).abs().max() < 0.1, (got - theirs).abs().max()


def test_config_json_round_trips_and_refuses_what_transformers_lacks():
    config = Qwen3MoeConfig.tiny(tie_word_embeddings=False, mlp_only_layers=(1,), norm_topk_prob=False)
    hf = to_hf_config(config)
    assert (hf["model_type"], hf["num_experts"], hf["mlp_only_layers"]) == ("qwen3_moe", 4, [1])
    assert from_hf_config(hf) == config
    check_hf_config(config, json.loads(json.dumps(hf)))
    v5 = {**hf, "num_local_experts": 4}  # transformers 5 writes num_local_experts
    del v5["num_experts"]
    assert from_hf_config(v5).num_experts == 4
    with pytest.raises(ValueError, match="num_experts_per_tok is 2 there but 1 here"):
        check_hf_config(Qwen3MoeConfig.tiny(tie_word_embeddings=False, num_experts_per_tok=1), hf)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=8, which Qwen3MoeForCausalLM does not"):
        to_hf_config(Qwen3MoeConfig.tiny(shared_expert_intermediate_size=8))
    with pytest.raises(ValueError, match="family='qwen3' builds a Qwen3Config, the model is a Qwen3MoeConfig"):
        to_hf_config(config, "qwen3")
    dense = FAMILIES["qwen3"].config(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8)
    assert to_hf_config(dense)["model_type"] == "qwen3"  # a dense model never exports as qwen3_moe


def test_hf_defaults_are_transformers_defaults():
    theirs = transformers.Qwen3MoeConfig().to_dict()
    theirs["num_experts"] = theirs.get("num_experts", theirs.get("num_local_experts"))
    for name, value in FAMILIES["qwen3_moe"].hf.defaults.items():
        if name in ("rope_theta", "max_window_layers"):
            continue
        assert theirs[name] == value, name
    assert theirs["rope_parameters"]["rope_theta"] == FAMILIES["qwen3_moe"].hf.defaults["rope_theta"]


# --- the model's own behaviour -------------------------------------------------------------------------------------


def test_shared_expert_and_sparse_step_build_the_layers_hf_would():
    config = Qwen3MoeConfig.tiny(num_layers=4, decoder_sparse_step=2, shared_expert_intermediate_size=8)
    model = Qwen3MoeLM(config)
    assert config.moe_layers() == (1, 3)
    assert [type(model.layers[str(i)]).__name__ for i in range(4)] == [
        "Qwen3DecoderLayer",
        "Qwen3MoeDecoderLayer",
        "Qwen3DecoderLayer",
        "Qwen3MoeDecoderLayer",
    ]
    assert model.layers["1"].mlp.shared_expert_gate.weight.shape == (1, 16)
    out = model(torch.zeros(1, 3, dtype=torch.long))
    assert out["expert_counts"].shape == (2, 4)
    # the gated shared expert contributes: zeroing its down projection changes the logits
    with torch.no_grad():
        model.layers["1"].mlp.shared_expert.down_proj.weight.zero_()
        assert not torch.equal(model(torch.zeros(1, 3, dtype=torch.long))["logits"], out["logits"])


def test_find_repeated_blocks_finds_the_moe_decoder_layer():
    model = Qwen3MoeLM(Qwen3MoeConfig.tiny(num_layers=3))
    assert Qwen3MoeDecoderLayer in find_repeated_blocks(model)
    assert not list(model.buffers())  # no state kept in buffers: the load is returned


def test_aux_loss_has_a_router_gradient_and_counts_none():
    model = Qwen3MoeLM(Qwen3MoeConfig.tiny())
    out = model(torch.randint(0, 256, (2, 7)))
    out["aux_loss"].backward()
    assert model.layers["0"].mlp.gate.weight.grad.abs().sum() > 0
    assert not out["expert_counts"].requires_grad
    assert out["expert_counts"].sum() == 2 * 7 * 2 * 2  # tokens x top_k x MoE layers


def test_plan_covers_every_switch():
    config = Qwen3MoeConfig.tiny(num_layers=3, mlp_only_layers=(1,), shared_expert_intermediate_size=8)
    with torch.device("meta"):
        model = FAMILIES["qwen3_moe"].model(config, None)
    dims = logical_dims(FAMILIES["qwen3_moe"].plan, dict(model.named_parameters()))
    assert dims["layers.0.mlp.experts.gate_up_proj"] == ("experts", "expert_mlp", "embed")
    assert dims["layers.1.mlp.gate_proj.weight"] == ("mlp", "embed")


def test_bad_configs_are_one_line_naming_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok=5 is more than num_experts=4"):
        Qwen3MoeConfig.tiny(num_experts_per_tok=5)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[7\] names \[7\]"):
        Qwen3MoeConfig.tiny(mlp_only_layers=(7,))
    with pytest.raises(ValueError, match="no layer of 2 is an MoE layer"):
        Qwen3MoeLM(Qwen3MoeConfig.tiny(mlp_only_layers=(0, 1)))
    with pytest.raises(ValueError, match="scoring='topk'"):
        Qwen3MoeConfig.tiny(scoring="topk")


def test_experts_reference_path_is_the_default_for_fp32_model():
    x = torch.randn(4, 16)
    routing = route(torch.randn(4, 4), 2)
    gate_up, down = _weights()
    assert torch.equal(experts(x, routing, gate_up, down), experts_reference(x, routing, gate_up, down))


# --- in the step: the MoE decoder layer compiled once, fp32 and bf16 ------------------------------------------------


def _moe_batches(n: int = 3) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def _moe_steps(compile, *, precision=None, steps: int = 3):
    from d9dfn import init_train_state, make_train_step
    from d9dfn import optim as d9dfn_optim
    from d9dfn.tasks import CausalLMTask

    torch.manual_seed(0)
    model = Qwen3MoeLM(Qwen3MoeConfig.tiny(vocab_size=64, num_layers=4))
    opt = d9dfn_optim.adamw(3e-3)
    state = init_train_state(model, opt, task=CausalLMTask(num_experts=4))
    task = CausalLMTask(aux_loss_weight=0.01, num_experts=4)
    step = make_train_step(
        model,
        task,
        opt,
        compile=compile,
        repeated_blocks=(Qwen3MoeDecoderLayer,),
        num_microbatches=2,
        **({"precision": precision} if precision else {}),
    )
    outs = []
    for index, batch in enumerate(_moe_batches(steps)):
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):  # steps 2..N reuse the pieces
            state, out = step(state, batch)
        outs.append(out)
    return state, outs


@pytest.mark.slow  # aot_eager steps, eager steps: ~15 s on 2 shared cores
def test_moe_layer_is_one_region_for_all_its_layers_and_the_step_does_not_recompile():
    from test_blocks import _region_uses
    from torch._dynamo.testing import CompileCounterWithBackend

    from d9dfn.testing import assert_trees_close

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    state, outs = _moe_steps(counter)
    assert _region_uses(counter)[:2] == [[], [4]]  # the head: none; the forward: one traced MoE layer, four calls
    _, eager = _moe_steps(False)
    # compiled fp32 runs the dense expert path, eager the reference one: equal to rounding
    assert_trees_close(outs[0].loss, eager[0].loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(outs[0].grad_norm, eager[0].grad_norm, rtol=1e-5, atol=1e-7)
    assert_trees_close([o.loss for o in outs], [o.loss for o in eager], rtol=1e-4, atol=1e-6)  # Adam amplifies
    counts = state.metric_state["experts"]  # the metric: every token copy of 3 steps, once (not per recompute)
    assert float(counts.sum()) == 3 * 4 * 8 * 2 * 4  # steps x rows x tokens x top-2 x MoE layers
    assert float(outs[-1].loss) != float(outs[0].loss)
    assert outs[0].logs["aux_loss"] > 0


@pytest.mark.slow
def test_moe_step_in_bf16_runs_the_grouped_path_compiled():
    from torch._dynamo.testing import CompileCounterWithBackend

    from d9dfn import Precision

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    _, outs = _moe_steps(counter, precision=Precision(compute_dtype=torch.bfloat16), steps=2)
    targets = {
        node.target
        for graph in counter.graphs
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    }
    assert torch._grouped_mm in targets  # inside the MoE layer's region: the grouped path, compiled
    assert all(torch.isfinite(o.loss) for o in outs)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"num_layers": 3, "mlp_only_layers": (1,), "shared_expert_intermediate_size": 8, "tie_word_embeddings": False},
    ],
)
def test_num_parameters_counts_the_experts_and_flops_count_the_active_ones(fields):
    from d9dfn.models import flops_per_token, num_parameters

    config = Qwen3MoeConfig.tiny(**fields)
    assert num_parameters(config) == sum(p.numel() for p in Qwen3MoeLM(config).parameters())
    top_all = Qwen3MoeConfig.tiny(**{**fields, "num_experts_per_tok": 4})  # every expert active: more FLOPs
    per_expert = 3 * 16 * 32
    moe_layers = len(config.moe_layers())
    assert flops_per_token(top_all, 8) - flops_per_token(config, 8) == 6 * moe_layers * 2 * per_expert
