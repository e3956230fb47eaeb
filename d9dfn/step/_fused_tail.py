"""The tail's per-leaf part as the optimizer's fused kernel (:class:`d9dfn.FusedUpdate`), run eagerly.

``× 1/Σw`` → global norm → clip → the update → the skip of a non-finite step, as :func:`d9dfn.step._tail_parts.
update_whole` does them, in a handful of calls over all the params: the per-leaf norms in one
``torch._foreach_norm`` (the scale applied to their total, not to every gradient), ``1/Σw`` and the clip factor
handed to the kernel as one gradient scale, the skip as the kernel's ``found_inf`` (params and moments unchanged),
and only the state's scalars (``count``, ``lr``) kept by hand. Nothing of it is compiled, so it costs a process
nothing to start: on the CPU the compiled optimizer tail was half of the first step's compile, and the kernel is
faster warm than the compiled one (``docs/design/step.md``, "The fused optimizer tail").

``DTensor`` params update as their local shards (the fused transforms are elementwise), the norms combined over the
shards as everywhere else (``leaf_norms``).
"""

from __future__ import annotations

from typing import Any

import torch

from d9dfn import optim
from d9dfn._types import FusedUpdate, Params
from d9dfn.parallel._grads import leaf_norms
from d9dfn.parallel._pipeline import PipelineReduction
from d9dfn.step._state import TrainState
from d9dfn.step._state_slots import StateSlots
from d9dfn.step._tail_parts import TailUpdate, kept_scalars, local_of, placed_like, total_norm

__all__ = ["update_fused"]


def update_fused(
    train_state: TrainState,
    grad_sum: Params,
    inv_weight: torch.Tensor,
    loss: torch.Tensor,
    fused: FusedUpdate,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    pipeline: PipelineReduction | None,
    distributed: bool,
    donate: bool = False,
) -> TailUpdate:
    """``update_whole``'s steps with the update in ``fused``'s kernel; ``grad_sum`` (the step's own reduced sums)
    may be overwritten. ``distributed``: whether some param is a ``DTensor``. ``donate``: the kernel updates the
    state's own params and moments (their local shards) in place, and they are what comes back; else copies."""
    params, opt_state = train_state.params, train_state.opt_state
    grad_norm = total_norm(leaf_norms(grad_sum), pipeline) * inv_weight
    scale = inv_weight
    if max_grad_norm:
        scale = scale * optim.clip_factor(grad_norm, max_grad_norm)
    nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    found_inf = nonfinite.to(torch.float32) if skip_nonfinite else None
    state = StateSlots.of(opt_state, params.keys())
    local_params, local_grads, local_state = params, grad_sum, opt_state
    if distributed:  # each DTensor as its local shard; the slots (the moments) alike
        local_params, local_grads = _locals(params), _locals(grad_sum)
        local_state = state.spec.unflatten(
            [_locals(leaf) if i in state.slots else leaf for i, leaf in enumerate(state.leaves)]
        )
    new_params, new_state = fused.apply(
        local_grads, local_state, local_params, (1.0 / scale).to(torch.float32), found_inf, in_place=donate
    )
    lr = optim.learning_rate(new_state)  # what this update used, before a skip restores the state
    new = StateSlots.of(new_state, params.keys()).like(state.slots, len(state.leaves), "the fused update")
    leaves = new.leaves
    if donate:  # the kernel wrote into the state's own tensors: those come back (DTensors as they were)
        new_params = dict(params)
        leaves = [dict(state.leaves[i]) if i in state.slots else leaf for i, leaf in enumerate(leaves)]
    elif distributed:
        new_params = _placed(new_params, params)
        leaves = [_placed(leaf, params) if i in state.slots else leaf for i, leaf in enumerate(leaves)]
    if skip_nonfinite:  # the kernel kept the params and moments; the scalars (count, lr) are kept here
        leaves = kept_scalars(nonfinite, state, leaves)
    return TailUpdate(
        params=new_params, opt_state=state.spec.unflatten(leaves), grad_norm=grad_norm, nonfinite=nonfinite, lr=lr
    )


def _locals(tensors: dict[str, Any]) -> dict[str, Any]:
    return {name: local_of(t) for name, t in tensors.items()}


def _placed(local: dict[str, torch.Tensor], like: Params) -> dict[str, torch.Tensor]:
    """Each local tensor back into its param's ``DTensor`` placement (plain params: itself)."""
    return {name: placed_like(like[name], t) for name, t in local.items()}
