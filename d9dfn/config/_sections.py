"""The job configs: ``TrainerConfig`` and ``InferenceConfig`` and their sections (d9d's names and meanings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    JsonValue,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from d9dfn.config._base import FrozenConfig, _escape
from d9dfn.config._mesh import BatchMaths, DeviceMeshParameters, batch_maths
from d9dfn.config._optim import AutoLRSchedulerConfig, AutoOptimizerConfig, build_lr_schedule
from d9dfn.config._periods import StepActionPeriod
from d9dfn.step._precision import DTYPES, Precision

__all__ = [
    "AnyPipelineScheduleConfig",
    "AnyTrackerConfig",
    "BatchingConfig",
    "CheckpointingConfig",
    "DataLoadingConfig",
    "DeterminismConfig",
    "DualPipeVScheduleConfig",
    "GPipeScheduleConfig",
    "GarbageCollectionConfig",
    "GradientClippingConfig",
    "InferenceCheckpointingConfig",
    "InferenceConfig",
    "Interleaved1F1BScheduleConfig",
    "JsonlTrackerConfig",
    "LoggingConfig",
    "LoopedBFSScheduleConfig",
    "ModelStageFactoryConfig",
    "NullTrackerConfig",
    "PipeliningConfig",
    "PrecisionConfig",
    "ProfilingConfig",
    "RunConfig",
    "TimeoutConfig",
    "TrainerConfig",
    "ZeroBubbleVScheduleConfig",
]


def _one_path_component(field: str, name: str, what: str, example: str) -> str:
    """``name`` if it is one non-empty path component, else a ``ValueError`` naming ``field`` and the fix."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(
            f"{field} {name!r} must be a non-empty name without '/' or '\\' ({what}); use e.g. {example!r}"
        )
    return name


class _Config(FrozenConfig):
    """Shared settings (see ``FrozenConfig``)."""


# --- Run, batching, data ------------------------------------------------------------------------------------


def _device_name(field: str, value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    message = (
        f"{field}={value!r} is not a device d9dfn runs on; use 'auto' (CUDA when available, else CPU), 'cpu', "
        "'cuda' (under torchrun: the LOCAL_RANK GPU) or 'cuda:N'"
    )
    raise PydanticCustomError("device", _escape(message))


class RunConfig(_Config):
    """What the run is called, where it computes, and what the tracker records about it."""

    name: str = "d9dfn"
    """The run's name; also its directory under ``checkpointing.save_dir`` (one path component)."""
    device: str = "auto"
    """Where the model and the step live: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``
    (under ``torchrun``, the ``LOCAL_RANK`` GPU) or ``"cuda:N"``."""
    description: str | None = None
    """A free-text note stored with the run's hyperparameters."""
    hparams: dict[str, JsonValue] = Field(default_factory=dict)
    """Extra hyperparameters to record with the run (JSON values)."""

    @field_validator("name")
    @classmethod
    def _name_is_one_path_component(cls, name: str) -> str:
        return _one_path_component("run.name", name, "it names the run's directory", "my-run")

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, device: str) -> str:
        return _device_name("run.device", device)


class BatchingConfig(_Config):
    """How many samples one optimizer step sees, and how they are cut into microbatches."""

    global_batch_size: PositiveInt = 8
    """Samples per optimizer step, summed over all data-parallel ranks."""
    microbatch_size: PositiveInt = 8
    """Samples per forward/backward pass on one rank; gradients accumulate over the microbatches."""

    @model_validator(mode="after")
    def _global_is_multiple_of_micro(self) -> BatchingConfig:
        if self.global_batch_size % self.microbatch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of microbatch_size="
                f"{self.microbatch_size}; make global_batch_size a multiple of microbatch_size (e.g. "
                f"{self.global_batch_size // self.microbatch_size * self.microbatch_size or self.microbatch_size}) "
                f"or pick a microbatch_size that divides {self.global_batch_size}"
            )
        return self


class DataLoadingConfig(_Config):
    """How batches are loaded (torch ``DataLoader`` options; the batches and their order do not change)."""

    num_workers: NonNegativeInt = 0
    """Worker processes that load batches; 0 loads them in the main process."""
    pin_memory: bool | Literal["auto"] = "auto"
    """Put batches in page-locked memory, so their host-to-GPU copies are asynchronous: ``auto`` pins when the
    run's device is CUDA (and not on the CPU, where pinning buys nothing)."""
    persistent_workers: bool = False
    """Keep the worker processes alive between epochs (needs ``num_workers`` > 0)."""
    prefetch_factor: PositiveInt = 2
    """Batches each worker loads ahead of the loop (with ``num_workers`` > 0)."""

    @model_validator(mode="after")
    def _persistent_needs_workers(self) -> DataLoadingConfig:
        if self.persistent_workers and self.num_workers == 0:
            raise ValueError(
                "persistent_workers=true needs num_workers > 0 (there are no workers to keep); set num_workers "
                "or set persistent_workers=false"
            )
        return self


# --- Logging ------------------------------------------------------------------------------------------------


class JsonlTrackerConfig(_Config):
    """Write metrics as JSON lines in the run directory."""

    provider: Literal["jsonl"] = "jsonl"
    """The tracker kind."""
    filename: str = "metrics.jsonl"
    """The file, in the run directory, that receives one JSON object per logged step."""

    @field_validator("filename")
    @classmethod
    def _filename_is_one_path_component(cls, name: str) -> str:
        return _one_path_component("logging.tracker.filename", name, "a file in the run directory", "metrics.jsonl")


class NullTrackerConfig(_Config):
    """Record nothing (metrics still go to the console)."""

    provider: Literal["null"] = "null"
    """The tracker kind."""


AnyTrackerConfig = Annotated[JsonlTrackerConfig | NullTrackerConfig, Field(discriminator="provider")]
"""A tracker, chosen by ``provider``: ``"jsonl"`` or ``"null"``."""


class LoggingConfig(_Config):
    """When metrics are logged and where they go."""

    period_steps: StepActionPeriod = 10
    """Log every this many optimizer steps (and on the last step), or ``"last_step"`` / ``"disable"``."""
    tracker: AnyTrackerConfig = JsonlTrackerConfig()
    """Where metrics are recorded."""


# --- Pipelining ---------------------------------------------------------------------------------------------


class GPipeScheduleConfig(_Config):
    """GPipe: all forwards, then all backwards in reverse; one stage per rank."""

    schedule: Literal["gpipe"] = "gpipe"
    """The schedule kind."""


class LoopedBFSScheduleConfig(_Config):
    """Looped breadth-first: several stages per rank, stage s on rank s mod pp."""

    schedule: Literal["looped_bfs"] = "looped_bfs"
    """The schedule kind."""
    num_stages_per_rank: PositiveInt = 1
    """Model stages each pipeline rank holds."""


class Interleaved1F1BScheduleConfig(_Config):
    """Interleaved one-forward-one-backward (classic 1F1B with one stage per rank), optionally zero-bubble."""

    schedule: Literal["1f1b"] = "1f1b"
    """The schedule kind."""
    num_stages_per_rank: PositiveInt = 1
    """Model stages each pipeline rank holds."""
    zero_bubble: bool = False
    """Split backward into input and weight gradients and defer the latter into bubbles (ZB1P)."""


class ZeroBubbleVScheduleConfig(_Config):
    """Zero-bubble V: two stages per rank in a V (zig-zag) layout."""

    schedule: Literal["zero_bubble_v"] = "zero_bubble_v"
    """The schedule kind."""


class DualPipeVScheduleConfig(_Config):
    """DualPipeV: two stages per rank, overlapped forward/backward pairs."""

    schedule: Literal["dual_pipe_v"] = "dual_pipe_v"
    """The schedule kind."""


AnyPipelineScheduleConfig = Annotated[
    GPipeScheduleConfig
    | LoopedBFSScheduleConfig
    | Interleaved1F1BScheduleConfig
    | ZeroBubbleVScheduleConfig
    | DualPipeVScheduleConfig,
    Field(discriminator="schedule"),
]
"""A pipeline schedule, chosen by ``schedule``."""


class PipeliningConfig(_Config):
    """Pipeline parallelism; leave the whole section out (``null``) for none."""

    schedule: AnyPipelineScheduleConfig = GPipeScheduleConfig()
    """The pipeline schedule."""


# --- Model, determinism, GC, checkpoints, clipping, profiling, timeouts --------------------------------------


class ModelStageFactoryConfig(_Config):
    """Where the model's initial weights come from."""

    source_checkpoint: Path | None = None
    """A safetensors directory to load initial weights from; ``None`` keeps the fresh initialization."""


class DeterminismConfig(_Config):
    """Seeds and determinism switches."""

    seed: int = 0
    """The base seed of the run's random key (and of Python, numpy and torch generators)."""
    deterministic_algorithms: bool = False
    """Call ``torch.use_deterministic_algorithms(True)``: slower kernels, bitwise-repeatable results."""


DtypeName = Literal["float32", "bfloat16"]


class PrecisionConfig(_Config):
    """The precision policy (``d9dfn.Precision``): params, compute and gradient reductions."""

    param_dtype: DtypeName = "float32"
    """The dtype of the parameters (master weights), their gradients and the optimizer's inputs. ``bfloat16``
    is pure bf16 training: pair it with ``optimizer={"name": "stochastic_adamw", ...}``."""
    compute_dtype: DtypeName = "float32"
    """The dtype the model runs in: params and floating inputs are cast inside the step (``bfloat16``: mixed
    precision; the loss, ``Σw`` and norms stay float32)."""
    reduce_dtype: DtypeName | None = None
    """The dtype gradients are reduced in across data-parallel ranks; ``null``: their own (``param_dtype``)."""

    def policy(self) -> Precision:
        """This config as a :class:`d9dfn.Precision`."""
        reduce = None if self.reduce_dtype is None else DTYPES[self.reduce_dtype]
        return Precision(DTYPES[self.param_dtype], DTYPES[self.compute_dtype], reduce)


class GarbageCollectionConfig(_Config):
    """Manual Python garbage collection (automatic GC is off during the loop)."""

    period_steps: StepActionPeriod = 100
    """Collect every this many optimizer steps, or ``"last_step"`` / ``"disable"``."""


class CheckpointingConfig(_Config):
    """Where and when training checkpoints are saved."""

    save_dir: Path = Path("runs")
    """The root directory; the run's files go under ``save_dir / run.name``."""
    period_steps: StepActionPeriod = 100
    """Save every this many optimizer steps (and always after the last step), or ``"last_step"``/``"disable"``."""
    num_to_keep: PositiveInt | None = 3
    """How many of the newest checkpoints to keep; ``None`` keeps all."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""


class InferenceCheckpointingConfig(_Config):
    """Which training checkpoint an inference job loads."""

    load_dir: Path = Path("runs") / "d9dfn"
    """A training run's directory (``TrainerConfig.run_dir``) whose checkpoint is loaded."""
    step: NonNegativeInt | None = None
    """The checkpoint's step; ``None`` loads the newest."""


class GradientClippingConfig(_Config):
    """Clipping of the global gradient norm."""

    max_norm: PositiveFloat | None = None
    """Scale gradients down so that their global L2 norm is at most this; ``None`` does not clip.

    The gradient norm (before clipping) is logged as ``grad_norm`` for every step, with ``logging.period_steps``.
    """


class ProfilingConfig(_Config):
    """``torch.profiler`` traces: every ``period_steps``, skip, warm up, then record ``active_steps``."""

    enabled: bool = True
    """Turn profiling on (a ``null`` section turns it off too)."""
    traces_dir: Path = Path("traces")
    """The directory traces are written to."""
    period_steps: PositiveInt = 100
    """The length of one profiling cycle in optimizer steps."""
    warmup_steps: NonNegativeInt = 1
    """Steps traced but discarded before recording, in each cycle."""
    active_steps: PositiveInt = 2
    """Steps recorded in each cycle."""

    @model_validator(mode="after")
    def _cycle_fits(self) -> ProfilingConfig:
        if self.warmup_steps + self.active_steps > self.period_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} + active_steps={self.active_steps} exceed period_steps="
                f"{self.period_steps}; raise period_steps to at least {self.warmup_steps + self.active_steps} or "
                f"shorten warmup_steps/active_steps"
            )
        return self


class TimeoutConfig(_Config):
    """Collective-communication timeouts, in seconds."""

    init_timeout: PositiveInt = 10000
    """Timeout during configuration and the first step (compilation, weight loading)."""
    step_timeout: PositiveInt = 100
    """Timeout for every later step."""


# --- The job configs ----------------------------------------------------------------------------------------


class TrainerConfig(_Config):
    """Everything a training job needs besides the model, data and task providers.

    Only ``optimizer`` is required:

    >>> TrainerConfig(optimizer={"name": "adamw", "lr": 1e-3}).batching.microbatch_size
    8
    """

    run: RunConfig = RunConfig()
    """The run's name and recorded hyperparameters."""
    batching: BatchingConfig = BatchingConfig()
    """Global batch and microbatch sizes."""
    data_loading: DataLoadingConfig = DataLoadingConfig()
    """Data loader options."""
    logging: LoggingConfig = LoggingConfig()
    """Metric logging period and tracker."""
    pipelining: PipeliningConfig | None = None
    """Pipeline parallelism; ``None`` for none."""
    model_stage_factory: ModelStageFactoryConfig = ModelStageFactoryConfig()
    """Initial weights."""
    determinism: DeterminismConfig = DeterminismConfig()
    """Seed and determinism switches."""
    precision: PrecisionConfig = PrecisionConfig()
    """Params, compute and reduction dtypes (``d9dfn.Precision``); float32 throughout by default."""
    gc: GarbageCollectionConfig = GarbageCollectionConfig()
    """Manual garbage collection period."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoint directory, period and retention."""
    gradient_clipping: GradientClippingConfig = GradientClippingConfig()
    """Global gradient-norm clipping."""
    profiling: ProfilingConfig | None = None
    """``torch.profiler`` traces; ``None`` for none."""
    timeout: TimeoutConfig = TimeoutConfig()
    """Collective-communication timeouts."""
    optimizer: AutoOptimizerConfig
    """The optimizer (``{"name": "adamw", "lr": ...}`` and so on)."""
    lr_scheduler: AutoLRSchedulerConfig | None = None
    """A schedule of the optimizer's ``lr``; ``None`` keeps it constant."""
    total_steps: PositiveInt | None = None
    """Optimizer steps to train; ``None`` trains for one epoch (the number of full global batches in the data)."""
    compile: bool = True
    """Run the step under ``torch.compile``."""
    repeated_blocks: tuple[str, ...] | None = None
    """Class names of the model's repeated blocks (e.g. ``["Qwen3DecoderLayer"]``), each compiled once for all its
    layers (in one process and inside pipeline stages), so depth adds little to cold compile time; the optimizer
    then updates each block through one region too. ``null`` (the default): found in the model
    (``d9dfn.step.find_repeated_blocks``: a class repeated in a layer list, holding no buffers); ``[]``: off, the
    whole model traced per microbatch. A zero-bubble schedule (``1f1b`` with ``zero_bubble``, ``zero_bubble_v``,
    ``dual_pipe_v``) traces its stages whole, so there ``null`` means off and a named class is an error."""
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
            schedule, steps = str(error), self.total_steps
            problems = [
                (
                    ("lr_scheduler", "scheduler", "phases"),
                    f"do not fit in total_steps={steps}: {schedule}; shorten them",
                ),
                (("total_steps",), f"{steps} is shorter than lr_scheduler.scheduler.phases need; raise it"),
            ]
            # One error per setting, each at its own location (``trainer.total_steps`` in a job).
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("schedule_length", _escape(message)), loc=loc, input=steps
                    )
                    for loc, message in problems
                ],
            ) from None
        return self

    @property
    def run_dir(self) -> Path:
        """The run's directory: ``checkpointing.save_dir / run.name``."""
        return self.checkpointing.save_dir / self.run.name

    def batch_maths(self, mesh: DeviceMeshParameters) -> BatchMaths:
        """The batch arithmetic of this config on ``mesh`` (see :func:`batch_maths`)."""
        return batch_maths(
            global_batch_size=self.batching.global_batch_size,
            microbatch_size=self.batching.microbatch_size,
            data_parallel_size=mesh.data_parallel_size,
            pipelining=self.pipelining is not None,
        )


class InferenceConfig(_Config):
    """Everything an inference job needs besides the model, data and task providers."""

    batching: BatchingConfig = BatchingConfig()
    """Global batch and microbatch sizes."""
    data_loading: DataLoadingConfig = DataLoadingConfig()
    """Data loader options."""
    model_stage_factory: ModelStageFactoryConfig = ModelStageFactoryConfig()
    """The weights to run when ``checkpointing`` is ``None`` (e.g. a ``d9dfn export`` or Hugging Face directory)."""
    determinism: DeterminismConfig = DeterminismConfig()
    """Seed and determinism switches."""
    device: str = "auto"
    """Where the model and the step live: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"``."""
    precision: PrecisionConfig = PrecisionConfig()
    """The dtype the model runs in (``compute_dtype``); ``param_dtype`` is the dtype the weights are loaded in."""
    gc: GarbageCollectionConfig = GarbageCollectionConfig()
    """Manual garbage collection period (in inference steps)."""
    checkpointing: InferenceCheckpointingConfig | None = InferenceCheckpointingConfig()
    """The training checkpoint to load; ``None`` runs ``model_stage_factory.source_checkpoint``'s weights (or a
    fresh initialization when that is ``None`` too)."""
    profiling: ProfilingConfig | None = None
    """``torch.profiler`` traces (periods in inference steps); ``None`` for none."""
    compile: bool = True
    """Run the step under ``torch.compile``."""
    repeated_blocks: tuple[str, ...] | None = None
    """Class names of the model's repeated blocks, each compiled once for all its layers, in one process and inside
    pipeline stages, as ``trainer.repeated_blocks``: ``null`` (the default) finds them, ``[]`` turns it off."""
    timeout: TimeoutConfig = TimeoutConfig()
    """Collective timeouts on a pipeline mesh: ``init_timeout`` while the process group starts and for the first
    batch, ``step_timeout`` for every later one (unused on one process)."""

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

    def batch_maths(self, mesh: DeviceMeshParameters) -> BatchMaths:
        """The batch arithmetic of this config on ``mesh`` (inference does not pipeline here)."""
        return batch_maths(
            global_batch_size=self.batching.global_batch_size,
            microbatch_size=self.batching.microbatch_size,
            data_parallel_size=mesh.data_parallel_size,
        )
