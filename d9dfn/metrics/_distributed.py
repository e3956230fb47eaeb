"""``reduce``: the one side-effecting metric function, an all-reduce (SUM) of a state across ranks.

It lives at the loop's edge and runs eagerly, once per logging period, between ``update`` (in the
compiled step) and ``compute``. ``torch.distributed`` is imported only when it is called, so the pure
metric modules never depend on it.
"""

from __future__ import annotations

from typing import Any

import torch

from d9dfn._pytree import format_path, tree_flatten_with_path
from d9dfn._types import PyTree

__all__ = ["reduce"]


def reduce(state: PyTree, group: Any) -> PyTree:
    """Sum a metric state over the ranks of ``group``; every rank gets the same, global state.

    Every d9dfn metric state holds sufficient statistics (counts, sums, histograms), never ratios, so
    the sum of the ranks' states is the state of all their inputs together; a custom metric must keep
    that property to be reduced. Leaves are packed into one buffer per (dtype, device), so a state
    costs one collective per dtype, however many metrics it holds. The input is not modified.

    Pass the **data-parallel** group: ranks that hold replicas of the same samples (tensor- or
    context-parallel peers) would otherwise count them twice, which d9d does by reducing over WORLD.
    Ranks that saw no data (e.g. pipeline stages without the loss) contribute their ``init()`` zeros.

    Args:
        state: a metric state, e.g. ``metric.update(...)``'s result; every leaf a tensor.
        group: the data-parallel process group, 1-D ``DeviceMesh`` or group name to reduce over. There is no
            default: pass ``torch.distributed.group.WORLD`` only if every rank is a data-parallel replica.

    Returns:
        A new state of the same structure, dtypes and devices.

    Raises:
        TypeError: if a leaf is not a tensor, or ``group`` is ``None`` or not a group.
        ValueError: if ``torch.distributed`` is not initialized.
    """
    paths, leaves, _ = tree_flatten_with_path(state)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"reduce: leaf {format_path(path)} is a {type(leaf).__name__}, not a tensor; metric states must hold "
                f"only tensors of sufficient statistics (counts, sums) that add up across ranks"
            )
    from d9dfn.parallel import all_reduce_sum, group_name  # one bucketed, out-of-place SUM per (dtype, device)

    name = group_name(group, "reduce")  # None: a TypeError that names the fix (no WORLD default)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "reduce: torch.distributed is not initialized; call torch.distributed.init_process_group first, or do "
            "not reduce in a single-process run (a local state is already global)"
        )
    return all_reduce_sum(state, name)
