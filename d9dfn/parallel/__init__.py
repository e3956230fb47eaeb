"""Parallelism inside the step: the data-parallel mesh's axes, parameter placements and the gradient
reductions traced into the compiled step (``docs/design/data-parallel.md``).

Replicated (DDP), sharded (FSDP-style ``Shard(0)``) and hybrid data parallelism over a 2-D
``(dp_replicate, dp_shard)`` ``DeviceMesh``, on gloo (CPU) and NCCL (GPUs). Creating process groups and
meshes is the loop's job (``d9dfn.loop.init_distributed``); nothing here starts a process group.
"""

from d9dfn._types import DataParallel, GradientReduction
from d9dfn.parallel._axes import AXIS_NAMES, ROLES, ExpertFrom, MeshAxes, MeshAxis, Role
from d9dfn.parallel._experts import ExpertParallel, bind_expert_parallel, dispatch_experts, expert_parallel_of
from d9dfn.parallel._grads import global_norm, leaf_norms
from d9dfn.parallel._mesh import (
    DATA_PARALLEL_AXES,
    DATA_PARALLEL_AXIS,
    PIPELINE_AXIS,
    PIPELINE_MESH_AXES,
    SHARD_AXIS,
    data_parallel_group,
    data_parallel_position,
    data_parallel_submesh,
    pipeline_group,
    pipeline_rank,
)
from d9dfn.parallel._pipeline import PipelineReduction, pipeline_reduction
from d9dfn.parallel._placement import (
    PlacementFn,
    data_parallel_placements,
    distribute_params,
    full_tensors,
    is_distributed_tensor,
    shard_offset,
)
from d9dfn.parallel._plan import (
    DATA_PARALLEL_RULES,
    EXPERT_PARALLEL_RULES,
    SEQUENCE_PARALLEL_RULES,
    TENSOR_PARALLEL_RULES,
    VOCAB_PARALLEL_RULES,
    ParallelPlan,
    ParamLayout,
    Rules,
    make_plan,
    plan_data_parallel,
    plan_for,
    token_group,
)
from d9dfn.parallel._reduce import all_reduce_sum, data_parallel, data_parallel_reduction, group_name
from d9dfn.parallel._tensor import (
    TensorParallel,
    enter_tensor_parallel,
    gather_sequence,
    leave_tensor_parallel,
    scatter_sequence,
    sequence_rank,
    split_sequence,
    tensor_parallel_of,
    unsplit_sequence,
)
from d9dfn.parallel._vocab import (
    VocabParallelLogits,
    check_vocab_parallel,
    vocab_parallel_correct,
    vocab_parallel_embedding,
    vocab_parallel_nll,
    whole_logits,
)

__all__ = [
    "AXIS_NAMES",
    "DATA_PARALLEL_AXES",
    "DATA_PARALLEL_RULES",
    "EXPERT_PARALLEL_RULES",
    "ExpertFrom",
    "ExpertParallel",
    "MeshAxes",
    "MeshAxis",
    "ParallelPlan",
    "ParamLayout",
    "ROLES",
    "Role",
    "Rules",
    "SEQUENCE_PARALLEL_RULES",
    "TENSOR_PARALLEL_RULES",
    "TensorParallel",
    "VOCAB_PARALLEL_RULES",
    "VocabParallelLogits",
    "check_vocab_parallel",
    "vocab_parallel_correct",
    "vocab_parallel_embedding",
    "vocab_parallel_nll",
    "whole_logits",
    "enter_tensor_parallel",
    "gather_sequence",
    "scatter_sequence",
    "sequence_rank",
    "split_sequence",
    "unsplit_sequence",
    "leave_tensor_parallel",
    "tensor_parallel_of",
    "make_plan",
    "plan_data_parallel",
    "plan_for",
    "token_group",
    "DATA_PARALLEL_AXIS",
    "PIPELINE_AXIS",
    "PIPELINE_MESH_AXES",
    "DataParallel",
    "PipelineReduction",
    "SHARD_AXIS",
    "GradientReduction",
    "PlacementFn",
    "all_reduce_sum",
    "data_parallel",
    "data_parallel_group",
    "data_parallel_position",
    "data_parallel_placements",
    "data_parallel_reduction",
    "data_parallel_submesh",
    "bind_expert_parallel",
    "dispatch_experts",
    "expert_parallel_of",
    "distribute_params",
    "full_tensors",
    "global_norm",
    "group_name",
    "is_distributed_tensor",
    "leaf_norms",
    "pipeline_group",
    "pipeline_rank",
    "pipeline_reduction",
    "shard_offset",
]
