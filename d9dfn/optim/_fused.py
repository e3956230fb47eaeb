"""Adam and AdamW as torch's fused kernels (``torch._fused_adam_``, ``torch._fused_adamw_``): one call updates
every param, on the CPU and on CUDA, with the gradients' scale and a skip flag read inside the kernel.

The kernels update in place; this update is pure by default: it copies the params and moments first and updates the
copies. A donating train step (``make_train_step(donate=True)``) asks for ``in_place=True``: no copies, the caller's
params and moments are updated and returned.
The maths is torch.optim's ``fused=True`` AdamW, equal to :func:`d9dfn.optim.adamw`'s foreach arrangement to
rounding (the decoupled decay multiplies the param before the step instead of being added to the update).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from d9dfn._types import FusedUpdate, FusedUpdateFn, Grads, OptState, Params, PathPredicate
from d9dfn.optim._base import (
    LearningRate,
    flatten_like,
    flatten_tensors,
    lr_at,
    record_lr,
    select_flags,
    unflatten,
    with_dtypes,
)

__all__ = ["AdamSettings", "fused_adam"]


class AdamSettings(NamedTuple):
    """An Adam-family transform's checked settings, as its factory resolved them."""

    lr: LearningRate
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled_weight_decay: bool
    weight_decay_mask: PathPredicate | None


def fused_adam(
    fn: str, state_cls: Callable[..., Any], settings: AdamSettings, fused: bool | None
) -> FusedUpdate | None:
    """The fused form of :func:`d9dfn.optim.adam` / :func:`d9dfn.optim.adamw` with these settings, or ``None``
    when ``fused`` is ``False``; ``fused=None`` marks it as the step's default choice (:class:`d9dfn.FusedUpdate`).
    """
    lr, (beta1, beta2), eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, weight_decay_mask = settings
    if fused is False:
        return None
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_

    def apply(
        grads: Grads,
        state: OptState,
        params: Params,
        grad_scale: torch.Tensor,
        found_inf: torch.Tensor | None,
        /,
        *,
        in_place: bool = False,
    ) -> tuple[Params, OptState]:
        name = f"{fn}.update (fused)"
        mu, spec = flatten_tensors(name, "state.mu", state.mu)
        g = with_dtypes(flatten_like(name, "grads", grads, spec, mu, "state.mu"), mu)
        p = flatten_like(name, "params", params, spec, mu, "state.mu")
        moments = [mu, flatten_like(name, "state.nu", state.nu, spec, mu, "state.mu")]
        if amsgrad:
            moments.append(flatten_like(name, "state.nu_max", state.nu_max, spec, mu, "state.mu"))
        if in_place:  # donated: the kernel writes into the caller's tensors
            new_p, new_m = p, moments
        else:  # the kernel writes into these, never into the caller's tensors
            new_p, new_m = [x.clone() for x in p], [[x.clone() for x in leaves] for leaves in moments]
        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        steps = count.to(torch.float32)  # the kernel's bias correction reads the count after this update
        flags = select_flags(name, weight_decay_mask, spec.paths(), p) if weight_decay != 0.0 else [False] * len(p)
        for idx, decay in _groups(new_p, flags):
            kernel(
                [new_p[i] for i in idx],
                [g[i] for i in idx],
                [new_m[0][i] for i in idx],
                [new_m[1][i] for i in idx],
                [new_m[2][i] for i in idx] if amsgrad else [],
                [steps] * len(idx),
                lr=lr_t,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay if decay else 0.0,
                eps=eps,
                amsgrad=amsgrad,
                maximize=maximize,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )
        new_state = state_cls(
            count=count,
            lr=record_lr(lr_t, state.count),
            mu=unflatten(spec, new_m[0]),
            nu=unflatten(spec, new_m[1]),
            nu_max=unflatten(spec, new_m[2]) if amsgrad else None,
        )
        return unflatten(spec, new_p), new_state

    fused_apply: FusedUpdateFn = apply
    return FusedUpdate(fused_apply, auto=fused is None)


def _groups(params: Sequence[torch.Tensor], decays: Sequence[bool]) -> list[tuple[list[int], bool]]:
    """The params' positions by (device, dtype, decayed or not): one kernel call takes one device and dtype, and
    one weight decay."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    for i, (param, decay) in enumerate(zip(params, decays, strict=True)):
        groups.setdefault((param.device, param.dtype, decay), []).append(i)
    return [(idx, key[2]) for key, idx in groups.items()]
