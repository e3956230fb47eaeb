"""d9dfn: a functional training and inference loop on torch.func, torch.compile and DTensor.

The pure core is importable from here. The edge is imported on demand, never by ``import d9dfn``:
``d9dfn.config``, ``d9dfn.checkpoint``, ``d9dfn.data``, ``d9dfn.loop`` (``Trainer``, providers, events),
``d9dfn.compat`` (Megatron, timm), ``d9dfn.jobs`` (the default job) and ``d9dfn.cli``
(``docs/architecture.md``).
"""

from d9dfn import metrics, models, optim, prng, schedules, step, tasks
from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import (
    field,
    format_path,
    pytree_dataclass,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_map_with_path,
    tree_structure,
    tree_unflatten,
)
from d9dfn._sharding import SpecReplicate, SpecShard, shard_tree, spec_on_dim, spec_replicate_all, unshard_tree
from d9dfn._task import (
    BuildForwardInputsResult,
    ComputeLossResult,
    InferenceTask,
    PipelineShardingSpec,
    TrainTask,
)
from d9dfn._types import (
    Batch,
    Buffers,
    DataParallel,
    FusedUpdate,
    GradientReduction,
    Grads,
    KeyPath,
    OptState,
    Params,
    PathPredicate,
    PyTree,
    Schedule,
    StateUpdate,
    Sums,
    Transform,
    Updates,
)
from d9dfn.step import (
    EvalOutput,
    InferenceState,
    Precision,
    Sequential,
    StepOutput,
    TrainState,
    cast_params,
    frozen_names,
    init_train_state,
    make_eval_step,
    make_inference_step,
    make_train_step,
    split_module_state,
    trainable_params,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "Batch",
    "Buffers",
    "BuildForwardInputsResult",
    "ComputeLossResult",
    "DataParallel",
    "EvalOutput",
    "FusedUpdate",
    "GradientReduction",
    "Grads",
    "InferenceState",
    "InferenceTask",
    "KeyPath",
    "OptState",
    "Params",
    "PathPredicate",
    "PipelineShardingSpec",
    "PipelineState",
    "Precision",
    "PyTree",
    "Schedule",
    "Sequential",
    "SpecReplicate",
    "SpecShard",
    "StateUpdate",
    "StepOutput",
    "Sums",
    "TrainState",
    "TrainTask",
    "Transform",
    "Updates",
    "cast_params",
    "field",
    "format_path",
    "frozen_names",
    "init_train_state",
    "make_eval_step",
    "make_inference_step",
    "make_train_step",
    "metrics",
    "models",
    "optim",
    "prng",
    "pytree_dataclass",
    "schedules",
    "shard_tree",
    "spec_on_dim",
    "spec_replicate_all",
    "split_module_state",
    "step",
    "tasks",
    "trainable_params",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_with_path",
    "tree_structure",
    "tree_unflatten",
    "unshard_tree",
]


def __getattr__(name: str) -> object:
    # `d9dfn.compat.megatron` after a bare `import d9dfn` keeps working, without loading compat at import.
    if name == "compat":
        import importlib

        return importlib.import_module("d9dfn.compat")
    raise AttributeError(f"module 'd9dfn' has no attribute {name!r}")
