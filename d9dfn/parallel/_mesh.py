"""The mesh's vocabulary: its axes, the one process group of all data-parallel ranks, the pipeline group.

Data parallelism exists in two flavours, on two mesh axes that are always present (size 1 when unused):
``dp_replicate`` (every rank holds whole params, DDP) and ``dp_shard`` (params, gradients and optimizer
state split along dim 0, FSDP); both at once is hybrid sharding (HSDP). The mesh itself is created at the
edge (``d9dfn.loop.init_data_parallel_mesh``); the core only reads it.

Pipeline parallelism adds an outermost ``pp`` axis: a 3-D ``(pp, dp_replicate, dp_shard)`` mesh
(``d9dfn.loop.init_distributed`` with ``pipeline_parallel > 1``). Each pipeline rank's stages are data-parallel
over its own ``(dp_replicate, dp_shard)`` sub-mesh (:func:`data_parallel_submesh`); activations and gradients
travel along ``pp`` (:func:`pipeline_group`), inter-node in production.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DATA_PARALLEL_AXES",
    "DATA_PARALLEL_AXIS",
    "PIPELINE_AXIS",
    "PIPELINE_MESH_AXES",
    "SHARD_AXIS",
    "data_parallel_group",
    "data_parallel_submesh",
    "pipeline_group",
    "pipeline_rank",
]

DATA_PARALLEL_AXIS = "dp_replicate"
"""The replicated data-parallel mesh axis (d9d's ``data_parallel_replicate`` degree)."""
SHARD_AXIS = "dp_shard"
"""The sharded data-parallel mesh axis (d9d's ``data_parallel_shard`` degree)."""
DATA_PARALLEL_AXES = (DATA_PARALLEL_AXIS, SHARD_AXIS)
"""The data-parallel mesh's axes, outermost first: replicas of shard groups (HSDP)."""
PIPELINE_AXIS = "pp"
"""The pipeline mesh axis, outermost (d9d's ``pipeline_parallel`` degree)."""
PIPELINE_MESH_AXES = (PIPELINE_AXIS, *DATA_PARALLEL_AXES)
"""The axes of a pipeline mesh, outermost first."""


def data_parallel_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ``ProcessGroup`` of all the mesh's ranks.

    A 2-D mesh is flattened, which creates a process group (a collective): call it once, when a hook is
    built, never inside the compiled step.
    """
    return (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()


def _check_pipeline_mesh(owner: str, mesh: DeviceMesh) -> None:
    if mesh.mesh_dim_names != PIPELINE_MESH_AXES:
        raise ValueError(
            f"{owner}: the mesh's axes are {mesh.mesh_dim_names}, not {PIPELINE_MESH_AXES}; build it with "
            "d9dfn.loop.init_distributed(DeviceMeshParameters(pipeline_parallel=...)) or init_pipeline_mesh"
        )


def pipeline_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ``pp`` process group of this rank in a ``(pp, dp_replicate, dp_shard)`` mesh: its pipeline peers.

    Raises:
        ValueError: ``mesh`` is not a pipeline mesh.
    """
    _check_pipeline_mesh("pipeline_group", mesh)
    return mesh.get_group(PIPELINE_AXIS)


def pipeline_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on ``pp``: the program row it runs (``Program.ranks[pipeline_rank(mesh)]``).

    Raises:
        ValueError: ``mesh`` is not a pipeline mesh.
    """
    _check_pipeline_mesh("pipeline_rank", mesh)
    return int(mesh.get_local_rank(PIPELINE_AXIS))


def data_parallel_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``(dp_replicate, dp_shard)`` mesh of this rank's pipeline slice: where its stages' gradients are reduced.

    Pass it wherever a data-parallel mesh goes (``init_train_state(mesh=...)``, ``data_parallel_reduction``).

    Raises:
        ValueError: ``mesh`` is not a pipeline mesh.
    """
    _check_pipeline_mesh("data_parallel_submesh", mesh)
    return mesh[DATA_PARALLEL_AXES]
