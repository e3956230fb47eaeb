"""The edge of a multi-process job: the process group, its timeouts, and who writes files.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed`
creates the default process group from them (gloo on CPU, NCCL on CUDA) with the configured timeout and
returns the data-parallel mesh. Every function here has side effects and runs once, at start-up or
between steps, never inside the compiled step.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from d9dfn.parallel._mesh import default_device_type, init_data_parallel_mesh

__all__ = [
    "CollectiveError",
    "data_parallel_group",
    "init_distributed",
    "is_main_process",
    "launched_world_size",
    "set_collective_timeout",
]


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, or did not arrive within the process group's timeout."""


def launched_world_size() -> int:
    """The number of processes ``torchrun`` started (``WORLD_SIZE``), 1 outside ``torchrun``.

    >>> launched_world_size() >= 1
    True
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(int(value), 1)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an int; launch with torchrun, or unset it") from None


def is_main_process() -> bool:
    """Rank 0 of the job, or the only process: the one that writes logs, plots and progress."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def init_distributed(degrees: Any, *, timeout_s: float, device_type: str | None = None) -> Any:
    """Create the default process group (if needed) with ``timeout_s``, then the data-parallel mesh.

    Args:
        degrees: ``DeviceMeshParameters``-like degrees (see :func:`init_data_parallel_mesh`).
        timeout_s: how long a collective waits for the other ranks before it fails (``TimeoutConfig.
            init_timeout`` at start-up; :func:`set_collective_timeout` lowers it after the first step).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); default: ``"cuda"`` when available.

    Returns:
        The ``(dp_replicate, dp_shard)`` ``DeviceMesh``.

    Raises:
        ValueError: the degrees do not multiply to the number of processes, or an unimplemented degree.
    """
    import torch.distributed as dist

    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ValueError(
                "init_distributed: the mesh asks for several processes but this one was not started by torchrun "
                "(MASTER_ADDR is unset); launch with `torchrun --nproc-per-node N -m d9dfn train CONFIG`"
            )
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return init_data_parallel_mesh(degrees, device_type=device_type)


def set_collective_timeout(timeout_s: float) -> None:
    """Set the default process group's collective timeout (d9d: ``step_timeout`` after the first step)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if dist.is_initialized():
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), dist.group.WORLD)


def data_parallel_group(mesh: Any) -> Any:
    """The ``ProcessGroup`` of all the mesh's ranks (a 2-D mesh is flattened: a collective, call it once)."""
    return (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()
