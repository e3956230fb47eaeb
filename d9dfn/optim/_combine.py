"""Putting transforms together: ``chain``, ``masked``, and ``apply_updates`` at the end of the line."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn._pytree import format_path, tree_flatten
from d9dfn._types import Grads, OptState, Params, PathPredicate, PyTree, Transform, Updates
from d9dfn.optim._base import (
    Structure,
    flatten_leaves,
    flatten_like,
    flatten_tensors,
    path_name,
    same_structure,
    select_flags,
    unflatten,
)

__all__ = ["MaskedState", "apply_updates", "chain", "masked"]


def chain(*transforms: Transform) -> Transform:
    """Apply ``transforms`` one after another; the state is the tuple of their states.

    Args:
        *transforms: each one's updates are the next one's gradients.

    Returns:
        A :class:`~d9dfn.Transform`; every inner transform sees the same ``params``.

    >>> import torch
    >>> from d9dfn import optim
    >>> opt = chain(optim.clip_by_global_norm(1.0), optim.sgd(0.5))
    >>> updates, state = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init({"w": torch.zeros(2)}))
    >>> updates["w"], len(state)
    (tensor([-0.3000, -0.4000]), 2)
    """
    for i, transform in enumerate(transforms):
        if not isinstance(transform, Transform):
            raise TypeError(
                f"chain: argument {i} is a {type(transform).__name__}, not a Transform; pass transforms made by "
                f"d9dfn.optim factories (adamw(...), clip_by_global_norm(...)) or Transform(init, update)"
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(transform.init(params) for transform in transforms)

    def update(
        grads: Grads, state: tuple[OptState, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"{len(state)} states" if isinstance(state, tuple) else f"a {type(state).__name__}"
            raise ValueError(
                f"chain.update: got {got} for {len(transforms)} transforms; pass the state that this chain's init made"
            )
        new_states = []
        for transform, inner in zip(transforms, state, strict=True):
            grads, inner = transform.update(grads, inner, params)
            new_states.append(inner)
        return grads, tuple(new_states)

    return Transform(init, update, leafwise=all(transform.leafwise for transform in transforms))


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state over the selected leaves only."""

    inner: OptState


def masked(transform: Transform, predicate: PathPredicate) -> Transform:
    """Apply ``transform`` only to the leaves that ``predicate(name, leaf)`` selects; pass the others through.

    The inner transform sees a flat dict ``{name: leaf}`` of the selected leaves, where a name is the
    leaf's keys joined with dots (for d9dfn's flat params: the param's own name). Unselected gradients
    come out unchanged (optax's convention). The predicate runs on ``params`` when given, else on the
    gradients, so it must depend only on names, shapes and dtypes.

    Args:
        transform: the transform to restrict.
        predicate: ``(name, leaf) -> bool``.

    Returns:
        A :class:`~d9dfn.Transform` whose state is :class:`MaskedState`.

    >>> import torch
    >>> from d9dfn import optim
    >>> opt = masked(optim.sgd(0.1), lambda name, leaf: name.endswith("weight"))
    >>> params = {"fc.weight": torch.ones(1), "fc.bias": torch.ones(1)}
    >>> updates, _ = opt.update({"fc.weight": torch.ones(1), "fc.bias": torch.ones(1)}, opt.init(params), params)
    >>> updates
    {'fc.weight': tensor([-0.1000]), 'fc.bias': tensor([1.])}
    """

    def split(
        fn: str, selector: PyTree, tree: PyTree | None = None
    ) -> tuple[dict[str, torch.Tensor], list[bool], Structure]:
        # ``tree`` None: the selector's own leaves (a flag, not ``tree is selector``: torch 2.11's dynamo cannot trace
        # ``is`` between two dicts).
        sel_leaves, spec = flatten_leaves(selector)
        paths = spec.paths()
        leaves = sel_leaves if tree is None else flatten_like(fn, "grads", tree, spec, sel_leaves, "params")
        flags = select_flags(fn, predicate, paths, sel_leaves)
        chosen: dict[str, torch.Tensor] = {}
        for path, leaf, flag in zip(paths, leaves, flags, strict=True):
            if flag:
                name = path_name(path)
                if name in chosen:
                    raise ValueError(
                        f"{fn}: two leaves share the name {name!r} (one at {format_path(path)}); "
                        f"rename one of them so dotted names are unique"
                    )
                chosen[name] = leaf
        return chosen, flags, spec

    def init(params: Params) -> MaskedState:
        flatten_tensors("masked.init", "params", params)
        chosen, _, _ = split("masked.init", params)
        return MaskedState(inner=transform.init(chosen))

    def update(grads: Grads, state: MaskedState, params: Params | None = None) -> tuple[Updates, MaskedState]:
        fn = "masked.update"
        flatten_tensors(fn, "grads", grads)
        chosen_grads, flags, spec = split(fn, grads) if params is None else split(fn, params, grads)
        chosen_params = split(fn, params)[0] if params is not None else None
        inner_updates, inner = transform.update(chosen_grads, state.inner, chosen_params)
        grad_leaves = tree_flatten(grads)[0]
        selected = iter(inner_updates[name] for name in chosen_grads)
        out = [next(selected) if flag else leaf for leaf, flag in zip(grad_leaves, flags, strict=True)]
        return unflatten(spec, out), MaskedState(inner=inner)

    return Transform(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates``, out of place, each result in its param's dtype (``None`` updates keep the param).

    The sum is computed in the promoted dtype (bf16 params with float32 updates add in float32) and
    rounded once to the param's dtype.

    >>> import torch
    >>> apply_updates({"w": torch.ones(2, dtype=torch.bfloat16)}, {"w": torch.full((2,), 0.5)})
    {'w': tensor([1.5000, 1.5000], dtype=torch.bfloat16)}
    """
    p, spec = flatten_tensors("apply_updates", "params", params)
    u, u_spec = flatten_leaves(updates)
    if not same_structure(u_spec, spec):
        flatten_like("apply_updates", "updates", updates, spec, p, "params")  # raises with the difference
    for i, (leaf, param) in enumerate(zip(u, p, strict=True)):
        if leaf is not None and (not isinstance(leaf, torch.Tensor) or leaf.shape != param.shape):
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            path = format_path(spec.paths()[i])
            raise ValueError(
                f"apply_updates: updates{path} is {got} but params{path} has shape "
                f"{tuple(param.shape)}; pass updates from a transform initialized on these params"
            )
    idx = [i for i, leaf in enumerate(u) if leaf is not None]
    sums = torch._foreach_add([p[i] for i in idx], [u[i] for i in idx]) if idx else []
    out = list(p)
    for i, total in zip(idx, sums, strict=True):
        out[i] = total if total.dtype == p[i].dtype else total.to(p[i].dtype)
    return unflatten(spec, out)
