"""SGD with momentum, dampening, Nesterov and weight decay, numerically following ``torch.optim.SGD``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn._types import Grads, Params, Transform, Updates
from d9dfn.optim._base import (
    LearningRate,
    TensorList,
    check_lr,
    check_range,
    flatten_like,
    flatten_tensors,
    lr_at,
    new_count,
    record_lr,
    unflatten,
    with_dtypes,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of :func:`sgd`: step count, the rate the last update used, momentum buffers (``None`` without momentum)."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's name; shadows tuple.count, unused on a state
    lr: torch.Tensor
    momentum_buffer: Params | None


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> Transform:
    """Stochastic gradient descent as ``torch.optim.SGD`` defines it.

    The first step sets the momentum buffer to the gradient itself (no dampening), as torch does.

    Args:
        lr: a float, or a schedule evaluated at the step count before the update.
        momentum: momentum factor in ``[0, 1]``.
        dampening: dampening of the gradient's contribution to the momentum, in ``[0, 1]``.
        weight_decay: L2 coefficient (``grad + weight_decay·param``).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        maximize: ascend instead of descend.

    Returns:
        A :class:`~d9dfn.Transform` whose state is :class:`SGDState`.

    Raises:
        ValueError: for out-of-range hyperparameters or ``nesterov`` without plain momentum.

    >>> import torch
    >>> opt = sgd(0.5, momentum=0.9)
    >>> params = {"w": torch.zeros(2)}
    >>> updates, state = opt.update({"w": torch.tensor([1.0, -2.0])}, opt.init(params), params)
    >>> updates["w"], state.momentum_buffer["w"]
    (tensor([-0.5000,  1.0000]), tensor([ 1., -2.]))
    """
    fn = "sgd"
    lr = check_lr(fn, lr)
    momentum = check_range(fn, "momentum", momentum, 0.0, 1.0)
    dampening = check_range(fn, "dampening", dampening, 0.0, 1.0)
    weight_decay = check_range(fn, "weight_decay", weight_decay, 0.0, float("inf"))
    if nesterov and (momentum == 0.0 or dampening != 0.0):
        raise ValueError(
            f"{fn}: nesterov=True needs momentum > 0 and dampening == 0, got momentum={momentum}, "
            f"dampening={dampening}; set a momentum and dampening=0, or nesterov=False"
        )

    def init(params: Params) -> SGDState:
        leaves, spec = flatten_tensors(f"{fn}.init", "params", params)
        buffers = unflatten(spec, [torch.zeros_like(p) for p in leaves]) if momentum != 0.0 else None
        count = new_count(leaves)
        return SGDState(count=count, lr=record_lr(lr_at(lr, count), count), momentum_buffer=buffers)

    def update(grads: Grads, state: SGDState, params: Params | None = None) -> tuple[Updates, SGDState]:
        name = f"{fn}.update"
        leaves, spec = flatten_tensors(name, "grads", grads)
        g: TensorList = leaves
        if maximize:
            g = torch._foreach_neg(g)
        if weight_decay != 0.0:
            if params is None:
                raise ValueError(
                    f"{name}: weight_decay={weight_decay} needs the params; call update(grads, state, params)"
                )
            p = flatten_like(name, "params", params, spec, g, "grads")
            g = torch._foreach_add(with_dtypes(g, p), p, alpha=weight_decay)

        buffers = None
        if momentum != 0.0:
            buf: TensorList = flatten_like(name, "state.momentum_buffer", state.momentum_buffer, spec, g, "grads")
            g = with_dtypes(g, buf)
            # Step 0: the buffer is zero and takes the plain gradient; later: momentum·buf + (1 - dampening)·grad.
            first = state.count == 0
            grad_weight = torch.where(first, 1.0, 1.0 - dampening).to(torch.float32)
            buf = torch._foreach_add(torch._foreach_mul(buf, momentum), torch._foreach_mul(g, grad_weight))
            g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
            buffers = unflatten(spec, buf)

        lr_t = lr_at(lr, state.count)
        updates = torch._foreach_mul(g, -lr_t)
        new_state = SGDState(count=state.count + 1, lr=record_lr(lr_t, state.count), momentum_buffer=buffers)
        return unflatten(spec, updates), new_state

    return Transform(init, update, leafwise=True)
