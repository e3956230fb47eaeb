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

from d9dfn.parallel._axes import AXIS_NAMES, MeshAxes

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
    "data_parallel_position",
    "data_parallel_submesh",
    "pipeline_group",
    "pipeline_rank",
]

DATA_PARALLEL_AXIS = AXIS_NAMES["data_replicate"]
"""The replicated data-parallel mesh axis (d9d's ``data_parallel_replicate`` degree)."""
SHARD_AXIS = AXIS_NAMES["data_shard"]
"""The sharded data-parallel mesh axis (d9d's ``data_parallel_shard`` degree)."""
DATA_PARALLEL_AXES = MeshAxes.of().names
"""The data-parallel mesh's axes, outermost first: replicas of shard groups (HSDP)."""
PIPELINE_AXIS = AXIS_NAMES["pipeline"]
"""The pipeline mesh axis, outermost (d9d's ``pipeline_parallel`` degree)."""
PIPELINE_MESH_AXES = MeshAxes.of(pipeline=1).names
"""The axes of a pipeline mesh, outermost first."""


def data_parallel_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ``ProcessGroup`` of all the mesh's ranks.

    A 2-D mesh is flattened, which creates a process group (a collective): call it once, when a hook is
    built, never inside the compiled step.
    """
    return (mesh if mesh.ndim == 1 else mesh._flatten()).get_group()


def _pipeline_axis(owner: str, mesh: DeviceMesh) -> str:
    """The name of ``mesh``'s pipeline axis (role ``pipeline``)."""
    name = MeshAxes.of_mesh(mesh).name_of("pipeline")
    if name is None:
        raise ValueError(
            f"{owner}: the mesh's axes are {mesh.mesh_dim_names}, none of them a pipeline axis ({PIPELINE_AXIS!r}); "
            "build it with d9dfn.loop.init_distributed(DeviceMeshParameters(pipeline_parallel=...)) or "
            "init_pipeline_mesh"
        )
    return name


def pipeline_group(mesh: DeviceMesh) -> ProcessGroup:
    """The ``pp`` process group of this rank in a mesh with a pipeline axis: its pipeline peers.

    Raises:
        ValueError: ``mesh`` has no pipeline axis.
    """
    return mesh.get_group(_pipeline_axis("pipeline_group", mesh))


def pipeline_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on ``pp``: the program row it runs (``Program.ranks[pipeline_rank(mesh)]``).

    Raises:
        ValueError: ``mesh`` has no pipeline axis.
    """
    return int(mesh.get_local_rank(_pipeline_axis("pipeline_rank", mesh)))


def data_parallel_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of this rank's pipeline slice (every axis but ``pp``): where its stages' params live and their
    gradients are reduced.

    Pass it wherever a data-parallel mesh goes (``init_train_state(mesh=...)``, ``plan_for``).

    Raises:
        ValueError: ``mesh`` has no pipeline axis.
    """
    _pipeline_axis("data_parallel_submesh", mesh)
    return mesh[MeshAxes.of_mesh(mesh).without("pipeline").names]


def data_parallel_position(mesh: DeviceMesh) -> tuple[int, int]:
    """``(index, count)``: this rank's index among the ranks of ``mesh`` that take different rows of each global batch
    (its data-parallel axes, :attr:`MeshAxes.sample_axes`), and their number."""
    axes = MeshAxes.of_mesh(mesh)
    coordinates = {name: int(mesh.get_local_rank(name)) for name in axes.names}
    return axes.data_parallel_rank(coordinates), axes.data_parallel_size
