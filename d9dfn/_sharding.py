"""Sharding specs: how a pytree splits into shards (microbatches) and how shards join back.

A *spec* is a pytree whose leaves are :class:`SpecShard`, :class:`SpecReplicate` or ``None`` (which
means replicate). It may be a **prefix** of the data tree: a spec leaf then covers the whole subtree at
its position. The semantics follow d9d's ``core/sharding`` row by row (uneven splits like
``torch.tensor_split``, lists chunked on dim 0, stack mode, replicate passes the same object), with two
deliberate differences: a ``None`` spec leaf replicates (d9d's docs promise it, its code rejects it), and
:func:`unshard_tree` can check that replicated leaves agree across shards.

Everything here is pure and traces under ``torch.compile``: shapes are static, so the Python-level shape
logic runs once at trace time, and the data moves with torch ops only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch

from d9dfn._pytree import NAMESPACE, format_path, tree_map_with_path
from d9dfn._types import KeyPath, PyTree

__all__ = [
    "SpecReplicate",
    "SpecShard",
    "shard_tree",
    "spec_on_dim",
    "spec_replicate_all",
    "unshard_tree",
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


def _is_node(x: Any) -> bool:
    return not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)


def _one_level(x: Any) -> optree.ops.FlattenOneLevelOutputEx[Any]:
    return optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=NAMESPACE)


def _describe(x: Any) -> str:
    """A short description of a node or leaf for structure-mismatch messages."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {list(x)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    if _is_node(x):
        return f"a {type(x).__name__} node with entries {list(_one_level(x).entries)}"
    return f"a {type(x).__name__} leaf"


def _spec_leaf_error(fn: str, path: KeyPath, spec: Any) -> TypeError:
    return TypeError(
        f"{fn}: the spec at {format_path(path)} is {spec!r}, which is neither a spec leaf nor a pytree node; "
        "use SpecShard(dim), SpecShard(dim, stack=True), SpecReplicate() or None (replicate)"
    )


def _pair(fn: str, spec: Any, trees: Sequence[Any], path: KeyPath, unit: str) -> Iterator[tuple[KeyPath, Any]]:
    """Walk ``spec`` down ``trees`` (all of one structure up to the spec); yield (path, spec leaf).

    Raises ValueError at the first position where a tree does not have the spec's node there.
    """
    if _is_spec_leaf(spec):
        yield path, spec
        return
    if not _is_node(spec):
        raise _spec_leaf_error(fn, path, spec)
    spec_level = _one_level(spec)
    spec_entries = spec_level.entries
    for index, tree in enumerate(trees):
        where = f" in {unit} {index}" if len(trees) > 1 else ""
        if type(tree) is not type(spec):  # spec is a node, so a tree of its type is one too
            matches = False
        elif isinstance(spec, dict):
            matches = set(_one_level(tree).entries) == set(spec_entries)
        else:
            matches = tuple(_one_level(tree).entries) == tuple(spec_entries)
        if not matches:
            raise ValueError(
                f"{fn}: the spec does not match the tree at {format_path(path)}{where}: the spec has "
                f"{_describe(spec)} but the tree has {_describe(tree)}; the spec must be a prefix of the tree "
                "(a spec leaf such as SpecReplicate() may stand for a whole subtree)"
            )
    # Every walk goes in the spec's entry order; dicts pair by key, so a tree whose keys come in another
    # order still fits, and _rebuild puts them back in the tree's own order.
    for entry, child_spec in zip(spec_entries, spec_level.children, strict=True):
        yield from _pair(fn, child_spec, [_child(tree, entry) for tree in trees], (*path, entry), unit)


def _child(tree: Any, entry: Any) -> Any:
    level = _one_level(tree)
    return level.children[level.entries.index(entry)]


def _rebuild(spec: Any, tree: Any, pieces: Iterator[Any]) -> Any:
    """``tree`` with each subtree at a spec leaf replaced by the next item of ``pieces`` (in :func:`_pair` order)."""
    if _is_spec_leaf(spec):
        return next(pieces)
    spec_level = _one_level(spec)
    rebuilt = {
        entry: _rebuild(child_spec, _child(tree, entry), pieces)
        for entry, child_spec in zip(spec_level.entries, spec_level.children, strict=True)
    }
    level = _one_level(tree)
    return level.unflatten_func(level.metadata, [rebuilt[entry] for entry in level.entries])


def _subtrees(spec: Any, tree: Any) -> Iterator[Any]:
    """The subtrees of ``tree`` at the spec leaves, in :func:`_pair` order."""
    if _is_spec_leaf(spec):
        yield tree
        return
    spec_level = _one_level(spec)
    for entry, child_spec in zip(spec_level.entries, spec_level.children, strict=True):
        yield from _subtrees(child_spec, _child(tree, entry))


def _plural(unit: str) -> str:
    return f"{unit}es" if unit.endswith("ch") else f"{unit}s"


def _check_dim(fn: str, path: KeyPath, x: torch.Tensor, dim: int, *, stack_insert: bool = False) -> None:
    ndim = x.ndim + 1 if stack_insert else x.ndim
    if not -ndim <= dim < ndim:
        what = "stack on" if stack_insert else "split on"
        raise ValueError(
            f"{fn}: leaf {format_path(path)} has shape {tuple(x.shape)}, which has no dim {dim} to {what} "
            f"(valid dims: {-ndim}..{ndim - 1}); pass a spec with a dim in that range"
        )


def _split_sizes(size: int, num_shards: int) -> list[int]:
    """Chunk sizes as ``torch.tensor_split`` gives them: the first ``size % num_shards`` chunks one larger."""
    base, extra = divmod(size, num_shards)
    return [base + 1 if i < extra else base for i in range(num_shards)]


def _shard_leaf(fn: str, path: KeyPath, x: Any, spec: SpecLeaf, num_shards: int, *, even: bool, unit: str) -> list[Any]:
    if spec is None or isinstance(spec, SpecReplicate):
        return [x] * num_shards
    dim, stack = spec.dim, spec.stack
    if isinstance(x, torch.Tensor):
        if x.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a 0-d tensor, which {spec!r} cannot split; use SpecReplicate() "
                f"to give every {unit} the same value, or give the value a leading dim of size {num_shards}"
            )
        _check_dim(fn, path, x, dim)
        size = x.shape[dim]
        if stack:
            if size != num_shards:
                raise ValueError(
                    f"{fn}: leaf {format_path(path)} has shape {tuple(x.shape)} with {size} entries on dim {dim}, "
                    f"but SpecShard({dim}, stack=True) needs exactly one per {unit} ({num_shards}); "
                    f"use SpecShard({dim}) to cut it into chunks instead"
                )
            return list(x.unbind(dim))
        _check_even(fn, path, f"shape {tuple(x.shape)} with {size} rows on dim {dim}", size, num_shards, even, unit)
        return list(torch.tensor_split(x, num_shards, dim=dim))
    if isinstance(x, list):
        if dim != 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a list, which {spec!r} cannot split: lists split on dim 0 only; "
                f"use SpecShard(0{', stack=True' if stack else ''}), or make it a tensor to split on dim {dim}"
            )
        if stack:
            if len(x) != num_shards:
                raise ValueError(
                    f"{fn}: leaf {format_path(path)} is a list of length {len(x)}, but SpecShard(0, stack=True) "
                    f"needs exactly one element per {unit} ({num_shards}); use SpecShard(0) to cut it into chunks"
                )
            return list(x)
        _check_even(fn, path, f"a list with {len(x)} elements", len(x), num_shards, even, unit)
        pieces, start = [], 0
        for size in _split_sizes(len(x), num_shards):
            pieces.append(x[start : start + size])
            start += size
        return pieces
    hint = "; or give a spec per entry of the node" if _is_node(x) else ""
    raise TypeError(
        f"{fn}: leaf {format_path(path)} is {_describe(x)}, which {spec!r} cannot split (SpecShard splits tensors "
        f"and lists); use SpecReplicate() to give every {unit} the whole object{hint}"
    )


def _check_even(fn: str, path: KeyPath, what: str, size: int, num_shards: int, even: bool, unit: str) -> None:
    if even and size % num_shards:
        raise ValueError(
            f"{fn}: leaf {format_path(path)} has {what}, which {num_shards} {_plural(unit)} cannot divide evenly; "
            "pass even=False (the first shards then get one row more) or change the microbatch size"
        )


def _check_num_shards(fn: str, num_shards: Any) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise TypeError(f"{fn}: num_shards must be an int, got {num_shards!r}")
    if num_shards < 1:
        raise ValueError(f"{fn}: num_shards must be at least 1, got {num_shards}")


def _shard(
    fn: str, tree: PyTree, spec: PyTree, num_shards: int, *, even: bool, prefix: KeyPath = (), unit: str = "shard"
) -> tuple[PyTree, ...]:
    pairs = list(_pair(fn, spec, [tree], prefix, unit))
    per_leaf = [
        _shard_leaf(fn, path, x, leaf_spec, num_shards, even=even, unit=unit)
        for (path, leaf_spec), x in zip(pairs, _subtrees(spec, tree), strict=True)
    ]
    return tuple(_rebuild(spec, tree, iter([pieces[i] for pieces in per_leaf])) for i in range(num_shards))


def shard_tree(tree: PyTree, spec: PyTree, num_shards: int, *, even: bool) -> tuple[PyTree, ...]:
    """Split ``tree`` into ``num_shards`` trees of the same structure, as ``spec`` says.

    Args:
        tree: the data.
        spec: a spec tree, a prefix of ``tree``: leaves :class:`SpecShard`, :class:`SpecReplicate` or ``None``.
        num_shards: how many shards (microbatches) to make.
        even: raise unless every split size divides by ``num_shards``; otherwise split like
            ``torch.tensor_split`` (the first ``size % num_shards`` shards get one more row; shards may be empty).

    Returns:
        One tree per shard. Replicated subtrees are the same objects in every shard.

    Raises:
        ValueError: the spec does not fit the tree, a size does not divide evenly, a stacked dim does not
            have ``num_shards`` entries, a dim is out of range, or a 0-d tensor meets a :class:`SpecShard`.
        TypeError: a :class:`SpecShard` covers something other than a tensor or list, or a spec leaf is not
            a spec.

    >>> x = {"ids": torch.arange(5), "name": "batch"}
    >>> shard_tree(x, {"ids": SpecShard(0), "name": None}, 2, even=False)
    ({'ids': tensor([0, 1, 2]), 'name': 'batch'}, {'ids': tensor([3, 4]), 'name': 'batch'})
    """
    _check_num_shards("shard_tree", num_shards)
    return _shard("shard_tree", tree, spec, num_shards, even=even)


def _trees_differ(a: Any, b: Any, path: KeyPath) -> tuple[KeyPath, Any, Any] | None:
    """The first (path, a_leaf, b_leaf) where ``a`` and ``b`` differ, or None if they are equal."""
    if a is b:
        return None
    if _is_node(a) or _is_node(b):
        if type(a) is not type(b) or not _is_node(a) or not _is_node(b):
            return path, a, b
        level_a, level_b = _one_level(a), _one_level(b)
        if tuple(level_a.entries) != tuple(level_b.entries) or level_a.metadata != level_b.metadata:
            return path, a, b
        for entry, x, y in zip(level_a.entries, level_a.children, level_b.children, strict=True):
            found = _trees_differ(x, y, (*path, entry))
            if found is not None:
                return found
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return None if same and torch.equal(a, b) else (path, a, b)
    return None if a == b else (path, a, b)


def _unshard_leaf(
    fn: str, path: KeyPath, pieces: list[Any], spec: SpecLeaf, *, check_replicated: bool, unit: str
) -> Any:
    if spec is None or isinstance(spec, SpecReplicate):
        if check_replicated:
            for index, piece in enumerate(pieces[1:], start=1):
                found = _trees_differ(pieces[0], piece, path)
                if found is not None:
                    where, first, other = found
                    raise ValueError(
                        f"{fn}: replicated leaf {format_path(where)} differs between {unit} 0 and {index}: "
                        f"{first!r} vs {other!r}; write it with a SpecShard spec if it is meant to differ"
                    )
        return pieces[0]
    dim, stack = spec.dim, spec.stack
    is_tensor = [isinstance(piece, torch.Tensor) for piece in pieces]
    if any(is_tensor) and not all(is_tensor):
        index = is_tensor.index(not is_tensor[0])
        raise TypeError(
            f"{fn}: leaf {format_path(path)} is {_describe(pieces[0])} in {unit} 0 but {_describe(pieces[index])} "
            f"in {unit} {index}; every {unit} must hold the same kind of value there"
        )
    if all(is_tensor):
        first = pieces[0]
        if not stack and first.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a 0-d tensor, which {spec!r} cannot concatenate; "
                f"use SpecShard(0, stack=True) to stack the {_plural(unit)} into a vector"
            )
        _check_dim(fn, path, first, dim, stack_insert=stack)
        for index, piece in enumerate(pieces[1:], start=1):
            expected, got = list(first.shape), list(piece.shape)
            if not stack and len(expected) == len(got):
                expected[dim] = got[dim] = -1  # the concatenated dim may differ between shards
            if expected != got:
                raise ValueError(
                    f"{fn}: leaf {format_path(path)} has shape {tuple(first.shape)} in {unit} 0 but "
                    f"{tuple(piece.shape)} in {unit} {index}, which {spec!r} cannot join; "
                    f"{'stacking needs equal shapes' if stack else f'shapes may differ only on dim {dim}'}"
                )
        return torch.stack(pieces, dim) if stack else torch.cat(pieces, dim)
    if stack:
        return list(pieces)
    if all(isinstance(piece, list) for piece in pieces):
        if dim != 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} holds lists, which {spec!r} cannot join: lists join on dim 0 only; "
                "use SpecShard(0)"
            )
        return [item for piece in pieces for item in piece]
    kinds = sorted({type(piece).__name__ for piece in pieces})
    raise TypeError(
        f"{fn}: leaf {format_path(path)} holds {'/'.join(kinds)} objects, which {spec!r} cannot concatenate "
        f"(only tensors and lists concatenate); use SpecShard({dim}, stack=True) to collect one per {unit} "
        "in a list, or SpecReplicate() to keep the first"
    )


def _unshard(
    fn: str,
    shards: Sequence[PyTree],
    spec: PyTree,
    *,
    check_replicated: bool,
    prefix: KeyPath = (),
    unit: str = "shard",
) -> PyTree:
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
        raise TypeError(f"{fn}: shards must be a sequence of trees (a list or tuple), got {type(shards).__name__}")
    if not shards:
        raise ValueError(f"{fn}: got no {_plural(unit)}; pass at least one tree (the output of shard_tree)")
    pairs = list(_pair(fn, spec, list(shards), prefix, unit))
    per_shard = [list(_subtrees(spec, shard)) for shard in shards]
    joined = [
        _unshard_leaf(
            fn, path, [pieces[i] for pieces in per_shard], leaf_spec, check_replicated=check_replicated, unit=unit
        )
        for i, (path, leaf_spec) in enumerate(pairs)
    ]
    return _rebuild(spec, shards[0], iter(joined))


def unshard_tree(shards: Sequence[PyTree], spec: PyTree, *, check_replicated: bool = False) -> PyTree:
    """Join ``shards`` back into one tree: the inverse of :func:`shard_tree` for the same ``spec``.

    Args:
        shards: trees of one structure (up to ``spec``), in shard order.
        spec: the spec tree, as for :func:`shard_tree`.
        check_replicated: verify that replicated subtrees agree across shards (``torch.equal`` for tensors,
            ``==`` otherwise). Off by default: it costs a comparison per element and a host sync per
            tensor, and :func:`shard_tree` hands every shard the same object anyway. Turn it on in eager
            code when shards come from elsewhere.

    Returns:
        One tree: sharded tensors concatenated (or stacked), lists concatenated, other objects with
        ``stack=True`` gathered in a list; replicated subtrees taken from the first shard.

    Raises:
        ValueError: no shards, shards whose structures differ, shapes that cannot join, or (with
            ``check_replicated``) replicated leaves that differ.
        TypeError: a concatenating spec over objects that are neither tensors nor lists.

    >>> unshard_tree([torch.tensor(1.0), torch.tensor(2.0)], SpecShard(0, stack=True))
    tensor([1., 2.])
    >>> unshard_tree([[1], [2, 3]], SpecShard(0))
    [1, 2, 3]
    """
    return _unshard("unshard_tree", shards, spec, check_replicated=check_replicated)


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
            _check_dim("spec_on_dim", path, x, dim)
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
            _check_dim(fn, path, x, spec.dim, stack_insert=True)
            return
        if x.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a 0-d tensor, which {spec!r} cannot "
                f"{'concatenate' if mergeable else 'split'}; use "
                f"{'SpecShard(0, stack=True)' if mergeable else 'SpecReplicate()'}"
            )
        _check_dim(fn, path, x, spec.dim)
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
        f"{fn}: leaf {format_path(path)} is {_describe(x)}, which {spec!r} cannot "
        f"{'concatenate' if mergeable else 'split'} (only tensors and lists can); use {hint}"
    )


def check_spec(fn: str, tree: PyTree, spec: PyTree, *, mergeable: bool, prefix: KeyPath = ()) -> None:
    """Raise if ``spec`` cannot apply to ``tree`` whatever the shard count (see :func:`_check_leaf`)."""
    pairs = list(_pair(fn, spec, [tree], prefix, "shard"))
    for (path, leaf_spec), x in zip(pairs, _subtrees(spec, tree), strict=True):
        _check_leaf(fn, path, x, leaf_spec, mergeable=mergeable)


def normalize_spec(spec: PyTree) -> PyTree:
    """``spec`` with every ``None`` leaf made :class:`SpecReplicate`, so equal meanings compare equal."""
    return tree_map_with_path(lambda _path, leaf: SpecReplicate() if leaf is None else leaf, spec)
