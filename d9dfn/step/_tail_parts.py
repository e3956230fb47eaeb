"""What the train step's tail forms share (:mod:`d9dfn.step._tail`): its per-leaf part's result, the global norm,
the update over the whole tree, and the skip of a non-finite step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from d9dfn import optim
from d9dfn._pytree import tree_map
from d9dfn._types import OptState, Params, Transform
from d9dfn.parallel._grads import leaf_norms
from d9dfn.parallel._pipeline import PipelineReduction
from d9dfn.parallel._placement import is_distributed_tensor, local_of, placed_like
from d9dfn.step._state import TrainState
from d9dfn.step._state_slots import StateSlots

__all__ = [
    "TailUpdate",
    "donated_update",
    "kept",
    "kept_leaf",
    "kept_scalars",
    "local_of",
    "placed_like",
    "total_norm",
    "update_whole",
    "write_into",
]


@dataclasses.dataclass(frozen=True)
class TailUpdate:
    """The tail's per-leaf part, done: params and optimizer state after the update (and the skip), and the
    step's gradient norm, non-finite flag and learning rate."""

    params: Params
    opt_state: OptState
    grad_norm: torch.Tensor
    nonfinite: torch.Tensor
    lr: torch.Tensor


def total_norm(norms: Mapping[str, torch.Tensor], pipeline: PipelineReduction | None) -> torch.Tensor:
    """The global norm from per-leaf norms: over every stage with a pipeline (torchtitan#596 clipped with the
    local norm), else the norm of this process's norms (``optim.global_norm``'s formula)."""
    if pipeline is not None:
        return pipeline.total_norm(norms)
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(list(norms.values())))
    return total


def update_whole(
    train_state: TrainState,
    grad_sum: Params,
    inv_weight: torch.Tensor,
    loss: torch.Tensor,
    optimizer: Transform,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    pipeline: PipelineReduction | None,
) -> TailUpdate:
    """``× 1/Σw`` → global norm → clip → ``optimizer.update`` → ``apply_updates`` → skip, over the whole tree."""
    params = train_state.params
    grads = {name: g * inv_weight.to(g.dtype) for name, g in grad_sum.items()}
    grad_norm = total_norm(leaf_norms(grads), pipeline)  # over all shards: one collective per sharding pattern
    if max_grad_norm:
        scale = optim.clip_factor(grad_norm, max_grad_norm)  # the norm over all shards, not this rank's
        grads = {name: g * scale.to(g.dtype) for name, g in grads.items()}
    if optimizer.leafwise and any(is_distributed_tensor(p) for p in params.values()):
        new_params, opt_state = _update_local_shards(optimizer, grads, train_state.opt_state, params)
    else:
        updates, opt_state = optimizer.update(grads, train_state.opt_state, params)
        new_params = optim.apply_updates(params, updates)
    lr = optim.learning_rate(opt_state)  # what this update used, before a skip restores the state
    nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if skip_nonfinite:
        new_params, opt_state = kept(nonfinite, (params, train_state.opt_state), (new_params, opt_state))
    return TailUpdate(params=new_params, opt_state=opt_state, grad_norm=grad_norm, nonfinite=nonfinite, lr=lr)


def _update_local_shards(optimizer: Transform, grads: Params, opt_state: Any, params: Params) -> tuple[Params, Any]:
    """``optimizer.update`` → ``apply_updates`` of a ``leafwise`` optimizer on the ``DTensor``s' local shards (a
    shard's update is that part of the whole update: :class:`~d9dfn.Transform`'s ``leafwise``), the results placed
    back as their params. The same kernels on the same shards as the ``DTensor`` ops run; without torch's sharding
    propagation, which for the foreach ops over every param of a many-axis mesh costs seconds per new mesh (eager)
    or per trace."""
    state = StateSlots.of(opt_state, params.keys())
    local = {name: local_of(param) for name, param in params.items()}
    leaves = [
        {name: local_of(leaf[name]) for name in params} if i in state.slots else leaf
        for i, leaf in enumerate(state.leaves)
    ]
    updates, new_state = optimizer.update(
        {name: local_of(grad) for name, grad in grads.items()}, state.spec.unflatten(leaves), local
    )
    new_local = optim.apply_updates(local, updates)
    new = StateSlots.of(new_state, params.keys()).like(state.slots, len(state.leaves), "the optimizer's update")
    placed = [
        {name: placed_like(params[name], leaf[name]) for name in params} if i in new.slots else leaf
        for i, leaf in enumerate(new.leaves)
    ]
    return {name: placed_like(params[name], new_local[name]) for name in params}, new.spec.unflatten(placed)


def donated_update(train_state: TrainState, done: TailUpdate, *, written: bool) -> tuple[Any, ...]:
    """A donating tail's update: the new params and per-param optimizer state written into ``train_state``'s own
    tensors (unless the fused kernel ``written`` them there already), and the new optimizer state's other leaves
    (``count``, ``lr``), in order, which :meth:`d9dfn.step._tail.Tail.rebuilt` puts back beside the slots."""
    params = train_state.params
    old = StateSlots.of(train_state.opt_state, params.keys())
    new = StateSlots.of(done.opt_state, params.keys()).like(old.slots, len(old.leaves), "the optimizer's update")
    if not written:
        write_into(params, done.params)
        for i in old.slots:
            write_into(old.leaves[i], new.leaves[i])
    return tuple(leaf for i, leaf in enumerate(new.leaves) if i not in old.slots)


def write_into(old: Params, new: Params) -> None:
    """``new``'s values copied into ``old``'s tensors (a ``DTensor``'s local shard), name by name: one foreach copy.
    Inside a compiled tail this is a mutation of the graph's inputs, which the compiler writes back."""
    names = [name for name, tensor in old.items() if isinstance(tensor, torch.Tensor)]
    torch._foreach_copy_([local_of(old[name]) for name in names], [local_of(new[name]) for name in names])


def kept(nonfinite: torch.Tensor, old: Any, new: Any) -> Any:
    """``new`` where the step is finite, ``old`` where it is not (tensor leaves; the rest is ``new``'s)."""
    return tree_map(lambda n, o: kept_leaf(nonfinite, o, n), new, old)


def kept_scalars(nonfinite: torch.Tensor, state: StateSlots, new_leaves: list[Any]) -> list[Any]:
    """The new state's leaves (``state``'s layout) with every leaf but the slots kept from ``state`` on a
    non-finite step (the slots were kept leaf by leaf already, by the caller)."""
    return [
        leaf if i in state.slots else kept_leaf(nonfinite, old, leaf)
        for i, (old, leaf) in enumerate(zip(state.leaves, new_leaves, strict=True))
    ]


def kept_leaf(nonfinite: torch.Tensor, old: Any, new: Any) -> Any:
    """One leaf of :func:`kept`."""
    return torch.where(nonfinite, old, new) if isinstance(new, torch.Tensor) else new
