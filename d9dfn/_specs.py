"""Sharding specs: the vocabulary that says how a pytree splits into shards (microbatches), and its tree walk.

A *spec* is a pytree whose leaves are :class:`SpecShard`, :class:`SpecReplicate` or ``None`` (which means
replicate). It may be a **prefix** of the data tree: a spec leaf then covers the whole subtree at its position.
:func:`pair_leaves` walks a spec down one or more trees (every error names the key path where they part);
:func:`subtrees` and :func:`rebuild` take the covered subtrees out and put pieces back. Splitting and joining with
a spec are in ``_sharding.py``; :func:`check_spec` validates what needs no shard count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import optree
import torch

from d9dfn._pytree import NAMESPACE, format_path, tree_map_with_path
from d9dfn._types import KeyPath, PyTree

__all__ = [
    "SpecLeaf",
    "SpecReplicate",
    "SpecShard",
    "check_dim",
    "check_spec",
    "describe",
    "is_node",
    "normalize_spec",
    "one_level",
    "pair_leaves",
    "plural",
    "rebuild",
    "spec_on_dim",
    "spec_replicate_all",
    "subtrees",
]


@dataclasses.dataclass(frozen=True, slots=True)
class SpecReplicate:
    """Every shard gets the same object; unsharding takes the first shard's.

    >>> SpecReplicate() == SpecReplicate()
    True
    """


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class SpecShard:
    """Split along ``dim``; with ``stack=True`` the dim has one entry per shard and is removed.

    Tensors split like ``torch.tensor_split`` (the first ``size % num_shards`` shards get one extra row)
    and join with ``torch.cat``; with ``stack=True`` they ``unbind`` and join with ``torch.stack``.
    Lists split into contiguous chunks on dim 0 and join by concatenation; with ``stack=True`` element
    ``i`` goes to shard ``i``. Unsharding any other object with ``stack=True`` gives a list of the
    per-shard objects.

    >>> SpecShard(0), SpecShard(-1, stack=True)
    (SpecShard(0), SpecShard(-1, stack=True))
    """

    dim: int
    stack: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"SpecShard: dim must be an int, got {self.dim!r}; e.g. SpecShard(0)")
        if not isinstance(self.stack, bool):
            raise TypeError(f"SpecShard: stack must be a bool, got {self.stack!r}")

    def __repr__(self) -> str:
        return f"SpecShard({self.dim}, stack=True)" if self.stack else f"SpecShard({self.dim})"


SpecLeaf = SpecShard | SpecReplicate | None
"""What a spec tree holds at its leaves; ``None`` means :class:`SpecReplicate`."""


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (SpecShard, SpecReplicate))


def is_node(x: Any) -> bool:
    return type(x) is dict or not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)


class DictLevel(NamedTuple):
    """A plain dict one level down, as optree's one-level flatten gives it (insertion order, d9dfn's namespace), built
    without optree: the microbatch split runs inside the compiled step, where dynamo traces optree's flatten as its
    Python version, some 80 lines a call, again at every start."""

    entries: tuple[Any, ...]
    children: list[Any]
    metadata: tuple[Any, ...]

    @staticmethod
    def unflatten_func(keys: Any, children: Sequence[Any]) -> dict[Any, Any]:
        return dict(zip(keys, children, strict=True))


def one_level(x: Any) -> optree.ops.FlattenOneLevelOutputEx[Any] | DictLevel:
    if type(x) is dict:
        keys = tuple(x)
        return DictLevel(keys, list(x.values()), keys)
    return optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=NAMESPACE)


def describe(x: Any) -> str:
    """A short description of a node or leaf for structure-mismatch messages."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {list(x)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    if is_node(x):
        return f"a {type(x).__name__} node with entries {list(one_level(x).entries)}"
    return f"a {type(x).__name__} leaf"


def _spec_leaf_error(fn: str, path: KeyPath, spec: Any) -> TypeError:
    return TypeError(
        f"{fn}: the spec at {format_path(path)} is {spec!r}, which is neither a spec leaf nor a pytree node; "
        "use SpecShard(dim), SpecShard(dim, stack=True), SpecReplicate() or None (replicate)"
    )


def pair_leaves(fn: str, spec: Any, trees: Sequence[Any], path: KeyPath, unit: str) -> Iterator[tuple[KeyPath, Any]]:
    """Walk ``spec`` down ``trees`` (all of one structure up to the spec); yield (path, spec leaf).

    Raises ValueError at the first position where a tree does not have the spec's node there.
    """
    if _is_spec_leaf(spec):
        yield path, spec
        return
    if not is_node(spec):
        raise _spec_leaf_error(fn, path, spec)
    spec_level = one_level(spec)
    spec_entries = spec_level.entries
    for index, tree in enumerate(trees):
        where = f" in {unit} {index}" if len(trees) > 1 else ""
        if type(tree) is not type(spec):  # spec is a node, so a tree of its type is one too
            matches = False
        elif isinstance(spec, dict):
            matches = set(one_level(tree).entries) == set(spec_entries)
        else:
            matches = tuple(one_level(tree).entries) == tuple(spec_entries)
        if not matches:
            raise ValueError(
                f"{fn}: the spec does not match the tree at {format_path(path)}{where}: the spec has "
                f"{describe(spec)} but the tree has {describe(tree)}; the spec must be a prefix of the tree "
                "(a spec leaf such as SpecReplicate() may stand for a whole subtree)"
            )
    # Every walk goes in the spec's entry order; dicts pair by key, so a tree whose keys come in another
    # order still fits, and rebuild puts them back in the tree's own order.
    for entry, child_spec in zip(spec_entries, spec_level.children, strict=True):
        yield from pair_leaves(fn, child_spec, [_child(tree, entry) for tree in trees], (*path, entry), unit)


def _child(tree: Any, entry: Any) -> Any:
    level = one_level(tree)
    return level.children[level.entries.index(entry)]


def rebuild(spec: Any, tree: Any, pieces: Iterator[Any]) -> Any:
    """``tree`` with each subtree at a spec leaf replaced by the next item of ``pieces`` (:func:`pair_leaves` order)."""
    if _is_spec_leaf(spec):
        return next(pieces)
    spec_level = one_level(spec)
    rebuilt = {
        entry: rebuild(child_spec, _child(tree, entry), pieces)
        for entry, child_spec in zip(spec_level.entries, spec_level.children, strict=True)
    }
    level = one_level(tree)
    return level.unflatten_func(level.metadata, [rebuilt[entry] for entry in level.entries])


def subtrees(spec: Any, tree: Any) -> Iterator[Any]:
    """The subtrees of ``tree`` at the spec leaves, in :func:`pair_leaves` order."""
    if _is_spec_leaf(spec):
        yield tree
        return
    spec_level = one_level(spec)
    for entry, child_spec in zip(spec_level.entries, spec_level.children, strict=True):
        yield from subtrees(child_spec, _child(tree, entry))


def plural(unit: str) -> str:
    return f"{unit}es" if unit.endswith("ch") else f"{unit}s"


def check_dim(fn: str, path: KeyPath, x: torch.Tensor, dim: int, *, stack_insert: bool = False) -> None:
    ndim = x.ndim + 1 if stack_insert else x.ndim
    if not -ndim <= dim < ndim:
        what = "stack on" if stack_insert else "split on"
        raise ValueError(
            f"{fn}: leaf {format_path(path)} has shape {tuple(x.shape)}, which has no dim {dim} to {what} "
            f"(valid dims: {-ndim}..{ndim - 1}); pass a spec with a dim in that range"
        )


def _map_tensor_or_list(fn: Callable[[KeyPath, Any], Any], tree: PyTree) -> PyTree:
    return tree_map_with_path(fn, tree, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)))


def spec_on_dim(tree: PyTree, dim: int) -> PyTree:
    """The default spec: split tensors on ``dim`` and lists on dim 0; replicate everything else.

    Lists and tensors are spec leaves (a list of tensors is split *as a list*); dicts, tuples and d9dfn
    dataclasses are recursed into. 0-d tensors, ``None`` and other objects replicate.

    Raises:
        ValueError: a tensor with at least one dim has no dim ``dim``, or ``dim`` is not 0 and the tree
            holds a list.

    >>> spec_on_dim({"x": torch.ones(4, 2), "scale": torch.tensor(2.0), "tags": ["a", "b"], "n": 3}, 0)
    {'x': SpecShard(0), 'scale': SpecReplicate(), 'tags': SpecShard(0), 'n': SpecReplicate()}
    """

    def leaf_spec(path: KeyPath, x: Any) -> SpecLeaf:
        if isinstance(x, list):
            if dim != 0:
                raise ValueError(
                    f"spec_on_dim: leaf {format_path(path)} is a list, which splits on dim 0 only, but dim={dim}; "
                    "give that entry SpecShard(0) or SpecReplicate() in an explicit spec"
                )
            return SpecShard(0)
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            check_dim("spec_on_dim", path, x, dim)
            return SpecShard(dim)
        return SpecReplicate()

    return _map_tensor_or_list(leaf_spec, tree)


def spec_replicate_all(tree: PyTree) -> PyTree:
    """A spec of ``tree``'s structure with every leaf :class:`SpecReplicate` (``SpecReplicate()`` alone is the
    same as a prefix).

    >>> spec_replicate_all({"a": torch.ones(2), "b": [1, 2]})
    {'a': SpecReplicate(), 'b': [SpecReplicate(), SpecReplicate()]}
    """
    return tree_map_with_path(lambda _path, _x: SpecReplicate(), tree)


def _check_leaf(fn: str, path: KeyPath, x: Any, spec: SpecLeaf, *, mergeable: bool) -> None:
    """Validate what can be known without a shard count.

    ``mergeable=False``: ``spec`` must be able to split ``x`` (a global value). ``mergeable=True``: ``x`` is
    one shard and ``spec`` must be able to join it with its peers.
    """
    if spec is None or isinstance(spec, SpecReplicate):
        return
    if isinstance(x, torch.Tensor):
        if mergeable and spec.stack:
            check_dim(fn, path, x, spec.dim, stack_insert=True)
            return
        if x.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a 0-d tensor, which {spec!r} cannot "
                f"{'concatenate' if mergeable else 'split'}; use "
                f"{'SpecShard(0, stack=True)' if mergeable else 'SpecReplicate()'}"
            )
        check_dim(fn, path, x, spec.dim)
        return
    if mergeable and spec.stack:
        return
    if isinstance(x, list):
        if spec.dim != 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a list, which {spec!r} cannot handle: lists split and join on "
                "dim 0 only; use SpecShard(0)"
            )
        return
    hint = "SpecShard(0, stack=True) to collect one per microbatch" if mergeable else "SpecReplicate()"
    raise TypeError(
        f"{fn}: leaf {format_path(path)} is {describe(x)}, which {spec!r} cannot "
        f"{'concatenate' if mergeable else 'split'} (only tensors and lists can); use {hint}"
    )


def check_spec(fn: str, tree: PyTree, spec: PyTree, *, mergeable: bool, prefix: KeyPath = ()) -> None:
    """Raise if ``spec`` cannot apply to ``tree`` whatever the shard count (see :func:`_check_leaf`)."""
    pairs = list(pair_leaves(fn, spec, [tree], prefix, "shard"))
    for (path, leaf_spec), x in zip(pairs, subtrees(spec, tree), strict=True):
        _check_leaf(fn, path, x, leaf_spec, mergeable=mergeable)


def normalize_spec(spec: PyTree) -> PyTree:
    """``spec`` with every ``None`` leaf made :class:`SpecReplicate`, so equal meanings compare equal."""
    return tree_map_with_path(lambda _path, leaf: SpecReplicate() if leaf is None else leaf, spec)
