"""Parallelism: the data-parallel reduction inside the compiled step, its mesh, and per-rank compile caches.

Issue 5 groundwork (``docs/design/data-parallel.md``): replicated data parallelism over one process
group. DTensor placements (FSDP ``Shard(0)``, hybrid) come later.
"""

from d9dfn.parallel._cache import per_rank_compile_cache
from d9dfn.parallel._mesh import DATA_PARALLEL_AXIS, check_data_parallel_degrees, init_data_parallel_mesh
from d9dfn.parallel._reduce import GradientReduction, all_reduce_sum, data_parallel_reduction, group_name

__all__ = [
    "DATA_PARALLEL_AXIS",
    "GradientReduction",
    "all_reduce_sum",
    "check_data_parallel_degrees",
    "data_parallel_reduction",
    "group_name",
    "init_data_parallel_mesh",
    "per_rank_compile_cache",
]
