"""shard_tree / unshard_tree / spec_on_dim: d9d's semantics row by row, plus properties.

The rows are those of docs/design/pipeline-state.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from d9dfn._pytree import NAMESPACE, format_path, tree_flatten_with_path, tree_map, tree_structure
from d9dfn._sharding import SpecReplicate, SpecShard, shard_tree, spec_on_dim, spec_replicate_all, unshard_tree
from d9dfn.testing import (
    ExampleNode,
    assert_trees_close,
    microbatch_counts,
    shardable_trees_and_specs,
    tensor_trees,
    tensors,
)

# --- helpers ---------------------------------------------------------------------------------------


def _is_node(x: Any) -> bool:
    return not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for entry in path:
        level = optree.tree_flatten_one_level(tree, none_is_leaf=True, namespace=NAMESPACE)
        tree = level.children[level.entries.index(entry)]
    return tree


def _replace_at(tree: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    level = optree.tree_flatten_one_level(tree, none_is_leaf=True, namespace=NAMESPACE)
    children = list(level.children)
    index = level.entries.index(path[0])
    children[index] = _replace_at(children[index], path[1:], new)
    return level.unflatten_func(level.metadata, children)


def _node_paths(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if not _is_node(tree):
        return []
    level = optree.tree_flatten_one_level(tree, none_is_leaf=True, namespace=NAMESPACE)
    out = [path]
    for entry, child in zip(level.entries, level.children, strict=True):
        out += _node_paths(child, (*path, entry))
    return out


def _spec_leaves_with_paths(spec: Any) -> list[tuple[tuple[Any, ...], Any]]:
    paths, leaves, _ = tree_flatten_with_path(spec)
    return list(zip(paths, leaves, strict=True))


def _sizes(x: Any, spec: SpecShard, num_shards: int) -> list[int]:
    """What torch.tensor_split gives for the split dim's size."""
    size = len(x) if isinstance(x, list) else x.shape[spec.dim]
    return [len(chunk) for chunk in torch.tensor_split(torch.arange(size), num_shards)]


# --- spec leaves -----------------------------------------------------------------------------------


def test_spec_leaves_frozen_hashable_and_leaves_of_trees() -> None:
    assert hash(SpecShard(0)) == hash(SpecShard(0))
    assert len({SpecShard(0), SpecShard(0), SpecShard(0, stack=True), SpecReplicate(), SpecReplicate()}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        SpecShard(0).dim = 1  # type: ignore[misc]
    spec = {"a": SpecShard(1), "b": [SpecReplicate(), None]}
    assert tree_structure(spec) == tree_structure({"a": 0, "b": [0, 0]})
    assert hash(tree_structure(spec)) == hash(tree_structure({"a": SpecShard(1), "b": [SpecReplicate(), None]}))


@pytest.mark.parametrize(("dim", "stack"), [(1.0, False), (True, False), ("0", False), (0, 1)])
def test_spec_shard_rejects_bad_fields(dim: Any, stack: Any) -> None:
    with pytest.raises(TypeError, match="SpecShard"):
        SpecShard(dim, stack=stack)


# --- shard_tree: d9d's rows (docs/design/pipeline-state.md) ----------------------------------------


def test_shard_tree_prefix_spec_covers_subtree() -> None:
    meta = {"a": torch.arange(4), "b": [1, 2]}
    tree = {"x": torch.arange(4), "meta": meta}
    shards = shard_tree(tree, {"x": SpecShard(0), "meta": SpecReplicate()}, 2, even=True)
    assert all(shard["meta"] is meta for shard in shards)
    assert [shard["x"].tolist() for shard in shards] == [[0, 1], [2, 3]]


def test_shard_tree_structure_mismatch_names_path() -> None:
    tree = {"kwargs": {"labels": torch.arange(4), "mask": torch.ones(4)}}
    with pytest.raises(ValueError, match=r"shard_tree: the spec does not match the tree at \['kwargs'\]"):
        shard_tree(tree, {"kwargs": {"labels": SpecShard(0)}}, 2, even=True)
    with pytest.raises(ValueError, match=r"at \['kwargs'\]: the spec has a list of length 1 but the tree has a dict"):
        shard_tree(tree, {"kwargs": [SpecShard(0)]}, 2, even=True)


def test_shard_tree_spec_dict_in_another_order_still_fits() -> None:
    tree = {"a": torch.arange(4), "b": torch.arange(2)}
    shards = shard_tree(tree, {"b": SpecReplicate(), "a": SpecShard(0)}, 2, even=True)
    assert list(shards[0]) == ["a", "b"]
    assert shards[1]["a"].tolist() == [2, 3]


def test_shard_tree_replicate_passes_same_object_of_any_type() -> None:
    leaves = [torch.arange(3), torch.tensor(1.0), "s", 3, None, {"d": 1}, (1, 2), object()]
    for leaf in leaves:
        shards = shard_tree(leaf, SpecReplicate(), 3, even=True)
        assert all(shard is leaf for shard in shards)


def test_shard_tree_none_spec_leaf_replicates() -> None:
    # d9d's docs promise this; its code raises TypeError. d9dfn follows the docs.
    tree = {"x": torch.arange(4), "y": torch.arange(4)}
    shards = shard_tree(tree, {"x": SpecShard(0), "y": None}, 2, even=True)
    assert all(shard["y"] is tree["y"] for shard in shards)
    assert shard_tree(tree, None, 2, even=True) == (tree, tree)


def test_shard_tree_zero_dim_tensor_raises() -> None:
    with pytest.raises(ValueError, match=r"shard_tree: leaf \['t'\] is a 0-d tensor.*SpecReplicate\(\)"):
        shard_tree({"t": torch.tensor(1.0)}, {"t": SpecShard(0)}, 2, even=False)


def test_shard_tree_stack_unbinds_and_needs_size_equal_num_shards() -> None:
    x = torch.arange(6).reshape(2, 3)
    shards = shard_tree(x, SpecShard(1, stack=True), 3, even=True)
    assert [s.tolist() for s in shards] == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match=r"leaf <root> has shape \(2, 3\) with 2 entries on dim 0.*exactly one"):
        shard_tree(x, SpecShard(0, stack=True), 3, even=False)


def test_shard_tree_uneven_split_matches_tensor_split() -> None:
    shards = shard_tree(torch.arange(10), SpecShard(0), 4, even=False)
    assert [s.tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_shard_tree_empty_shards() -> None:
    shards = shard_tree(torch.arange(2), SpecShard(0), 4, even=False)
    assert [s.shape[0] for s in shards] == [1, 1, 0, 0]
    shards = shard_tree([1], SpecShard(0), 3, even=False)
    assert shards == ([1], [], [])
    assert shard_tree(torch.zeros(0, 3), SpecShard(0), 2, even=True)[1].shape == (0, 3)


def test_shard_tree_even_raises_on_non_divisible_with_fix() -> None:
    tree = {"kwargs": {"labels": torch.arange(10)}}
    message = (
        r"shard_tree: leaf \['kwargs'\]\['labels'\] has shape \(10,\) with 10 rows on dim 0, which 4 shards cannot "
        r"divide evenly; pass even=False .* or change the microbatch size"
    )
    with pytest.raises(ValueError, match=message):
        shard_tree(tree, spec_on_dim(tree, 0), 4, even=True)
    with pytest.raises(ValueError, match=r"leaf \['l'\] has a list with 3 elements, which 2 shards"):
        shard_tree({"l": [1, 2, 3]}, {"l": SpecShard(0)}, 2, even=True)


def test_shard_tree_negative_dims() -> None:
    x = torch.arange(12).reshape(2, 6)
    assert [s.shape for s in shard_tree(x, SpecShard(-1), 3, even=True)] == [(2, 2)] * 3
    assert [s.tolist() for s in shard_tree(x, SpecShard(-2, stack=True), 2, even=True)] == [
        x[0].tolist(),
        x[1].tolist(),
    ]
    with pytest.raises(ValueError, match=r"has shape \(2, 6\), which has no dim -3 .*valid dims: -2\.\.1"):
        shard_tree(x, SpecShard(-3), 2, even=False)


def test_shard_tree_lists_chunk_on_dim_zero_only() -> None:
    assert shard_tree([1, 2, 3, 4, 5], SpecShard(0), 2, even=False) == ([1, 2, 3], [4, 5])
    assert shard_tree(["a", {"b": 1}], SpecShard(0, stack=True), 2, even=True) == ("a", {"b": 1})
    with pytest.raises(ValueError, match=r"leaf \['l'\] is a list, which SpecShard\(1\) cannot split"):
        shard_tree({"l": [1, 2]}, {"l": SpecShard(1)}, 2, even=False)
    with pytest.raises(ValueError, match="list of length 3, but SpecShard"):
        shard_tree([1, 2, 3], SpecShard(0, stack=True), 2, even=False)


def test_shard_tree_list_of_tensors_is_split_as_a_list() -> None:
    items = [torch.ones(5), torch.zeros(1)]
    shards = shard_tree(items, SpecShard(0), 2, even=True)
    assert shards[0][0] is items[0]
    assert shards[1][0] is items[1]


@pytest.mark.parametrize("leaf", [3, "s", None, 1.5, (1, 2), {"a": 1}])
def test_shard_tree_shard_on_non_tensor_non_list_raises_type_error(leaf: Any) -> None:
    with pytest.raises(TypeError, match=r"shard_tree: leaf \['k'\] is .* which SpecShard\(0\) cannot split"):
        shard_tree({"k": leaf}, {"k": SpecShard(0)}, 2, even=False)


@pytest.mark.parametrize("bad", [3, "replicate", torch.tensor(0)])
def test_shard_tree_non_spec_leaf_raises_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"shard_tree: the spec at \['k'\] is .* neither a spec leaf"):
        shard_tree({"k": torch.ones(2)}, {"k": bad}, 2, even=False)


@pytest.mark.parametrize(
    ("num_shards", "error"), [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_shard_tree_bad_num_shards(num_shards: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="shard_tree: num_shards"):
        shard_tree(torch.ones(2), SpecShard(0), num_shards, even=False)


def test_shard_tree_recurses_into_dataclasses_and_namedtuples() -> None:
    node = ExampleNode(left=torch.arange(4), right=(torch.arange(2), "x"), tag="t")
    spec = ExampleNode(left=SpecShard(0), right=(SpecShard(0, stack=True), None), tag="t")
    shards = shard_tree(node, spec, 2, even=True)
    assert shards[1].tag == "t"
    assert shards[1].left.tolist() == [2, 3]
    assert shards[1].right[0].item() == 1
    assert_trees_close(unshard_tree(shards, spec), node, rtol=0, atol=0)


# --- unshard_tree: d9d's rows (docs/design/pipeline-state.md) --------------------------------------


@pytest.mark.parametrize("shards", [[], ()])
def test_unshard_tree_empty_raises(shards: Any) -> None:
    with pytest.raises(ValueError, match="unshard_tree: got no shards"):
        unshard_tree(shards, SpecShard(0))


def test_unshard_tree_not_a_sequence_raises() -> None:
    with pytest.raises(TypeError, match="unshard_tree: shards must be a sequence"):
        unshard_tree(torch.ones(2), SpecShard(0))


def test_unshard_tree_structure_mismatch_names_path_and_shard() -> None:
    shards = [{"a": {"b": torch.ones(1)}}, {"a": {"b": torch.ones(1)}}, {"a": {"c": torch.ones(1)}}]
    with pytest.raises(ValueError, match=r"unshard_tree: the spec does not match the tree at \['a'\] in shard 2"):
        unshard_tree(shards, {"a": {"b": SpecShard(0)}})


def test_unshard_tree_replicate_takes_first_without_check() -> None:
    first, second = torch.ones(2), torch.zeros(2)
    assert unshard_tree([first, second], SpecReplicate()) is first


def test_unshard_tree_check_replicated_names_path() -> None:
    shards = [{"m": {"t": torch.ones(2)}}, {"m": {"t": torch.ones(2)}}, {"m": {"t": torch.zeros(2)}}]
    with pytest.raises(ValueError, match=r"replicated leaf \['m'\]\['t'\] differs between shard 0 and 2"):
        unshard_tree(shards, {"m": SpecReplicate()}, check_replicated=True)
    same = [{"m": {"t": torch.ones(2), "s": "x"}}] * 2 + [{"m": {"t": torch.ones(2), "s": "x"}}]
    assert unshard_tree(same, {"m": None}, check_replicated=True)["m"] is same[0]["m"]
    with pytest.raises(ValueError, match=r"replicated leaf \['s'\] differs"):
        unshard_tree([{"s": 1}, {"s": 2}], {"s": None}, check_replicated=True)


def test_unshard_tree_tensors_cat_or_stack() -> None:
    a, b = torch.arange(2), torch.arange(3)
    assert unshard_tree([a, b], SpecShard(0)).tolist() == [0, 1, 0, 1, 2]
    assert unshard_tree([a, a + 2], SpecShard(-1, stack=True)).tolist() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"shape \(2,\) in shard 0 but \(3,\) in shard 1.*stacking needs equal"):
        unshard_tree([a, b], SpecShard(0, stack=True))
    with pytest.raises(ValueError, match=r"shapes may differ only on dim 1"):
        unshard_tree([torch.ones(2, 1), torch.ones(3, 1)], SpecShard(1))
    with pytest.raises(ValueError, match=r"0-d tensor, which SpecShard\(0\) cannot concatenate.*stack=True"):
        unshard_tree([torch.tensor(1.0), torch.tensor(2.0)], SpecShard(0))


def test_unshard_tree_non_tensors() -> None:
    assert unshard_tree([{"a": 1}, None], SpecShard(0, stack=True)) == [{"a": 1}, None]
    assert unshard_tree([[1], [], [2, 3]], SpecShard(0)) == [1, 2, 3]
    assert unshard_tree([[1], [2]], SpecShard(0, stack=True)) == [[1], [2]]
    with pytest.raises(TypeError, match=r"unshard_tree: leaf \['n'\] holds int objects.*stack=True"):
        unshard_tree([{"n": 1}, {"n": 2}], {"n": SpecShard(0)})
    with pytest.raises(
        TypeError, match=r"leaf <root> is a tensor of shape \(1,\) in shard 0 but a int leaf in shard 1"
    ):
        unshard_tree([torch.ones(1), 1], SpecShard(0, stack=True))
    with pytest.raises(ValueError, match="lists join on dim 0 only"):
        unshard_tree([[1], [2]], SpecShard(1))


def test_unshard_tree_list_of_tensors_stacked_becomes_a_tensor() -> None:
    # The one place where the round trip does not hold (d9d behaves the same): unshard cannot know that
    # the stacked pieces came from a list, so it stacks the tensors. testing.sharding_specs avoids it.
    items = [torch.ones(2), torch.zeros(2)]
    joined = unshard_tree(shard_tree(items, SpecShard(0, stack=True), 2, even=True), SpecShard(0, stack=True))
    assert isinstance(joined, torch.Tensor)
    assert joined.shape == (2, 2)


# --- spec_on_dim / spec_replicate_all ---------------------------------------------------------------


def test_spec_on_dim_rows() -> None:
    tree = {
        "x": torch.ones(4, 3),
        "scalar": torch.tensor(1.0),
        "items": [torch.ones(1), "a"],
        "n": 3,
        "s": "str",
        "none": None,
        "nested": ({"y": torch.ones(2)},),
        "node": ExampleNode(left=torch.ones(2), right=5),
    }
    assert spec_on_dim(tree, 0) == {
        "x": SpecShard(0),
        "scalar": SpecReplicate(),
        "items": SpecShard(0),
        "n": SpecReplicate(),
        "s": SpecReplicate(),
        "none": SpecReplicate(),
        "nested": ({"y": SpecShard(0)},),
        "node": ExampleNode(left=SpecShard(0), right=SpecReplicate()),
    }
    assert spec_on_dim({"x": torch.ones(4, 3)}, 1) == {"x": SpecShard(1)}
    assert spec_on_dim({"x": torch.ones(4, 3)}, -1) == {"x": SpecShard(-1)}


def test_spec_on_dim_errors_name_path() -> None:
    with pytest.raises(ValueError, match=r"spec_on_dim: leaf \['a'\]\['l'\] is a list, which splits on dim 0 only"):
        spec_on_dim({"a": {"l": [1]}}, 1)
    with pytest.raises(ValueError, match=r"spec_on_dim: leaf \['x'\] has shape \(3,\), which has no dim 1"):
        spec_on_dim({"x": torch.ones(3)}, 1)


def test_spec_replicate_all_same_structure() -> None:
    tree = {"a": [torch.ones(1), None], "b": (1,)}
    spec = spec_replicate_all(tree)
    assert spec == {"a": [SpecReplicate(), SpecReplicate()], "b": (SpecReplicate(),)}
    shards = shard_tree(tree, spec, 3, even=True)
    assert all(shard["a"][0] is tree["a"][0] for shard in shards)


# --- compile ---------------------------------------------------------------------------------------


def _round_trip(tree: Any) -> Any:
    spec = {"x": SpecShard(0), "y": SpecShard(-1, stack=True), "l": SpecShard(0), "s": None}
    shards = shard_tree(tree, spec, 3, even=False)
    shards = tuple({**shard, "x": shard["x"] * 2} for shard in shards)
    return unshard_tree(shards, spec)


@pytest.mark.slow
def test_shard_tree_compiles_without_graph_breaks_or_recompiles() -> None:
    def make(offset: float) -> dict[str, Any]:
        return {"x": torch.arange(7.0) + offset, "y": torch.ones(2, 3), "l": [1, 2, 3, 4], "s": "tag"}

    assert torch._dynamo.explain(_round_trip)(make(0.0)).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(_round_trip, fullgraph=True, backend="aot_eager")
    out = compiled(make(0.0))
    assert_trees_close(out, _round_trip(make(0.0)), rtol=0, atol=0)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = compiled(make(1.0))
    assert_trees_close(out["x"], (torch.arange(7.0) + 1) * 2, rtol=0, atol=0)


# --- properties ------------------------------------------------------------------------------------


@given(shardable_trees_and_specs())
def test_shard_tree_round_trip_and_sizes_follow_tensor_split(case: Any) -> None:
    shards = shard_tree(case.tree, case.spec, case.num_shards, even=case.even)
    assert len(shards) == case.num_shards
    for path, leaf_spec in _spec_leaves_with_paths(case.spec):
        original = _at(case.tree, path)
        pieces = [_at(shard, path) for shard in shards]
        if not isinstance(leaf_spec, SpecShard):
            assert all(piece is original for piece in pieces)
        elif leaf_spec.stack:
            expected = list(original) if isinstance(original, list) else list(original.unbind(leaf_spec.dim))
            assert_trees_close(pieces, expected, rtol=0, atol=0)
        else:
            got = [len(p) if isinstance(p, list) else p.shape[leaf_spec.dim] for p in pieces]
            assert got == _sizes(original, leaf_spec, case.num_shards)
    assert_trees_close(unshard_tree(shards, case.spec), case.tree, rtol=0, atol=0)


@given(shardable_trees_and_specs(even=False), microbatch_counts())
def test_shard_tree_even_raises_exactly_when_a_size_does_not_divide(case: Any, num_shards: int) -> None:
    spec = spec_on_dim(case.tree, 0)
    sizes = [
        (path, len(x) if isinstance(x, list) else x.shape[0])
        for path, leaf in _spec_leaves_with_paths(spec)
        if isinstance(leaf, SpecShard)
        for x in [_at(case.tree, path)]
    ]
    bad = [path for path, size in sizes if size % num_shards]
    if bad:
        with pytest.raises(ValueError, match="cannot divide evenly") as info:
            shard_tree(case.tree, spec, num_shards, even=True)
        assert format_path(bad[0]) in str(info.value)
    else:
        assert len(shard_tree(case.tree, spec, num_shards, even=True)) == num_shards


_TREES = tensor_trees(st.one_of(tensors(), st.none(), st.integers(-2, 2), st.text(max_size=2)))


@st.composite
def _bad_leaf_specs(draw: st.DrawFn) -> tuple[Any, Any, int, tuple[Any, ...], type[Exception]]:
    """A tree, a spec that is valid except at one leaf, the shard count, that leaf's path, the error type."""
    tree = draw(_TREES)
    num_shards = draw(st.integers(2, 4))
    paths, leaves, _ = tree_flatten_with_path(tree)
    assume(paths)
    index = draw(st.integers(0, len(paths) - 1))
    path, leaf = paths[index], leaves[index]
    choices: list[tuple[Any, type[Exception]]] = [(draw(st.sampled_from([3, "x", 1.5])), TypeError)]
    if isinstance(leaf, torch.Tensor) and leaf.ndim == 0:
        choices.append((SpecShard(0), ValueError))
    elif isinstance(leaf, torch.Tensor):
        choices.append((SpecShard(leaf.ndim + draw(st.integers(0, 2))), ValueError))
        choices.append((SpecShard(-leaf.ndim - 1), ValueError))
        if leaf.shape[0] != num_shards:
            choices.append((SpecShard(0, stack=True), ValueError))
    else:
        choices.append((SpecShard(0), TypeError))
    bad, error = draw(st.sampled_from(choices))
    return tree, _replace_at(spec_replicate_all(tree), path, bad), num_shards, path, error


@given(_bad_leaf_specs())
def test_shard_tree_invalid_leaf_spec_raises_documented_error_naming_path(case: Any) -> None:
    tree, spec, num_shards, path, error = case
    with pytest.raises(error) as info:
        shard_tree(tree, spec, num_shards, even=False)
    assert format_path(path) in str(info.value)
    assert str(info.value).startswith("shard_tree: ")


@given(_TREES, st.data())
def test_shard_tree_structure_mismatch_raises_naming_node_path(tree: Any, data: st.DataObject) -> None:
    nodes = _node_paths(tree)
    assume(nodes)
    path = data.draw(st.sampled_from(nodes))
    node = _at(tree, path)
    # A spec node of another shape at that position: a dict with one key more, or a list one longer.
    wrong = {**node, "__extra__": None} if isinstance(node, dict) else [None] * (len(_at_children(node)) + 1)
    spec = _replace_at(tree_map(lambda _: SpecReplicate(), tree), path, wrong)
    with pytest.raises(ValueError, match="the spec does not match the tree") as info:
        shard_tree(tree, spec, 2, even=False)
    assert f"at {format_path(path)}:" in str(info.value)


def _at_children(node: Any) -> list[Any]:
    return optree.tree_flatten_one_level(node, none_is_leaf=True, namespace=NAMESPACE).children


@given(shardable_trees_and_specs(), st.data())
def test_unshard_tree_structure_mismatch_raises_naming_path_and_shard(case: Any, data: st.DataObject) -> None:
    assume(case.num_shards > 1)
    shards = list(shard_tree(case.tree, case.spec, case.num_shards, even=case.even))
    # Spec nodes are where unshard compares structures; corrupt one shard there.
    nodes = _node_paths(case.spec)
    nodes = [path for path in nodes if not isinstance(_at(case.spec, path), (SpecShard, SpecReplicate))]
    assume(nodes)
    path = data.draw(st.sampled_from(nodes))
    index = data.draw(st.integers(1, case.num_shards - 1))
    shards[index] = _replace_at(shards[index], path, "not a node")
    with pytest.raises(ValueError, match="unshard_tree: the spec does not match the tree") as info:
        unshard_tree(shards, case.spec)
    assert f"at {format_path(path)} in shard {index}:" in str(info.value)
