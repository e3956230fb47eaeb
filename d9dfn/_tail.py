"""The train step's update after the reduction: ``× 1/Σw`` → global norm → clip → ``optimizer.update`` →
``apply_updates`` → the skip of a non-finite step, over the whole tree (:func:`update_whole`) or, with repeated
blocks and a ``leafwise`` optimizer, each block's leaves through one shared compiled region
(:class:`BlockwiseTail`: the optimizer's graph stops growing with depth; ``docs/design/step.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from d9dfn import optim
from d9dfn._pytree import tree_flatten, tree_map
from d9dfn._train_state import TrainState
from d9dfn._types import OptState, Params, Transform
from d9dfn.parallel._grads import global_norm as parallel_global_norm
from d9dfn.parallel._pipeline import PipelineReduction

__all__ = ["BlockwiseTail", "TailUpdate", "kept", "update_whole"]


@dataclasses.dataclass(frozen=True)
class TailUpdate:
    """The tail's per-leaf part, done: params and optimizer state after the update (and the skip), and the
    step's gradient norm, non-finite flag and learning rate."""

    params: Params
    opt_state: OptState
    grad_norm: torch.Tensor
    nonfinite: torch.Tensor
    lr: torch.Tensor


def update_whole(
    train_state: TrainState,
    grad_sum: Params,
    inv_weight: torch.Tensor,
    loss: torch.Tensor,
    optimizer: Transform,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    distributed: bool,
    reduce_pipeline: PipelineReduction | None,
) -> TailUpdate:
    """``× 1/Σw`` → global norm → clip → ``optimizer.update`` → ``apply_updates`` → skip, over the whole tree."""
    params = train_state.params
    grads = {name: g * inv_weight.to(g.dtype) for name, g in grad_sum.items()}
    # Over all shards: one collective per sharding pattern for DTensor gradients.
    if reduce_pipeline is not None:  # over every stage: torchtitan#596 clipped with the local norm
        grad_norm = reduce_pipeline.global_norm(grads)
    else:
        grad_norm = parallel_global_norm(grads) if distributed else optim.global_norm(grads)
    if max_grad_norm:
        scale = optim.clip_factor(grad_norm, max_grad_norm)  # the norm over all shards, not this rank's
        grads = {name: g * scale.to(g.dtype) for name, g in grads.items()}
    updates, opt_state = optimizer.update(grads, train_state.opt_state, params)
    lr = optim.learning_rate(opt_state)  # what this update used, before a skip restores the state
    new_params = optim.apply_updates(params, updates)
    nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if skip_nonfinite:
        new_params, opt_state = kept(nonfinite, (params, train_state.opt_state), (new_params, opt_state))
    return TailUpdate(params=new_params, opt_state=opt_state, grad_norm=grad_norm, nonfinite=nonfinite, lr=lr)


class BlockwiseTail:
    """The tail's per-leaf work with each repeated block's leaves through one shared region, built once per step.

    For the leaves outside the blocks, and for the scalars, it is the tail itself; for a block's leaves, two
    regions keyed by the names inside the block (``self_attn.q_proj.weight``), so every block reuses the first
    block's compiled code: its scaled gradients' norms, then ``× 1/Σw`` (``× clip``) → ``optimizer.update`` on the
    block's part of the state → ``apply_updates`` → the skip. The maths and its order are the tail's, leaf by
    leaf, so results equal the whole-tree tail to rounding. Needs a ``leafwise`` optimizer (:class:`d9dfn.Transform`).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[type[nn.Module]], optimizer: Transform) -> None:
        wanted = frozenset(blocks)
        self.prefixes = tuple(f"{name}." for name, module in model.named_modules() if type(module) in wanted)
        self.optimizer = optimizer
        self._norms = torch.compiler.nested_compile_region(_scaled_norms)

        def update(
            grads: Params, params: Params, state: OptState, factor: tuple[torch.Tensor, ...], nonfinite: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            new_params, new_state = _update_leaves(optimizer, grads, params, state, factor)
            new_params, new_state = kept(nonfinite, (params, state), (new_params, new_state))
            return (*new_params.values(), *(t for slot in _slots(new_state, params.keys()) for t in slot.values()))

        self._update = torch.compiler.nested_compile_region(update)

    def applies(self, params: Params) -> bool:
        """Whether this step's params have leaves outside the blocks (they carry the state's shared scalars)."""
        return any(not name.startswith(self.prefixes) for name in params)

    def __call__(
        self,
        params: Params,
        grads: Params,
        opt_state: OptState,
        inv_weight: torch.Tensor,
        loss: torch.Tensor,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
    ) -> TailUpdate:
        """``grads`` are the reduced sums ``Σwᵢ∇ℓᵢ``; the tail's steps from ``× 1/Σw`` to the skip."""
        groups = [{name: name[len(p) :] for name in params if name.startswith(p)} for p in self.prefixes]
        rest = {name: name for name in params if not name.startswith(self.prefixes)}
        norms = dict(zip(rest, _scaled_norms({name: grads[name] for name in rest}, inv_weight).unbind(), strict=True))
        for group in groups:
            block_norms = self._norms({inner: grads[name] for name, inner in group.items()}, inv_weight)
            norms.update(zip(group, block_norms.unbind(), strict=True))
        grad_norm = torch.linalg.vector_norm(torch.stack([norms[name] for name in params]))
        factor = (inv_weight, optim.clip_factor(grad_norm, max_grad_norm)) if max_grad_norm else (inv_weight,)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        keep = nonfinite if skip_nonfinite else torch.zeros_like(nonfinite)

        def part(tree: Any, names: Mapping[str, str]) -> Any:
            return {inner: tree[name] for name, inner in names.items()}

        rest_params, rest_state = part(params, rest), _restricted(opt_state, params.keys(), rest)
        new_rest, rest_state_new = _update_leaves(self.optimizer, part(grads, rest), rest_params, rest_state, factor)
        lr = optim.learning_rate(rest_state_new)  # what the update used, before a skip restores the state
        new_rest, rest_state_new = kept(keep, (rest_params, rest_state), (new_rest, rest_state_new))
        new_params, slots = dict(new_rest), [dict(slot) for slot in _slots(rest_state_new, rest.keys())]
        for group in groups:
            inner_state = _restricted(opt_state, params.keys(), group)
            flat = self._update(part(grads, group), part(params, group), inner_state, factor, keep)
            chunks = [flat[i : i + len(group)] for i in range(0, len(flat), len(group))]  # params, then each slot
            for into, chunk in zip([new_params, *slots], chunks, strict=True):
                into.update(zip(group, chunk, strict=True))
        ordered = [{name: slot[name] for name in params} for slot in slots]
        return TailUpdate(
            params={name: new_params[name] for name in params},
            opt_state=_with_slots(rest_state_new, rest.keys(), ordered),
            grad_norm=grad_norm,
            nonfinite=nonfinite,
            lr=lr,
        )


def _scaled_norms(grads: Params, inv_weight: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each ``g × 1/Σw`` in float32, stacked in ``grads``' order (``optim.global_norm``'s first half)."""
    scaled = [g * inv_weight.to(g.dtype) for g in grads.values()]
    return torch.stack(list(torch._foreach_norm(scaled, 2.0, dtype=torch.float32)))


def _update_leaves(
    optimizer: Transform, grads: Params, params: Params, state: OptState, factor: tuple[torch.Tensor, ...]
) -> tuple[Params, OptState]:
    """``× 1/Σw`` (``× clip``) → ``optimizer.update`` → ``apply_updates``, as the whole-tree tail does them."""
    for f in factor:
        grads = {name: g * f.to(g.dtype) for name, g in grads.items()}
    updates, new_state = optimizer.update(grads, state, params)
    return optim.apply_updates(params, updates), new_state


def kept(nonfinite: torch.Tensor, old: Any, new: Any) -> Any:
    """``new`` where the step is finite, ``old`` where it is not (tensor leaves; the rest is ``new``'s)."""

    def keep(n: Any, o: Any) -> Any:
        return torch.where(nonfinite, o, n) if isinstance(n, torch.Tensor) else n

    return tree_map(keep, new, old)


def _is_slot(names: Any) -> Callable[[Any], bool]:
    keys = set(names)
    return lambda node: isinstance(node, dict) and bool(node) and node.keys() == keys


def _slots(state: OptState, names: Any) -> list[dict[str, torch.Tensor]]:
    """The dicts of ``state`` keyed by exactly ``names`` (a leafwise optimizer's per-param moments), in tree order."""
    is_slot = _is_slot(names)
    return [leaf for leaf in tree_flatten(state, is_leaf=is_slot)[0] if is_slot(leaf)]


def _restricted(state: OptState, names: Any, renamed: Mapping[str, str]) -> OptState:
    """``state`` with every dict keyed by ``names`` cut to ``renamed``'s keys, under their new names."""
    is_slot = _is_slot(names)
    leaves, spec = tree_flatten(state, is_leaf=is_slot)
    return spec.unflatten(
        [{new: leaf[old] for old, new in renamed.items()} if is_slot(leaf) else leaf for leaf in leaves]
    )


def _with_slots(state: OptState, names: Any, slots: Sequence[dict[str, torch.Tensor]]) -> OptState:
    """``state`` with its dicts keyed by ``names`` replaced, in tree order, by ``slots``."""
    is_slot = _is_slot(names)
    leaves, spec = tree_flatten(state, is_leaf=is_slot)
    replacements = iter(slots)
    return spec.unflatten([next(replacements) if is_slot(leaf) else leaf for leaf in leaves])
