"""``TrainingConfigurator`` → ``Trainer``: d9d's training job, around d9dfn's compiled pure step.

The configure order follows d9d's (``TrainingConfigurator.configure`` in ``d9d/loop/run/train.py``): mesh,
seeds, task, events, batch maths, data, model, schedule, optimizer, step, then the edge components (checkpoints,
logs). ``Trainer`` (``_trainer.py``) then feeds batches to the step.
"""

from __future__ import annotations

import functools
import itertools
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from d9dfn import parallel
from d9dfn._task import TrainTask
from d9dfn._types import Params
from d9dfn.checkpoint import load_initial_weights
from d9dfn.config import BatchMaths, DataLoadingConfig, DeviceMeshParameters, TrainerConfig, build_optimizer
from d9dfn.data import BatchLoader, StatefulBatchIterator
from d9dfn.loop import _events as ev
from d9dfn.loop._compile_cache import run_compile_cache
from d9dfn.loop._distributed import init_distributed, resolve_device
from d9dfn.loop._init import check_initialized, poison
from d9dfn.loop._memory import check_memory, estimate_memory, estimate_memory_of_count, processes_on_device
from d9dfn.loop._parallelism import Parallelism, context_split
from d9dfn.loop._pipelining import PipelineLayout, build_pipeline_stages, build_program
from d9dfn.loop._providers import (
    AutoLRSchedulerProvider,
    AutoOptimizerProvider,
    DatasetProvider,
    InitializeDatasetContext,
    InitializeLRSchedulerContext,
    InitializeModelStageContext,
    InitializeOptimizerStageContext,
    LRSchedulerProvider,
    ModelProvider,
    OptimizerProvider,
    TrainTaskProvider,
)
from d9dfn.loop._run_dir import RunDirectoryError, RunLock, check_writable
from d9dfn.loop._trainer import Trainer
from d9dfn.loop._validation import Validation
from d9dfn.models import bind_context_parallel, bind_tensor_parallel
from d9dfn.pipeline import Pipeline, PipelineRank
from d9dfn.step import cast_params, frozen_names, make_eval_step, make_train_step
from d9dfn.step._blocks import repeated_classes

__all__ = ["TrainingConfigurator", "load_batches", "materialize_model", "start_configuration"]


def materialize_model(
    provider: ModelProvider,
    context: InitializeModelStageContext,
    device: torch.device,
    *,
    before_allocating: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Build the model on the meta device, then a materialized, initialized copy on ``device``.

    Returns ``(skeleton, model)``: the skeleton (meta) is what the compiled step closes over; the model's
    tensors become the initial state. ``before_allocating(skeleton)`` runs first (the configurators' memory
    check). ``to_empty`` memory is poisoned (NaN), ``provider.initialize_weights`` runs under ``torch.no_grad``
    (by default the model's own scheme, so a seed fixes the weights), and a tensor it left unwritten or
    non-finite is an error naming it (``d9dfn/loop/_init.py``).

    Raises:
        ValueError: a parameter or buffer the init did not write, or wrote NaN/inf into.
    """
    with torch.device("meta"):
        skeleton = provider.initialize_model_stage(context).model
    if before_allocating is not None:
        before_allocating(skeleton)
    with torch.device("meta"):
        model = provider.initialize_model_stage(context).model
    model = model.to_empty(device=device)
    poison(model)
    with torch.no_grad():
        provider.initialize_weights(context, model)
    check_initialized(model, f"{type(provider).__name__}.initialize_weights")
    return skeleton, model


def block_classes(
    model: nn.Module, names: Sequence[str] | None, field: str = "trainer.repeated_blocks"
) -> tuple[type[nn.Module], ...] | Literal["auto"]:
    """``repeated_blocks`` (the config ``field``): the classes of ``model``'s modules with these names, in order;
    ``None`` is ``"auto"`` (the step finds them).

    Raises:
        ValueError: a name no module class of ``model`` has; the message lists the classes that occur more than once.
    """
    if names is None:
        return "auto"
    by_name: dict[str, type[nn.Module]] = {}
    for module in model.modules():
        by_name.setdefault(type(module).__name__, type(module))
    for name in names:
        if name not in by_name:
            raise ValueError(
                f"{field}: {name!r} is not the class name of any module of {type(model).__name__}; "
                f"name the class of its repeated block (classes here that occur more than once: "
                f"{repeated_classes(model)})"
            )
    return tuple(by_name[name] for name in names)


def load_source_checkpoint(
    provider: ModelProvider,
    context: InitializeModelStageContext,
    model: nn.Module,
    directory: Path,
    whole: nn.Module | None = None,
) -> None:
    """``model_stage_factory.source_checkpoint`` into ``model``, through the provider's load mapper and config
    check (``ModelProvider.prepare_load_model_stage``; d9d streams these in through a mapper). ``whole``: the whole
    model (a skeleton) when ``model`` is one of its pipeline stages, which takes its own tensors from the files."""
    load = provider.prepare_load_model_stage(context)
    names = None if whole is None else whole.state_dict().keys()
    load_initial_weights(
        model, directory, load.state_mapper, load.check_config, not_in_source=load.not_in_source, whole=names
    )


def load_batches(
    iterator: StatefulBatchIterator, loading: DataLoadingConfig, device: torch.device
) -> StatefulBatchIterator | BatchLoader:
    """``iterator`` loaded as ``data_loading`` says: by ``DataLoader`` workers and/or pinned, else itself.

    ``pin_memory="auto"`` pins when ``device`` is CUDA. The batches, their order and the resumable position are
    the iterator's either way (``BatchLoader``).
    """
    pin = device.type == "cuda" if loading.pin_memory == "auto" else loading.pin_memory
    if loading.num_workers == 0 and not pin:
        return iterator  # nothing to add: no loader in between
    return BatchLoader(
        iterator,
        num_workers=loading.num_workers,
        pin_memory=pin,
        persistent_workers=loading.persistent_workers,
        prefetch_factor=loading.prefetch_factor,
    )


def start_configuration(
    who: str,
    mesh: DeviceMeshParameters,
    config: Any,
    task_provider: Any,
    model_provider: ModelProvider,
    event: Any,
    *,
    distributed: bool = False,
) -> tuple[Any, ev.EventBus]:
    """d9d's first configure steps: seeds, the task, the event bus (after the mesh, when ``distributed``).

    The model provider registers its handlers before the task, then ``event`` (the job's
    ``*.configuration.start``) fires.
    """
    if mesh.is_distributed and not distributed:
        raise NotImplementedError(
            f"{who}: mesh {mesh!r} asks for more than one process; {who} runs on one process only — use "
            "DeviceMeshParameters() (all degrees 1)"
        )
    torch.manual_seed(config.determinism.seed)
    task = task_provider()
    bus = ev.EventBus()
    model_provider.register_events(bus)
    task.register_events(bus)
    bus.trigger(event, ev.EventConfigurationStartedContext(config=config, mesh=mesh))
    return task, bus


class TrainingConfigurator:
    """Wire a training job from a config, a mesh and the user's providers (d9d's DI, same names)."""

    def __init__(
        self,
        mesh: DeviceMeshParameters,
        parameters: TrainerConfig,
        task_provider: TrainTaskProvider,
        model_provider: ModelProvider,
        data_provider: DatasetProvider,
        optimizer_provider: OptimizerProvider | None = None,
        lr_scheduler_provider: LRSchedulerProvider | None = None,
        *,
        rng_kwarg: str | None = None,
        main_process: bool = True,
    ) -> None:
        self.mesh = mesh
        self.parameters = parameters
        self.task_provider = task_provider
        self.model_provider = model_provider
        self.data_provider = data_provider
        self.optimizer_provider = optimizer_provider or AutoOptimizerProvider(
            parameters.optimizer, seed=parameters.determinism.seed
        )
        self.lr_scheduler_provider = lr_scheduler_provider or AutoLRSchedulerProvider(parameters.lr_scheduler)
        self.rng_kwarg = rng_kwarg
        self.main_process = main_process

    def configure(self) -> Trainer:
        """Build every component, in d9d's order, and return the ready ``Trainer``.

        With a mesh of several processes (under ``torchrun``) the process group and the data-parallel
        ``DeviceMesh`` come first, with ``timeout.init_timeout``; each rank compiles into its own cache.
        """
        config = self.parameters
        device = resolve_device(config.run.device, "run.device")
        precision = config.precision.policy()
        device_mesh: Any = None  # the whole mesh: (dp_replicate, dp_shard), or (pp, dp_replicate, dp_shard)
        dp_mesh: Any = None  # the data-parallel ranks of this rank's pipeline slice; None when there is one
        dp_rank, dp_size, rank = 0, 1, 0
        pipelined = config.pipelining is not None
        if self.mesh.pipeline_parallel > 1 and not pipelined:
            raise ValueError(
                f"TrainingConfigurator: mesh.pipeline_parallel={self.mesh.pipeline_parallel} needs a pipeline "
                "schedule, but trainer.pipelining is null; set it, e.g. --set "
                '\'trainer.pipelining={"schedule": {"schedule": "1f1b"}}\', or set mesh.pipeline_parallel=1'
            )
        # From the config's arithmetic, before the process group, the run directory's lock and any module.
        self._check_memory(None, device=device, param_dtype=precision.param_dtype)
        if self.mesh.is_distributed:
            device_mesh = init_distributed(self.mesh, timeout_s=config.timeout.init_timeout, device_type=device.type)
            rank = device_mesh.get_rank()
            # The data-parallel ranks: this pipeline slice's (the whole mesh without a pipeline), by their roles.
            dp_mesh = parallel.data_parallel_submesh(device_mesh) if self.mesh.pipeline_parallel > 1 else device_mesh
            dp_rank, dp_size = parallel.data_parallel_position(dp_mesh)
            dp_mesh = dp_mesh if dp_mesh.size() > 1 else None
        main_process = self.main_process and rank == 0
        run_lock = _lock_run_dir(Path(config.run_dir), main=main_process, distributed=device_mesh is not None)
        if config.compile:  # the run's own cache, one directory per rank (pytorch/pytorch#188390)
            run_compile_cache(config.run_dir, rank, distributed=device_mesh is not None)
        task, bus = start_configuration(
            "TrainingConfigurator",
            self.mesh,
            config,
            self.task_provider,
            self.model_provider,
            ev.EVENT_TRAIN_CONFIGURATION_START,
            distributed=True,
        )

        maths = config.batch_maths(self.mesh.data_parallel_size)
        dataset = self.data_provider(
            InitializeDatasetContext(
                split="train",
                per_rank_batch_size=maths.per_rank_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=config.determinism.seed,
            )
        )
        batches_per_epoch = len(dataset.dataset) // config.batching.global_batch_size
        if batches_per_epoch < 1:
            raise ValueError(
                f"TrainingConfigurator: the dataset has {len(dataset.dataset)} items, fewer than one global batch "
                f"of {config.batching.global_batch_size}; lower batching.global_batch_size or add data"
            )
        iterator = StatefulBatchIterator(
            dataset.dataset,
            batch_size=config.batching.global_batch_size,
            collate_fn=context_split(dataset.collator, dp_mesh),  # with a cp axis, this rank's part of each row
            seed=config.determinism.seed,
            shuffle=dataset.shuffle,
            drop_last=True,
            infinite=True,
            part=(dp_rank, dp_size),  # this rank's rows of every global batch (the provider does not shard)
        )
        data = load_batches(iterator, config.data_loading, device)
        total_steps = config.total_steps if config.total_steps is not None else batches_per_epoch
        bus.trigger(ev.EVENT_TRAIN_CONFIGURATION_DATA_LOADER, ev.EventDataLoaderReadyContext(data_loader=data))

        stage = InitializeModelStageContext(mesh=self.mesh, device_mesh=dp_mesh)
        layout, pp_group, placements = None, None, None
        fits = functools.partial(self._check_memory, device=device, param_dtype=precision.param_dtype, stage=stage)
        if config.pipelining is not None:  # the skeleton is the whole model on meta: export's names, nothing else
            with torch.device("meta"):
                skeleton = model = self.model_provider.initialize_model_stage(stage).model
            fits(skeleton)
            pp_rank = parallel.pipeline_rank(device_mesh) if self.mesh.pipeline_parallel > 1 else 0
            program = build_program(config.pipelining, self.mesh.pipeline_parallel, maths.num_microbatches)
            layout = build_pipeline_stages(
                self.model_provider,
                program,
                pp_rank,
                mesh=self.mesh,
                device_mesh=dp_mesh,
                device=device,
                seed=config.determinism.seed,
            )
            if self.mesh.pipeline_parallel > 1:
                pp_group = parallel.pipeline_group(device_mesh)
            modules: tuple[nn.Module, ...] = layout.modules
            source = config.model_stage_factory.source_checkpoint
            if source is not None and self.model_provider.parameters_to_train(stage) is not None:
                raise NotImplementedError(
                    "TrainingConfigurator: model_stage_factory.source_checkpoint with trainer.pipelining and frozen "
                    "params: a run with frozen params saves checkpoints without them, for the source checkpoint to "
                    "give back, which pipeline stages do not read at a resume yet; train it without pipelining"
                )
            for module in modules:
                if source is not None:  # each stage its own tensors of the whole model's files
                    load_source_checkpoint(self.model_provider, stage, module, source, whole=skeleton)
                cast_params(module, precision.param_dtype)
        else:
            skeleton, model = materialize_model(self.model_provider, stage, device, before_allocating=fits)
            if config.model_stage_factory.source_checkpoint is not None:
                load_source_checkpoint(self.model_provider, stage, model, config.model_stage_factory.source_checkpoint)
            cast_params(model, precision.param_dtype)  # the master weights' dtype (float32 unless pure bf16)
            placements = self.model_provider.parallelize_model_stage(stage, model) if dp_mesh is not None else None
            modules = (model,)
        bus.trigger(ev.EVENT_TRAIN_CONFIGURATION_MODEL_STAGES, ev.EventModelStagesReadyContext(modules=modules))

        multiplier = self.lr_scheduler_provider(InitializeLRSchedulerContext(total_steps=total_steps))
        trainable = self.model_provider.parameters_to_train(stage)
        frozen = {name for m in modules for name in frozen_names(m, trainable)}
        params: Params = {name: p for m in modules for name, p in m.named_parameters() if name not in frozen}
        optimizer = self.optimizer_provider(InitializeOptimizerStageContext(params=params, lr_multiplier=multiplier))
        bus.trigger(ev.EVENT_TRAIN_CONFIGURATION_OPTIMIZER, ev.EventOptimizerReadyContext(optimizer=optimizer))
        bus.trigger(ev.EVENT_TRAIN_CONFIGURATION_LR_SCHEDULER, ev.EventLRSchedulerReadyContext(lr_schedule=multiplier))

        plan = _plan(
            modules,
            dp_mesh,
            [placements] if layout is None else list(layout.placements),
            *_dims(self.model_provider, stage, skeleton, self.mesh, dp_mesh),
            rules=_rules(self.mesh),
        )
        _bind_experts(plan, _step_modules(skeleton, layout), self.mesh.expert_parallel)
        _bind_tensor_parallel(plan, _step_modules(skeleton, layout), self.mesh)
        _bind_context_parallel(plan, skeleton, self.mesh, pipelined)
        executor = _executor(layout, pp_group)
        step = make_train_step(
            skeleton,
            task,
            optimizer,
            num_microbatches=maths.num_microbatches,
            executor=executor,
            repeated_blocks=block_classes(skeleton, config.repeated_blocks),
            activation_checkpointing=config.activation_checkpointing.policy_value(),
            prefetch_gathers=config.prefetch_gathers,
            precision=precision,
            plan=plan,
            device=device,
            max_grad_norm=config.gradient_clipping.max_norm,
            skip_nonfinite=config.skip_nonfinite,
            rng_kwarg=self.rng_kwarg,
            compile=config.compile,
            donate=True,  # the loop never reads a state it handed to the step: one train state in memory, not two
        )
        validation = None
        if config.evaluation.period_steps != "disable":
            validation = self._validation(task, skeleton, executor, maths, dp_rank, dp_size, plan)
        parallelism = Parallelism(
            device_mesh=device_mesh,
            data_parallel_mesh=dp_mesh,
            plan=plan,
            pipeline=layout,
            pipeline_group=pp_group,
            data_parallel_group=parallel.token_group(plan) if plan is not None else None,
        )
        return Trainer(
            config=config,
            task=task,
            model=model,
            skeleton=skeleton,
            optimizer=optimizer,
            step_fn=step,
            data=data,
            total_steps=total_steps,
            bus=bus,
            hparams={
                **config.run.hparams,
                "task": task.dump_hparams(),
                "model": self.model_provider.dump_hparams(),
                "config": config.model_dump(mode="json"),
            },
            device=device,
            parallelism=parallelism,
            main_process=main_process,
            run_lock=run_lock,
            export_mapper=self.model_provider.prepare_export_model_stage(stage).state_mapper,
            validation=validation,
            lr_schedule_for=lambda steps: self.lr_scheduler_provider(InitializeLRSchedulerContext(total_steps=steps)),
            trainable=trainable,
        )

    def _validation(
        self,
        task: TrainTask,
        skeleton: nn.Module,
        executor: Pipeline | PipelineRank | None,
        maths: BatchMaths,
        dp_rank: int,
        dp_size: int,
        plan: parallel.ParallelPlan | None,
    ) -> Validation:
        """``evaluation``'s step (``make_eval_step``, as the train step: microbatches, executor, precision, compile,
        repeated blocks) and this rank's rows of the validation split's whole global batches, in order."""
        config = self.parameters
        dataset = self.data_provider(
            InitializeDatasetContext(
                split="validation",
                per_rank_batch_size=maths.per_rank_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=config.determinism.seed,
            )
        )
        available = len(dataset.dataset) // config.batching.global_batch_size
        if available < 1:
            raise ValueError(
                f"TrainingConfigurator: evaluation.period_steps={config.evaluation.period_steps!r} validates on the "
                f"validation split, which has {len(dataset.dataset)} items, fewer than one global batch of "
                f'{config.batching.global_batch_size}; set evaluation.period_steps="disable" or add validation data'
            )
        num_batches = min(available, config.evaluation.num_batches or available)

        def batches() -> Any:
            iterator = StatefulBatchIterator(
                dataset.dataset,
                batch_size=config.batching.global_batch_size,
                collate_fn=context_split(dataset.collator, None if plan is None else plan.mesh),
                shuffle=False,
                drop_last=True,
                part=(dp_rank, dp_size),
            )
            return itertools.islice(iterator, num_batches)

        step_fn = make_eval_step(
            skeleton,
            task,
            num_microbatches=maths.num_microbatches,
            executor=executor,
            precision=config.precision.policy(),
            plan=plan,
            compile=config.compile,
            repeated_blocks=block_classes(skeleton, config.repeated_blocks),
        )
        return Validation(
            step_fn=step_fn, batches=batches, num_batches=num_batches, period=config.evaluation.period_steps
        )

    def _check_memory(
        self,
        skeleton: nn.Module | None,
        *,
        device: torch.device,
        param_dtype: torch.dtype,
        stage: InitializeModelStageContext | None = None,
    ) -> None:
        """Refuse, before allocating, a model whose weights, gradients and optimizer state exceed the device's memory.

        With ``skeleton=None``, from the model provider's ``num_params`` (its config's arithmetic: no module is
        built), and nothing when it does not know; otherwise from the skeleton's parameters, gradients and optimizer
        state over the trainable ones only: those the train state trains (``frozen_names`` of the provider's
        ``parameters_to_train(stage)``, as the state's ``frozen`` is made below). The optimizer state is
        counted for the optimizer the loop builds from ``trainer.optimizer`` (a custom ``optimizer_provider``'s is
        not known before the params exist, so it is left out: a lower bound still).
        """
        optimizer = None
        if isinstance(self.optimizer_provider, AutoOptimizerProvider):
            optimizer = build_optimizer(self.optimizer_provider.config, key=self.optimizer_provider.seed)
        if skeleton is None:
            num_params = self.model_provider.num_params()
            if num_params is None:
                return
            estimate = estimate_memory_of_count(num_params, optimizer, param_dtype=param_dtype)
        else:
            assert stage is not None
            frozen = frozen_names(skeleton, self.model_provider.parameters_to_train(stage))
            estimate = estimate_memory(
                dict(skeleton.named_parameters()), optimizer, param_dtype=param_dtype, frozen=frozen
            )
        check_memory(
            estimate,
            device,
            who="TrainingConfigurator",
            fix=lambda: self.model_provider.memory_hint(skeleton),
            shards=self.mesh.pipeline_parallel * self.mesh.data_parallel_shard,
            processes=processes_on_device(device),
        )


def _plan(
    modules: Sequence[nn.Module],
    dp_mesh: Any,
    placements: Sequence[parallel.PlacementFn | None],
    dims: Mapping[str, Sequence[str]] | None = None,
    sums_over: Mapping[str, Sequence[str]] | None = None,
    rules: parallel.Rules = parallel.TENSOR_PARALLEL_RULES,
) -> parallel.ParallelPlan | None:
    """This rank's params' plan on the data-parallel mesh: each module's params, frozen ones too, placed as its
    provider's ``parallelize_model_stage`` chose (``None``: the default), computed as ``rules`` (:func:`_rules`: tensor
    and expert parallelism's) split their logical ``dims`` (the provider's ``logical_dims`` and ``summed_dims``), and
    its buffers (replicated); ``None`` without a mesh."""
    if dp_mesh is None:
        return None
    params: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    chosen: dict[str, parallel.PlacementFn | None] = {}
    for module, placement_fn in zip(modules, placements, strict=True):
        for name, p in module.named_parameters():
            params[name], chosen[name] = p, placement_fn
        buffers.update(module.named_buffers())

    def placements_of(name: str, tensor: Any, mesh: Any) -> Any:
        fn = chosen[name]
        return None if fn is None else fn(name, tensor, mesh)

    return parallel.plan_for(
        params,
        dp_mesh,
        placements=placements_of,
        buffers=buffers,
        dims=dims,
        rules=rules,
        sums_over=sums_over,
    )


def _step_modules(skeleton: nn.Module, layout: PipelineLayout | None) -> tuple[nn.Module, ...]:
    """The modules the step calls: the skeleton, and with ``trainer.pipelining`` every stage's meta skeleton (each
    stage runs its own module, not the whole model's: ``d9dfn.pipeline.Stage``)."""
    return (skeleton,) if layout is None else (skeleton, *(stage.module for stage in layout.stages))


def _bind_experts(plan: parallel.ParallelPlan | None, modules: Sequence[nn.Module], degree: int) -> None:
    """Hand the expert group to the MoE layers of every module the step runs (:func:`_step_modules`: with pipeline
    stages, each stage's; every module with an ``expert_parallel`` attribute), when the plan splits experts over an
    expert axis. With a pipeline the plan is on this stage's data-parallel mesh (every axis but ``pp``), so each
    stage's MoE layers dispatch over the expert group of that stage's data-parallel ranks.

    Raises:
        ValueError: ``mesh.expert_parallel > 1`` but the plan splits no param over the expert axis (the model provider
            names no ``experts`` dimension in ``logical_dims``), or the model has no layer to dispatch.
    """
    if degree == 1:
        return
    group = parallel.expert_parallel_of(plan)
    bound = 0 if group is None else sum(parallel.bind_expert_parallel(module, group) for module in modules)
    if not bound:
        raise ValueError(
            f"TrainingConfigurator: mesh.expert_parallel={degree} but "
            + ("no param is split over the expert axis" if group is None else "the model has no MoE layer")
            + " (the model provider's logical_dims names the stacked experts' dimension 'experts', and its MoE layers "
            "have an expert_parallel attribute: d9dfn.models.qwen3_moe); set --set mesh.expert_parallel=1"
        )


def _rules(mesh: DeviceMeshParameters) -> parallel.Rules:
    """The layout's rules table: tensor parallelism's, with sequence parallelism's row when ``mesh.sequence_parallel``
    and vocabulary parallelism's when ``mesh.vocab_parallel`` (the default) on a tensor axis of more than one rank,
    then expert parallelism's (on a mesh without a tensor or an expert axis they split nothing: data parallelism)."""
    tensor = parallel.SEQUENCE_PARALLEL_RULES if mesh.sequence_parallel else parallel.TENSOR_PARALLEL_RULES
    vocab = parallel.VOCAB_PARALLEL_RULES if mesh.vocab_parallel and mesh.tensor_parallel > 1 else ()
    return (*tensor, *vocab, *parallel.EXPERT_PARALLEL_RULES)


def _dims(
    provider: ModelProvider,
    stage: InitializeModelStageContext,
    skeleton: nn.Module,
    mesh: DeviceMeshParameters,
    dp_mesh: Any,
) -> tuple[Mapping[str, Sequence[str]] | None, Mapping[str, Sequence[str]] | None]:
    """The provider's logical dimensions of the skeleton's params on a mesh (the rules split them over a tensor or an
    expert axis, else nothing), and its summed dimensions when a tensor axis reads them (``mesh.tensor_parallel >
    1``); ``None`` for each otherwise."""
    if dp_mesh is None:
        return None, None
    summed = provider.summed_dims(stage, skeleton) if mesh.tensor_parallel > 1 else None
    return provider.logical_dims(stage, skeleton), summed


def _bind_tensor_parallel(
    plan: parallel.ParallelPlan | None, modules: Sequence[nn.Module], mesh: DeviceMeshParameters
) -> None:
    """Bind the decoder blocks of every module the step runs (:func:`_step_modules`: with pipeline stages, each
    stage's, as :func:`_bind_experts` does) to the tensor group (``d9dfn.models.bind_tensor_parallel``) when
    ``mesh.tensor_parallel > 1``. With a pipeline the plan is on this stage's data-parallel sub-mesh (every axis but
    ``pp``), so each stage's blocks split over the tensor group of that stage's ranks, and the stage boundaries carry
    the hidden states whole over it (with sequence parallelism too: a stage joins the sequence before it sends).

    Raises:
        ValueError: when the plan splits no param over the tensor axis (the model provider names no logical
            dimensions), or when the model has no block to bind.
    """
    degree = mesh.tensor_parallel
    if degree == 1:
        return
    tp = parallel.tensor_parallel_of(plan, _rules(mesh))
    bound = 0 if tp is None else sum(bind_tensor_parallel(module, tp) for module in modules)
    if not bound:
        raise ValueError(
            f"TrainingConfigurator: mesh.tensor_parallel={degree} but "
            + ("no param is split over the tensor axis" if tp is None else "the model has no decoder block to split")
            + " (the model provider's logical_dims names heads, kv_heads and mlp, and the model is the shared "
            "decoder's: d9dfn.models.Qwen3LM); set --set mesh.tensor_parallel=1"
        )


def _executor(layout: PipelineLayout | None, group: Any) -> Pipeline | PipelineRank | None:
    """``make_train_step``'s executor: this rank's row over the pp group, the whole program on one process, or
    ``None`` (the sequential default) without pipelining."""
    if layout is None:
        return None
    if group is None:
        return Pipeline(layout.program, layout.stages)
    return PipelineRank(layout.program, layout.stages, layout.rank, group)


_RUN_DIR_SETTING = "checkpointing.save_dir and run.name (trainer.checkpointing.save_dir, trainer.run.name in a job)"


def _lock_run_dir(run_dir: Path, *, main: bool, distributed: bool) -> RunLock | None:
    """The main process locks the run directory and checks it and ``checkpoints/`` are writable; under ``torchrun``
    every other rank then checks what it will write there itself.

    Done first in ``configure``, before anything is written there or compiled. Under ``torchrun`` only rank 0
    writes run files (metrics, ``hparams.json``, ``job.json``, the plot) and locks; every rank stages its part of
    each checkpoint in ``checkpoints/`` (``CheckpointStore``), so each checks, after rank 0's verdict, that it sees
    rank 0's lock (one folder that every host shares) and can write in ``checkpoints/`` (:func:`_rank_problem`). The
    verdicts are gathered, so every rank fails alike, before step 1, naming the first rank that cannot, its host and
    the folder (instead of at the first checkpoint, with the steps before it lost).
    """
    lock, problem = None, None
    if main:
        lock = RunLock(run_dir, setting=_RUN_DIR_SETTING)
        try:
            lock.acquire()
            check_writable(run_dir / "checkpoints", f"{_RUN_DIR_SETTING} (the run's checkpoints/ folder)")
        except RunDirectoryError as error:
            lock.release()
            problem = str(error)
    if distributed:
        verdict = [problem]
        torch.distributed.broadcast_object_list(verdict, src=0)  # rank 0 has locked (and made the folders) first
        problem = verdict[0]
        rank = torch.distributed.get_rank()
        mine = _rank_problem(run_dir) if problem is None and rank != 0 else None
        verdicts: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(verdicts, (rank, socket.gethostname(), mine))
        failed = next(((r, host, p) for r, host, p in verdicts if p is not None), None)
        if failed is not None:
            problem = f"rank {failed[0]} (host {failed[1]}): {failed[2]}"
    if problem is not None:
        if lock is not None:
            lock.release()
        raise RunDirectoryError(f"TrainingConfigurator: {problem}")
    return lock


def _rank_problem(run_dir: Path) -> str | None:
    """Why this rank (not rank 0) cannot write its part of the run in ``run_dir`` (``None``: it can): it does not see
    the lock rank 0 took (the run directory is not one shared folder), or cannot write in ``checkpoints/``."""
    if not (run_dir / ".lock").is_file():
        return (
            f"it does not see {run_dir / '.lock'}, which rank 0 has just written: every rank must see one run "
            f"directory; put {_RUN_DIR_SETTING} on a filesystem that every host shares"
        )
    try:
        check_writable(run_dir / "checkpoints", f"{_RUN_DIR_SETTING} (the run's checkpoints/ folder)")
    except RunDirectoryError as error:
        return str(error)
    return None


def _bind_context_parallel(
    plan: parallel.ParallelPlan | None, skeleton: nn.Module, mesh: DeviceMeshParameters, pipelined: bool
) -> None:
    """Bind the shared decoder of the model the step runs to the context group (``d9dfn.models.
    bind_context_parallel``) when ``mesh.context_parallel_shard > 1``; the batches are split by ``context_split``.

    Raises:
        ValueError: with ``trainer.pipelining`` (the step would run the stages, which are not bound), or what
            ``bind_context_parallel`` refuses (dropout, a model of its own forward, a pipeline stage).
    """
    degree = mesh.context_parallel_shard
    if degree == 1:
        return
    if pipelined:
        raise ValueError(
            f"TrainingConfigurator: mesh.context_parallel_shard={degree} with trainer.pipelining is not built yet; "
            "set --set trainer.pipelining=null or mesh.context_parallel_shard=1"
        )
    bind_context_parallel(skeleton, parallel.context_parallel_of(plan))
