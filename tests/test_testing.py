"""d9dfn.testing: the strategies make what they promise; the assertions fail with the path and both sides."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import NAMESPACE, tree_flatten_with_path, tree_leaves
from d9dfn._sharding import SpecReplicate, SpecShard, shard_tree
from d9dfn.testing import (
    DTYPES,
    ExampleNode,
    assert_trees_close,
    assert_trees_equal_structure,
    microbatch_counts,
    pipeline_states,
    shardable_trees_and_specs,
    sharding_specs,
    tensor_trees,
    tensors,
)


def test_import_d9dfn_does_not_import_testing_or_hypothesis() -> None:
    code = "import sys, d9dfn; assert 'd9dfn.testing' not in sys.modules; assert 'hypothesis' not in sys.modules"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr


@given(tensors())
def test_tensors_are_small_with_assorted_dtypes(x: torch.Tensor) -> None:
    assert x.dtype in DTYPES
    assert x.ndim <= 3
    assert all(side <= 4 for side in x.shape)
    assert x.device.type == "cpu"


@given(tensors(dtypes=[torch.int64], shapes=st.just((2, 3))))
def test_tensors_honour_shapes_and_dtypes(x: torch.Tensor) -> None:
    assert x.shape == (2, 3)
    assert x.dtype == torch.int64


def test_tensors_cover_every_dtype_and_zero_dims() -> None:
    seen: set[Any] = set()

    @given(tensors())
    def collect(x: torch.Tensor) -> None:
        seen.add(x.dtype)
        seen.add(("ndim", x.ndim))
        seen.add(("empty", x.numel() == 0))

    collect()
    assert set(DTYPES) <= seen
    assert {("ndim", 0), ("ndim", 3), ("empty", True)} <= seen


def test_tensor_trees_cover_every_node_kind() -> None:
    kinds: set[str] = set()

    def visit(x: Any) -> None:
        kinds.add(type(x).__name__)
        if not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE):
            for child in optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=NAMESPACE).children:
                visit(child)

    @given(tensor_trees())
    def collect(tree: Any) -> None:
        visit(tree)
        assert all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in tree_leaves(tree))

    collect()
    assert {"dict", "list", "tuple", "ExampleNode", "Tensor", "NoneType"} <= kinds


@given(shardable_trees_and_specs())
def test_shardable_trees_and_specs_are_valid(case: Any) -> None:
    assert 1 <= case.num_shards <= 4
    shards = shard_tree(case.tree, case.spec, case.num_shards, even=case.even)
    assert len(shards) == case.num_shards


def test_shardable_trees_and_specs_cover_prefix_stack_negative_and_none() -> None:
    seen: set[str] = set()

    @given(shardable_trees_and_specs())
    def collect(case: Any) -> None:
        _, spec_leaves, _ = tree_flatten_with_path(case.spec)
        _, tree_leaves_, _ = tree_flatten_with_path(case.tree)
        if len(spec_leaves) < len(tree_leaves_):
            seen.add("prefix")
        for leaf in spec_leaves:
            if leaf is None:
                seen.add("none")
            elif isinstance(leaf, SpecReplicate):
                seen.add("replicate")
            elif isinstance(leaf, SpecShard):
                seen.add("stack" if leaf.stack else "shard")
                if leaf.dim < 0:
                    seen.add("negative")

    collect()
    assert {"prefix", "none", "replicate", "stack", "shard", "negative"} <= seen


@given(tensor_trees(), microbatch_counts(), st.booleans(), st.data())
def test_sharding_specs_fit_any_tree(tree: Any, num_shards: int, even: bool, data: st.DataObject) -> None:
    spec = data.draw(sharding_specs(tree, num_shards, even))
    assert len(shard_tree(tree, spec, num_shards, even=even)) == num_shards


@given(microbatch_counts().flatmap(lambda n: st.tuples(st.just(n), pipeline_states(n))))
def test_pipeline_states_split_evenly(case: tuple[int, PipelineState]) -> None:
    num_microbatches, state = case
    assert state.is_global
    assert all(isinstance(key, str) for key in state)
    assert len(state.split(num_microbatches, even=True)) == num_microbatches


# --- assertions ------------------------------------------------------------------------------------


def test_assert_trees_equal_structure_names_path_and_both_sides() -> None:
    assert_trees_equal_structure({"a": (1, [torch.ones(2)])}, {"a": (2, [torch.zeros(3)])})
    with pytest.raises(AssertionError, match=r"at \['a'\]\[1\]: list with entries \[0\] vs dict with entries"):
        assert_trees_equal_structure({"a": (1, [2])}, {"a": (1, {"x": 2})})
    with pytest.raises(
        AssertionError, match=r"at <root>: dict with entries \['a', 'b'\] vs dict with entries \['b', 'a'\]"
    ):
        assert_trees_equal_structure({"a": 1, "b": 2}, {"b": 2, "a": 1})
    with pytest.raises(AssertionError, match=r"at \['n'\]: ExampleNode static data \('x',\) vs \('y',\)"):
        assert_trees_equal_structure(
            {"n": ExampleNode(left=1, right=2, tag="x")}, {"n": ExampleNode(left=1, right=2, tag="y")}
        )
    with pytest.raises(AssertionError, match=r"at \['a'\]: NoneType leaf None vs list with entries \[\]"):
        assert_trees_equal_structure({"a": None}, {"a": []})


def test_assert_trees_close_names_path_and_both_values() -> None:
    assert_trees_close({"a": [torch.ones(2), "s", None]}, {"a": [torch.ones(2) + 1e-7, "s", None]})
    with pytest.raises(
        AssertionError, match=r"trees differ at leaf \['a'\]\[0\]: tensor\(\[1\., 1\.\]\) vs tensor\(\[1\., 2\.\]\)"
    ):
        assert_trees_close({"a": [torch.ones(2)]}, {"a": [torch.tensor([1.0, 2.0])]})
    with pytest.raises(AssertionError, match=r"trees differ at leaf \['s'\]: 'x' vs 'y'"):
        assert_trees_close({"s": "x"}, {"s": "y"})
    with pytest.raises(
        AssertionError, match=r"trees differ at leaf \['t'\]: tensor\(shape=\(1,\), dtype=torch.float32\) vs int leaf 1"
    ):
        assert_trees_close({"t": torch.ones(1)}, {"t": 1})
    with pytest.raises(AssertionError, match=r"trees differ at leaf \['t'\].*dtype"):
        assert_trees_close({"t": torch.ones(1)}, {"t": torch.ones(1, dtype=torch.float64)})
    with pytest.raises(AssertionError, match="trees differ in structure"):
        assert_trees_close([1], [1, 2])


def test_assert_trees_close_tolerances() -> None:
    assert_trees_close(torch.tensor([1.0]), torch.tensor([1.05]), rtol=0, atol=0.1)
    with pytest.raises(AssertionError, match="leaf <root>"):
        assert_trees_close(torch.tensor([1.0]), torch.tensor([1.05]), rtol=0, atol=0.01)
    assert_trees_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def test_assert_trees_close_compares_pipeline_state_specs() -> None:
    state = PipelineState.from_dict({"x": torch.ones(2)})
    assert_trees_close(state, PipelineState.from_dict({"x": torch.ones(2)}))
    with pytest.raises(AssertionError, match=r"PipelineState static data"):
        assert_trees_close(state, state.set("x", torch.ones(2), spec=SpecReplicate()))
