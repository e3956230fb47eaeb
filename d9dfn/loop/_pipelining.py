"""The loop's side of pipeline parallelism: ``trainer.pipelining`` → a program, stages, this rank's weights.

:func:`build_program` turns the config's schedule into a pure ``d9dfn.pipeline`` program (``num_stages = pp ×
stages per rank``) through the schedule's registry entry (``d9dfn.pipeline.SCHEDULE_OPTIONS``);
:func:`build_pipeline_stages` calls the model provider once per stage on the meta device
(``InitializeModelStageContext(stage_index=i, num_stages=n)``) and materializes only this rank's stages.

Construction consistency (d9d): a stage's initial weights must not depend on the layout, so that a pp=2 run
starts from the bits a pp=1 run starts from and a checkpoint moves between layouts. Each module that owns
tensors is re-initialized by its ``reset_parameters`` under a torch seed derived from the run's seed and the
module's *full* name (:func:`seeded_reset`): stage 1 of 2 and the same layers inside a one-stage model draw the
same numbers. (A run without ``trainer.pipelining`` keeps the one-process order-of-modules initialization.)
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch
from torch import nn

from d9dfn.config import PipeliningConfig
from d9dfn.loop._init import check_initialized, poison
from d9dfn.loop._providers import InitializeModelStageContext, ModelProvider
from d9dfn.loop._runtime import torch_rng_restored
from d9dfn.pipeline import PipelineStageInfo, Program, Stage, build_stages

__all__ = ["PipelineLayout", "build_pipeline_stages", "build_program", "seeded_reset"]


def build_program(config: PipeliningConfig, num_ranks: int, num_microbatches: int) -> Program:
    """The training program of ``config``'s schedule on ``num_ranks`` pipeline ranks: the schedule's options (its
    ``d9dfn.pipeline.SCHEDULE_OPTIONS`` entry) build it, so a newly registered schedule needs nothing here.

    Args:
        config: ``trainer.pipelining``.
        num_ranks: ``mesh.pipeline_parallel``.
        num_microbatches: the batch maths' ``num_microbatches`` (microbatches per rank per step).

    >>> print(build_program(PipeliningConfig(), 2, 2))
    r0: 0F0 0F1 0B0 0B1
    r1: 1F0 1F1 1B0 1B1
    """
    return config.schedule.options().program(num_ranks, num_microbatches)


def _seed_of(seed: int, name: str) -> int:
    """A 63-bit torch seed from the run's seed and a module's full name (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_reset(module: nn.Module, seed: int) -> None:
    """Initialize every module of ``module`` that owns tensors, each under a seed from ``seed`` and its name.

    ``module``'s names must be the whole model's (a stage keeps full names), so the weights of a layer do not
    depend on which stage, rank or layout built it. The global RNG state is restored afterwards.

    Raises:
        ValueError: a module owns parameters or buffers but has no ``reset_parameters`` (its tensors would
            stay uninitialized after ``to_empty``).
    """
    with torch_rng_restored(), torch.no_grad():
        for name, child in module.named_modules():
            owns = any(True for _ in child.parameters(recurse=False)) or any(True for _ in child.buffers(recurse=False))
            if not owns:
                continue
            reset = getattr(child, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"seeded_reset: module {name!r} ({type(child).__name__}) owns tensors but has no "
                    "reset_parameters(); define one that initializes its own parameters and buffers (d9d's "
                    "ModuleLateInit), so that a pipeline stage can be built on the meta device"
                )
            torch.manual_seed(_seed_of(seed, name))
            reset()


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """A pipelined run's program and stages, as this rank sees them.

    Attributes:
        program: the training program (every rank's rows).
        stages: every stage's meta skeleton, in stage order.
        rank: this process's pipeline rank (0 on one process).
        modules: this rank's materialized stage modules, in stage order (full param names).
        placements: per module, the model provider's ``parallelize_model_stage`` choice on the data-parallel
            mesh (``None``: the default placements, or no mesh).
    """

    program: Program
    stages: tuple[Stage, ...]
    rank: int
    modules: tuple[nn.Module, ...]
    placements: tuple[Any, ...] = ()

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank that holds the last stage (it computes the loss, the metrics and the task's logs)."""
        return self.program.stage_to_rank[self.program.num_stages - 1]


def build_pipeline_stages(
    provider: ModelProvider,
    program: Program,
    rank: int,
    *,
    mesh: Any,
    device_mesh: Any,
    device: torch.device,
    seed: int,
) -> PipelineLayout:
    """Every stage's meta skeleton from ``provider``, and this rank's stages materialized on ``device``.

    The provider builds stage ``i`` of ``program.num_stages`` when called with
    ``InitializeModelStageContext(stage_index=i, num_stages=n)``; its modules must keep the whole model's
    parameter names (``Qwen3LM(config, stage=PipelineStageInfo(i, n))`` does).

    Raises:
        ValueError: two stages build a tensor of the same name, or a module cannot be initialized.
    """

    def build(info: PipelineStageInfo) -> nn.Module:
        context = InitializeModelStageContext(
            stage_index=info.current_stage, num_stages=info.num_stages, mesh=mesh, device_mesh=device_mesh
        )
        return provider.initialize_model_stage(context).model

    stages = build_stages(build, program.num_stages)
    modules, placements = [], []
    for stage in stages:
        if program.stage_to_rank[stage.index] != rank:
            continue
        context = InitializeModelStageContext(
            stage_index=stage.index, num_stages=program.num_stages, mesh=mesh, device_mesh=device_mesh
        )
        with torch.device("meta"):
            module = provider.initialize_model_stage(context).model
        module = module.to_empty(device=device)
        poison(module)  # as materialize_model: a tensor no reset_parameters writes is an error, not garbage
        seeded_reset(module, seed)
        check_initialized(module, f"seeded_reset (stage {stage.index})")
        modules.append(module)
        placements.append(provider.parallelize_model_stage(context, module) if device_mesh is not None else None)
    return PipelineLayout(
        program=program, stages=stages, rank=rank, modules=tuple(modules), placements=tuple(placements)
    )
