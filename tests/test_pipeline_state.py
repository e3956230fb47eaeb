"""PipelineState: immutable, explicit specs, split/merge, pytree and compile behaviour.

The split/merge rows are those of docs/design/pipeline-state.md.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given
from hypothesis import strategies as st

from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import NAMESPACE, format_path, tree_flatten_with_path, tree_map
from d9dfn._sharding import SpecReplicate, SpecShard
from d9dfn.testing import (
    ExampleNode,
    assert_trees_close,
    microbatch_counts,
    pipeline_states,
    tensor_trees,
    tensors,
)

# --- construction, reading, immutability -----------------------------------------------------------


def test_pipeline_state_mapping_interface() -> None:
    state = PipelineState.from_dict({"a": torch.ones(2), "b": 3})
    assert len(state) == 2
    assert list(state) == ["a", "b"]
    assert "a" in state
    assert "c" not in state
    assert 1 not in state
    assert state.get("c") is None
    assert state.get("b") == 3
    assert state["b"] == 3
    assert list(state.keys()) == ["a", "b"]
    assert state.is_global
    assert state.num_microbatches is None
    assert len(PipelineState()) == 0


def test_pipeline_state_missing_key_raises_key_error_listing_keys() -> None:
    state = PipelineState.from_dict({"logits": torch.ones(2), "labels": torch.ones(2)})
    with pytest.raises(KeyError, match=r"no key 'loss'; present keys: \['logits', 'labels'\]"):
        state["loss"]
    with pytest.raises(KeyError, match="no key 'loss'"):
        state.spec("loss")


@pytest.mark.parametrize("key", [1, ("a",), None, b"a"])
def test_pipeline_state_non_str_key_raises_type_error(key: Any) -> None:
    with pytest.raises(TypeError, match=r"PipelineState\.set: keys are str"):
        PipelineState().set(key, 1)
    with pytest.raises(TypeError, match="keys are str"):
        PipelineState()[key]


def test_pipeline_state_set_returns_new_state_and_leaves_old_unchanged() -> None:
    before = PipelineState.from_dict({"a": torch.ones(2)})
    after = before.set("a", torch.zeros(3)).set("b", 1)
    assert list(before) == ["a"]
    assert before["a"].tolist() == [1.0, 1.0]
    assert after["a"].tolist() == [0.0, 0.0, 0.0]
    assert after.spec("b") == SpecReplicate()


def test_pipeline_state_is_immutable() -> None:
    state = PipelineState()
    with pytest.raises(AttributeError, match="immutable"):
        state._values = {}  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del state._values
    with pytest.raises(TypeError):
        state["a"] = 1  # type: ignore[index]


def test_pipeline_state_copies_and_pickles() -> None:
    state = PipelineState.from_dict({"a": torch.arange(4)}).split(2)[1]
    for other in (copy.copy(state), copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        assert_trees_close(other, state, rtol=0, atol=0)
        assert other.num_microbatches == 2


def test_pipeline_state_from_dict_validates() -> None:
    with pytest.raises(ValueError, match=r"specs given for keys \['b'\] that have no value"):
        PipelineState.from_dict({"a": 1}, {"b": SpecReplicate()})
    with pytest.raises(TypeError, match="values must be a mapping"):
        PipelineState.from_dict([("a", 1)])  # type: ignore[arg-type]
    state = PipelineState.from_dict({"a": torch.ones(2, 4)}, {"a": SpecShard(1)})
    assert state.spec("a") == SpecShard(1)


def test_pipeline_state_repr_names_view_keys_and_specs() -> None:
    state = PipelineState.from_dict({"x": torch.ones(4)})
    assert repr(state) == "PipelineState(global; {'x': tensor(4,) @ SpecShard(0)})"
    assert "microbatch of 2" in repr(state.split(2)[0])


# --- detach ----------------------------------------------------------------------------------------


def test_pipeline_state_detaches_tensors_unless_asked() -> None:
    w = torch.ones(3, requires_grad=True)
    y = {"y": w * 2, "n": 1}
    assert not PipelineState().set("out", y)["out"]["y"].requires_grad
    kept = PipelineState().set("out", y, detach=False)["out"]["y"]
    assert kept.requires_grad
    assert kept.grad_fn is not None


# --- default specs ---------------------------------------------------------------------------------


def test_pipeline_state_global_default_spec_recurses_into_dicts() -> None:
    # d9d replicates a whole dict written globally; d9dfn splits the tensors inside (spec_on_dim).
    state = PipelineState().set("meta", {"a": torch.arange(4), "t": torch.tensor(2.0), "tags": ["a", "b"], "s": "x"})
    assert state.spec("meta") == {"a": SpecShard(0), "t": SpecReplicate(), "tags": SpecShard(0), "s": SpecReplicate()}
    _, second = state.split(2)
    assert second["meta"]["a"].tolist() == [2, 3]
    assert second["meta"]["tags"] == ["b"]
    assert second["meta"]["t"] is state["meta"]["t"]
    # d9d's behaviour is one explicit spec away.
    whole = PipelineState().set("meta", {"a": torch.arange(4)}, spec=SpecReplicate())
    assert all(part["meta"] is whole["meta"] for part in whole.split(2))


def test_pipeline_state_microbatch_default_specs() -> None:
    (part,) = PipelineState().split(1)
    value = {"loss": torch.tensor(1.0), "ids": torch.ones(2), "tags": ["a"], "name": "x", "none": None}
    assert part.set("v", value).spec("v") == {
        "loss": SpecShard(0, stack=True),
        "ids": SpecShard(0),
        "tags": SpecShard(0),
        "name": SpecShard(0, stack=True),
        "none": SpecShard(0, stack=True),
    }


def test_pipeline_state_spec_not_sticky_across_writes_or_steps() -> None:
    # d9d keeps the first guessed spec across reset(): a key first written per shard as a 0-d tensor
    # stacks in every later step. d9dfn computes the spec at each write.
    def step(values: list[torch.Tensor]) -> torch.Tensor:
        parts = PipelineState().split(len(values))
        return PipelineState.merge([p.set("k", v) for p, v in zip(parts, values, strict=True)])["k"]

    assert step([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]
    assert step([torch.ones(2), torch.zeros(1)]).tolist() == [1.0, 1.0, 0.0]
    state = PipelineState().set("k", torch.tensor(1.0))
    assert state.spec("k") == SpecReplicate()
    assert state.set("k", torch.ones(2)).spec("k") == SpecShard(0)


def test_pipeline_state_explicit_spec_none_leaves_become_replicate() -> None:
    state = PipelineState().set("v", {"a": torch.ones(2), "b": 1}, spec={"a": SpecShard(0), "b": None})
    assert state.spec("v") == {"a": SpecShard(0), "b": SpecReplicate()}


def test_pipeline_state_set_invalid_spec_names_key_path() -> None:
    with pytest.raises(ValueError, match=r"PipelineState.set: leaf \['x'\]\['a'\] is a 0-d tensor.*SpecReplicate"):
        PipelineState().set("x", {"a": torch.tensor(1.0)}, spec={"a": SpecShard(0)})
    with pytest.raises(ValueError, match=r"PipelineState.set: the spec does not match the tree at \['x'\]"):
        PipelineState().set("x", {"a": 1}, spec={"b": None})
    with pytest.raises(TypeError, match=r"PipelineState.set: leaf \['x'\] is a int leaf, which SpecShard\(0\) cannot"):
        PipelineState().set("x", 3, spec=SpecShard(0))
    with pytest.raises(ValueError, match=r"leaf \['x'\] has shape \(2,\), which has no dim 1"):
        PipelineState().set("x", torch.ones(2), spec=SpecShard(1))
    (part,) = PipelineState().split(1)
    with pytest.raises(ValueError, match=r"leaf \['x'\] is a 0-d tensor, which SpecShard\(0\) cannot concatenate"):
        part.set("x", torch.tensor(1.0), spec=SpecShard(0))
    with pytest.raises(TypeError, match=r"leaf \['x'\] is a str leaf, which SpecShard\(0\) cannot concatenate"):
        part.set("x", "s", spec=SpecShard(0))
    assert part.set("x", "s", spec=SpecShard(0, stack=True)).spec("x") == SpecShard(0, stack=True)
    assert part.set("x", torch.ones(2), spec=SpecShard(-2, stack=True)).spec("x") == SpecShard(-2, stack=True)


# --- split / merge: d9d's examples (docs/design/pipeline-state.md) ------------------------------------


def test_pipeline_state_merge_stacks_scalars() -> None:
    a, b = PipelineState().split(2)
    merged = PipelineState.merge([a.set("x", torch.tensor(1.0)), b.set("x", torch.tensor(2.0))])
    assert merged["x"].tolist() == [1.0, 2.0]
    assert merged.is_global
    assert merged.spec("x") == SpecShard(0, stack=True)


def test_pipeline_state_merge_dicts_recurse_or_stack_by_spec() -> None:
    t, u = torch.ones(1), torch.zeros(2)
    a, b = PipelineState().split(2)
    merged = PipelineState.merge([a.set("d", {"a": t}), b.set("d", {"a": u})])
    assert merged["d"]["a"].tolist() == [1.0, 0.0, 0.0]  # d9d would give [{"a": t}, {"a": u}]
    stack = SpecShard(0, stack=True)
    merged = PipelineState.merge([a.set("d", {"a": t}, spec=stack), b.set("d", {"a": u}, spec=stack)])
    assert merged["d"][0]["a"] is not None
    assert_trees_close(merged["d"], [{"a": t}, {"a": u}], rtol=0, atol=0)


def test_pipeline_state_split_uneven_raises_unless_even_false() -> None:
    state = PipelineState.from_dict({"labels": torch.arange(3)})
    message = r"PipelineState.split: leaf \['labels'\] has shape \(3,\) with 3 rows on dim 0, which 2 microbatches"
    with pytest.raises(ValueError, match=message):
        state.split(2)
    assert [p["labels"].tolist() for p in state.split(2, even=False)] == [[0, 1], [2]]


def test_pipeline_state_single_microbatch() -> None:
    state = PipelineState.from_dict({"x": torch.arange(3)})
    (part,) = state.split(1)
    assert part["x"].tolist() == [0, 1, 2]
    merged = PipelineState.merge([part.set("s", torch.tensor(5.0))])
    assert merged["s"].tolist() == [5.0]
    assert merged["x"].tolist() == [0, 1, 2]


def test_pipeline_state_round_trip_gives_equal_new_tensors_and_same_replicated_objects() -> None:
    x, scalar = torch.arange(4), torch.tensor(3.0)
    state = PipelineState().set("x", x, detach=False).set("scalar", scalar, detach=False)
    merged = PipelineState.merge(state.split(2))
    assert merged["x"] is not x
    assert torch.equal(merged["x"], x)
    assert merged["scalar"] is scalar


def test_pipeline_state_microbatch_write_replaces_split_value() -> None:
    # d9d raises when a shard write hits a key that holds a global value; here the key simply gets the new
    # value and the spec of this write.
    state = PipelineState.from_dict({"x": torch.arange(4)})
    parts = [p.set("x", p["x"] * 10) for p in state.split(2)]
    assert PipelineState.merge(parts)["x"].tolist() == [0, 10, 20, 30]


def test_pipeline_state_split_errors() -> None:
    part = PipelineState().split(2)[0]
    with pytest.raises(ValueError, match="already one of 2 microbatches"):
        part.split(2)
    with pytest.raises(ValueError, match="num_microbatches must be at least 1"):
        PipelineState().split(0)
    with pytest.raises(TypeError, match="num_microbatches must be an int"):
        PipelineState().split(2.0)  # type: ignore[arg-type]


def test_pipeline_state_merge_errors_name_key_and_microbatch() -> None:
    a, b, c = PipelineState.from_dict({"x": torch.arange(3)}).split(3)
    with pytest.raises(ValueError, match=r"key 'loss' is set in microbatch 0 but missing in microbatch 2"):
        PipelineState.merge([a.set("loss", torch.tensor(1.0)), b.set("loss", torch.tensor(1.0)), c])
    with pytest.raises(ValueError, match=r"key 'extra' is set in microbatch 1 but missing in microbatch 0"):
        PipelineState.merge([a, b.set("extra", 1), c])
    with pytest.raises(
        ValueError,
        match=r"key 'loss' has spec SpecShard\(0, stack=True\) in microbatch 0 but SpecShard\(0\) in microbatch 1",
    ):
        PipelineState.merge([a.set("loss", torch.tensor(1.0)), b.set("loss", torch.ones(1)), c.set("loss", 1)])
    with pytest.raises(
        ValueError, match=r"key 'd' has spec \{'a': .*\} in microbatch 0 but \{'b': .*\} in microbatch 2"
    ):
        PipelineState.merge([a.set("d", {"a": 1}), b.set("d", {"a": 1}), c.set("d", {"b": 1})])
    stack = SpecShard(0, stack=True)
    ragged = [p.set("y", torch.ones(n), spec=stack) for p, n in zip((a, b, c), (2, 3, 2), strict=True)]
    with pytest.raises(ValueError, match=r"leaf \['y'\] has shape \(2,\) in microbatch 0 but \(3,\) in microbatch 1"):
        PipelineState.merge(ragged)
    with pytest.raises(ValueError, match="got no states"):
        PipelineState.merge([])
    with pytest.raises(ValueError, match="state 0 is a global state"):
        PipelineState.merge([PipelineState()])
    with pytest.raises(ValueError, match="state 0 is one of 3 microbatches, but 2 states were given"):
        PipelineState.merge([a, b])
    with pytest.raises(TypeError, match="item 1 is a dict, not a PipelineState"):
        PipelineState.merge([a, {}, c])  # type: ignore[list-item]


def test_pipeline_state_merge_check_replicated() -> None:
    a, b = PipelineState().split(2)
    a, b = a.set("r", 1, spec=SpecReplicate()), b.set("r", 2, spec=SpecReplicate())
    assert PipelineState.merge([a, b])["r"] == 1
    with pytest.raises(ValueError, match=r"PipelineState.merge: replicated leaf \['r'\] differs between microbatch 0"):
        PipelineState.merge([a, b], check_replicated=True)


# --- properties ------------------------------------------------------------------------------------


@given(microbatch_counts().flatmap(lambda n: st.tuples(st.just(n), pipeline_states(n))))
def test_pipeline_state_merge_of_split_is_identity(case: tuple[int, PipelineState]) -> None:
    num_microbatches, state = case
    parts = state.split(num_microbatches)
    assert len(parts) == num_microbatches
    assert all(part.num_microbatches == num_microbatches and list(part) == list(state) for part in parts)
    merged = PipelineState.merge(parts)
    # Values, keys, specs and view: assert_trees_close compares the treespecs too.
    assert_trees_close(merged, state, rtol=0, atol=0)
    assert all(merged.spec(key) == state.spec(key) for key in state)


_MB_LEAVES = st.one_of(tensors(), st.none(), st.integers(-3, 3), st.text(max_size=2))
_MB_TREES = tensor_trees(_MB_LEAVES, max_leaves=6)


def _variant(tree: Any, index: int, repeats: int) -> Any:
    """Microbatch ``index``'s value: the same leaf kinds, with other contents and other dim-0 sizes."""

    def leaf(x: Any) -> Any:
        if isinstance(x, list):
            return [f"{index}"] * repeats
        if isinstance(x, torch.Tensor):
            x = x ^ bool(index % 2) if x.dtype == torch.bool else x + index
            return x if x.ndim == 0 else x.repeat(repeats, *[1] * (x.ndim - 1))
        return f"{x!r}/{index}"

    return tree_map(leaf, tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)))


def _expected_merge(values: list[Any]) -> Any:
    """The documented global value of per-microbatch writes, written out independently."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values) if first.ndim == 0 else torch.cat(values)
    if isinstance(first, list):
        return [item for value in values for item in value]
    if isinstance(first, dict):
        return {key: _expected_merge([value[key] for value in values]) for key in first}
    if isinstance(first, tuple):
        return tuple(_expected_merge([value[i] for value in values]) for i in range(len(first)))
    if isinstance(first, ExampleNode):
        return first.replace(
            left=_expected_merge([v.left for v in values]), right=_expected_merge([v.right for v in values])
        )
    return list(values)


@given(_MB_TREES, microbatch_counts(), st.lists(st.integers(0, 2), min_size=4, max_size=4))
def test_pipeline_state_per_microbatch_writes_merge_to_documented_value(
    tree: Any, num_microbatches: int, repeats: list[int]
) -> None:
    parts = PipelineState().split(num_microbatches)
    values = [_variant(tree, i, repeats[i]) for i in range(num_microbatches)]
    merged = PipelineState.merge([part.set("k", value) for part, value in zip(parts, values, strict=True)])
    assert_trees_close(merged["k"], _expected_merge(values), rtol=0, atol=0)
    # Splitting the merged state again gives each microbatch its own value back (concat sizes aside).
    if len(set(repeats[:num_microbatches])) == 1:
        again = merged.split(num_microbatches, even=False)
        for part, value in zip(again, values, strict=True):
            assert_trees_close(part["k"], value, rtol=0, atol=0)


@given(_MB_TREES, st.integers(2, 4), st.data())
def test_pipeline_state_merge_with_a_changed_kind_raises_naming_key_and_microbatch(
    tree: Any, num_microbatches: int, data: st.DataObject
) -> None:
    _, leaves, _ = tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)))
    kinds = [
        "scalar"
        if isinstance(x, torch.Tensor) and x.ndim == 0
        else "rows"
        if isinstance(x, (torch.Tensor, list))
        else ""
        for x in leaves
    ]
    candidates = [i for i, kind in enumerate(kinds) if kind]
    if not candidates:
        return
    index = data.draw(st.sampled_from(candidates))
    culprit = data.draw(st.integers(1, num_microbatches - 1))
    # One microbatch writes a 1-D tensor where the others wrote a 0-d one (or the reverse): specs differ.
    swap = torch.ones(2) if kinds[index] == "scalar" else torch.tensor(1.0)
    swapped = optree.tree_unflatten(
        optree.tree_structure(
            tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)), none_is_leaf=True, namespace=NAMESPACE
        ),
        [swap if i == index else leaf for i, leaf in enumerate(leaves)],
    )
    parts = PipelineState().split(num_microbatches)
    written = [part.set("key", swapped if i == culprit else tree) for i, part in enumerate(parts)]
    with pytest.raises(ValueError, match=rf"key 'key' has spec .* in microbatch 0 but .* in microbatch {culprit}"):
        PipelineState.merge(written)


@given(_MB_TREES, st.integers(2, 4))
def test_pipeline_state_split_uneven_raises_naming_key_path(tree: Any, num_microbatches: int) -> None:
    state = PipelineState().set("key", tree)
    leaves = tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)))
    bad = [
        path
        for path, x in zip(leaves[0], leaves[1], strict=True)
        if (isinstance(x, list) and len(x) % num_microbatches)
        or (isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] % num_microbatches)
    ]
    if not bad:
        assert len(state.split(num_microbatches)) == num_microbatches
        return
    with pytest.raises(ValueError, match=r"PipelineState\.split: leaf .* microbatches cannot divide evenly") as info:
        state.split(num_microbatches)
    assert format_path(("key", *bad[0])) in str(info.value)


# --- pytree ----------------------------------------------------------------------------------------


def _state() -> PipelineState:
    return PipelineState.from_dict({"b": torch.ones(4), "a": {"x": torch.zeros(4, 2), "n": 3}})


def test_pipeline_state_is_an_optree_node() -> None:
    state = _state()
    paths, leaves, treespec = tree_flatten_with_path(state)
    assert paths == [("b",), ("a", "x"), ("a", "n")]
    assert leaves[0] is state["b"]
    rebuilt = optree.tree_unflatten(treespec, leaves)
    assert isinstance(rebuilt, PipelineState)
    assert rebuilt.spec("a") == state.spec("a")
    doubled = tree_map(lambda x: x * 2, state)
    assert doubled["a"]["n"] == 6
    assert doubled.spec("b") == SpecShard(0)
    accessors = optree.tree_accessors(state, none_is_leaf=True, namespace=NAMESPACE)
    assert accessors[0](state) is state["b"]


def test_pipeline_state_treespec_compares_specs_and_view() -> None:
    spec = optree.tree_structure(_state(), none_is_leaf=True, namespace=NAMESPACE)
    assert spec == optree.tree_structure(_state(), none_is_leaf=True, namespace=NAMESPACE)
    assert hash(spec) == hash(optree.tree_structure(_state(), none_is_leaf=True, namespace=NAMESPACE))
    other = _state().set("b", torch.ones(4), spec=SpecReplicate())
    assert spec != optree.tree_structure(other, none_is_leaf=True, namespace=NAMESPACE)
    parts = PipelineState.from_dict({"b": torch.ones(4)}).split(2)
    single = optree.tree_structure(
        PipelineState.from_dict({"b": torch.ones(2)}), none_is_leaf=True, namespace=NAMESPACE
    )
    assert optree.tree_structure(parts[0], none_is_leaf=True, namespace=NAMESPACE) != single


def test_pipeline_state_is_a_torch_pytree_node() -> None:
    state = _state()
    leaves, treespec = torch_pytree.tree_flatten(state)
    assert leaves[0] is state["b"]
    assert leaves[1] is state["a"]["x"]
    assert leaves[2] == 3
    rebuilt = torch_pytree.tree_unflatten(leaves, treespec)
    assert_trees_close(rebuilt, state, rtol=0, atol=0)
    keyed, _ = torch_pytree.tree_flatten_with_path(state)
    assert torch_pytree.keystr(keyed[1][0]) == "['a']['x']"


def test_pipeline_state_flows_through_torch_func_grad() -> None:
    state = PipelineState.from_dict({"w": torch.tensor([1.0, 2.0]), "scale": torch.tensor(3.0)})

    def loss(s: PipelineState) -> torch.Tensor:
        return (s["w"] ** 2).sum() * s["scale"]

    grads = torch.func.grad(loss)(state)
    assert isinstance(grads, PipelineState)
    assert grads["w"].tolist() == [6.0, 12.0]
    assert grads["scale"].item() == 5.0
    assert grads.spec("w") == SpecShard(0)


# --- compile ---------------------------------------------------------------------------------------


def _step(state: PipelineState) -> PipelineState:
    state = state.set("y", state["x"] * 2).set("meta", {"scale": state["x"].sum(), "tag": "t"})
    # A state built inside the compiled function, as the step does for each batch.
    state = PipelineState.from_dict(dict(state.items()), {"labels": SpecShard(0)})
    parts = state.split(2)
    parts = [part.set("loss", (part["x"] * part["meta"]["scale"]).mean()).set("rows", part["y"] + 1) for part in parts]
    return PipelineState.merge(parts)


def _input(offset: float) -> PipelineState:
    return PipelineState.from_dict({"x": torch.arange(4.0) + offset, "labels": [1, 2, 3, 4], "n": 7})


@pytest.mark.slow
def test_pipeline_state_compiles_with_no_graph_breaks_and_no_recompiles() -> None:
    explanation = torch._dynamo.explain(_step)(_input(0.0))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    out = compiled(_input(0.0))
    assert_trees_close(out, _step(_input(0.0)))
    assert out.spec("loss") == SpecShard(0, stack=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = compiled(_input(1.0))
    assert_trees_close(out, _step(_input(1.0)))


# Importing inductor's CPU backend touches torch.jit.script_method, which warns; not ours to fix.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
@pytest.mark.compiled
def test_pipeline_state_compiles_with_inductor() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    assert_trees_close(compiled(_input(0.5)), _step(_input(0.5)))
