"""Pipeline parallelism's pure core: programs are data.

A schedule is a pure function ``(num_ranks, stages_per_rank, num_microbatches) -> Program``; a
:class:`Program` is a frozen tuple, per rank, of :class:`Action` s (``F``, ``B``, ``I``, ``W`` per stage and
microbatch) written in torch's notation (``0F3``, ``2SEND_B1``); :data:`SCHEDULE_OPTIONS` registers the schedules a
JSON config selects (``trainer.pipelining.schedule``); :func:`lower` adds the sends and receives,
:func:`dry_run` proves the ranks cannot deadlock, :func:`simulate` and :func:`render` time and draw it. A
:class:`Stage` is a pure function over a slice of the model that keeps full parameter names
(:func:`build_stages`, :func:`split_stages`, :func:`distribute_layers`, :func:`stage_io_shapes`).
:func:`run_program` interprets a program in one process; :func:`run_rank_program` runs one rank's row of it
with sends and receives over the ``pp`` group (:class:`PipelineRank`), and :func:`run_rank_forward` its
forwards only. See ``docs/design/pipeline.md``.

>>> from d9dfn import pipeline
>>> print(pipeline.one_f_one_b(num_ranks=2, stages_per_rank=1, num_microbatches=3))
r0: 0F0 0F1 0B0 0F2 0B1 0B2
r1: 1F0 1B0 1F1 1B1 1F2 1B2
>>> print(pipeline.render(pipeline.one_f_one_b(2, 1, 3)))
r0 F0 F1  .  . B0  ~ F2 B1  ~  . B2  ~
r1  . F0 B0  ~ F1 B1  ~ F2 B2  ~  .  .
"""

from d9dfn._types import PipelineStageInfo
from d9dfn.pipeline._executor import (
    Pipeline,
    ProgramResult,
    StageCall,
    StageConsts,
    StageRunner,
    TracedStages,
    execution_order,
    run_forward,
    run_program,
    stage_args,
)
from d9dfn.pipeline._lower import DryRun, dry_run, lower
from d9dfn.pipeline._p2p import PipelineRank, run_rank_forward, run_rank_program
from d9dfn.pipeline._program import (
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Program,
    loop_placement,
    parse_action,
    v_placement,
    validate,
)
from d9dfn.pipeline._schedules import (
    SCHEDULE_OPTIONS,
    SCHEDULES,
    ScheduleOptions,
    dual_pipe_v,
    gpipe,
    inference,
    looped_bfs,
    one_f_one_b,
    zero_bubble_1f1b,
    zero_bubble_v,
)
from d9dfn.pipeline._simulate import Costs, Timeline, render, simulate
from d9dfn.pipeline._split_backward import SplitBackward
from d9dfn.pipeline._stage import Stage, build_stages, distribute_layers, split_stages, stage_io_shapes
from d9dfn.pipeline._torch_ir import from_torch, to_torch

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "SCHEDULES",
    "SCHEDULE_OPTIONS",
    "Action",
    "Costs",
    "DryRun",
    "Pipeline",
    "ProgramResult",
    "ActionKind",
    "PipelineRank",
    "PipelineStageInfo",
    "Program",
    "ScheduleOptions",
    "SplitBackward",
    "Stage",
    "StageCall",
    "StageConsts",
    "StageRunner",
    "Timeline",
    "TracedStages",
    "build_stages",
    "distribute_layers",
    "dry_run",
    "execution_order",
    "dual_pipe_v",
    "from_torch",
    "gpipe",
    "inference",
    "loop_placement",
    "lower",
    "looped_bfs",
    "one_f_one_b",
    "parse_action",
    "render",
    "run_forward",
    "run_program",
    "run_rank_forward",
    "run_rank_program",
    "simulate",
    "split_stages",
    "stage_args",
    "stage_io_shapes",
    "to_torch",
    "v_placement",
    "validate",
    "zero_bubble_1f1b",
    "zero_bubble_v",
]
