"""Expert parallelism (issue 41 items 3-4): the expert axis, the plan's expert rule, token dispatch by all-to-all, and
the oracle: the EP step equals the one-process step.

The oracle runs the Qwen3-MoE tiny model (4 experts, top-2, 2 MoE layers) for 3 steps of SGD with momentum (SGD, not
Adam: Adam's normalization would hide a gradient wrong by a constant factor, the pytorch/pytorch#160285 kind) and
records every reduced gradient (a pass-through transform that keeps them in the optimizer state). Each data-parallel
rank feeds its consecutive rows of every global batch. Compared with the eager fp32 step on one process over the
whole batch:

* losses, gradients and params: ``TOL`` (``rtol = atol = 1e-6``): the ranks' sums are added in another order (per
  rank, then across ranks; the expert gradient over the expert group's rows by source rank), so not bitwise; a
  gradient wrong by a factor (2x: pytorch/pytorch#160285) or a lost rank's share moves them by 1e-2 or more. The
  measured max |Δ| per mesh is in the commit's report (about 5e-7 on losses, 3e-8 on params).

Meshes run in one process under ``LocalTensorMode`` (torch's ``fake`` process group, as ``tests/test_parallel_
properties.py``): it runs the static-slot all-to-all of ``d9dfn.parallel.dispatch_experts`` as the exchange between
simulated ranks. Two real gloo ranks (``ranks``) run EP 1 and 2 over replicate and shard once more, and the CLI runs
the LM job under ``torchrun``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _jobs import TINY_DATA, TINY_TRAINER
from _ranks import _init, _run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import d9dfn.optim as optim
from d9dfn import Transform, init_train_state, make_train_step, parallel, prng, tree_map
from d9dfn.cli import main
from d9dfn.config import DeviceMeshParameters
from d9dfn.loop import init_distributed, init_mesh, mesh_axes
from d9dfn.models import FullTune, LoRA, Qwen3MoeConfig, adapter_plan, apply_peft, logical_dims, peft_trainable
from d9dfn.models.qwen3_moe import QWEN3_MOE_PLAN, Qwen3MoeLM, Routing, experts
from d9dfn.parallel import MeshAxes, make_plan
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask
from d9dfn.testing import assert_trees_close

TOL = {"rtol": 1e-6, "atol": 1e-6}
CONFIG = Qwen3MoeConfig.tiny()
ROWS, SEQ, STEPS = 4, 8, 3


# --- the expert axis and the plan ---------------------------------------------------------------------------------


def test_mesh_axes_carve_the_expert_axis_out_of_dp_shard_else_dp_replicate() -> None:
    shard = mesh_axes(DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=4, expert_parallel=2))
    assert (shard.names, shard.sizes, shard.expert_from) == (
        ("dp_replicate", "dp_shard", "ep"),
        (2, 2, 2),
        "data_shard",
    )
    assert shard.storage_shard_axes == ("dp_shard", "ep")
    assert shard.data_parallel_size == 8
    replicate = mesh_axes(DeviceMeshParameters(data_parallel_replicate=4, expert_parallel=2))
    assert (replicate.names, replicate.sizes) == (("dp_replicate", "ep", "dp_shard"), (2, 2, 1))
    assert replicate.expert_from == "data_replicate"
    assert replicate.storage_shard_axes == ("dp_shard",)
    with pytest.raises(ValueError, match=r"^mesh.expert_parallel=4 divides neither .* set --set mesh.expert_parallel"):
        mesh_axes(DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=4))


def test_init_distributed_refuses_an_expert_degree_it_cannot_carve_before_any_process_group() -> None:
    mesh = DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=4)
    with pytest.raises(ValueError, match=r"mesh.expert_parallel=4 divides neither"):
        init_distributed(mesh, timeout_s=1.0, device_type="cpu")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"mesh.expert_parallel=3 does not divide .*--set mesh.expert_parallel"):
        DeviceMeshParameters(data_parallel_shard=4, expert_parallel=3)


def _params() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(Qwen3MoeLM(CONFIG).named_parameters())


@pytest.mark.parametrize("expert_from", ["data_shard", "data_replicate"])
def test_the_plan_shards_the_stacked_experts_over_ep_and_places_the_rest_as_data_parallelism(expert_from: str) -> None:
    params = _params()
    axes = MeshAxes.of(data_replicate=1, data_shard=1, expert=2, expert_from=expert_from)  # type: ignore[arg-type]
    plan = make_plan(params, axes, dims=logical_dims(QWEN3_MOE_PLAN, params), rules=parallel.EXPERT_PARALLEL_RULES)
    ep = axes.names.index("ep")
    for name in ("layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"):
        layout = plan.params[name]
        assert layout.storage[ep] == layout.compute[ep] == "S(0)"
        assert not layout.gathered
        assert layout.partial == ("dp_replicate", "dp_shard")  # complete over ep after the all-to-all's backward
    dense = "S(0)" if expert_from == "data_shard" else "R"  # stored as the carved data-parallel axis stores them
    for name in ("layers.0.mlp.gate.weight", "layers.0.self_attn.q_proj.weight", "embed_tokens.weight"):
        layout = plan.params[name]
        assert layout.storage[ep] == dense, name
        assert set(layout.compute) == {"R"}, name
        assert "ep" in layout.partial
    dims = logical_dims(QWEN3_MOE_PLAN, params)
    whole = make_plan(params, MeshAxes.of(data_replicate=2), dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
    assert whole.params == make_plan(params, MeshAxes.of(data_replicate=2)).params  # no expert axis: data parallelism


@pytest.mark.parametrize("expert_from", ["data_shard", "data_replicate"])
def test_the_plan_fsdp_shards_the_experts_over_the_remaining_shard_ranks(expert_from: str) -> None:
    """With ``data_shard`` ranks left beside the expert axis (4 ranks, data_parallel_shard=4, expert_parallel=2: 2
    left; or carved from the replicas beside 2 shard ranks) the stacked experts are stored ``S(1)`` over them as well
    (1/4 per rank) and gathered over them to compute, split over ``ep`` only; the dense params keep their layout."""
    params = _params()
    dims = logical_dims(QWEN3_MOE_PLAN, params)
    axes = MeshAxes.of(data_replicate=1, data_shard=2, expert=2, expert_from=expert_from)  # type: ignore[arg-type]
    plan = make_plan(params, axes, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
    ep, shard = axes.names.index("ep"), axes.names.index("dp_shard")
    for name in ("layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj"):
        layout = plan.params[name]
        assert (layout.storage[ep], layout.storage[shard]) == ("S(0)", "S(1)"), name
        assert (layout.compute[ep], layout.compute[shard]) == ("S(0)", "R"), name
        assert layout.gathered
        assert layout.partial == ("dp_replicate", "dp_shard")
        assert sorted(layout.split_axes(axes)) == sorted((ep, shard))
    dense = make_plan(params, axes, rules=parallel.EXPERT_PARALLEL_RULES)  # no dims: nothing split for compute
    for name in ("layers.0.mlp.gate.weight", "layers.0.self_attn.q_proj.weight", "embed_tokens.weight"):
        assert plan.params[name] == dense.params[name], name
    # One shard rank left (4 ranks at EP 4, or 2 at EP 2): the experts stored as computed, as before.
    alone = MeshAxes.of(data_shard=1, expert=2, expert_from=expert_from)  # type: ignore[arg-type]
    stored = make_plan(params, alone, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
    assert not stored.params["layers.0.mlp.experts.gate_up_proj"].gathered


# --- dispatch: the property over routing --------------------------------------------------------------------------


def _forget_meshes() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


class _Simulated:
    """``num_ranks`` ranks simulated in this process (fake process group + ``LocalTensorMode``)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks

    def __enter__(self) -> _Simulated:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        _forget_meshes()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.num_ranks)
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.destroy_process_group()
        _forget_meshes()


def _agreed(tensor: Any) -> Any:
    """A value every simulated rank holds (a gathered param, the global loss): one plain tensor, bitwise agreed."""
    from torch.distributed._local_tensor import LocalTensor

    if parallel.is_distributed_tensor(tensor):
        tensor = tensor.full_tensor()
    if not isinstance(tensor, LocalTensor):
        return tensor
    values = [tensor._local_tensors[r] for r in sorted(tensor._ranks)]
    assert all(torch.equal(v, values[0]) for v in values), "simulated ranks disagree"
    return values[0].clone()


def _per_rank(tensor: Any) -> list[torch.Tensor]:
    from torch.distributed._local_tensor import LocalTensor

    assert isinstance(tensor, LocalTensor)
    return [tensor._local_tensors[r] for r in sorted(tensor._ranks)]


@st.composite
def routings(draw: Any) -> tuple[int, int, int, torch.Tensor, int]:
    """(ranks, experts, top_k, router logits (ranks·T, E), seed): experts a multiple of the ranks, routing skewed
    (a large bias on a few experts: some get no token) or collapsed (all tokens to the same top-k)."""
    num_ranks = draw(st.sampled_from([2, 4]))
    num_experts = num_ranks * draw(st.integers(1, 3))
    top_k = draw(st.integers(1, num_experts))
    tokens = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_ranks * tokens, num_experts, generator=gen)
    skew = draw(st.sampled_from(["none", "skewed", "one"]))
    if skew == "skewed":
        logits[:, : max(1, num_experts // 3)] += 6.0
    elif skew == "one":
        logits = torch.zeros_like(logits)
        logits[:, torch.randperm(num_experts, generator=gen)[:top_k]] = torch.arange(top_k, 0, -1.0)
    return num_ranks, num_experts, top_k, logits, seed


@settings(max_examples=25, deadline=None)
@given(routings())
def test_dispatch_experts_equals_the_whole_experts_forward_and_backward(case: tuple) -> None:
    from torch.distributed._local_tensor import LocalTensorMode

    num_ranks, num_experts, top_k, logits, seed = case
    hidden, inter = 8, 6
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(logits.shape[0], hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=gen) * 0.3
    cotangent = torch.randn(logits.shape[0], hidden, generator=gen)

    def whole(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        routing = _route(logits, top_k)
        return experts(x, routing, gate_up, down, path="reference")

    leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, down)]
    expected = whole(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves, cotangent)

    local = num_experts // num_ranks
    tokens = logits.shape[0] // num_ranks
    with _Simulated(num_ranks):
        mesh = init_mesh(MeshAxes.of(expert=num_ranks), device_type="cpu")
        ep = parallel.ExpertParallel(mesh.get_group("ep").group_name, num_ranks)
        with LocalTensorMode(num_ranks) as mode:

            def rows(t: torch.Tensor) -> Any:
                return mode.rank_map(lambda r: t[r * tokens : (r + 1) * tokens].clone())

            def mine(t: torch.Tensor) -> Any:
                return mode.rank_map(lambda r: t[r * local : (r + 1) * local].clone())

            xs, ls, gus, ds = (t.requires_grad_() for t in (rows(x), rows(logits), mine(gate_up), mine(down)))
            routing = _route(ls, top_k)

            def compute(r: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                top1 = Routing(weights=w[:, None], experts=ids[:, None], probs=w[:, None])
                return experts(r, top1, gus, ds, path="reference")

            out = parallel.dispatch_experts(xs, routing.experts, routing.weights, local, compute, ep)
            grads = torch.autograd.grad(out, [xs, ls, gus, ds], rows(cotangent))
        got = torch.cat(_per_rank(out))
        got_grads = [torch.cat(_per_rank(g)) for g in grads]
    # The same products added in the same order, but each expert's matmul over other rows (BLAS blocks by row count).
    torch.testing.assert_close(got, expected.detach(), **TOL)
    for name, g, e in zip(("x", "logits", "gate_up", "down"), got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")


def _route(logits: torch.Tensor, top_k: int) -> Routing:
    from d9dfn.models.qwen3_moe import route

    return route(logits, top_k, normalize=True)


# --- the oracle: the EP step equals the one-process step -----------------------------------------------------------


def _record() -> Transform:
    """A pass-through transform that keeps each step's reduced gradients in its state (placed like the params)."""
    return Transform(
        init=lambda params: {name: torch.zeros_like(p) for name, p in params.items()},
        update=lambda grads, state, params=None: (grads, dict(grads)),
    )


def _optimizer() -> Transform:
    return optim.chain(_record(), optim.sgd(0.5, momentum=0.9))


def _batches(config: Qwen3MoeConfig | None = None) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, (config or CONFIG).vocab_size, (ROWS, SEQ + 1), generator=gen)
        labels = tokens[:, 1:].clone()
        labels[1, :3] = IGNORE_INDEX  # uneven token counts per rank
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return out


def _model(config: Qwen3MoeConfig | None = None) -> Qwen3MoeLM:
    torch.manual_seed(0)
    return Qwen3MoeLM(config or CONFIG)


_ONE_PROCESS: dict[tuple[Any, int], tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _one_process(
    microbatches: int = 1, config: Qwen3MoeConfig | None = None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, the last step's gradients, params after the last step) of the eager fp32 step on one process; run
    once per model config and microbatch count in a process (every oracle cell compares against the same run)."""
    key = (config or CONFIG, microbatches)
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = _run_one_process(microbatches, config)
    return _ONE_PROCESS[key]


def _run_one_process(
    microbatches: int, config: Qwen3MoeConfig | None = None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, task = _model(config), CausalLMTask()
    step = make_train_step(model, task, _optimizer(), num_microbatches=microbatches, compile=False)
    state = init_train_state(model, _optimizer(), task=task)
    losses = []
    for batch in _batches(config):
        state, out = step(state, batch)
        losses.append(out.loss)
    return losses, dict(state.opt_state[0]), {**state.params, **_biases(state.buffers)}


def _biases(buffers: Any) -> dict[str, Any]:
    """The MoE layers' balancing biases (``load_balance_bias_rate > 0``), compared with the params."""
    return {name: b for name, b in buffers.items() if name.endswith("expert_bias")}


def _ep_plan(model: Qwen3MoeLM, mesh: Any) -> parallel.ParallelPlan:
    params = dict(model.named_parameters())
    dims = logical_dims(QWEN3_MOE_PLAN, params)
    plan = parallel.plan_for(model, mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
    parallel.bind_expert_parallel(model, parallel.expert_parallel_of(plan))
    return plan


def _degrees(placement: str, num_ranks: int, ep: int) -> MeshAxes:
    return mesh_axes(
        DeviceMeshParameters(
            data_parallel_replicate=num_ranks if placement == "replicate" else 1,
            data_parallel_shard=num_ranks if placement == "shard" else 1,
            expert_parallel=ep,
        )
    )


def _expert_storage(params: dict[str, Any], grads: dict[str, Any], axes: MeshAxes, ep: int) -> list[int]:
    """Each simulated rank's bytes of the expert weights as stored, after checking that each rank holds
    ``1 / (ep · M)`` of every expert weight (``M`` the ``dp_shard`` ranks beside ``ep``) and that the recorded
    gradients (the optimizer state) are placed as the params."""
    names = [name for name in params if ".experts." in name]
    assert names
    shards = ep * axes.size_of("data_shard")
    per_rank = [0] * math.prod(axes.sizes)
    for name in names:
        param = params[name]
        assert grads[name].placements == param.placements, name
        for rank, local in enumerate(_per_rank(param.to_local())):
            assert local.numel() * shards == param.numel(), (name, rank, tuple(local.shape))
            per_rank[rank] += local.numel() * local.element_size()
    return per_rank


def _simulated(placement: str, num_ranks: int, ep: int, axes: MeshAxes | None = None) -> tuple[list, dict, dict]:
    """As :func:`_one_process`, on ``num_ranks`` simulated ranks with the experts over ``ep`` of them (on ``axes``,
    default the mesh ``placement`` asks for: :func:`_degrees`)."""
    from torch.distributed._local_tensor import LocalTensorMode

    model, task = _model(), CausalLMTask()
    axes = axes or _degrees(placement, num_ranks, ep)
    with _Simulated(num_ranks):
        mesh = init_mesh(axes, device_type="cpu")
        plan = _ep_plan(model, mesh)
        assert (parallel.expert_parallel_of(plan) is None) == (ep == 1)
        step = make_train_step(model, task, _optimizer(), num_microbatches=1, compile=False, plan=plan)
        rows, batches = ROWS // num_ranks, _batches()  # drawn outside the mode: its RNG is per simulated rank
        with LocalTensorMode(num_ranks) as mode:
            state = init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            losses = []
            for batch in batches:
                local = {k: mode.rank_map(lambda r, v=v: v[r * rows : (r + 1) * rows]) for k, v in batch.items()}
                state, out = step(state, local)
                losses.append(_agreed(out.loss))
            if ep > 1:  # each rank holds its experts only, FSDP-split over the shard ranks left beside ep
                assert state.params["layers.0.mlp.experts.gate_up_proj"].to_local().shape[0] == CONFIG.num_experts // ep
                stored = _expert_storage(state.params, dict(state.opt_state[0]), axes, ep)
                if os.environ.get("D9DFN_EP_REPORT"):
                    print(f"{axes.names}={axes.sizes}: expert weights stored per rank {stored} B")
            params = {**state.params, **_biases(state.buffers)}
            return losses, tree_map(_agreed, dict(state.opt_state[0])), tree_map(_agreed, params)


def _max_deltas(got: tuple, want: tuple) -> tuple[float, float, float]:
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    loss = max(float((a - b).abs()) for a, b in zip(losses, ref_losses, strict=True))
    grad = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    param = max(float((params[n] - ref_params[n]).abs().max()) for n in ref_params)
    return loss, grad, param


def _assert_same(got: tuple, want: tuple, num_ranks: int) -> None:
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    for index, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=index: f"step {i} loss: {m}")
    assert_trees_close(grads, ref_grads, **TOL)
    assert_trees_close(params, ref_params, **TOL)


MESHES = [(placement, n, ep) for placement in ("replicate", "shard") for n, ep in ((2, 1), (2, 2), (4, 2), (4, 4))]
"""``shard4-ep2`` leaves 2 ``dp_shard`` ranks beside ``ep``: the experts are FSDP-split over them too."""


@pytest.mark.parametrize(("placement", "num_ranks", "ep"), MESHES, ids=[f"{p}{n}-ep{e}" for p, n, e in MESHES])
def test_ep_step_matches_the_one_process_step(placement: str, num_ranks: int, ep: int) -> None:
    _assert_same(_simulated(placement, num_ranks, ep), _one_process(), num_ranks)


PEFT = (LoRA("q_proj|k_proj|v_proj|o_proj", rank=4, alpha=8), FullTune("gate"))
"""LoRA on the attention and the routers trained whole (``trainer.peft``), the experts frozen."""


def _lora_steps(placement: str | None) -> tuple[list, dict, dict]:
    """(losses, the last step's gradients, every param after the last step) of the tiny MoE model with :data:`PEFT`'s
    adapters, on one process (``None``) or on 2 simulated ranks with the experts over ep 2, placed as the job places
    them (the family's plan with its adapters' rows, :func:`~d9dfn.models.adapter_plan`, as the job's provider)."""
    from torch.distributed._local_tensor import LocalTensorMode

    model, task = apply_peft(_model(), PEFT), CausalLMTask()
    trainable = peft_trainable(PEFT)
    if placement is None:
        step = make_train_step(model, task, _optimizer(), num_microbatches=1, compile=False)
        state = init_train_state(model, _optimizer(), task=task, trainable=trainable)
        losses = []
        for batch in _batches():
            state, out = step(state, batch)
            losses.append(out.loss)
        return losses, dict(state.opt_state[0]), dict(state.params)
    with _Simulated(2):
        mesh = init_mesh(_degrees(placement, 2, 2), device_type="cpu")
        dims = logical_dims({**QWEN3_MOE_PLAN, **adapter_plan(QWEN3_MOE_PLAN)[0]}, dict(model.named_parameters()))
        plan = parallel.plan_for(model, mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
        parallel.bind_expert_parallel(model, parallel.expert_parallel_of(plan))
        step = make_train_step(model, task, _optimizer(), num_microbatches=1, compile=False, plan=plan)
        rows, batches = ROWS // 2, _batches()
        with LocalTensorMode(2) as mode:
            state = init_train_state(
                model, _optimizer(), task=task, mesh=mesh, placements=plan.placements, trainable=trainable
            )
            assert "layers.0.mlp.experts.gate_up_proj" in state.frozen
            assert state.params["layers.0.mlp.experts.gate_up_proj"].to_local().shape[0] == CONFIG.num_experts // 2
            losses = []
            for batch in batches:
                local = {k: mode.rank_map(lambda r, v=v: v[r * rows : (r + 1) * rows]) for k, v in batch.items()}
                state, out = step(state, local)
                losses.append(_agreed(out.loss))
            return losses, tree_map(_agreed, dict(state.opt_state[0])), tree_map(_agreed, dict(state.params))


def test_the_jobs_provider_gives_a_lora_moe_model_the_dims_that_split_its_experts() -> None:
    # The job's provider returned no dims with trainer.peft, so expert parallelism found nothing to split and a LoRA
    # run with mesh.expert_parallel=2 ended "no param is split over the expert axis".
    from d9dfn.jobs._providers import Qwen3Provider

    provider = Qwen3Provider(CONFIG, "qwen3_moe", peft=PEFT)
    model = apply_peft(_model(), PEFT)
    dims = provider.logical_dims(None, model)  # type: ignore[arg-type]  # the context is not read
    assert dims is not None
    assert dims["layers.0.mlp.experts.gate_up_proj"][0] == "experts"
    assert dims["layers.0.self_attn.q_proj.lora_A.weight"] == ("lora_rank", "embed")  # its base's in and out
    assert dims["layers.0.self_attn.q_proj.lora_B.weight"] == (
        "heads",
        "lora_rank",
    )  # (expert parallelism splits neither)
    sums = provider.summed_dims(None, model)  # type: ignore[arg-type]
    assert sums is not None
    assert sums["layers.0.self_attn.q_proj.lora_A.weight"] == ("heads",)  # partial where tp splits q's rows
    assert dims.keys() == dict(model.named_parameters()).keys()


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_lora_beside_frozen_experts_split_over_ep_matches_the_one_process_step(placement: str) -> None:
    """``trainer.peft`` with ``mesh.expert_parallel``: the frozen experts split over ep 2 (each rank holds half), the
    adapters and the routers replicated (or FSDP-sharded); loss, the trainable params' gradients and every param after
    3 steps equal the one-process step within :data:`TOL`. Refused before (the adapters had no logical dims)."""
    got, want = _lora_steps(placement), _lora_steps(None)
    _assert_same(got, want, 2)
    assert set(want[1]) == {n for n in want[2] if "lora_" in n or ".mlp.gate." in n}  # what trains
    assert float(got[1]["layers.0.self_attn.q_proj.lora_B.weight"].abs().max()) > 0


@pytest.mark.slow
def test_ep_carved_from_the_replicas_beside_two_shard_ranks_matches_the_one_process_step() -> None:
    """The other mesh order, ``(dp_replicate, ep, dp_shard)`` (the expert axis carved from the replicas, what
    ``data_parallel_replicate=2, data_parallel_shard=3, expert_parallel=2`` gives): the experts ``S(0)`` over ``ep``
    and ``S(1)`` over the 2 shard ranks after it, gathered over those."""
    axes = MeshAxes.of(data_replicate=1, data_shard=2, expert=2, expert_from="data_replicate")
    _assert_same(_simulated("shard", 4, 2, axes), _one_process(), 4)


@pytest.mark.parametrize(("placement", "num_ranks", "ep"), [("shard", 4, 2), ("replicate", 2, 2)])
def test_ep_with_the_balancing_bias_and_a_capacity_matches_the_one_process_step(
    placement: str, num_ranks: int, ep: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The auxiliary-loss-free bias (its counts summed over every data-parallel rank, the expert axis included) and
    a capacity that drops copies (each forward's own tokens: a rank's, as one process's microbatch's) compose with the
    experts split: loss, gradients, params and the biases after 3 steps equal one process running each rank's rows
    as a microbatch."""
    config = dataclasses.replace(CONFIG, load_balance_bias_rate=0.05, capacity_factor=1.0)
    monkeypatch.setattr(sys.modules[__name__], "CONFIG", config)
    want = _one_process(microbatches=num_ranks)
    assert any(name.endswith("expert_bias") for name in want[2])
    assert any(float(b.abs().max()) > 0 for name, b in want[2].items() if name.endswith("expert_bias"))
    _assert_same(_simulated(placement, num_ranks, ep), want, num_ranks)


def test_expert_gradients_are_not_doubled_at_ep2_pytorch_160285(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's expert gradients came out exactly 2x at EP=2 (pytorch/pytorch#160285): here each rank's expert
    gradient must equal the one-process gradient of its experts (ratio 1, not 2), and the check must catch the bug
    (an all-to-all adjoint that counts each copy once per rank of the group doubles them exactly)."""
    _, want_grads, _ = _one_process()
    names = [n for n in want_grads if ".experts." in n]

    def ratios() -> list[float]:
        _, grads, _ = _simulated("replicate", 2, 2)
        return [float(grads[n].norm() / want_grads[n].norm()) for n in names]

    assert ratios() == pytest.approx([1.0] * len(names), abs=1e-6)
    backward = parallel._experts._AllToAll.backward

    def doubled(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, none = backward(ctx, grad)
        return out * 2, none

    monkeypatch.setattr(parallel._experts._AllToAll, "backward", staticmethod(doubled))
    # The last MoE layer's experts: 2x (the third step's gradient, at params two doubled steps moved: within 1%).
    buggy = ratios()
    assert buggy[names.index("layers.1.mlp.experts.down_proj")] == pytest.approx(2.0, abs=0.02)
    assert buggy != pytest.approx([1.0] * len(names), abs=1e-6)  # what the first assert would have caught


# --- stochastic AdamW on every layout the loop produces ----------------------------------------------------------

STOCHASTIC_LAYOUTS = [
    ("replicate", 2, 1, (), ()),
    ("shard", 2, 1, (0,), (0,)),
    ("replicate", 2, 2, (0,), ()),
    ("shard", 4, 2, (0, 1), (0, 0)),
]
"""``(placement, ranks, ep, the dims the stacked experts are split on, those a dense weight is split on)`` (over mesh
axes of more than one rank): replicated, FSDP (``S(0)`` over ``dp_shard``), EP over the replicas, EP + FSDP (the
experts ``S(0)`` over ``ep`` and ``S(1)`` over the 2 ``dp_shard`` ranks left; the dense params ``S(0)`` over both)."""
STOCHASTIC_PARAMS = (
    "embed_tokens.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.mlp.gate.weight",
    "layers.0.mlp.experts.gate_up_proj",
    "layers.0.mlp.experts.down_proj",
    "norm.weight",
)
"""One layer's kinds of params (the simulated ranks' DTensor dispatch costs per leaf, and the other layer repeats)."""


def _stochastic_adamw() -> Transform:
    return optim.stochastic_adamw(1e-3, weight_decay=0.1, state_dtype=torch.bfloat16, key=7)


def _bf16_problem() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The tiny Qwen3-MoE's params in bf16 and ``STEPS`` float32 gradients for them (one process's, whole)."""
    whole = dict(_model().named_parameters())
    params = {name: whole[name].detach().to(torch.bfloat16) for name in STOCHASTIC_PARAMS}
    gen = torch.Generator().manual_seed(2)
    grads = [{name: torch.randn(p.shape, generator=gen) * 1e-2 for name, p in params.items()} for _ in range(STEPS)]
    return params, grads


def _stochastic_steps(params: dict[str, Any], grads: list[dict[str, Any]]) -> tuple[dict[str, Any], Any]:
    """``STEPS`` updates of :func:`_stochastic_adamw` (then ``apply_updates``): params and moments after them."""
    opt = _stochastic_adamw()
    state = opt.init(params)
    for step_grads in grads:
        updates, state = opt.update(step_grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, {"mu": state.mu, "nu": state.nu}


@pytest.mark.parametrize(
    ("placement", "num_ranks", "ep", "expert_dims", "dense_dims"),
    STOCHASTIC_LAYOUTS,
    ids=[f"{p}{n}-ep{e}" for p, n, e, _, _ in STOCHASTIC_LAYOUTS],
)
def test_stochastic_adamw_on_sharded_params_equals_the_one_process_update_bitwise(
    placement: str, num_ranks: int, ep: int, expert_dims: tuple[int, ...], dense_dims: tuple[int, ...]
) -> None:
    """Issue 41: ``stochastic_adamw`` on the ``DTensor`` params the EP plan stores (each rank holding its shard, the
    gradients placed like them, as the tail hands them over) gives, after 3 steps, bf16 params and bf16 moments equal
    bit for bit to the one-process update of the whole tensors: every element draws the noise of its global index.
    (Before the fix: "aten.add.Tensor got mixed torch.Tensor and DTensor".)"""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor

    params, grads = _bf16_problem()
    want = _stochastic_steps(params, grads)
    assert not torch.equal(want[0]["norm.weight"], params["norm.weight"])  # the steps moved the params
    axes = _degrees(placement, num_ranks, ep)
    with _Simulated(num_ranks):
        mesh = init_mesh(axes, device_type="cpu")
        plan = _ep_plan(_model(), mesh)
        with LocalTensorMode(num_ranks):

            def placed(tree: dict[str, torch.Tensor]) -> dict[str, Any]:
                return {name: distribute_tensor(t, mesh, plan.placements(name)) for name, t in tree.items()}

            sharded = placed(params)
            got = tree_map(_agreed, _stochastic_steps(sharded, [placed(g) for g in grads]))

    def split_dims(param: Any) -> tuple[int, ...]:  # the dims split over mesh axes of more than one rank
        axes = zip(param.placements, param.device_mesh.shape, strict=True)
        return tuple(sorted(p.dim for p, size in axes if isinstance(p, Shard) and size > 1))

    assert split_dims(sharded["layers.0.mlp.experts.gate_up_proj"]) == expert_dims  # the layout asked for
    assert split_dims(sharded["layers.0.self_attn.q_proj.weight"]) == dense_dims
    for (name, a), (_, b) in zip(_named(got), _named(want), strict=True):
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: {int((a != b).sum())} elements differ"


def _named(tree: tuple[dict[str, Any], dict[str, dict[str, Any]]]) -> list[tuple[str, torch.Tensor]]:
    params, moments = tree
    return [*params.items(), *((f"{k}.{name}", t) for k, leaves in moments.items() for name, t in leaves.items())]


@pytest.mark.slow
def test_stochastic_adamw_in_the_ep_fsdp_train_step_equals_the_one_process_update_of_its_gradients() -> None:
    """Through the loop's tail: 2 pure-bf16 train steps on the EP + FSDP mesh (4 simulated ranks, the experts ``S(0)``
    over ``ep`` and ``S(1)`` over ``dp_shard``) with ``stochastic_adamw`` leave the params that one process's
    ``stochastic_adamw`` gives, bit for bit, when fed the gradients the step reduced (recorded in the state). The
    gradients themselves differ from one process's in reduction order (and with them, in bf16, Adam's first steps),
    which is why the oracle is the update of the same gradients and not a one-process run."""
    from torch.distributed._local_tensor import LocalTensorMode

    from d9dfn import Precision, cast_params

    def opt() -> Transform:
        return optim.chain(_record(), _stochastic_adamw())

    model, task, num_ranks = cast_params(_model(), torch.bfloat16), CausalLMTask(), 4
    first = {name: p.detach().clone() for name, p in model.named_parameters()}
    axes = _degrees("shard", num_ranks, 2)
    recorded = []
    with _Simulated(num_ranks):
        mesh = init_mesh(axes, device_type="cpu")
        plan = _ep_plan(model, mesh)
        step = make_train_step(model, task, opt(), compile=False, plan=plan, precision=Precision.bf16_pure())
        rows, batches = ROWS // num_ranks, _batches()[:2]
        with LocalTensorMode(num_ranks) as mode:
            state = init_train_state(model, opt(), task=task, mesh=mesh, placements=plan.placements)
            for batch in batches:
                local = {k: mode.rank_map(lambda r, v=v: v[r * rows : (r + 1) * rows]) for k, v in batch.items()}
                state, _ = step(state, local)
                recorded.append(tree_map(_agreed, dict(state.opt_state[0])))
            got = tree_map(_agreed, dict(state.params))
    assert len(state.params["layers.0.mlp.experts.gate_up_proj"].to_local().shape) == 3
    want, _ = _stochastic_steps(first, recorded)
    for name in want:
        a, b = got[name], want[name]
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: {int((a != b).sum())} elements differ"
    assert not torch.equal(got["norm.weight"], first["norm.weight"])


@st.composite
def _dtensor_splits(draw: Any) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    """(mesh sizes, one placement per mesh axis: ``R`` or ``S<dim>`` (a dim split again on a later axis, or unevenly:
    trailing ranks' shards short or empty), seed); the tensor's shape is drawn by the test."""
    sizes = draw(st.sampled_from([(2,), (4,), (2, 2), (3,)]))
    placements = tuple(draw(st.sampled_from(["R", "S0", "S1", "S2"])) for _ in sizes)
    return sizes, placements, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=25, deadline=None)
@given(_dtensor_splits(), st.lists(st.integers(1, 9), min_size=3, max_size=3))
def test_stochastic_round_of_a_dtensor_is_the_slice_of_the_whole_tensors_rounding(
    split: tuple, dims: list[int]
) -> None:
    """Split any way (``Shard`` of any dim over 2, 3 or 4 simulated ranks, nested, uneven, or replicated), each rank's
    rounded shard is the slice of the unsplit tensor's rounding at the shard's offset (``shard_offset``, which must
    agree with torch's own ``compute_local_shape_and_global_offset``), and the gathered result is the whole one."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, names, seed = split
    x = torch.randn(*dims, generator=torch.Generator().manual_seed(seed)) * 3
    key = prng.key(seed)
    whole = optim.stochastic_round(x, key)
    placements = [Replicate() if name == "R" else Shard(int(name[1])) for name in names]
    with _Simulated(math.prod(sizes)), LocalTensorMode(math.prod(sizes)):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=tuple(f"a{i}" for i in range(len(sizes))))
        dx = distribute_tensor(x, mesh, placements)
        rounded = optim.stochastic_round(dx, key)
        assert tuple(rounded.placements) == tuple(placements)
        offset = parallel.shard_offset(dx)
        shape, torch_offset = compute_local_shape_and_global_offset(dx.shape, mesh, dx.placements)
        local = rounded.to_local()
        ranks = range(math.prod(sizes))
        per_rank = [[_value(o, r) for o in offset] for r in ranks]
        assert per_rank == [[_value(o, r) for o in torch_offset] for r in ranks]
        for rank, start in zip(ranks, per_rank, strict=True):
            mine = local._local_tensors[rank] if hasattr(local, "_local_tensors") else local
            assert list(mine.shape) == [_value(n, rank) for n in shape]
            want = whole[tuple(slice(o, o + n) for o, n in zip(start, mine.shape, strict=True))]
            assert torch.equal(mine.view(torch.int16), want.view(torch.int16)), (rank, start)
        assert torch.equal(_agreed(rounded).view(torch.int16), whole.view(torch.int16))


def test_stochastic_round_of_a_dtensor_compiles_fullgraph_on_one_rank_as_in_eager() -> None:
    """On a real rank (rank 3 of a fake 2 x 2 group: its coordinates are Python ints, as under ``torchrun``) the shard's
    offset is traced into the graph: ``torch.compile(fullgraph=True)`` (``aot_eager``) rounds the EP + FSDP shard
    bit for bit as eager does, and both as the slice of the whole tensor's rounding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    whole, key = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0)), prng.key(5)
    want = optim.stochastic_round(whole, key)[2:4, 3:6]  # rank 3: ep coordinate 1, dp_shard coordinate 1
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_shard"))
        shard = DTensor.from_local(
            whole[2:4, 3:6], mesh, [Shard(0), Shard(1)], run_check=False, shape=whole.shape, stride=whole.stride()
        )
        assert parallel.shard_offset(shard) == (2, 3, 0)
        compiled = torch.compile(optim.stochastic_round, backend="aot_eager", fullgraph=True)
        for rounded in (optim.stochastic_round(shard, key), compiled(shard, key)):
            assert torch.equal(rounded.to_local().view(torch.int16), want.view(torch.int16))
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def test_shard_offset_refuses_partial_placements_and_a_rank_off_the_mesh() -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        partial = DTensor.from_local(torch.zeros(2, 3), mesh, [Partial()], run_check=False)
        with pytest.raises(TypeError, match=r"shard_offset: a DTensor of shape \(2, 3\) has placement Partial\(sum\)"):
            optim.stochastic_round(partial, prng.key(0))
        off = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("ep",))  # ranks 0 and 1: not rank 3
        shard = DTensor.from_local(torch.zeros(2, 3), off, [Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))
        with pytest.raises(ValueError, match=r"shard_offset: this rank is not on the tensor's mesh"):
            parallel.shard_offset(shard)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _value(value: Any, rank: int) -> int:
    """A simulated rank's value of an int that may be a per-rank symbolic one (``LocalIntNode``)."""
    node = getattr(value, "node", None)
    return int(node._local_ints[rank]) if node is not None and hasattr(node, "_local_ints") else int(value)


# --- expert parallelism inside pipeline stages ------------------------------------------------------------------

PIPELINE_CONFIG = dataclasses.replace(CONFIG, num_layers=3, tie_word_embeddings=False, load_balance_bias_rate=0.05)
"""3 MoE layers (2 stages: 2 layers and 1 beside the head), untied (a pipeline needs it), with the balancing bias: each
stage's rank moves its layers' biases from the counts the last stage returns (summed over ``pp`` on real ranks)."""
PIPELINE_MICROBATCHES = 2
PIPELINED = [("shard", "1f1b", {})]
"""Simulated: the sharded placement (the gloo test below runs the replicated one, the example's); one cell, ~25 s (the
simulated ranks' DTensor dispatch, not the model, is the cost)."""


def _pipelined(placement: str, schedule: str, options: dict[str, int]) -> tuple[list, dict, dict]:
    """As :func:`_simulated` at EP 2 on 2 simulated ranks, each running the pipeline program over the model's stages
    (the one-process ``Pipeline`` executor: every pipeline rank's row in this process), the experts of every stage
    bound to the expert group by the loop's own functions (``loop/_train.py``: ``_step_modules``, ``_bind_experts``)."""
    from torch.distributed._local_tensor import LocalTensorMode

    from d9dfn import pipeline
    from d9dfn.loop._pipelining import PipelineLayout
    from d9dfn.loop._train import _bind_experts, _step_modules

    num_ranks = 2
    model, task = _model(PIPELINE_CONFIG), CausalLMTask()
    program = pipeline.SCHEDULE_OPTIONS[schedule](**options).program(2, PIPELINE_MICROBATCHES)
    stages = pipeline.build_stages(lambda info: Qwen3MoeLM(PIPELINE_CONFIG, info), program.num_stages)
    layout = PipelineLayout(program=program, stages=stages, rank=0, modules=())
    with _Simulated(num_ranks):
        mesh = init_mesh(_degrees(placement, num_ranks, 2), device_type="cpu")
        dims = logical_dims(QWEN3_MOE_PLAN, dict(model.named_parameters()))
        plan = parallel.plan_for(model, mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
        _bind_experts(plan, _step_modules(model, layout), 2)
        assert all(
            m.expert_parallel is not None for s in stages for m in s.module.modules() if hasattr(m, "expert_parallel")
        )
        executor = pipeline.Pipeline(program, stages)
        step = make_train_step(model, task, _optimizer(), executor=executor, compile=False, plan=plan)
        rows, batches = ROWS // num_ranks, _batches(PIPELINE_CONFIG)
        with LocalTensorMode(num_ranks) as mode:
            state = init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            losses = []
            for batch in batches:
                local = {k: mode.rank_map(lambda r, v=v: v[r * rows : (r + 1) * rows]) for k, v in batch.items()}
                state, out = step(state, local)
                losses.append(_agreed(out.loss))
            for index in range(PIPELINE_CONFIG.num_layers):  # each rank holds half of every stage's experts
                local_experts = state.params[f"layers.{index}.mlp.experts.gate_up_proj"].to_local()
                assert local_experts.shape[0] == PIPELINE_CONFIG.num_experts // 2
            params = {**state.params, **_biases(state.buffers)}
            return losses, tree_map(_agreed, dict(state.opt_state[0])), tree_map(_agreed, params)


@pytest.mark.parametrize(
    ("placement", "schedule", "options"), PIPELINED, ids=[f"{p}-{s}-{len(o) + 1}" for p, s, o in PIPELINED]
)
def test_ep_in_pipeline_stages_matches_the_one_process_step(
    placement: str, schedule: str, options: dict[str, int]
) -> None:
    """``trainer.pipelining`` with ``mesh.expert_parallel=2``: each stage's MoE layers dispatch over the expert group
    of that stage's data-parallel ranks. Loss, every gradient and the params after 3 steps equal the one-process step
    over the same microbatches (each rank's rows cut in 2) within :data:`TOL`, for one and two stages per rank."""
    want = _one_process(2 * PIPELINE_MICROBATCHES, PIPELINE_CONFIG)
    got = _pipelined(placement, schedule, options)
    if os.environ.get("D9DFN_EP_REPORT"):
        print(f"pipelined {placement} {schedule} {options}: max |d| loss, grads, params = {_max_deltas(got, want)}")
    _assert_same(got, want, 2)
    assert float(got[1]["layers.0.mlp.experts.gate_up_proj"].abs().max()) > 0  # the first stage's experts learn


RANK_SCHEDULES = [("1f1b", {}), ("gpipe", {})]
"""On real ranks: each rank runs its row of the program (``PipelineRank``), the boundary shapes found on the stages'
meta skeletons, activations sent between the pipeline ranks. Programs that split the backward into I and W cannot
run an MoE stage (its expert shapes follow the routing): refused by the job (``tests/test_qwen3_moe_job.py``)."""


def _pipeline_gloo_worker(rank: int, world_size: int, init_file: str) -> None:
    """pp 2 × dp_replicate 2 with the experts over ep 2 (the example's mesh): each rank runs its row of each program
    (``PipelineRank``), its stages' experts bound to its stage's expert group; its stages' params and recorded
    gradients, and the loss, against the one-process step."""
    from d9dfn import pipeline
    from d9dfn.loop._pipelining import PipelineLayout
    from d9dfn.loop._train import _bind_experts, _step_modules

    distributed = _init(rank, world_size, init_file, timeout_s=120.0)
    want = _one_process(2 * PIPELINE_MICROBATCHES, PIPELINE_CONFIG)
    try:
        degrees = DeviceMeshParameters(pipeline_parallel=2, data_parallel_replicate=2, expert_parallel=2)
        mesh = init_mesh(mesh_axes(degrees), device_type="cpu")
        dp_mesh, pp_rank = parallel.data_parallel_submesh(mesh), parallel.pipeline_rank(mesh)
        dp_rank, dp_size = parallel.data_parallel_position(dp_mesh)
        for schedule, options in RANK_SCHEDULES:
            model, task, opt = _model(PIPELINE_CONFIG), CausalLMTask(), _optimizer()
            program = pipeline.SCHEDULE_OPTIONS[schedule](**options).program(2, PIPELINE_MICROBATCHES)
            stages = pipeline.build_stages(lambda info: Qwen3MoeLM(PIPELINE_CONFIG, info), program.num_stages)
            executor = pipeline.PipelineRank(program, stages, pp_rank, parallel.pipeline_group(mesh))
            whole = init_train_state(model, opt, task=task)
            mine = {n: p for s in executor.local_stages for n, p in s.select_params(whole.params).items()}
            dims = logical_dims(QWEN3_MOE_PLAN, mine)
            plan = parallel.plan_for(mine, dp_mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
            _bind_experts(plan, _step_modules(model, PipelineLayout(program, stages, pp_rank, ())), 2)
            step = make_train_step(model, task, opt, executor=executor, plan=plan, compile=False)
            params = parallel.distribute_params(mine, dp_mesh, plan.placements)
            buffers = {n: b for s in executor.local_stages for n, b in s.select_buffers(whole.buffers).items()}
            assert _biases(buffers)  # this rank's stages' biases, moved by the step from the last stage's counts
            state = whole.replace(params=params, buffers=buffers, opt_state=opt.init(params))
            rows, losses = ROWS // dp_size, []
            for batch in _batches(PIPELINE_CONFIG):
                state, out = step(state, {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()})
                losses.append(out.loss)
            got_params = {**parallel.full_tensors(state.params), **_biases(state.buffers)}
            got = (losses, parallel.full_tensors(dict(state.opt_state[0])), got_params)
            local = (
                {n: g for n, g in want[1].items() if n in mine},
                {n: p for n, p in want[2].items() if n in got_params},
            )
            try:
                _assert_same(got, (want[0], *local), world_size)
            except AssertionError as error:
                raise AssertionError(f"{schedule} {options} on rank {rank}: {error}") from error
            if rank == 0 and os.environ.get("D9DFN_EP_REPORT"):
                print(f"gloo pp2 x ep2 {schedule} {options}: max |d| = {_max_deltas(got, (want[0], *local))}")
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_ep_in_pipeline_ranks_on_four_gloo_ranks_matches_the_one_process_step(tmp_path: Any) -> None:
    """1F1B and GPipe on pp 2 × dp 2 with the experts over ep 2 (4 gloo ranks): loss, every gradient and the params
    after 3 steps equal the one-process step within :data:`TOL`."""
    _run_ranks(_pipeline_gloo_worker, 4, tmp_path, timeout_s=300)


# --- two gloo ranks --------------------------------------------------------------------------------------------------


def _gloo_steps(rank: int, world_size: int, placement: str, ep: int) -> tuple[tuple[Any, Any, Any], Any]:
    """This rank's eager steps over its rows of :func:`_batches` at ``placement`` and expert degree ``ep``: (losses,
    full gradients, full params) and the final state."""
    model, task = _model(), CausalLMTask()
    mesh = init_mesh(_degrees(placement, world_size, ep), device_type="cpu")
    plan = _ep_plan(model, mesh)
    step = make_train_step(model, task, _optimizer(), num_microbatches=1, compile=False, plan=plan)
    state = init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
    rows = ROWS // world_size
    losses = []
    for batch in _batches():
        state, out = step(state, {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()})
        losses.append(out.loss)
    return (losses, parallel.full_tensors(dict(state.opt_state[0])), parallel.full_tensors(state.params)), state


def _gloo_worker(rank: int, world_size: int, init_file: str) -> None:
    distributed = _init(rank, world_size, init_file)  # first: it leaves the parent's OpenMP pool (set_num_threads)
    want = _one_process()  # the one-process step of the whole batch, on each rank
    try:
        for placement in ("replicate", "shard"):
            for ep in (1, 2):
                got, _ = _gloo_steps(rank, world_size, placement, ep)
                _assert_same(got, want, world_size)
                if rank == 0 and os.environ.get("D9DFN_EP_REPORT"):
                    print(f"gloo {placement} ep={ep}: max |d| loss, grads, params = {_max_deltas(got, want)}")
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_ep_step_on_two_gloo_ranks_matches_the_one_process_step(tmp_path: Any) -> None:
    _run_ranks(_gloo_worker, 2, tmp_path, timeout_s=300)


def _fsdp_ep_gloo_worker(rank: int, world_size: int, init_file: str, directory: str) -> None:
    """4 gloo ranks, data_parallel_shard=4 with expert_parallel=2 (2 shard ranks left beside ep): 3 steps as one
    process, each rank storing a quarter of every expert weight; then the state saved as step 3."""
    from d9dfn.checkpoint import CheckpointStore

    distributed = _init(rank, world_size, init_file)
    want = _one_process()
    try:
        got, state = _gloo_steps(rank, world_size, "shard", 2)
        for name, param in state.params.items():
            if ".experts." in name:
                assert param.to_local().numel() * world_size == param.numel(), name
        _assert_same(got, want, world_size)
        if rank == 0 and os.environ.get("D9DFN_EP_REPORT"):
            print(f"gloo shard4 ep=2: max |d| loss, grads, params = {_max_deltas(got, want)}")
        with CheckpointStore(directory) as store:
            store.save(3, state, {"step": 3})
    finally:
        distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_ep_with_the_experts_fsdp_sharded_on_four_gloo_ranks_and_its_checkpoint_restores_on_one_process(
    tmp_path: Any,
) -> None:
    """The shard case on real collectives (the all-gather of the experts' dim 1 over the 2 shard ranks, the reduce-
    scatter of their gradients), and the resharding restore: the checkpoint holding each rank's quarter of the expert
    weights and of their optimizer state restores into the one-process state, equal to the one-process run's."""
    from d9dfn.checkpoint import CheckpointStore

    directory = tmp_path / "ckpt"
    _run_ranks(_fsdp_ep_gloo_worker, 4, tmp_path, str(directory), clean=True, timeout_s=300)
    gate_up = "params/layers.0.mlp.experts.gate_up_proj"  # (4, 64, 16) whole: each rank wrote its own quarter
    pieces = [json.loads((directory / "3" / f"manifest_{r:05d}" / "metadata").read_text())["leaves"] for r in range(4)]
    assert [(p[gate_up]["offsets"], p[gate_up]["shape"]) for p in pieces] == [
        ([0, 0, 0], [2, 32, 16]),
        ([2, 0, 0], [2, 32, 16]),
        ([0, 32, 0], [2, 32, 16]),
        ([2, 32, 0], [2, 32, 16]),
    ]
    model, task = _model(), CausalLMTask()
    step = make_train_step(model, task, _optimizer(), num_microbatches=1, compile=False)
    state = init_train_state(model, _optimizer(), task=task)
    like = init_train_state(_model(), _optimizer(), task=task)
    for batch in _batches():
        state, _ = step(state, batch)
    restored, metadata = CheckpointStore(directory, create=False).restore(None, like=like)
    assert metadata == {"step": 3}
    assert not any(parallel.is_distributed_tensor(p) for p in restored.params.values())
    # Params, momentum, recorded gradients, buffers, step, key: the one-process run's (the metric state is per rank).
    assert_trees_close(restored.replace(metric_state=state.metric_state), state, **TOL)


# --- the job --------------------------------------------------------------------------------------------------------

_MOE_JOB = (
    *TINY_TRAINER,
    *TINY_DATA,
    "model.family=qwen3_moe",
    "model.hidden_size=16",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=8",
    "model.intermediate_size=32",
    "trainer.batching.global_batch_size=4",
    "trainer.total_steps=3",
    "trainer.checkpointing.period_steps=3",
    "trainer.logging.period_steps=1",
)


def _sets(*overrides: str) -> list[str]:
    return [arg for override in (*_MOE_JOB, *overrides) for arg in ("--set", override)]


def test_lm_job_refuses_an_expert_degree_that_does_not_divide_the_experts(tmp_path: Any, capsys: Any) -> None:
    argv = ["train", *_sets(f"trainer.checkpointing.save_dir={tmp_path}", "mesh.expert_parallel=2")]
    assert main([*argv, "--set", "model.moe.num_experts=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "mesh.expert_parallel=2 does not divide model.moe.num_experts=3" in err[0]
    assert (
        main(
            [
                "train",
                *_sets(f"trainer.checkpointing.save_dir={tmp_path}", "mesh.expert_parallel=2", "model.family=qwen3"),
            ]
        )
        == 2
    )
    assert "has no experts; set --set mesh.expert_parallel=1" in capsys.readouterr().err


def _losses(run_dir: Any) -> list[float]:
    import json

    records = [json.loads(line) for line in (run_dir / "stdlib-lm" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.cli
def test_torchrun_trains_qwen3_moe_at_ep2_as_at_ep1_and_evaluates_on_one_process(tmp_path: Any) -> None:
    """``torchrun --nproc-per-node 2 -m d9dfn train --set model.family=qwen3_moe --set mesh.expert_parallel=2``: the
    same losses as data parallelism over the same 2 ranks (bitwise: the same products in the same order), and the
    checkpoint saved with the experts split over 2 ranks evaluated after training on one process (a resharding
    restore)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "d9dfn"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    runs = {}
    for ep in (2, 1):
        save_dir = tmp_path / f"ep{ep}"
        mesh = "mesh.expert_parallel=2" if ep == 2 else "mesh.data_parallel_replicate=2"
        command = [*launcher, "train", *_sets(f"trainer.checkpointing.save_dir={save_dir}", mesh)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "validation perplexity" in done.stdout + done.stderr
        runs[ep] = _losses(save_dir)
    assert len(runs[2]) == 3
    assert runs[2] == runs[1]
