"""d9dfn's pytree conventions: one optree namespace, torch-compatible flattening, frozen state classes.

Two decisions are made once here and hold everywhere in d9dfn:

* ``None`` is a **leaf** (``none_is_leaf=True``), as in ``torch.utils._pytree`` and d9d.
* Dicts flatten in **insertion order**, as in ``torch.utils._pytree``; optree's default sorts keys.

Both matter because ``torch.func`` and ``torch.compile`` flatten with torch's own registry: a tree that
d9dfn flattens must give the same leaves, in the same order, as torch gives for it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, dataclass_transform

import optree
import torch.utils._pytree as torch_pytree

from d9dfn._types import KeyPath

__all__ = [
    "NAMESPACE",
    "field",
    "format_path",
    "pytree_dataclass",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_structure",
    "tree_unflatten",
]

NAMESPACE = "d9dfn"
"""The optree namespace in which d9dfn registers its node types."""

T = TypeVar("T")

# optree offers insertion-ordered dicts per namespace only through a context manager; enter it once, for
# the whole process, so that every d9dfn flatten matches torch's order. The reference must live as long as
# the module: a collected generator would run its ``finally`` and restore sorted keys.
_INSERTION_ORDERED = optree.dict_insertion_ordered(True, namespace=NAMESPACE)
_INSERTION_ORDERED.__enter__()

_NONE_IS_LEAF = True  # passed as a literal to optree, whose stubs want a bool, not a dict's ``object``


def tree_flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into its leaves and a treespec, with d9dfn's conventions."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def tree_flatten_with_path(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[KeyPath], list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into key paths, leaves and a treespec."""
    return optree.tree_flatten_with_path(tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def tree_unflatten(treespec: optree.PyTreeSpec, leaves: Iterable[Any]) -> Any:
    """Rebuild a tree from ``treespec`` and ``leaves``."""
    return optree.tree_unflatten(treespec, leaves)


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def tree_structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> optree.PyTreeSpec:
    """The treespec of ``tree``."""
    return optree.tree_structure(tree, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def tree_map(fn: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (and the matching leaves of ``rests``)."""
    return optree.tree_map(fn, tree, *rests, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def tree_map_with_path(
    fn: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """Map ``fn(path, leaf, *rest_leaves)`` over the leaves of ``tree``."""
    return optree.tree_map_with_path(fn, tree, *rests, is_leaf=is_leaf, none_is_leaf=_NONE_IS_LEAF, namespace=NAMESPACE)


def format_path(path: Sequence[Any]) -> str:
    """Render a key path the way error messages show it.

    >>> format_path(("kwargs", "labels", 0))
    "['kwargs']['labels'][0]"
    >>> format_path(())
    '<root>'
    """
    if not path:
        return "<root>"
    return "".join(f"[{key!r}]" for key in path)


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; ``static=True`` keeps it out of the tree (callables, configs, meshes).

    Static fields travel in the treespec, so ``torch.compile`` guards on them: put only values there
    that are fixed for the run.
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata["static"] = static
    return dataclasses.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field, field))
def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, keyword-only dataclass that is a pytree node for optree and torch.

    Fields made with ``field(static=True)`` are not nodes: they ride in the treespec. Instances get
    ``.replace(**changes)``, which returns a new instance; nothing is ever assigned in place.

    >>> import torch
    >>> @pytree_dataclass
    ... class Counter:
    ...     count: torch.Tensor
    ...     name: str = field(static=True, default="c")
    >>> c = Counter(count=torch.tensor(0))
    >>> tree_leaves(c.replace(count=c.count + 1))
    [tensor(1)]
    """
    # mypy sees neither what ``dataclass`` makes of ``cls`` nor that optree accepts any class as a node (its
    # stubs say ``type[Collection]``), so the machinery below handles the class untyped.
    node_cls: Any = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    fields = dataclasses.fields(node_cls)
    data_names = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static_names = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        children = tuple(getattr(obj, name) for name in data_names)
        aux = tuple(getattr(obj, name) for name in static_names)
        return children, aux, data_names

    def unflatten(aux: Any, children: Iterable[Any]) -> Any:  # aux: the static fields' values, a tuple
        kwargs = dict(zip(data_names, children, strict=True))
        kwargs.update(zip(static_names, aux, strict=True))
        return node_cls(**kwargs)

    optree.register_pytree_node(node_cls, flatten, unflatten, namespace=NAMESPACE)

    def torch_flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        children, aux, _ = flatten(obj)
        return list(children), aux

    def torch_flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, aux, _ = flatten(obj)
        keys = [torch_pytree.GetAttrKey(name) for name in data_names]
        return list(zip(keys, children, strict=True)), aux

    torch_pytree.register_pytree_node(
        node_cls,
        torch_flatten,
        lambda children, aux: unflatten(aux, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=torch_flatten_with_keys,
    )
    node_cls.replace = functools.wraps(dataclasses.replace)(
        lambda self, **changes: dataclasses.replace(self, **changes)
    )
    node_cls.replace.__doc__ = "Return a copy with ``changes`` applied; the original is unchanged."
    return cls  # the same class object: ``dataclass`` without slots decorates in place
