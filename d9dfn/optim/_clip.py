"""Gradient norms and clipping without host syncs: the clip factor stays a 0-d tensor."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn._pytree import tree_leaves
from d9dfn._types import Grads, Params, PyTree, Transform, Updates
from d9dfn.optim._base import check_range, flatten_tensors, unflatten

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "clip_factor", "global_norm"]

CLIP_EPS = 1e-6
"""Keeps the clip factor finite for a zero norm; ``torch.nn.utils.clip_grad_norm_``'s value."""


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: nothing (clipping is stateless)."""


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves together, as a 0-d float32 tensor (``None`` leaves are skipped).

    Computed like ``torch.nn.utils.clip_grad_norm_``: per-leaf norms in float32, then the norm of those.

    >>> import torch
    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]]), "frozen": None})
    tensor(5.)
    """
    leaves = [leaf for leaf in tree_leaves(tree) if leaf is not None]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(leaves, 2.0, dtype=torch.float32)
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack(list(norms)))  # torch types vector_norm's result Any
    return norm


def clip_factor(norm: torch.Tensor, max_norm: float, eps: float = CLIP_EPS) -> torch.Tensor:
    """``min(1, max_norm / (norm + eps))``: what clipping multiplies every gradient by (a 0-d tensor, no host sync).

    The one definition of clipping: :func:`clip_by_global_norm` and ``make_train_step(max_grad_norm=...)``
    (which passes the norm over all shards) both call it.

    Args:
        norm: the global L2 norm, a 0-d tensor.
        max_norm: the largest norm let through.
        eps: keeps the division finite for a zero norm (torch's value).

    >>> import torch
    >>> clip_factor(torch.tensor(5.0), 1.0), clip_factor(torch.tensor(0.5), 1.0)
    (tensor(0.2000), tensor(1.))
    """
    return torch.clamp(max_norm / (norm + eps), max=1.0)


def clip_by_global_norm(max_norm: float, eps: float = CLIP_EPS) -> Transform:
    """Scale the updates by :func:`clip_factor` of their global norm, as ``clip_grad_norm_`` does.

    No host sync: the factor is a 0-d tensor and every leaf is multiplied by it, clipped or not.

    Args:
        max_norm: the largest global L2 norm let through.
        eps: keeps the division finite for zero gradients (torch's value).

    Returns:
        A stateless :class:`~d9dfn.Transform` (its state is :class:`ClipByGlobalNormState`).

    >>> import torch
    >>> clip = clip_by_global_norm(1.0)
    >>> clipped, _ = clip.update({"w": torch.tensor([3.0, 4.0])}, clip.init({}))
    >>> clipped["w"]
    tensor([0.6000, 0.8000])
    """
    fn = "clip_by_global_norm"
    max_norm = check_range(fn, "max_norm", max_norm, 0.0, float("inf"))
    eps = check_range(fn, "eps", eps, 0.0, float("inf"))

    def init(params: Params) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState()

    def update(
        grads: Grads, state: ClipByGlobalNormState, params: Params | None = None
    ) -> tuple[Updates, ClipByGlobalNormState]:
        del params
        leaves, spec = flatten_tensors(f"{fn}.update", "grads", grads)
        if not leaves:
            return grads, state
        factor = clip_factor(global_norm(leaves), max_norm, eps)
        return unflatten(spec, torch._foreach_mul(leaves, factor)), state

    return Transform(init, update)
