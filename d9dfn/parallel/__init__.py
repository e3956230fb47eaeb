"""Parallelism: data-parallel meshes, parameter placements, the reduction inside the compiled step, and
per-rank compile caches (``docs/design/data-parallel.md``).

Replicated (DDP), sharded (FSDP-style ``Shard(0)``) and hybrid data parallelism over a 2-D
``(dp_replicate, dp_shard)`` ``DeviceMesh``, on gloo (CPU) and NCCL (GPUs).
"""

from d9dfn.parallel._cache import per_rank_compile_cache
from d9dfn.parallel._launch import (
    CollectiveError,
    data_parallel_group,
    init_distributed,
    is_main_process,
    launched_world_size,
    set_collective_timeout,
)
from d9dfn.parallel._mesh import (
    DATA_PARALLEL_AXES,
    DATA_PARALLEL_AXIS,
    SHARD_AXIS,
    check_data_parallel_degrees,
    init_data_parallel_mesh,
)
from d9dfn.parallel._placement import (
    PlacementFn,
    data_parallel_placements,
    distribute_params,
    full_tensors,
    is_distributed_tensor,
)
from d9dfn.parallel._reduce import GradientReduction, all_reduce_sum, data_parallel_reduction, group_name

__all__ = [
    "DATA_PARALLEL_AXES",
    "DATA_PARALLEL_AXIS",
    "SHARD_AXIS",
    "CollectiveError",
    "GradientReduction",
    "PlacementFn",
    "all_reduce_sum",
    "check_data_parallel_degrees",
    "data_parallel_group",
    "data_parallel_placements",
    "data_parallel_reduction",
    "distribute_params",
    "full_tensors",
    "group_name",
    "init_data_parallel_mesh",
    "init_distributed",
    "is_main_process",
    "is_distributed_tensor",
    "launched_world_size",
    "per_rank_compile_cache",
    "set_collective_timeout",
]
