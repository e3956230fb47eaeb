"""The step: ``make_train_step`` / ``make_eval_step`` / ``make_inference_step``, programs of compiled pieces.

How a step runs is a value, and its features compose (``docs/architecture.md`` lists which module owns which):

- an **executor** runs the microbatches: :class:`Sequential` (one after another on this process, the default),
  :class:`d9dfn.pipeline.Pipeline` (a pipeline program whose stages this process holds) or
  :class:`d9dfn.pipeline.PipelineRank` (this rank's row, with sends and receives); every one returns the same named
  result to the one tail;
- **repeated blocks** (``repeated_blocks=``, found with :func:`find_repeated_blocks`) are compiled once for all
  their instances, in one process and inside pipeline stages, and the tail updates each block through one region;
- **activation checkpointing** (:class:`ActivationCheckpointing`) recomputes the blocks' forward in the backward;
- a **precision policy** (:class:`d9dfn.Precision`) casts at the one model call, every executor alike;
- **data parallelism** (:class:`d9dfn.DataParallel`) is placement plus a reduction in the tail.
"""

from d9dfn.step._blocks import find_repeated_blocks
from d9dfn.step._checkpointing import ActivationCheckpointing
from d9dfn.step._eval import make_eval_step, make_inference_step
from d9dfn.step._executors import Executor, Sequential
from d9dfn.step._precision import Precision, cast_params
from d9dfn.step._state import (
    EvalOutput,
    InferenceState,
    StepOutput,
    TrainState,
    frozen_names,
    init_train_state,
    split_module_state,
    trainable_params,
)
from d9dfn.step._train import make_train_step

__all__ = [
    "ActivationCheckpointing",
    "EvalOutput",
    "Executor",
    "InferenceState",
    "Precision",
    "Sequential",
    "StepOutput",
    "TrainState",
    "cast_params",
    "find_repeated_blocks",
    "frozen_names",
    "init_train_state",
    "make_eval_step",
    "make_inference_step",
    "make_train_step",
    "split_module_state",
    "trainable_params",
]
