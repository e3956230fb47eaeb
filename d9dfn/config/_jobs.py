"""The job configs: ``TrainerConfig`` and ``InferenceConfig``, and ``JobConfig``, the sections both share.

A section both jobs have (batching, data loading, initial weights, determinism, precision, GC, profiling, timeouts,
compilation, repeated blocks) is declared once, on :class:`JobConfig`, which both job configs extend: the JSON a
user writes is unchanged (the fields stay top-level), and :meth:`InferenceConfig.from_trainer` carries a training
run's sections over to the inference of its checkpoints without naming them one by one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import PositiveInt, field_validator, model_validator

from d9dfn.config._mesh import BatchMaths, batch_maths
from d9dfn.config._optim import AutoLRSchedulerConfig, AutoOptimizerConfig, build_lr_schedule
from d9dfn.config._pipelining import PipeliningConfig
from d9dfn.config._sections import (
    ActivationCheckpointingConfig,
    BatchingConfig,
    CheckpointingConfig,
    DataLoadingConfig,
    DeterminismConfig,
    EvaluationConfig,
    GarbageCollectionConfig,
    GradientClippingConfig,
    InferenceCheckpointingConfig,
    LoggingConfig,
    ModelStageFactoryConfig,
    PrecisionConfig,
    ProfilingConfig,
    RunConfig,
    TimeoutConfig,
    _Config,
    _device_name,
)

__all__ = ["InferenceConfig", "JobConfig", "TrainerConfig"]


class JobConfig(_Config):
    """The sections a training job and an inference job share: the same names, meanings and defaults in both.

    >>> InferenceConfig.from_trainer(TrainerConfig(optimizer={"name": "sgd", "lr": 0.1}, compile=False)).compile
    False
    """

    batching: BatchingConfig = BatchingConfig()
    """Global batch and microbatch sizes."""
    data_loading: DataLoadingConfig = DataLoadingConfig()
    """Data loader options."""
    model_stage_factory: ModelStageFactoryConfig = ModelStageFactoryConfig()
    """Weights from outside a checkpoint: a training run's initial weights; the weights an inference job runs when
    its ``checkpointing`` is ``None`` (e.g. a ``d9dfn export`` or Hugging Face directory)."""
    determinism: DeterminismConfig = DeterminismConfig()
    """Seed and determinism switches."""
    precision: PrecisionConfig = PrecisionConfig()
    """Params, compute and reduction dtypes (``d9dfn.Precision``); float32 throughout by default. Inference loads
    the weights in ``param_dtype`` and runs the model in ``compute_dtype``."""
    gc: GarbageCollectionConfig = GarbageCollectionConfig()
    """Manual garbage collection period (in optimizer steps; in batches for inference)."""
    profiling: ProfilingConfig | None = None
    """``torch.profiler`` traces (periods in optimizer steps; in batches for inference); ``None`` for none."""
    timeout: TimeoutConfig = TimeoutConfig()
    """Collective-communication timeouts: ``init_timeout`` while the process group starts and for the first step
    (or batch), ``step_timeout`` for every later one (unused on one process)."""
    compile: bool = True
    """Run the step under ``torch.compile``."""
    repeated_blocks: tuple[str, ...] | None = None
    """Class names of the model's repeated blocks (e.g. ``["Qwen3DecoderLayer"]``), each compiled once for all its
    layers (in one process and inside pipeline stages), so depth adds little to cold compile time; in training the
    optimizer then updates each block through one region too. ``null`` (the default): found in the model
    (``d9dfn.step.find_repeated_blocks``: a class repeated in a layer list, holding no buffers); ``[]``: off, the
    whole model traced per microbatch. A zero-bubble schedule (``1f1b`` with ``zero_bubble``, ``zero_bubble_v``,
    ``dual_pipe_v``) traces its stages whole, so there ``null`` means off and a named class is an error."""

    def batch_maths(self, data_parallel_size: int = 1, *, section: str = "batching") -> BatchMaths:
        """The batch arithmetic of ``batching`` over ``data_parallel_size`` ranks that see different rows
        (:func:`d9dfn.config.batch_maths`; ``DeviceMeshParameters.data_parallel_size`` in training, 1 in inference,
        where every data-parallel replica evaluates whole batches). ``section`` names ``batching`` in a message (a
        job sets it as ``trainer.batching``).

        >>> JobConfig(batching={"global_batch_size": 8, "microbatch_size": 2}).batch_maths(2).num_microbatches
        2
        """
        return batch_maths(
            global_batch_size=self.batching.global_batch_size,
            microbatch_size=self.batching.microbatch_size,
            data_parallel_size=data_parallel_size,
            section=section,
        )


class TrainerConfig(JobConfig):
    """Everything a training job needs besides the model, data and task providers.

    Only ``optimizer`` is required:

    >>> TrainerConfig(optimizer={"name": "adamw", "lr": 1e-3}).batching.microbatch_size
    8
    """

    run: RunConfig = RunConfig()
    """The run's name and recorded hyperparameters."""
    logging: LoggingConfig = LoggingConfig()
    """Metric logging period and tracker."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """Validation during training (off by default)."""
    pipelining: PipeliningConfig | None = None
    """Pipeline parallelism; ``None`` for none."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoint directory, period and retention."""
    gradient_clipping: GradientClippingConfig = GradientClippingConfig()
    """Global gradient-norm clipping."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    """Recompute the repeated blocks' forward in the backward instead of keeping their activations (off by
    default; it needs the repeated blocks, ``repeated_blocks``)."""
    prefetch_gathers: bool = False
    """With sharded params (``mesh.data_parallel_shard > 1``) gathered per block: issue each block's all-gather one
    block ahead, forward and backward, so it travels while the block before computes (``make_train_step``'s
    ``prefetch_gathers``). The gathered blocks are then compiled inline, not once per class: the first step compiles
    longer, growing with depth. Needs ``compile`` and the repeated blocks."""
    optimizer: AutoOptimizerConfig
    """The optimizer (``{"name": "adamw", "lr": ...}`` and so on)."""
    lr_scheduler: AutoLRSchedulerConfig | None = None
    """A schedule of the optimizer's ``lr``; ``None`` keeps it constant."""
    total_steps: PositiveInt | None = None
    """Optimizer steps to train; ``None`` trains for one epoch (the number of full global batches in the data)."""
    skip_nonfinite: bool = False
    """Skip the update of a step whose loss or gradient norm is NaN/inf (else the run stops with an error)."""
    max_consecutive_skipped_steps: PositiveInt | None = 10
    """With ``skip_nonfinite``: stop the run with an error once more than this many steps in a row were skipped
    (checked when the logging period's records are written); ``None`` never stops."""

    @model_validator(mode="after")
    def _schedule_fits_total_steps(self) -> TrainerConfig:
        # Checked here, not when the schedule is built, so a job fails before the model is built and the
        # message names both settings (with total_steps=None the length is known only once the data is).
        if self.lr_scheduler is None or self.total_steps is None:
            return self
        try:
            build_lr_schedule(self.lr_scheduler, self.total_steps)
        except ValueError as error:
            raise ValueError(
                f"lr_scheduler.scheduler.phases do not fit in total_steps={self.total_steps}: "
                f"{str(error).removeprefix('piecewise: ')}"
            ) from None
        return self

    @property
    def run_dir(self) -> Path:
        """The run's directory: ``checkpointing.save_dir / run.name``."""
        return self.checkpointing.save_dir / self.run.name


_NOT_FROM_TRAINER = frozenset({"model_stage_factory", "profiling"})
"""Shared sections :meth:`InferenceConfig.from_trainer` leaves at their defaults: a training run's initial weights
(its checkpoints supersede them) and its profiling cycle (counted in training steps)."""


class InferenceConfig(JobConfig):
    """Everything an inference job needs besides the model, data and task providers."""

    device: str = "auto"
    """Where the model and the step live: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"``."""
    checkpointing: InferenceCheckpointingConfig | None = InferenceCheckpointingConfig()
    """The training checkpoint to load; ``None`` runs ``model_stage_factory.source_checkpoint``'s weights (or a
    fresh initialization when that is ``None`` too)."""

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, device: str) -> str:
        return _device_name("device", device)

    @model_validator(mode="after")
    def _one_source_of_weights(self) -> InferenceConfig:
        if self.checkpointing is not None and self.model_stage_factory.source_checkpoint is not None:
            raise ValueError(
                f"model_stage_factory.source_checkpoint={str(self.model_stage_factory.source_checkpoint)!r} and "
                f"checkpointing.load_dir={str(self.checkpointing.load_dir)!r} both name the weights to run; set "
                "checkpointing=null to run the source_checkpoint's weights, or drop source_checkpoint to run the "
                "training checkpoint's"
            )
        return self

    @classmethod
    def from_trainer(cls, trainer: TrainerConfig, **fields: Any) -> InferenceConfig:
        """The inference of ``trainer``'s run as it trained: every :class:`JobConfig` section as in ``trainer`` (but
        ``model_stage_factory`` and ``profiling``: a run's initial weights and its training-step trace cycle),
        ``device`` from ``run.device``, and ``fields`` set by name (e.g. ``checkpointing=``).

        >>> trainer = TrainerConfig(optimizer={"name": "sgd", "lr": 0.1}, batching={"global_batch_size": 4,
        ...     "microbatch_size": 2}, run={"device": "cpu"})
        >>> inference = InferenceConfig.from_trainer(trainer, checkpointing={"load_dir": trainer.run_dir})
        >>> inference.batching == trainer.batching, inference.device, str(inference.checkpointing.load_dir)
        (True, 'cpu', 'runs/d9dfn')
        """
        shared = {name: getattr(trainer, name) for name in JobConfig.model_fields if name not in _NOT_FROM_TRAINER}
        return cls.model_validate({**shared, "device": trainer.run.device, **fields})
