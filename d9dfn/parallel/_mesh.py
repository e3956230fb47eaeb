"""The data-parallel ``DeviceMesh`` from d9d-style parallelism degrees.

Data parallelism exists in two flavours, on two mesh axes that are always present (size 1 when unused):
``dp_replicate`` (every rank holds whole params, DDP) and ``dp_shard`` (params, gradients and optimizer
state split along dim 0, FSDP); both at once is hybrid sharding (HSDP). Every other degree must be 1 and
says so clearly. This is an edge function: it creates process groups (and, under ``torchrun``, the default
group), so the loop calls it once at start-up and the pure step only ever sees the mesh it returns.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "DATA_PARALLEL_AXES",
    "DATA_PARALLEL_AXIS",
    "SHARD_AXIS",
    "check_data_parallel_degrees",
    "init_data_parallel_mesh",
]

_NOT_YET = (
    "pipeline_parallel",
    "context_parallel_replicate",
    "context_parallel_shard",
    "tensor_parallel",
    "expert_parallel",
)
DATA_PARALLEL_AXIS = "dp_replicate"
"""The replicated data-parallel mesh axis (d9d's ``data_parallel_replicate`` degree)."""
SHARD_AXIS = "dp_shard"
"""The sharded data-parallel mesh axis (d9d's ``data_parallel_shard`` degree)."""
DATA_PARALLEL_AXES = (DATA_PARALLEL_AXIS, SHARD_AXIS)
"""The data-parallel mesh's axes, outermost first: replicas of shard groups (HSDP)."""


def default_device_type() -> str:
    """``"cuda"`` (NCCL) when a GPU is visible, else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _degree(degrees: Any, name: str) -> int:
    value = getattr(degrees, name, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"init_data_parallel_mesh: {name}={value!r}; pass a positive int")
    return value


def check_data_parallel_degrees(degrees: Any) -> tuple[int, int]:
    """Validate DeviceMeshParameters-like ``degrees``; return ``(data_parallel_replicate, data_parallel_shard)``.

    ``degrees`` is any object with d9d's degree attributes (``loop.DeviceMeshParameters``); missing ones
    count as 1.

    Raises:
        ValueError: a degree that is not implemented (pipeline, context, tensor, expert) is above 1.

    >>> from types import SimpleNamespace
    >>> check_data_parallel_degrees(SimpleNamespace(data_parallel_replicate=2, data_parallel_shard=2))
    (2, 2)
    """
    for name in _NOT_YET:
        value = getattr(degrees, name, 1)
        if value != 1:
            raise ValueError(
                f"init_data_parallel_mesh: {name}={value} is not implemented (d9dfn has data parallelism only: "
                f"replicated, sharded and hybrid); set {name}=1 and spread the processes over "
                "data_parallel_replicate (DDP) and data_parallel_shard (FSDP)"
            )
    return _degree(degrees, "data_parallel_replicate"), _degree(degrees, "data_parallel_shard")


def init_data_parallel_mesh(degrees: Any, *, device_type: str | None = None) -> Any:
    """Create the 2-D data-parallel ``DeviceMesh`` ``(dp_replicate, dp_shard)`` over every process.

    If the default process group does not exist yet, ``init_device_mesh`` creates it from the
    ``torchrun`` environment (gloo on CPU, NCCL on CUDA). Ranks are laid out shard-major: ranks
    ``0..S-1`` form the first shard group, so with HSDP the reduce-scatter stays between neighbours.

    Args:
        degrees: DeviceMeshParameters-like degrees; only the two data-parallel ones may exceed 1.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        A ``DeviceMesh`` of shape ``(data_parallel_replicate, data_parallel_shard)``.

    Raises:
        ValueError: an unimplemented degree, or a world size that differs from the product of the degrees.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = check_data_parallel_degrees(degrees)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != replicate * shard:
        raise ValueError(
            f"init_data_parallel_mesh: data_parallel_replicate={replicate} x data_parallel_shard={shard} = "
            f"{replicate * shard} processes, but the job has {dist.get_world_size()}; launch {replicate * shard} "
            f"(torchrun --nproc-per-node {replicate * shard}) or change the degrees so that their product is "
            f"{dist.get_world_size()}"
        )
    return init_device_mesh(device_type or default_device_type(), (replicate, shard), mesh_dim_names=DATA_PARALLEL_AXES)
