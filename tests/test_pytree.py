"""d9dfn's pytree conventions: None is a leaf, dicts keep insertion order (as torch's pytree), frozen state classes."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from hypothesis import given

from d9dfn._pytree import (
    NAMESPACE,
    field,
    format_path,
    pytree_dataclass,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_map_with_path,
    tree_structure,
    tree_unflatten,
)
from d9dfn.testing import ExampleNode, assert_trees_close, tensor_trees


@pytree_dataclass
class _Params:
    weight: torch.Tensor
    bias: torch.Tensor | None
    name: str = field(static=True, default="linear")


def test_none_is_a_leaf() -> None:
    assert tree_leaves({"a": None, "b": [None, 1]}) == [None, None, 1]
    assert tree_map(lambda x: "leaf", None) == "leaf"
    # optree's own default drops None, which would shift every leaf after it.
    assert optree.tree_leaves({"a": None, "b": 1}) == [1]


def test_dicts_flatten_in_insertion_order_like_torch() -> None:
    tree = {"z": 1, "a": 2, "m": {"y": 3, "b": 4}}
    assert tree_leaves(tree) == [1, 2, 3, 4] == torch_pytree.tree_leaves(tree)
    paths, _, _ = tree_flatten_with_path(tree)
    assert paths == [("z",), ("a",), ("m", "y"), ("m", "b")]
    assert list(tree_map(lambda x: x, tree)) == ["z", "a", "m"]


@given(tensor_trees())
def test_leaves_order_matches_torch_pytree(tree: Any) -> None:
    ours = tree_leaves(tree)
    theirs = torch_pytree.tree_leaves(tree)
    assert len(ours) == len(theirs)
    assert all(a is b for a, b in zip(ours, theirs, strict=True))
    leaves, treespec = tree_flatten(tree)
    assert_trees_close(tree_unflatten(treespec, leaves), tree, rtol=0, atol=0)


def test_namedtuples_and_tuples_are_nodes() -> None:
    point = namedtuple("point", ["x", "y"])
    assert tree_leaves((1, point(2, 3))) == [1, 2, 3]
    assert tree_map(lambda v: v * 10, point(1, 2)) == point(10, 20)


def test_pytree_dataclass_static_fields_ride_in_the_treespec() -> None:
    p = _Params(weight=torch.ones(2), bias=None)
    leaves, treespec = tree_flatten(p)
    assert len(leaves) == 2
    assert leaves[1] is None
    assert tree_structure(_Params(weight=torch.ones(1), bias=None, name="other")) != treespec
    rebuilt = tree_unflatten(treespec, [torch.zeros(2), torch.ones(1)])
    assert rebuilt.name == "linear"
    assert rebuilt.bias.tolist() == [1.0]
    paths, _, _ = tree_flatten_with_path(p)
    assert paths == [("weight",), ("bias",)]


def test_pytree_dataclass_is_frozen_keyword_only_with_replace() -> None:
    p = _Params(weight=torch.ones(2), bias=torch.zeros(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.weight = torch.zeros(2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        _Params(torch.ones(2), None)  # type: ignore[misc]
    q = p.replace(bias=None)
    assert q.bias is None
    assert p.bias is not None
    assert q.weight is p.weight
    assert q.name == "linear"


def test_pytree_dataclass_registered_with_torch_pytree() -> None:
    p = _Params(weight=torch.ones(2), bias=torch.zeros(2), name="n")
    leaves, spec = torch_pytree.tree_flatten(p)
    assert leaves[0] is p.weight
    rebuilt = torch_pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, _Params)
    assert rebuilt.name == "n"
    keyed, _ = torch_pytree.tree_flatten_with_path(p)
    assert torch_pytree.keystr(keyed[1][0]) == ".bias"


def test_torch_func_grad_over_a_pytree_dataclass() -> None:
    p = _Params(weight=torch.tensor([1.0, 2.0]), bias=torch.tensor([0.5, 0.5]))
    x = torch.tensor([3.0, 4.0])

    def loss(params: _Params) -> torch.Tensor:
        return ((params.weight * x + params.bias) ** 2).sum()

    grads = torch.func.grad(loss)(p)
    assert isinstance(grads, _Params)
    expected_w = 2 * (p.weight * x + p.bias) * x
    assert torch.allclose(grads.weight, expected_w)
    assert torch.allclose(grads.bias, 2 * (p.weight * x + p.bias))


def test_tree_map_with_path_sees_entries() -> None:
    tree = {"a": [10, ExampleNode(left=1, right=2)]}
    seen = tree_map_with_path(lambda path, _: format_path(path), tree)
    assert seen == {"a": ["['a'][0]", ExampleNode(left="['a'][1]['left']", right="['a'][1]['right']")]}


def test_format_path() -> None:
    assert format_path(()) == "<root>"
    assert format_path(("kwargs", "labels")) == "['kwargs']['labels']"
    assert format_path(("a", 0, "weight")) == "['a'][0]['weight']"


def test_namespace_is_d9dfn() -> None:
    assert NAMESPACE == "d9dfn"
    # A d9dfn dataclass is a leaf to optree's global namespace: nothing leaks out of ours.
    assert optree.tree_leaves(ExampleNode(left=1, right=2), none_is_leaf=True) != [1, 2]
