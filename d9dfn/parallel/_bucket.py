"""Bucketed collectives: many tensors, one collective per bucket (every reduction in the step uses this).

A collective's fixed cost (a round trip, a kernel launch) dominates for small tensors, so tensors of the
same dtype and device (and the same ``group_by`` key, e.g. a mesh) are concatenated into one flat buffer,
the collective runs once on it, and the result is cut back into views shaped like the inputs. This is
DDP's gradient bucketing (``torch.nn.parallel.DistributedDataParallel``'s ``bucket_cap_mb``) without a
size cap: the buckets are as large as a dtype's whole gradient.

Where the inputs are the caller's own (the step's gradient sums, in the eager tail) the reduction can go back into
them (``into_inputs=True``): each bucket's flat buffer lives only while its collective runs, and buckets are cut at
``cap_bytes`` (DDP's 25 MiB by default), so the reduction holds one bucket beside the gradients instead of a flat copy
of them all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

__all__ = ["CAP_BYTES", "bucketed"]

CAP_BYTES = 25 << 20
"""The largest bucket an in-place reduction makes (``into_inputs=True``): DDP's default ``bucket_cap_mb``."""


def bucketed(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[torch.Tensor, Hashable], torch.Tensor],
    group_by: Sequence[Hashable] | None = None,
    *,
    into_inputs: bool = False,
    cap_bytes: int = CAP_BYTES,
) -> list[torch.Tensor]:
    """``collective`` applied to ``tensors`` with one call per (``group_by`` key, dtype, device) bucket.

    Buckets run in order of their first tensor, so every rank issues the same collectives in the same
    order when it passes the same structure. Inputs are not modified (``torch.cat`` copies) unless
    ``into_inputs``.

    Args:
        tensors: the tensors to reduce; any shapes.
        collective: ``(flat, key) -> flat``, keeping the length and dtype; ``key`` is the bucket's ``group_by``
            value (``None`` without ``group_by``). It may write into ``flat`` (a buffer of its own) and return it.
        group_by: per tensor, a further bucket key (e.g. its ``DeviceMesh``); ``None``: dtype and device only.
        into_inputs: copy each bucket's result back into its input tensors (which the caller owns: contiguous, not
            views of one another) and return those; buckets are then cut at ``cap_bytes``, in order, so that at most
            one bucket's flat buffer is alive at a time (a tensor larger than the cap is a bucket of its own).
        cap_bytes: the largest bucket with ``into_inputs``.

    Returns:
        One tensor per input, in order: each a view of its bucket's result shaped like the input, or with
        ``into_inputs`` the input itself, holding the result.

    >>> bucketed([torch.ones(2), torch.zeros(1, 2)], lambda flat, key: flat + 1)
    [tensor([2., 2.]), tensor([[1., 1.]])]
    """
    keys = [None] * len(tensors) if group_by is None else group_by
    buckets: dict[tuple[Hashable, torch.dtype, torch.device], list[int]] = {}
    for index, (tensor, key) in enumerate(zip(tensors, keys, strict=True)):
        buckets.setdefault((key, tensor.dtype, tensor.device), []).append(index)
    out: list[torch.Tensor] = list(tensors)
    for (key, _, _), indices in buckets.items():
        for run in _capped(indices, tensors, cap_bytes) if into_inputs else [indices]:
            flat = torch.cat([tensors[i].reshape(-1) for i in run])  # (Σ numel,), a copy
            result = collective(flat, key)
            chunks = torch.split(result, [tensors[i].numel() for i in run])
            if into_inputs:
                torch._foreach_copy_(
                    [tensors[i] for i in run], [c.view(tensors[i].shape) for i, c in zip(run, chunks, strict=True)]
                )
                continue
            for i, chunk in zip(run, chunks, strict=True):
                out[i] = chunk.view(tensors[i].shape)
    return out


def _capped(indices: list[int], tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """``indices`` cut, in order, into runs of at most ``cap_bytes`` (a larger tensor alone in its run)."""
    runs: list[list[int]] = [[]]
    size = 0
    for i in indices:
        nbytes = tensors[i].numel() * tensors[i].element_size()
        if runs[-1] and size + nbytes > cap_bytes:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += nbytes
    return runs
