"""A hypothesis kit for property-testing d9dfn code and your own tasks.

Strategies make small tensors, pytrees of them, sharding specs valid for a tree, PipelineStates and
microbatch counts; two assertions compare trees and name the key path of the first difference. It needs
``hypothesis`` (the ``test`` extra); ``import d9dfn`` never imports this module.

>>> from hypothesis import given, settings
>>> from d9dfn._sharding import shard_tree, unshard_tree
>>> @settings(max_examples=10, deadline=None)
... @given(shardable_trees_and_specs())
... def test_round_trip(case):
...     shards = shard_tree(case.tree, case.spec, case.num_shards, even=case.even)
...     assert_trees_close(unshard_tree(shards, case.spec), case.tree, rtol=0, atol=0)
>>> test_round_trip()
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch
from hypothesis import strategies as st

from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import NAMESPACE, field, format_path, pytree_dataclass
from d9dfn._sharding import SpecReplicate, SpecShard
from d9dfn._types import KeyPath, PyTree

__all__ = [
    "DTYPES",
    "ExampleNode",
    "ShardingCase",
    "assert_trees_close",
    "assert_trees_equal_structure",
    "microbatch_counts",
    "pipeline_states",
    "shardable_trees_and_specs",
    "sharding_specs",
    "tensor_trees",
    "tensors",
]

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool)
"""The dtypes :func:`tensors` draws from by default."""

_KEYS = st.sampled_from(["x", "labels", "mask", "loss", "meta", "a", "b"])


@pytree_dataclass
class ExampleNode:
    """A d9dfn dataclass that :func:`tensor_trees` nests: two children and a static tag."""

    left: Any
    right: Any
    tag: str = field(static=True, default="node")


def microbatch_counts(min_value: int = 1, max_value: int = 4) -> st.SearchStrategy[int]:
    """Microbatch (shard) counts between ``min_value`` and ``max_value``."""
    return st.integers(min_value, max_value)


def _make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator, dtype=dtype)


def tensors(
    *,
    dtypes: Sequence[torch.dtype] = DTYPES,
    min_dims: int = 0,
    max_dims: int = 3,
    sides: st.SearchStrategy[int] | None = None,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
) -> st.SearchStrategy[torch.Tensor]:
    """Small CPU tensors of assorted dtypes and shapes (sides 0..4 unless ``sides`` or ``shapes`` says).

    Values come from a drawn seed, so examples are cheap and reproducible; floats are standard normal,
    ints in [-100, 100), bools fair coins. ``shapes`` overrides ``min_dims``/``max_dims``/``sides``, e.g.
    ``tensors(dtypes=[torch.int64], shapes=st.just((2, 3)))``.
    """
    sides = sides if sides is not None else st.integers(0, 4)
    shapes = shapes if shapes is not None else st.lists(sides, min_size=min_dims, max_size=max_dims).map(tuple)
    return st.builds(_make_tensor, shapes, st.sampled_from(list(dtypes)), st.integers(0, 2**31 - 1))


def _trees(
    leaves: st.SearchStrategy[Any], *, max_leaves: int, list_sizes: tuple[int, ...]
) -> st.SearchStrategy[PyTree]:
    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        lists = st.one_of([st.lists(children, min_size=size, max_size=size) for size in list_sizes])
        return st.one_of(
            st.dictionaries(_KEYS, children, max_size=3),
            lists,
            st.lists(children, max_size=3).map(tuple),
            st.builds(ExampleNode, left=children, right=children, tag=st.sampled_from(["node", "other"])),
        )

    return st.recursive(leaves, extend, max_leaves=max_leaves)


def tensor_trees(
    leaves: st.SearchStrategy[Any] | None = None, *, max_leaves: int = 8, max_children: int = 3
) -> st.SearchStrategy[PyTree]:
    """Pytrees of nested dicts, lists, tuples and :class:`ExampleNode` over small tensors and ``None``.

    Args:
        leaves: what to put at the leaves (default: :func:`tensors` or ``None``).
        max_leaves: roughly how many leaves at most.
        max_children: the longest list.
    """
    leaves = leaves if leaves is not None else st.one_of(tensors(), st.none())
    return _trees(leaves, max_leaves=max_leaves, list_sizes=tuple(range(max_children + 1)))


def _is_node(x: Any) -> bool:
    return not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)


def _one_level(x: Any) -> optree.ops.FlattenOneLevelOutputEx[Any]:
    return optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=NAMESPACE)


def _can_stack_list(x: list[Any], num_shards: int) -> bool:
    # A stacked list of tensors unshards into one stacked tensor, not a list (d9d does the same), so the
    # round trip holds only for lists of non-tensors.
    return len(x) == num_shards and not any(isinstance(item, torch.Tensor) for item in x)


@st.composite
def sharding_specs(draw: st.DrawFn, tree: PyTree, num_shards: int, even: bool = True) -> PyTree:
    """Specs that :func:`~d9dfn.shard_tree` accepts for ``tree`` and ``num_shards`` (and ``even``).

    They cover prefix specs (a replicate leaf over a subtree), ``None`` leaves, negative dims, uneven
    splits when ``even`` is False, and ``stack=True`` where a size equals ``num_shards``. Every spec drawn
    round-trips through ``shard_tree`` / ``unshard_tree``.
    """

    def pick(options: Sequence[Any]) -> Any:
        return options[draw(st.integers(0, len(options) - 1))]

    def replicate() -> Any:
        return pick([SpecReplicate(), None])

    def divides(size: int) -> bool:
        return not even or size % num_shards == 0

    def walk(x: Any) -> Any:
        options: list[str] = ["replicate"]
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            options += ["shard"] * 2
        if isinstance(x, list):
            if divides(len(x)):
                options.append("shard_list")
            if _can_stack_list(x, num_shards):
                options.append("stack_list")
        if _is_node(x):
            options += ["recurse"] * 2
        choice = pick(options)
        if choice == "replicate":
            return replicate()
        if choice == "shard_list":
            return SpecShard(0)
        if choice == "stack_list":
            return SpecShard(0, stack=True)
        if choice == "shard":
            dims = [d for d in range(x.ndim) if divides(x.shape[d]) or x.shape[d] == num_shards]
            if not dims:
                return replicate()
            dim = pick(dims)
            stack = x.shape[dim] == num_shards and draw(st.booleans())
            if not stack and not divides(x.shape[dim]):
                return replicate()
            return SpecShard(dim - x.ndim if draw(st.booleans()) else dim, stack=stack)
        level = _one_level(x)
        return level.unflatten_func(level.metadata, [walk(child) for child in level.children])

    return walk(tree)


class ShardingCase(NamedTuple):
    """A tree, a spec valid for it, and the arguments of ``shard_tree``."""

    tree: PyTree
    spec: PyTree
    num_shards: int
    even: bool


@st.composite
def shardable_trees_and_specs(
    draw: st.DrawFn,
    num_shards: int | st.SearchStrategy[int] | None = None,
    even: bool | st.SearchStrategy[bool] | None = None,
    *,
    max_leaves: int = 8,
) -> ShardingCase:
    """A :class:`ShardingCase`: a tree whose sizes often divide (or equal) the shard count, and a valid spec.

    Args:
        num_shards: a count, a strategy for one, or None for :func:`microbatch_counts`.
        even: a flag, a strategy for one, or None for either.
        max_leaves: roughly how many leaves at most.
    """
    if not isinstance(num_shards, int):
        num_shards = draw(num_shards if num_shards is not None else microbatch_counts())
    if not isinstance(even, bool):
        even = draw(even if even is not None else st.booleans())
    tree = draw(_shardable_trees(num_shards, max_leaves))
    return ShardingCase(tree, draw(sharding_specs(tree, num_shards, even)), num_shards, even)


@functools.cache
def _shardable_trees(num_shards: int, max_leaves: int) -> st.SearchStrategy[PyTree]:
    # Built once per count: hypothesis spends most of its time validating freshly built strategies.
    sizes = tuple(sorted({0, 1, 2, 3, num_shards, 2 * num_shards}))
    leaves = st.one_of(tensors(sides=st.sampled_from(sizes)), st.none(), st.integers(-3, 3), st.text(max_size=2))
    return _trees(leaves, max_leaves=max_leaves, list_sizes=sizes)


@st.composite
def pipeline_states(
    draw: st.DrawFn, num_microbatches: int = 1, *, max_keys: int = 4, explicit_specs: bool = True
) -> PipelineState:
    """Global PipelineStates that ``split(num_microbatches)`` accepts with ``even=True``.

    Values are trees of tensors whose dim 0 divides by ``num_microbatches``, 0-d tensors, lists whose
    lengths divide by it, ints, strings and ``None``; some keys get an explicit spec from
    :func:`sharding_specs` when ``explicit_specs`` is True, the rest the default (``spec_on_dim(value, 0)``).
    """
    values_strategy = _state_values(num_microbatches)
    keys = draw(st.lists(st.text(min_size=1, max_size=4), max_size=max_keys, unique=True))
    values = {key: draw(values_strategy) for key in keys}
    specs = {}
    if explicit_specs:
        for key, value in values.items():
            if draw(st.booleans()):
                specs[key] = draw(sharding_specs(value, num_microbatches, even=True))
    return PipelineState.from_dict(values, specs)


@functools.cache
def _state_values(num_microbatches: int) -> st.SearchStrategy[PyTree]:
    rows = (0, num_microbatches, 2 * num_microbatches)
    shapes = st.tuples(st.sampled_from(rows), st.lists(st.integers(0, 3), max_size=2)).map(
        lambda parts: (parts[0], *parts[1])
    )
    leaves = st.one_of(tensors(max_dims=0), tensors(shapes=shapes), st.none(), st.integers(-3, 3), st.text(max_size=2))
    return _trees(leaves, max_leaves=6, list_sizes=rows)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    if _is_node(x):
        return f"{type(x).__name__} with entries {list(_one_level(x).entries)}"
    return f"{type(x).__name__} leaf {x!r}"


def _structure_difference(a: Any, b: Any, path: KeyPath) -> str | None:
    """A message for the first place where ``a`` and ``b`` differ in structure, or None."""
    if not _is_node(a) and not _is_node(b):
        return None
    if not _is_node(a) or not _is_node(b) or type(a) is not type(b):
        return f"at {format_path(path)}: {_describe(a)} vs {_describe(b)}"
    level_a, level_b = _one_level(a), _one_level(b)
    if tuple(level_a.entries) != tuple(level_b.entries):
        return f"at {format_path(path)}: {_describe(a)} vs {_describe(b)}"
    if level_a.metadata != level_b.metadata:
        return f"at {format_path(path)}: {type(a).__name__} static data {level_a.metadata!r} vs {level_b.metadata!r}"
    for entry, x, y in zip(level_a.entries, level_a.children, level_b.children, strict=True):
        found = _structure_difference(x, y, (*path, entry))
        if found is not None:
            return found
    return None


def assert_trees_equal_structure(a: PyTree, b: PyTree) -> None:
    """Assert that ``a`` and ``b`` have the same nodes, keys and static data (leaves may differ).

    Raises:
        AssertionError: naming the key path of the first difference and both sides.

    >>> assert_trees_equal_structure({"a": [1, 2]}, {"a": [3, 4]})
    >>> assert_trees_equal_structure({"a": [1, 2]}, {"a": [3]})
    Traceback (most recent call last):
    AssertionError: trees differ in structure at ['a']: list with entries [0, 1] vs list with entries [0]
    """
    found = _structure_difference(a, b, ())
    if found is not None:
        raise AssertionError(f"trees differ in structure {found}")


def _leaves_with_paths(tree: PyTree, path: KeyPath = ()) -> list[tuple[KeyPath, Any]]:
    if not _is_node(tree):
        return [(path, tree)]
    level = _one_level(tree)
    out = []
    for entry, child in zip(level.entries, level.children, strict=True):
        out += _leaves_with_paths(child, (*path, entry))
    return out


def assert_trees_close(a: PyTree, b: PyTree, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Assert that ``a`` and ``b`` have the same structure and close leaves.

    Tensors compare with ``torch.testing.assert_close`` (same dtype and shape; ``rtol``/``atol`` default
    to its per-dtype tolerances; ``rtol=0, atol=0`` asks for equality); other leaves with ``==``.

    Raises:
        AssertionError: naming the key path of the first differing leaf and both values.

    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7})
    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: trees differ at leaf ['w']: tensor([1., 1.]) vs tensor([0., 0.]) ...
    """
    assert_trees_equal_structure(a, b)
    for (path, x), (_, y) in zip(_leaves_with_paths(a), _leaves_with_paths(b), strict=True):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                raise AssertionError(f"trees differ at leaf {format_path(path)}: {_describe(x)} vs {_describe(y)}")
            try:
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as error:
                detail = " ".join(str(error).split())
                raise AssertionError(f"trees differ at leaf {format_path(path)}: {x!r} vs {y!r} ({detail})") from None
        elif not _python_equal(x, y):
            raise AssertionError(f"trees differ at leaf {format_path(path)}: {x!r} vs {y!r}")


def _python_equal(x: Any, y: Any) -> bool:
    if x is y:
        return True
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # objects whose == gives no bool (arrays, ...) count as different unless identical
        return False
