"""The data-parallel reduction inside the compiled step: a SUM all-reduce of a tree over one process group.

Built on ``torch.distributed._functional_collectives``: the collective is an out-of-place op that
``torch.compile(fullgraph=True)`` traces into the step's graph (checked on CPU/gloo with torch 2.13, for
the ``aot_eager`` and ``inductor`` backends), and that runs eagerly when the step is not compiled. Nothing
is written into the caller's tensors.

The group is always passed in: d9d reduces the loss weight over WORLD (it is a metric,
``d9d/loop/component/gradient_manager.py``, whose sync in ``d9d/metric/component/accumulator.py`` all-reduces
with no group), which counts tensor- or context-parallel peers' copies of the same samples twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from d9dfn._pytree import format_path, tree_flatten_with_path, tree_unflatten
from d9dfn._types import DataParallel, GradientReduction, Grads, PyTree
from d9dfn.parallel._bucket import bucketed
from d9dfn.parallel._mesh import data_parallel_group
from d9dfn.parallel._placement import is_distributed_tensor

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["all_reduce_sum", "data_parallel", "data_parallel_reduction", "group_name"]


def group_name(group: Any, caller: str = "group_name") -> str:
    """The registered name of a process group, which the functional collectives take.

    Resolve it once, outside the compiled function: the name is a plain string the graph can hold.

    Args:
        group: a ``ProcessGroup``, a ``DeviceMesh`` (all of its ranks: a mesh of several axes is flattened,
            which creates a process group, so every rank of the mesh must call this), or a name.
        caller: the public function to name in errors.

    Raises:
        TypeError: ``group`` is ``None`` or not one of the above.
        ValueError: ``torch.distributed`` is not initialized.

    >>> group_name("0")
    '0'
    """
    if isinstance(group, str):
        return group
    if group is None:
        raise TypeError(
            f"{caller}: group is None; pass the data-parallel process group or 1-D DeviceMesh explicitly (e.g. "
            "mesh['dp']). There is no WORLD default: tensor-parallel peers would count the same samples twice; "
            "pass torch.distributed.group.WORLD if every rank really is a data-parallel replica"
        )
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{caller}: torch.distributed is not initialized; call torch.distributed.init_process_group (or "
            "d9dfn.loop.init_data_parallel_mesh) first, or do not reduce in a single-process run"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        # A 2-D data-parallel mesh (replicate x shard) is one group of all its ranks: flatten it. Flattening
        # creates a process group, a collective; it happens here, when the hook is built, never in the step.
        return data_parallel_group(group).group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise TypeError(
        f"{caller}: group is a {type(group).__name__}; pass a torch.distributed ProcessGroup, a 1-D DeviceMesh "
        "or a group name"
    )


def all_reduce_sum(tree: PyTree, group: Any) -> PyTree:
    """Sum every leaf of ``tree`` over the ranks of ``group``; traceable by ``torch.compile(fullgraph=True)``.

    Leaves are packed into one flat buffer per (dtype, device), so a float32 tree costs one collective
    however many leaves it has. The result's leaves are views of those fresh buffers; the input is not
    modified. Every rank of ``group`` must call it with trees of the same structure, shapes and dtypes.

    Args:
        tree: a pytree whose leaves are all tensors.
        group: the process group (see :func:`group_name`); resolve it with :func:`group_name` beforehand
            when calling from a compiled function, as :func:`data_parallel_reduction` does.

    Returns:
        A tree of the same structure, shapes, dtypes and devices.

    Raises:
        TypeError: a leaf is not a tensor, or ``group`` is not a group.
    """
    import torch.distributed._functional_collectives as funcol

    paths, leaves, treespec = tree_flatten_with_path(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"all_reduce_sum: leaf {format_path(path)} is a {type(leaf).__name__}, not a tensor; every leaf "
                "of a reduced tree must be a tensor (keep static values out of the tree)"
            )
    # A cast, not GroupName(...): calling the NewType breaks torch.compile(fullgraph=True) (torch 2.13).
    name = cast("GroupName", group_name(group, "all_reduce_sum"))
    # The functional all_reduce is out of place; wait_tensor turns eager mode's AsyncCollectiveTensor into a
    # plain tensor (and is the explicit wait node in a traced graph).
    reduced = bucketed(
        leaves,
        lambda flat, _: funcol.wait_tensor(  # type: ignore[no-untyped-call]  # torch leaves wait_tensor unannotated
            funcol.all_reduce(flat, "sum", name)
        ),
    )
    return tree_unflatten(treespec, reduced)


def data_parallel(group: Any, rank: int) -> DataParallel:
    """``make_train_step(data_parallel=...)`` over ``group``, for the data-parallel rank ``rank``
    (:func:`data_parallel_reduction` and the rank that numbers this process's microbatches)."""
    if rank < 0:
        raise ValueError(f"data_parallel: rank={rank}; pass this process's data-parallel rank (>= 0)")
    return DataParallel(data_parallel_reduction(group), rank)


def data_parallel_reduction(group: Any) -> GradientReduction:
    """The ``DataParallel.reduce`` hook for data parallelism over ``group``.

    The hook sums the local ``Σwᵢℓᵢ``, ``Σwᵢ`` and every plain-tensor gradient over the data-parallel
    group (one bucketed all-reduce per dtype); the step then scales by ``1/Σ_all w``, so every rank takes
    the gradient of the global weighted mean ``Σ_ranks Σᵢ wᵢℓᵢ / Σ_ranks Σᵢ wᵢ`` and reports the global
    loss and weight. Gradients of ``DTensor`` params arrive already reduced to their param's placement
    (the step does that: all-reduce over replicated axes, reduce-scatter over sharded ones) and pass
    through untouched. Plain params must be equal on every rank (same seed, or a broadcast).

    Args:
        group: the **data-parallel** process group or ``DeviceMesh`` (all its axes are data-parallel;
            a 2-D ``(dp_replicate, dp_shard)`` mesh is flattened once, here), never WORLD by default.

    Returns:
        ``reduce(grad_sum, loss_sum, weight_sum) -> (grad_sum, loss_sum, weight_sum)``.

    Raises:
        TypeError, ValueError: as :func:`group_name` (checked now, not at the first step).
    """
    name = group_name(group, "data_parallel_reduction")

    def reduce(
        grad_sum: Grads, loss_sum: torch.Tensor, weight_sum: torch.Tensor
    ) -> tuple[Grads, torch.Tensor, torch.Tensor]:
        plain = {key: g for key, g in grad_sum.items() if not is_distributed_tensor(g)}
        plain, loss_sum, weight_sum = all_reduce_sum((plain, loss_sum, weight_sum), name)
        return {key: plain.get(key, g) for key, g in grad_sum.items()}, loss_sum, weight_sum

    return reduce
