"""An optimizer state seen as its per-param dicts (the *slots*: a leafwise optimizer's moments, keyed by the param
names) and the rest, for the per-block tail (``d9dfn.step._tail.BlockwiseTail``).

The tail runs inside the compiled step, where dynamo traces every line again at every start (cache or not), so the
state's structure is walked here without optree for the built-in containers every d9dfn optimizer's state is made
of (optree's flatten, which dynamo runs as its Python version, costs some 70 traced lines a node); a registered
node type takes optree's path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from d9dfn._pytree import tree_flatten, tree_map
from d9dfn._types import OptState

__all__ = ["Node", "StateSlots", "flatten_state", "is_slot_of", "rebuilder"]


def is_slot_of(names: Any) -> Callable[[Any], bool]:
    """Whether a node is a dict keyed by exactly ``names`` (in any order)."""
    # No bool(dict) and no comparison of dict keys: torch 2.11's dynamo traces this inside the compiled tail and
    # cannot trace them (seen on the GPU machine, docs/design/gpu.md). The tuple of a dict's keys in ``names``'
    # order (how the transforms build their moments) is compared first: traced in a few lines where the key-by-key
    # `in` costs some 20 traced lines a key, paid at every start.
    keys = tuple(names)  # a dict's keys: unique
    return lambda node: (
        isinstance(node, dict) and len(node) == len(keys) > 0 and (tuple(node) == keys or all(k in node for k in keys))
    )


@dataclasses.dataclass(frozen=True)
class StateSlots:
    """An optimizer state flattened once down to its per-param dicts (the slots, keyed by every param name), so
    that its restriction to each block costs one rebuild of the small outer structure, not a search."""

    leaves: list[Any]
    spec: Any
    slots: tuple[int, ...]  # the slots' positions in ``leaves``

    @staticmethod
    def of(state: OptState, names: Any) -> StateSlots:
        is_slot = is_slot_of(names)
        leaves, spec = flatten_state(state, is_slot)
        return StateSlots(leaves, spec, tuple(i for i, leaf in enumerate(leaves) if is_slot(leaf)))

    def restricted(self, names: Sequence[str]) -> OptState:
        """The state with every slot cut to ``names``."""
        rebuilt = [
            {name: leaf[name] for name in names} if i in self.slots else leaf for i, leaf in enumerate(self.leaves)
        ]
        return self.spec.unflatten(rebuilt)

    def like(self, slots: tuple[int, ...], count: int, what: str) -> StateSlots:
        """Itself, after checking that its slots sit at ``slots`` of ``count`` leaves, as in the state that ``what``
        was given."""
        if len(self.leaves) != count or self.slots != slots:
            raise ValueError(
                f"the step's tail: {what} returned a state whose per-param dicts sit at leaves {list(self.slots)} of "
                f"{len(self.leaves)}, where its input had them at {list(slots)} of {count}; a "
                "leafwise optimizer must return the structure of the state it was given"
            )
        return self


@dataclasses.dataclass(frozen=True)
class Node:
    """The structure of a state built from dicts, lists, tuples and NamedTuples (every built-in optimizer's):
    ``children[i]`` is ``None`` for a leaf. Flattening and rebuilding one is a few traced lines a node, where optree's
    flatten, which dynamo runs as its Python version, is some 70 (paid at every start, in the compiled tail)."""

    kind: type
    keys: tuple[Any, ...]  # a dict's keys, in order; () for the others
    children: tuple[Node | None, ...]

    def unflatten(self, leaves: Iterable[Any]) -> Any:
        return self._build(iter(leaves))

    def _build(self, leaves: Iterator[Any]) -> Any:
        children = [next(leaves) if child is None else child._build(leaves) for child in self.children]
        if self.kind is dict:
            return dict(zip(self.keys, children, strict=True))
        if self.kind is tuple or self.kind is list:
            return self.kind(children)
        return self.kind(*children)  # a NamedTuple


class _NotBuiltinError(Exception):
    pass


def flatten_state(state: OptState, is_slot: Callable[[Any], bool]) -> tuple[list[Any], Node | Any]:
    """``tree_flatten(state, is_leaf=is_slot)``'s leaves, in its order, and a structure that rebuilds the state from
    them: a :class:`Node` for a state of built-in containers and tensors (``None`` and numbers are leaves, as in
    d9dfn's trees), else optree's treespec."""
    leaves: list[Any] = []

    def walk(node: Any) -> Node | None:
        kind = type(node)
        if is_slot(node) or node is None or isinstance(node, (torch.Tensor, bool, int, float, str)):
            leaves.append(node)
            return None
        if kind is dict:
            return Node(dict, tuple(node), tuple(walk(child) for child in node.values()))
        # A NamedTuple by its ``_fields``: ``getattr`` with a default, since torch 2.11's dynamo refuses
        # ``hasattr`` on a class (GPU check of 2026-11-27, docs/design/gpu.md).
        if kind is tuple or kind is list or (isinstance(node, tuple) and getattr(kind, "_fields", None) is not None):
            return Node(kind, (), tuple(walk(child) for child in node))
        raise _NotBuiltinError  # a registered node type (or a leaf) that optree knows and this walk does not

    try:
        return leaves, walk(state)
    except _NotBuiltinError:
        return tree_flatten(state, is_leaf=is_slot)


def rebuilder(spec: Node | Any, count: int) -> Callable[[Sequence[Any]], Any]:
    """The state from its ``count`` leaves (a slot: its whole dict), for a structure from :func:`flatten_state`."""
    if isinstance(spec, Node):
        return spec.unflatten
    skeleton = spec.unflatten(range(count))  # the state with each leaf replaced by its position
    return lambda leaves: tree_map(lambda i: leaves[i], skeleton)
