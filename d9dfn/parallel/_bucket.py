"""Bucketed collectives: many tensors, one collective per bucket (every reduction in the step uses this).

A collective's fixed cost (a round trip, a kernel launch) dominates for small tensors, so tensors of the
same dtype and device (and the same ``group_by`` key, e.g. a mesh) are concatenated into one flat buffer,
the collective runs once on it, and the result is cut back into views shaped like the inputs. This is
DDP's gradient bucketing (``torch.nn.parallel.DistributedDataParallel``'s ``bucket_cap_mb``) without a
size cap: the step's buckets are as large as a dtype's whole gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = ["bucketed"]


def bucketed(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[torch.Tensor, Hashable], torch.Tensor],
    group_by: Sequence[Hashable] | None = None,
) -> list[torch.Tensor]:
    """``collective`` applied to ``tensors`` with one call per (``group_by`` key, dtype, device) bucket.

    Buckets run in order of their first tensor, so every rank issues the same collectives in the same
    order when it passes the same structure. Inputs are not modified (``torch.cat`` copies).

    Args:
        tensors: the tensors to reduce; any shapes.
        collective: ``(flat, key) -> flat``, out of place, keeping the length and dtype; ``key`` is the
            bucket's ``group_by`` value (``None`` without ``group_by``).
        group_by: per tensor, a further bucket key (e.g. its ``DeviceMesh``); ``None``: dtype and device only.

    Returns:
        One tensor per input, in order, each a view of its bucket's result shaped like the input.

    >>> bucketed([torch.ones(2), torch.zeros(1, 2)], lambda flat, key: flat + 1)
    [tensor([2., 2.]), tensor([[1., 1.]])]
    """
    keys = [None] * len(tensors) if group_by is None else group_by
    buckets: dict[tuple[Hashable, torch.dtype, torch.device], list[int]] = {}
    for index, (tensor, key) in enumerate(zip(tensors, keys, strict=True)):
        buckets.setdefault((key, tensor.dtype, tensor.device), []).append(index)
    out: list[torch.Tensor] = list(tensors)
    for (key, _, _), indices in buckets.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])  # (Σ numel,), a copy
        result = collective(flat, key)
        for i, chunk in zip(indices, torch.split(result, [tensors[i].numel() for i in indices]), strict=True):
            out[i] = chunk.view(tensors[i].shape)
    return out
