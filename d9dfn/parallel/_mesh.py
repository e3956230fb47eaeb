"""The data-parallel mesh's vocabulary: its axes, and the one process group of all its ranks.

Data parallelism exists in two flavours, on two mesh axes that are always present (size 1 when unused):
``dp_replicate`` (every rank holds whole params, DDP) and ``dp_shard`` (params, gradients and optimizer
state split along dim 0, FSDP); both at once is hybrid sharding (HSDP). The mesh itself is created at the
edge (``d9dfn.loop.init_data_parallel_mesh``); the core only reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DATA_PARALLEL_AXES", "DATA_PARALLEL_AXIS", "SHARD_AXIS", "data_parallel_group"]

DATA_PARALLEL_AXIS = "dp_replicate"
"""The replicated data-parallel mesh axis (d9d's ``data_parallel_replicate`` degree)."""
SHARD_AXIS = "dp_shard"
"""The sharded data-parallel mesh axis (d9d's ``data_parallel_shard`` degree)."""
DATA_PARALLEL_AXES = (DATA_PARALLEL_AXIS, SHARD_AXIS)
"""The data-parallel mesh's axes, outermost first: replicas of shard groups (HSDP)."""


def data_parallel_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ``ProcessGroup`` of all the mesh's ranks.

    A 2-D mesh is flattened, which creates a process group (a collective): call it once, when a hook is
    built, never inside the compiled step.
    """
    return (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()
