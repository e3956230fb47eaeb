"""The layout as a value: mesh axes with roles and the parallel plan (``d9dfn/parallel/_axes.py``, ``_plan.py``).

The golden files under ``tests/golden/plans/`` hold each model family's plan on a few meshes, so that a change of any
param's storage, compute layout or partial axes shows in a diff; regenerate them with
``D9DFN_REGENERATE_GOLDEN=1 python -m pytest tests/test_plan.py`` after a deliberate change, and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import d9dfn
from d9dfn import optim, parallel
from d9dfn.models import FAMILIES, Qwen3Config, logical_dims, summed_dims
from d9dfn.parallel import MeshAxes, MeshAxis, make_plan
from d9dfn.tasks import CausalLMTask

GOLDEN = Path(__file__).parent / "golden" / "plans"
_SWITCHES = {"qk_norm", "qkv_bias", "o_proj_bias"}  # each family sets its own
MESHES = {
    "dp2": {"data_replicate": 2},
    "fsdp2": {"data_shard": 2},
    "hsdp2x2": {"data_replicate": 2, "data_shard": 2},
    # mesh.expert_parallel=2 carved out of 2 sharded / 2 replicated ranks (d9dfn.loop.mesh_axes)
    "fsdp2-ep2": {"data_shard": 1, "expert": 2},
    "dp2-ep2": {"data_replicate": 1, "expert": 2, "expert_from": "data_replicate"},
    # mesh.data_parallel_shard=4, expert_parallel=2: 2 shard ranks left beside ep (the experts FSDP-split over them)
    "fsdp4-ep2": {"data_shard": 2, "expert": 2},
    "tp2": {"tensor": 2},
    "tp2fsdp2": {"data_shard": 2, "tensor": 2},
    # tp2 with vocabulary parallelism's rule (parallel.VOCAB_PARALLEL_RULES): the embedding and LM head S(0) over tp
    "tp2vocab": {"tensor": 2},
}
TENSOR_MESHES = {"tp2", "tp2fsdp2", "tp2vocab"}
VOCAB_MESHES = {"tp2vocab"}
DENSE = sorted(name for name in FAMILIES if name != "qwen3_moe")  # the MoE block has no tensor-parallel path yet


def _family_params(family: str) -> dict[str, torch.Tensor]:
    tiny = dataclasses.asdict(Qwen3Config.tiny(num_layers=2, tie_word_embeddings=False))
    config = FAMILIES[family].config(**{k: v for k, v in tiny.items() if k not in _SWITCHES})
    with torch.device("meta"):
        model = FAMILIES[family].model(config, None)
    return dict(model.named_parameters())


def _family_plan(family: str, mesh: str) -> parallel.ParallelPlan:
    params = _family_params(family)
    return make_plan(
        params,
        MeshAxes.of(**MESHES[mesh]),
        dims=logical_dims(FAMILIES[family].plan, params),
        rules=(
            *parallel.TENSOR_PARALLEL_RULES,
            *(parallel.VOCAB_PARALLEL_RULES if mesh in VOCAB_MESHES else ()),
            *parallel.EXPERT_PARALLEL_RULES,
        ),
        sums_over=summed_dims(FAMILIES[family].sums_over, params),
    )


def _text(plan: parallel.ParallelPlan) -> str:
    """The plan as JSON, one line per param (a change shows as that param's line in a diff)."""
    data = plan.to_json()
    lines = [f' "{name}": {json.dumps(layout)}' for name, layout in data.pop("params").items()]
    head = json.dumps(data)[:-1]
    return head + ', "params": {\n' + ",\n".join(lines) + "\n}}\n"


@pytest.mark.parametrize(
    ("family", "mesh"),
    [(f, m) for f in sorted(FAMILIES) for m in sorted(MESHES) if m not in TENSOR_MESHES or f in DENSE],
)
def test_each_family_plan_matches_its_golden_file(family: str, mesh: str) -> None:
    path = GOLDEN / f"{family}-{mesh}.json"
    text = _text(_family_plan(family, mesh))
    assert json.loads(text) == _family_plan(family, mesh).to_json()
    if os.environ.get("D9DFN_REGENERATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text, f"{path} differs from the plan; if deliberate, regenerate it (module docstring)"


def test_the_data_parallel_plan_stores_dim_zero_sharded_and_computes_whole() -> None:
    plan = _family_plan("qwen3", "hsdp2x2")
    q = plan.params["layers.0.self_attn.q_proj.weight"]
    assert (q.storage, q.compute, q.partial) == (("R", "S(0)"), ("R", "R"), ("dp_replicate", "dp_shard"))
    names = [n for n in plan.params if n.startswith("layers.0.")]
    assert plan.gathers_per_block(names) == 1  # every param of the block S(0) over dp_shard alone
    assert plan.gathers_per_block(["embed_tokens.weight", "layers.0.input_layernorm.weight"]) == 1
    assert _family_plan("qwen3", "dp2").gathers_per_block(names) is None  # replicated: nothing to gather


# --- mesh axes: roles decide --------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(parallel.ROLES), st.integers(1, 4), min_size=1))
def test_mesh_axes_keep_the_canonical_order_and_derive_every_group_from_the_roles(degrees: dict[str, int]) -> None:
    axes = MeshAxes.of(**degrees)
    assert [parallel.ROLES.index(a.role) for a in axes.axes] == sorted(parallel.ROLES.index(a.role) for a in axes.axes)
    assert set(axes.token_axes) >= set(axes.sample_axes)
    assert "tp" not in axes.token_axes
    assert "pp" not in axes.token_axes
    size = 1
    for axis in axes.axes:
        if axis.name in axes.sample_axes:
            size *= axis.size
    assert axes.data_parallel_size == size
    # the data-parallel index is row-major over the sample axes, outermost first: every index once
    shape = [a.size for a in axes.axes if a.name in axes.sample_axes]
    seen = set()
    for flat in range(size):
        coords, rest = {}, flat
        for axis, extent in zip(reversed(axes.sample_axes), reversed(shape), strict=True):
            coords[axis], rest = rest % extent, rest // extent
        coords.update({a.name: 0 for a in axes.axes if a.name not in axes.sample_axes})
        seen.add(axes.data_parallel_rank(coords))
        assert axes.data_parallel_rank(coords) == flat
    assert seen == set(range(size))


def test_mesh_axes_refuse_a_repeated_role_an_unknown_one_and_a_bad_size() -> None:
    with pytest.raises(ValueError, match=r"role 'tensor' is on two axes; give each role one axis"):
        MeshAxes((MeshAxis("tp", "tensor", 2), MeshAxis("tp2", "tensor", 2)))
    with pytest.raises(ValueError, match=r"'sequence' is not a role; pass degrees by role"):
        MeshAxes.of(sequence=2)
    with pytest.raises(ValueError, match=r"axis 'dp_shard' has size 0; pass a positive int"):
        MeshAxes((MeshAxis("dp_shard", "data_shard", 0),))


class _Mesh:
    """A stand-in with a ``DeviceMesh``'s names and sizes (``MeshAxes.of_mesh`` reads nothing else)."""

    def __init__(self, names: tuple[str, ...] | None, sizes: tuple[int, ...]) -> None:
        self.mesh_dim_names, self._sizes = names, sizes

    def size(self, index: int) -> int:
        return self._sizes[index]


def test_mesh_axes_read_a_mesh_by_its_dimension_names() -> None:
    assert MeshAxes.of_mesh(_Mesh(("pp", "dp_replicate", "dp_shard"), (2, 1, 2))) == MeshAxes.of(
        pipeline=2, data_shard=2
    )
    with pytest.raises(ValueError, match=r"mesh dimension 'fsdp' names no role; name it one of pp, dp_replicate"):
        MeshAxes.of_mesh(_Mesh(("fsdp",), (2,)))
    with pytest.raises(ValueError, match=r"the mesh has no dimension names"):
        MeshAxes.of_mesh(_Mesh(None, (2,)))


# --- the plan ------------------------------------------------------------------------------------------------------

_SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), _SHAPES, min_size=1),
    st.integers(1, 3),
    st.integers(1, 3),
)
def test_the_default_plan_stores_params_as_data_parallel_placements_do(
    shapes: dict[str, tuple[int, ...]], replicate: int, shard: int
) -> None:
    from torch.distributed.tensor import Replicate, Shard

    axes = MeshAxes.of(data_replicate=replicate, data_shard=shard)
    plan = make_plan({name: torch.empty(shape, device="meta") for name, shape in shapes.items()}, axes)
    for name, shape in shapes.items():
        expected = (Replicate(), Shard(0) if shape else Replicate())  # data_parallel_placements' answer
        assert plan.placements(name) == expected
        assert plan.params[name].compute == ("R", "R")
        assert plan.params[name].partial == axes.names  # every axis sees other tokens


def test_the_rules_split_a_logical_dimension_over_its_roles_first_match_wins() -> None:
    params = {"q": torch.empty(8, 4, device="meta"), "norm": torch.empty(4, device="meta")}
    dims = {"q": ("heads", "embed"), "norm": ("embed",)}
    rules = (("heads", ("tensor",)), ("embed", ("tensor",)))  # embed would take tensor too, but heads used it first
    plan = make_plan(params, MeshAxes.of(data_shard=2, tensor=2), dims=dims, rules=rules)
    assert plan.params["q"].compute == ("R", "R", "S(0)")
    assert plan.params["q"].storage == ("R", "R", "S(0)")  # dim 0 already split: FSDP leaves it
    assert plan.params["q"].partial == ("dp_replicate", "dp_shard")  # not over tp: the shards are distinct
    assert plan.params["norm"].compute == ("R", "R", "S(0)")
    assert plan.gathers_per_block(["q"]) is None
    on_one = make_plan(params, MeshAxes.of(data_shard=2), dims=dims, rules=rules)  # no tensor axis: rule skipped
    assert on_one.params["q"].compute == ("R", "R")


def test_a_placement_override_is_checked_and_named() -> None:
    from torch.distributed.tensor import Partial, Shard

    params = {"w": torch.empty(3, device="meta")}
    axes = MeshAxes.of(data_shard=2)
    with pytest.raises(ValueError, match=r"params\['w'\] got placements \('S\(0\)',\) for a 2-axis mesh"):
        make_plan(params, axes, placements=lambda n, t, m: (Shard(0),))
    with pytest.raises(ValueError, match=r"params\['w'\] got placement Partial\(sum\); a parameter is Replicate"):
        make_plan(params, axes, placements=lambda n, t, m: (Partial(), Shard(0)))
    with pytest.raises(ValueError, match=r"params\['w'\] has 1 dims but got S\(1\); shard a dimension it has"):
        make_plan(params, axes, placements=lambda n, t, m: ("R", "S(1)"))


# --- the step built against the plan ---------------------------------------------------------------------------------


def _fake_mesh(replicate: int, shard: int) -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn.loop import init_data_parallel_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=replicate * shard)
    return init_data_parallel_mesh(replicate, shard, device_type="cpu")


def test_a_state_that_is_not_the_plans_is_refused_at_the_first_call_by_name() -> None:
    model = d9dfn.models.Qwen3LM(Qwen3Config.tiny(num_layers=2))
    task, opt = CausalLMTask(), optim.sgd(0.1)
    tokens = torch.randint(0, 64, (2, 5))
    batch = {"input_ids": tokens, "labels": tokens}
    try:
        mesh = _fake_mesh(1, 2)
        state = d9dfn.init_train_state(model, opt, mesh=mesh)
        step = d9dfn.make_train_step(model, task, opt, compile=False)
        with pytest.raises(ValueError, match=r"params\['embed_tokens.weight'\] is a DTensor but the step was built "):
            step(state, batch)
        replicated = parallel.plan_for(model, mesh, placements=lambda n, t, m: ("R", "R"))
        step = d9dfn.make_train_step(model, task, opt, compile=False, plan=replicated)
        with pytest.raises(ValueError, match=r"is placed \('R', 'S\(0\)'\) but the plan stores it \('R', 'R'\)"):
            step(state, batch)
    finally:
        dist.destroy_process_group()


def test_the_step_decides_its_gathers_and_tail_when_built() -> None:
    model = d9dfn.models.Qwen3LM(Qwen3Config.tiny(num_layers=2))
    task, opt = CausalLMTask(), optim.adamw(0.1)
    try:
        mesh = _fake_mesh(1, 2)
        plan = parallel.plan_for(model, mesh)
        step = d9dfn.make_train_step(model, task, opt, compile=False, plan=plan, repeated_blocks="auto")
        runner = step.pieces["stages"]
        assert sorted(runner.gathering.layouts) == ["layers.0", "layers.1"]  # before any call
        assert step.pieces["tail"].fused is not None  # AdamW's kernel for CPU params, chosen at build
        on_cuda = d9dfn.make_train_step(model, task, opt, compile=False, plan=plan, device="cuda")
        assert on_cuda.pieces["tail"].fused is None  # the compiled tail there
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_rules_split_heads_and_mlp_column_then_row_wise() -> None:
    plan = _family_plan("qwen3", "tp2")  # axes (dp_replicate, dp_shard, tp)
    layout = plan.params
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert layout[f"layers.0.{name}.weight"].compute == ("R", "R", "S(0)"), name  # column-parallel
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert layout[f"layers.0.{name}.weight"].compute == ("R", "R", "S(1)"), name  # row-parallel
    # A split param's gradient is its shard's, complete over tp; partial over the data axes only.
    assert layout["layers.0.self_attn.q_proj.weight"].partial == ("dp_replicate", "dp_shard")
    # Residual-stream params get the same whole gradient on every tp rank (enter_tensor_parallel's adjoint summed it).
    for name in ("embed_tokens.weight", "layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"):
        assert layout[name].compute == ("R", "R", "R"), name
        assert "tp" not in layout[name].partial, name
    # The per-head norms see this rank's heads only: partial over tp.
    assert layout["layers.0.self_attn.q_norm.weight"].partial == ("dp_replicate", "dp_shard", "tp")
    assert layout["layers.0.self_attn.k_norm.weight"].partial == ("dp_replicate", "dp_shard", "tp")
    assert parallel.MeshAxes.of(tensor=2).token_axes == ("dp_replicate", "dp_shard")  # tp ranks see the same tokens


def test_a_tensor_parallel_degree_that_does_not_divide_the_heads_is_refused_naming_the_setting() -> None:
    from d9dfn.models._decoder import bind_tensor_parallel

    model = d9dfn.models.Qwen3LM(
        Qwen3Config.tiny(num_heads=6, num_kv_heads=3, head_dim=4, intermediate_size=48, num_layers=1)
    )
    with pytest.raises(ValueError, match=r"mesh.tensor_parallel=2 does not divide model num_kv_heads=3: .*--set mesh"):
        bind_tensor_parallel(model, parallel.TensorParallel("unused", 2))
    assert bind_tensor_parallel(model, parallel.TensorParallel("unused", 3)) == 2  # one attention, one MLP
    assert bind_tensor_parallel(model, None) == 2
