"""A 1-D data-parallel ``DeviceMesh`` from d9d-style parallelism degrees.

Only plain replicated data parallelism exists so far (issue 5); every other degree must be 1 and says
so clearly. This is an edge function: it creates process groups (and, under ``torchrun``, the default
group), so the loop calls it once at start-up and the pure step only ever sees the group it returns.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DATA_PARALLEL_AXIS", "check_data_parallel_degrees", "init_data_parallel_mesh"]

_NOT_YET = (
    "pipeline_parallel",
    "data_parallel_shard",
    "context_parallel_replicate",
    "context_parallel_shard",
    "tensor_parallel",
    "expert_parallel",
)
DATA_PARALLEL_AXIS = "dp_replicate"
"""The name of the data-parallel mesh axis (d9d's ``data_parallel_replicate`` degree)."""


def _default_device_type() -> str:
    """``"cuda"`` (NCCL) when a GPU is visible, else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_data_parallel_degrees(degrees: Any) -> int:
    """Validate DeviceMeshParameters-like ``degrees`` and return the data-parallel size.

    ``degrees`` is any object with d9d's degree attributes (``loop.DeviceMeshParameters``); missing ones
    count as 1.

    Raises:
        ValueError: a degree other than ``data_parallel_replicate`` is above 1 (not implemented yet).

    >>> from types import SimpleNamespace
    >>> check_data_parallel_degrees(SimpleNamespace(data_parallel_replicate=4))
    4
    """
    for name in _NOT_YET:
        value = getattr(degrees, name, 1)
        if value != 1:
            raise ValueError(
                f"init_data_parallel_mesh: {name}={value} is not implemented yet (issue 5 has only replicated data "
                f"parallelism); set {name}=1 and use data_parallel_replicate for the number of processes"
            )
    size = getattr(degrees, "data_parallel_replicate", 1)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"init_data_parallel_mesh: data_parallel_replicate={size!r}; pass a positive int")
    return size


def init_data_parallel_mesh(degrees: Any, *, device_type: str | None = None) -> Any:
    """Create the 1-D data-parallel ``DeviceMesh`` (axis ``"dp_replicate"``) over every process.

    If the default process group does not exist yet, ``init_device_mesh`` creates it from the
    ``torchrun`` environment (gloo on CPU, NCCL on CUDA). Pass ``mesh.get_group()`` (or the mesh) to
    :func:`d9dfn.parallel.data_parallel_reduction`.

    Args:
        degrees: DeviceMeshParameters-like degrees; only ``data_parallel_replicate`` may exceed 1.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        A 1-D ``torch.distributed.device_mesh.DeviceMesh`` of ``data_parallel_replicate`` ranks.

    Raises:
        ValueError: an unimplemented degree, or a world size that differs from ``data_parallel_replicate``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    size = check_data_parallel_degrees(degrees)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != size:
        raise ValueError(
            f"init_data_parallel_mesh: data_parallel_replicate={size} but the job has {dist.get_world_size()} "
            f"processes; launch {size} processes (torchrun --nproc-per-node {size}) or set data_parallel_replicate="
            f"{dist.get_world_size()}"
        )
    return init_device_mesh(device_type or _default_device_type(), (size,), mesh_dim_names=(DATA_PARALLEL_AXIS,))
