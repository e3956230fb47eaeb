"""Sharding: how a pytree splits into shards (microbatches) as a spec says, and how shards join back.

A *spec* (``_specs.py``) is a pytree whose leaves are :class:`SpecShard`, :class:`SpecReplicate` or ``None``
(which means replicate). It may be a **prefix** of the data tree: a spec leaf then covers the whole subtree at
its position. The semantics follow d9d's ``core/sharding`` row by row (uneven splits like
``torch.tensor_split``, lists chunked on dim 0, stack mode, replicate passes the same object), with two
deliberate differences: a ``None`` spec leaf replicates (d9d's docs promise it, its code rejects it), and
:func:`unshard_tree` can check that replicated leaves agree across shards.

Everything here is pure and traces under ``torch.compile``: shapes are static, so the Python-level shape
logic runs once at trace time, and the data moves with torch ops only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from d9dfn._pytree import format_path
from d9dfn._specs import (
    SpecLeaf,
    SpecReplicate,
    SpecShard,
    check_dim,
    check_spec,
    describe,
    is_node,
    normalize_spec,
    one_level,
    pair_leaves,
    plural,
    rebuild,
    spec_on_dim,
    spec_replicate_all,
    subtrees,
)
from d9dfn._types import KeyPath, PyTree

__all__ = [
    "SpecReplicate",
    "SpecShard",
    "check_spec",
    "normalize_spec",
    "shard_tree",
    "spec_on_dim",
    "spec_replicate_all",
    "unshard_tree",
]


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
        check_dim(fn, path, x, dim)
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
    hint = "; or give a spec per entry of the node" if is_node(x) else ""
    raise TypeError(
        f"{fn}: leaf {format_path(path)} is {describe(x)}, which {spec!r} cannot split (SpecShard splits tensors "
        f"and lists); use SpecReplicate() to give every {unit} the whole object{hint}"
    )


def _check_even(fn: str, path: KeyPath, what: str, size: int, num_shards: int, even: bool, unit: str) -> None:
    if even and size % num_shards:
        raise ValueError(
            f"{fn}: leaf {format_path(path)} has {what}, which {num_shards} {plural(unit)} cannot divide evenly; "
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
    pairs = list(pair_leaves(fn, spec, [tree], prefix, unit))
    per_leaf = [
        _shard_leaf(fn, path, x, leaf_spec, num_shards, even=even, unit=unit)
        for (path, leaf_spec), x in zip(pairs, subtrees(spec, tree), strict=True)
    ]
    return tuple(rebuild(spec, tree, iter([pieces[i] for pieces in per_leaf])) for i in range(num_shards))


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
    if is_node(a) or is_node(b):
        if type(a) is not type(b) or not is_node(a) or not is_node(b):
            return path, a, b
        level_a, level_b = one_level(a), one_level(b)
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
            f"{fn}: leaf {format_path(path)} is {describe(pieces[0])} in {unit} 0 but {describe(pieces[index])} "
            f"in {unit} {index}; every {unit} must hold the same kind of value there"
        )
    if all(is_tensor):
        first = pieces[0]
        if not stack and first.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {format_path(path)} is a 0-d tensor, which {spec!r} cannot concatenate; "
                f"use SpecShard(0, stack=True) to stack the {plural(unit)} into a vector"
            )
        check_dim(fn, path, first, dim, stack_insert=stack)
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
        raise ValueError(f"{fn}: got no {plural(unit)}; pass at least one tree (the output of shard_tree)")
    pairs = list(pair_leaves(fn, spec, list(shards), prefix, unit))
    per_shard = [list(subtrees(spec, shard)) for shard in shards]
    joined = [
        _unshard_leaf(
            fn, path, [pieces[i] for pieces in per_shard], leaf_spec, check_replicated=check_replicated, unit=unit
        )
        for i, (path, leaf_spec) in enumerate(pairs)
    ]
    return rebuild(spec, shards[0], iter(joined))


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
