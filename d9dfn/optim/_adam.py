"""Adam and AdamW as pure transforms, numerically following ``torch.optim.Adam(foreach=True)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from d9dfn._types import Grads, Params, PathPredicate, Transform, Updates
from d9dfn.optim._base import (
    LearningRate,
    TensorList,
    bias_correction,
    check_lr,
    check_range,
    flatten_like,
    flatten_tensors,
    lr_at,
    new_count,
    record_lr,
    select_flags,
    unflatten,
    with_dtypes,
)
from d9dfn.optim._fused import AdamSettings, fused_adam

__all__ = ["AdamState", "AdamWState", "adam", "adamw"]


class AdamCore(NamedTuple):
    """One Adam step's shared part (:func:`adam_core`): the new moments and the step ``-step_size · direction``."""

    direction: TensorList
    step_size: float | torch.Tensor
    mu: TensorList
    nu: TensorList
    nu_max: TensorList | None


def adam_core(
    grads: TensorList,
    mu: TensorList,
    nu: TensorList,
    nu_max: TensorList | None,
    t: torch.Tensor,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> AdamCore:
    """The Adam maths that :func:`adam`, :func:`adamw` and ``stochastic_adamw`` share, on lists of leaves.

    Moments: ``mu ← lerp(mu, g, 1-β1)``, ``nu ← β2·nu + (1-β2)·g²`` (``nu_max ← max(nu_max, nu)`` with
    amsgrad). Bias-corrected step in torch.optim's arrangement (``torch/optim/adam.py``, ``_multi_tensor_adam``):
    ``direction = mu / (sqrt(nu)/sqrt(1-β2ᵗ) + eps)`` and ``step_size = lr/(1-β1ᵗ)``. Weight decay, ``maximize``
    and what to do with the step (an update, or a stochastically rounded param) are the callers'.

    Args:
        grads, mu, nu: same-dtype leaves, in one order; ``nu_max`` too with amsgrad, else ``None``.
        t: the update's 1-based count as a float32 0-d tensor.
        lr: the learning rate this update uses.
        beta1, beta2, eps: as in :func:`adam`.
    """
    step_size = lr / bias_correction(beta1, t)
    if not grads:  # torch._foreach_* reject empty lists
        return AdamCore([], step_size, [], [], [] if nu_max is not None else None)
    mu = torch._foreach_lerp(mu, grads, 1.0 - beta1)
    nu = torch._foreach_addcmul(torch._foreach_mul(nu, beta2), grads, grads, value=1.0 - beta2)
    if nu_max is not None:
        nu_max = torch._foreach_maximum(nu_max, nu)
    bias_correction2_sqrt = _sqrt(bias_correction(beta2, t))
    second = nu_max if nu_max is not None else nu
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(second), bias_correction2_sqrt), eps)
    return AdamCore(torch._foreach_div(mu, denom), step_size, mu, nu, nu_max)


class AdamState(NamedTuple):
    """State of :func:`adam`: step count, the rate the last update used, moments (``nu_max`` with amsgrad)."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's name; shadows tuple.count, unused on a state
    lr: torch.Tensor
    mu: Params
    nu: Params
    nu_max: Params | None


class AdamWState(NamedTuple):
    """State of :func:`adamw`: step count, the rate the last update used, moments (``nu_max`` with amsgrad)."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's name; shadows tuple.count, unused on a state
    lr: torch.Tensor
    mu: Params
    nu: Params
    nu_max: Params | None


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    weight_decay_mask: PathPredicate | None = None,
    fused: bool | None = None,
) -> Transform:
    """AdamW: Adam with weight decay ``lr·weight_decay·param`` taken straight off the params.

    Moments are kept in each param's dtype, as ``torch.optim.AdamW`` keeps them.

    Args:
        lr: a float, or a schedule evaluated at the step count before the update.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator's root.
        weight_decay: decoupled decay coefficient.
        amsgrad: normalize by the running maximum of the second moment.
        maximize: ascend instead of descend.
        weight_decay_mask: ``(name, leaf) -> bool``; only leaves it selects decay (all when ``None``).
        fused: how a train step runs the update: ``True`` as torch's fused kernel (``torch._fused_adamw_``, one call
            for every param, eagerly: nothing to compile), ``False`` compiled with the step, ``None`` (the default)
            fused for params on the CPU, compiled elsewhere (``Transform.fused``). ``update`` itself is the same.

    Returns:
        A :class:`~d9dfn.Transform` whose state is :class:`AdamWState`; ``update`` needs ``params``.

    >>> import torch
    >>> params = {"w": torch.ones(2), "b": torch.zeros(2)}
    >>> opt = adamw(0.1, weight_decay=0.5, weight_decay_mask=lambda name, leaf: leaf.ndim >= 1 and name != "b")
    >>> updates, state = opt.update({"w": torch.ones(2), "b": torch.ones(2)}, opt.init(params), params)
    >>> updates["w"], updates["b"], state.count
    (tensor([-0.1500, -0.1500]), tensor([-0.1000, -0.1000]), tensor(1))
    """
    return _adam_family(
        "adamw",
        AdamWState,
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        decoupled_weight_decay=True,
        weight_decay_mask=weight_decay_mask,
        fused=fused,
    )


def adam(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    weight_decay_mask: PathPredicate | None = None,
    fused: bool | None = None,
) -> Transform:
    """Adam with L2 weight decay (``grad + weight_decay·param``), or AdamW's decoupled decay on request.

    Args:
        lr: a float, or a schedule evaluated at the step count before the update.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator's root.
        weight_decay: L2 coefficient (decoupled coefficient with ``decoupled_weight_decay``).
        amsgrad: normalize by the running maximum of the second moment.
        maximize: ascend instead of descend.
        decoupled_weight_decay: decay the params directly, as :func:`adamw` does (d9d's option).
        weight_decay_mask: ``(name, leaf) -> bool``; only leaves it selects decay (all when ``None``).
        fused: how a train step runs the update (torch's ``_fused_adam_`` / ``_fused_adamw_``), as in :func:`adamw`.

    Returns:
        A :class:`~d9dfn.Transform` whose state is :class:`AdamState`.

    >>> import torch
    >>> opt = adam(0.1)
    >>> updates, _ = opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init({"w": torch.zeros(2)}))
    >>> updates["w"]
    tensor([-0.1000,  0.1000])
    """
    return _adam_family(
        "adam",
        AdamState,
        lr,
        betas,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        decoupled_weight_decay=decoupled_weight_decay,
        weight_decay_mask=weight_decay_mask,
        fused=fused,
    )


def _adam_family(
    fn: str,
    state_cls: type[AdamState] | type[AdamWState],
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    *,
    decoupled_weight_decay: bool,
    weight_decay_mask: PathPredicate | None,
    fused: bool | None,
) -> Transform:
    lr = check_lr(fn, lr)
    if len(betas) != 2:
        raise ValueError(f"{fn}: betas={betas!r} must be a pair (beta1, beta2)")
    beta1 = check_range(fn, "betas[0]", betas[0], 0.0, 1.0, high_open=True)
    beta2 = check_range(fn, "betas[1]", betas[1], 0.0, 1.0, high_open=True)
    eps = check_range(fn, "eps", eps, 0.0, float("inf"))
    weight_decay = check_range(fn, "weight_decay", weight_decay, 0.0, float("inf"))

    def init(params: Params) -> AdamState | AdamWState:
        leaves, spec = flatten_tensors(f"{fn}.init", "params", params)
        count = new_count(leaves)
        return state_cls(
            count=count,
            lr=record_lr(lr_at(lr, count), count),
            mu=unflatten(spec, [torch.zeros_like(p) for p in leaves]),
            nu=unflatten(spec, [torch.zeros_like(p) for p in leaves]),
            nu_max=unflatten(spec, [torch.zeros_like(p) for p in leaves]) if amsgrad else None,
        )

    def update(
        grads: Grads, state: AdamState | AdamWState, params: Params | None = None
    ) -> tuple[Updates, AdamState | AdamWState]:
        name = f"{fn}.update"
        mu, spec = flatten_tensors(name, "state.mu", state.mu)
        g: TensorList = flatten_like(name, "grads", grads, spec, mu, "state.mu")
        nu = flatten_like(name, "state.nu", state.nu, spec, mu, "state.mu")
        nu_max = flatten_like(name, "state.nu_max", state.nu_max, spec, mu, "state.mu") if amsgrad else None
        g = with_dtypes(g, mu)
        decay_idx: list[int] = []
        p: list[torch.Tensor] = []
        if weight_decay != 0.0:
            if params is None:
                raise ValueError(
                    f"{name}: weight_decay={weight_decay} needs the params; call update(grads, state, params)"
                )
            p = flatten_like(name, "params", params, spec, mu, "state.mu")
            flags = select_flags(name, weight_decay_mask, spec.paths(), p)
            decay_idx = [i for i, flag in enumerate(flags) if flag]

        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        t = count.to(torch.float32)

        if maximize:
            g = torch._foreach_neg(g)
        if decay_idx and not decoupled_weight_decay:
            # L2: grad + weight_decay·param, on the selected leaves only.
            decayed = torch._foreach_add([g[i] for i in decay_idx], [p[i] for i in decay_idx], alpha=weight_decay)
            g = _scatter(g, decay_idx, decayed)

        core = adam_core(g, mu, nu, nu_max, t, lr_t, beta1, beta2, eps)
        updates: TensorList = torch._foreach_mul(core.direction, -core.step_size) if g else []

        if decay_idx and decoupled_weight_decay:
            decay = torch._foreach_mul([p[i] for i in decay_idx], -(lr_t * weight_decay))
            updates = _scatter(updates, decay_idx, torch._foreach_add([updates[i] for i in decay_idx], decay))

        new_state = state_cls(
            count=count,
            lr=record_lr(lr_t, state.count),
            mu=unflatten(spec, core.mu),
            nu=unflatten(spec, core.nu),
            nu_max=unflatten(spec, core.nu_max) if core.nu_max is not None else None,  # not None iff amsgrad
        )
        return unflatten(spec, updates), new_state

    settings = AdamSettings(
        lr, (beta1, beta2), eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, weight_decay_mask
    )
    kernel = fused_adam(fn, state_cls, settings, fused)
    return Transform(init, update, leafwise=weight_decay_mask is None, fused=kernel)


def _scatter(leaves: Sequence[torch.Tensor], idx: Sequence[int], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = list(leaves)
    for i, value in zip(idx, values, strict=True):
        out[i] = value
    return out


def _sqrt(x: float | torch.Tensor) -> float | torch.Tensor:
    return x**0.5 if isinstance(x, float) else torch.sqrt(x)
