"""``InferenceConfigurator`` → ``Inference``: d9d's inference job around the compiled forward-only step.

``Inference.infer`` loads a training run's weights (or, with ``checkpointing=None``, the
``model_stage_factory.source_checkpoint`` weights), walks the dataset once in order, folds every
microbatch's outputs into the task state and returns ``task.finalize(task_state)``. It runs under
``torch.inference_mode``, with the same ``data_loading``, ``determinism``, ``gc`` and ``profiling`` handling
as training (``_runtime.py``). Unlike d9d, a final batch smaller than the global batch is not an error
(d9d splits every batch into its microbatches with ``shard_tree``, which raises on one that does not divide:
``d9d/pipelining/infra/schedule/component/runtime/executor.py``): it runs as one microbatch of its own size.

With ``mesh.pipeline_parallel > 1`` (under ``torchrun``) it runs the inference schedule
(``d9dfn.pipeline.inference(pp, 1, m)``: one stage per rank, forwards only) across the ``pp`` ranks: every rank
builds every stage's skeleton on meta, materializes its own stage, restores only that stage's tensors from the
checkpoint (any layout restores onto any other), and runs ``make_inference_step(executor=PipelineRank(...))``.
Only the last stage's rank folds outputs into the task state; at the end its task and metric state are
broadcast over the ``pp`` group, so every rank finalizes the same result. With data parallelism beside the
pipeline (``(pp, dp_replicate, dp_shard)``), each data-parallel replica is a whole pipeline that evaluates every
batch (no rows are split, nothing is reduced over dp): the result is the same on every rank, and each rank holds
its whole stage, unsharded.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9dfn import parallel
from d9dfn._task import InferenceTask
from d9dfn.checkpoint import load_weights
from d9dfn.config import DeviceMeshParameters, InferenceConfig
from d9dfn.data import BatchLoader, DeviceBatches, StatefulBatchIterator
from d9dfn.loop import _events as ev
from d9dfn.loop._compile_cache import per_rank_compile_cache, publish_compile_cache, run_compile_cache
from d9dfn.loop._distributed import init_distributed, is_main_process, resolve_device, set_collective_timeout
from d9dfn.loop._logging import ProgressBar
from d9dfn.loop._memory import check_memory, estimate_memory, estimate_memory_of_count, processes_on_device
from d9dfn.loop._pipelining import build_pipeline_stages
from d9dfn.loop._providers import (
    DatasetProvider,
    InferenceTaskProvider,
    InitializeDatasetContext,
    InitializeModelStageContext,
    ModelProvider,
)
from d9dfn.loop._runtime import collect_garbage, deterministic_algorithms, manual_gc, profile
from d9dfn.loop._train import (
    block_classes,
    load_batches,
    load_source_checkpoint,
    materialize_model,
    start_configuration,
)
from d9dfn.pipeline import PipelineRank, inference
from d9dfn.step import InferenceState, make_inference_step, split_module_state
from d9dfn.step._precision import cast_params_tree

__all__ = ["Inference", "InferenceConfigurator", "InferenceResult"]


@dataclasses.dataclass(frozen=True)
class InferenceResult:
    """What ``Inference.infer`` returns: the task's result, its final state, and the checkpoint used.

    ``checkpoint_step`` is ``None`` when no training checkpoint was loaded (``checkpointing=None``).
    """

    task_result: Any
    state: InferenceState
    checkpoint_step: int | None
    num_batches: int
    first_step_s: float | None = None
    """Seconds the first batch took, compilation included (``None`` when there was no batch)."""


class InferenceConfigurator:
    """Wire an inference job (d9d's names): the task, the model, the data and a training run's weights."""

    def __init__(
        self,
        mesh: DeviceMeshParameters,
        parameters: InferenceConfig,
        task_provider: InferenceTaskProvider,
        model_provider: ModelProvider,
        data_provider: DatasetProvider,
        *,
        split: str = "validation",
        max_batches: int | None = None,
    ) -> None:
        self.mesh = mesh
        self.parameters = parameters
        self.task_provider = task_provider
        self.model_provider = model_provider
        self.data_provider = data_provider
        self.split = split
        self.max_batches = max_batches

    def configure(self) -> Inference:
        """Build the task, event bus, data, model and step; load the weights.

        With ``mesh.pipeline_parallel > 1`` the process group and the pipeline mesh come first (with
        ``timeout.init_timeout``), and this rank builds and loads only its stage (see the module docstring).

        Raises:
            NotImplementedError: a data-parallel mesh without a pipeline, or ``source_checkpoint`` weights on
                a pipeline mesh.
            ValueError: ``repeated_blocks`` naming a class the model lacks.
        """
        config = self.parameters
        device = resolve_device(config.device, "device")
        pipelined = self.mesh.pipeline_parallel > 1
        if pipelined and config.checkpointing is None and config.model_stage_factory.source_checkpoint is not None:
            raise NotImplementedError(
                f"InferenceConfigurator: model_stage_factory.source_checkpoint with mesh.pipeline_parallel="
                f"{self.mesh.pipeline_parallel}: source weights are not loaded into pipeline stages yet; run it on "
                "one process (mesh.pipeline_parallel=1), or train a step from it and infer from that run's checkpoint"
            )
        self._check_memory(None, device)  # from the config's arithmetic, before the process group and any module
        device_mesh: Any = None
        if pipelined:
            device_mesh = init_distributed(self.mesh, timeout_s=config.timeout.init_timeout, device_type=device.type)
        if config.compile:  # the trained run's cache, one directory per rank (pytorch/pytorch#188390), as in training
            rank = 0 if device_mesh is None else device_mesh.get_rank()
            if config.checkpointing is not None:
                run_compile_cache(config.checkpointing.load_dir, rank, distributed=pipelined)
            elif pipelined:
                per_rank_compile_cache(rank)
        task, bus = start_configuration(
            "InferenceConfigurator",
            self.mesh,
            config,
            self.task_provider,
            self.model_provider,
            ev.EVENT_INFERENCE_CONFIGURATION_START,
            distributed=pipelined,
        )
        batch_size = config.batching.global_batch_size
        dataset = self.data_provider(
            InitializeDatasetContext(split=self.split, per_rank_batch_size=batch_size, seed=config.determinism.seed)
        )
        data = load_batches(
            StatefulBatchIterator(
                dataset.dataset, batch_size=batch_size, collate_fn=dataset.collator, shuffle=False, drop_last=False
            ),
            config.data_loading,
            device,
        )
        bus.trigger(ev.EVENT_INFERENCE_CONFIGURATION_DATA_LOADER, ev.EventDataLoaderReadyContext(data_loader=data))
        stage = InitializeModelStageContext(mesh=self.mesh)
        rank_pipeline: PipelineRank | None = None
        if pipelined:
            skeleton, model, rank_pipeline = self._pipeline_stage(device_mesh, device)
        else:
            skeleton, model = materialize_model(
                self.model_provider,
                stage,
                device,
                before_allocating=lambda skeleton: self._check_memory(skeleton, device),
            )
        step: int | None = None
        if config.checkpointing is not None:
            params, buffers, step = load_weights(
                Path(config.checkpointing.load_dir),
                model,
                config.checkpointing.step,
                load_base=lambda module, folder: load_source_checkpoint(self.model_provider, stage, module, folder),
            )
        else:
            if config.model_stage_factory.source_checkpoint is not None:
                load_source_checkpoint(self.model_provider, stage, model, config.model_stage_factory.source_checkpoint)
            params, buffers = split_module_state(model)
        params = cast_params_tree(params, config.precision.policy().param_dtype)
        bus.trigger(ev.EVENT_INFERENCE_CONFIGURATION_MODEL_STAGES, ev.EventModelStagesReadyContext(modules=(model,)))
        return Inference(
            config=config,
            task=task,
            skeleton=skeleton,
            params=params,
            buffers=buffers,
            checkpoint_step=step,
            data=data,
            bus=bus,
            max_batches=self.max_batches,
            device=device,
            pipeline=rank_pipeline,
        )

    def _check_memory(self, skeleton: nn.Module | None, device: torch.device) -> None:
        """Refuse, before allocating, a model whose weights alone exceed the device's memory (``check_memory``);
        with ``skeleton=None`` from the model provider's ``num_params`` (nothing when it does not know)."""
        param_dtype = self.parameters.precision.policy().param_dtype
        if skeleton is None:
            num_params = self.model_provider.num_params()
            if num_params is None:
                return
            estimate = estimate_memory_of_count(num_params, None, param_dtype=param_dtype, gradients=False)
        else:
            estimate = estimate_memory(
                dict(skeleton.named_parameters()), None, param_dtype=param_dtype, gradients=False
            )
        check_memory(
            estimate,
            device,
            who="InferenceConfigurator",
            fix=lambda: self.model_provider.memory_hint(skeleton),
            shards=self.mesh.pipeline_parallel,
            processes=processes_on_device(device),
        )

    def _pipeline_stage(self, device_mesh: Any, device: torch.device) -> tuple[nn.Module, nn.Module, PipelineRank]:
        """The whole model's skeleton (meta), this rank's materialized stage, and its row of the inference program.

        One stage per pipeline rank whatever schedule trained the checkpoint: it is keyed by full names.
        """
        config = self.parameters
        with torch.device("meta"):
            skeleton = self.model_provider.initialize_model_stage(InitializeModelStageContext(mesh=self.mesh)).model
        self._check_memory(skeleton, device)
        program = inference(self.mesh.pipeline_parallel, 1, config.batch_maths().num_microbatches)
        layout = build_pipeline_stages(
            self.model_provider,
            program,
            parallel.pipeline_rank(device_mesh),
            mesh=self.mesh,
            device_mesh=None,  # no placements: each rank holds its whole stage (a dp replica is a whole pipeline)
            device=device,
            seed=config.determinism.seed,
        )
        (module,) = layout.modules
        group = parallel.pipeline_group(device_mesh)
        return skeleton, module, PipelineRank(program, layout.stages, layout.rank, group)


class Inference:
    """A configured inference job; ``infer()`` runs it once over the data."""

    def __init__(
        self,
        *,
        config: InferenceConfig,
        task: InferenceTask,
        skeleton: nn.Module,
        params: dict,
        buffers: dict,
        checkpoint_step: int | None,
        data: StatefulBatchIterator | BatchLoader,
        bus: ev.EventBus,
        max_batches: int | None,
        device: torch.device | None = None,
        pipeline: PipelineRank | None = None,
    ) -> None:
        self.config = config
        self.device = device or torch.device("cpu")
        self.task = task
        self.skeleton = skeleton
        self.params = params
        self.buffers = buffers
        self.checkpoint_step = checkpoint_step
        self.data = data
        self.bus = bus
        self.max_batches = max_batches
        self.pipeline = pipeline
        precision = config.precision.policy()
        build = functools.partial(
            make_inference_step,
            skeleton,
            task,
            precision=precision,
            compile=config.compile,
            repeated_blocks=block_classes(skeleton, config.repeated_blocks, "repeated_blocks"),
        )
        self.step_fn = build(num_microbatches=config.batch_maths().num_microbatches, executor=pipeline)
        # A final, smaller batch runs as one microbatch: no uneven split, no error (d9d raises there).
        self.tail_step_fn = build(executor=self.one_microbatch_pipeline())

    def one_microbatch_pipeline(self) -> PipelineRank | None:
        """This rank's row of the one-microbatch inference program (``None`` on one process): the tail batch's, and
        what a job that feeds one sequence at a time (a sampler) runs its forwards through."""
        if self.pipeline is None:
            return None
        program = inference(self.pipeline.program.num_ranks, 1, 1)
        return dataclasses.replace(self.pipeline, program=program)

    def infer(self) -> InferenceResult:
        """Run the task over the data (in order, once); finalize and fire ``inference.finished``."""
        metric = self.task.create_metrics()
        state = InferenceState(
            params=self.params,
            buffers=self.buffers,
            step=torch.zeros((), dtype=torch.int64),
            rng=torch.zeros((), dtype=torch.int64),
            task_state=self.task.init_state(),
            metric_state=metric.init() if metric is not None else None,
        )
        total = len(self.data) if self.max_batches is None else min(len(self.data), self.max_batches)
        batches = DeviceBatches(self.data, self.device, total)
        full_size = self.config.batching.global_batch_size
        config = self.config
        # Rank 0 draws it (every pipeline rank runs this loop); the first batch compiles under a ticking line.
        bar = ProgressBar(total, enabled=is_main_process(), desc="evaluate", unit="batch")
        try:
            with (
                torch.inference_mode(),
                deterministic_algorithms(config.determinism.deterministic_algorithms),
                manual_gc(),
                profile(config.profiling) as profiler,
            ):
                self.bus.trigger(ev.EVENT_INFERENCE_READY, ev.EventInferenceReadyContext())
                for position in range(1, total + 1):
                    batch = next(batches)
                    context = ev.EventStepContext(step=position, total_steps=total, state=state)
                    self.bus.trigger(ev.EVENT_INFERENCE_STEP_PRE, context)
                    with self.bus.bounded(ev.EVENT_INFERENCE_FORWARD_PRE, ev.EVENT_INFERENCE_FORWARD_POST, context):
                        step_fn = self.step_fn if _batch_size(batch) == full_size else self.tail_step_fn
                        if position == 1:
                            with bar.first_step("compiling (first batch)" if config.compile else "first batch"):
                                state = step_fn(state, batch)
                            publish_compile_cache()  # for the next job of this model on the host
                        else:
                            state = step_fn(state, batch)
                    bar.update(position)
                    batches.prefetch()  # the next batch loads, and copies on a side stream, while this one runs
                    if position == 1 and self.pipeline is not None:  # as training: a short timeout after step 1
                        set_collective_timeout(config.timeout.step_timeout, [self.pipeline.group])
                    collect_garbage(config.gc.period_steps, step=position, total_steps=total)
                    if profiler is not None:
                        profiler.step()
                    self.bus.trigger(ev.EVENT_INFERENCE_STEP_POST, dataclasses.replace(context, state=state))
            publish_compile_cache()  # the last, smaller batch's graph too
        finally:
            bar.close()
            self.data.close()  # stops data_loading's worker processes, if any
        state = self._from_last_stage(state)
        task_result = self.task.finalize(state.task_state)
        self.bus.trigger(ev.EVENT_INFERENCE_FINISHED, ev.EventInferenceFinishedContext())
        return InferenceResult(
            task_result=task_result,
            state=state,
            checkpoint_step=self.checkpoint_step,
            num_batches=total,
            first_step_s=bar.first_step_s,
        )

    def _from_last_stage(self, state: InferenceState) -> InferenceState:
        """The last stage's task and metric state on every rank of the ``pp`` group (only its rank folds outputs
        into them); ``state`` itself on one process."""
        if self.pipeline is None:
            return state
        program = self.pipeline.program
        source = torch.distributed.get_global_rank(self.pipeline.group, program.stage_to_rank[program.num_stages - 1])
        box = [(state.task_state, state.metric_state)]
        torch.distributed.broadcast_object_list(box, src=source, group=self.pipeline.group)
        task_state, metric_state = box[0]
        return state.replace(task_state=task_state, metric_state=metric_state)


def _batch_size(batch: Any) -> int:
    """The leading size of the batch's first tensor."""
    from d9dfn._pytree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return leaf.shape[0]
    return 0
