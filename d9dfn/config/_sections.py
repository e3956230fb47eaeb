"""The sections of the job configs (d9d's names and meanings); the job configs themselves are in ``_jobs.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    JsonValue,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from d9dfn.config._base import FrozenConfig
from d9dfn.config._periods import StepActionPeriod
from d9dfn.step._checkpointing import SAVED_BY_SELECTIVE, ActivationCheckpointing
from d9dfn.step._precision import DTYPES, Precision

__all__ = [
    "AnyTrackerConfig",
    "BatchingConfig",
    "CheckpointingConfig",
    "DataLoadingConfig",
    "DeterminismConfig",
    "EvaluationConfig",
    "GarbageCollectionConfig",
    "GradientClippingConfig",
    "InferenceCheckpointingConfig",
    "JsonlTrackerConfig",
    "LoggingConfig",
    "ModelStageFactoryConfig",
    "NullTrackerConfig",
    "PrecisionConfig",
    "ProfilingConfig",
    "RunConfig",
    "TensorBoardTrackerConfig",
    "TimeoutConfig",
]


def _one_path_component(field: str, name: str, what: str, example: str) -> str:
    """``name`` if it is one non-empty path component, else a ``ValueError`` naming ``field`` and the fix."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(
            f"{field} {name!r} must be a non-empty name without '/', '\\' or a NUL character ({what}); use e.g. "
            f"{example!r}"
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
    raise PydanticCustomError("device", message)  # no context: braces are not placeholders


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


class TensorBoardTrackerConfig(_Config):
    """TensorBoard event files in the run directory, beside the JSON lines (needs ``pip install 'd9dfn[tb]'``).

    The JSON lines stay the record a resume cuts back to and the loss plot reads; the event files mirror them,
    rewritten from them on resume, so TensorBoard shows each step once.
    """

    provider: Literal["tensorboard"] = "tensorboard"
    """The tracker kind."""
    log_dir: str = "tensorboard"
    """The folder, in the run directory, that receives the event files (``tensorboard --logdir runs``)."""
    filename: str = "metrics.jsonl"
    """The JSON-lines file, in the run directory, kept beside the event files."""

    @field_validator("log_dir")
    @classmethod
    def _log_dir_is_one_path_component(cls, name: str) -> str:
        return _one_path_component("logging.tracker.log_dir", name, "a folder in the run directory", "tensorboard")

    @field_validator("filename")
    @classmethod
    def _filename_is_one_path_component(cls, name: str) -> str:
        return _one_path_component("logging.tracker.filename", name, "a file in the run directory", "metrics.jsonl")


AnyTrackerConfig = Annotated[
    JsonlTrackerConfig | NullTrackerConfig | TensorBoardTrackerConfig, Field(discriminator="provider")
]
"""A tracker, chosen by ``provider``: ``"jsonl"``, ``"tensorboard"`` or ``"null"``."""


class LoggingConfig(_Config):
    """When metrics are logged and where they go."""

    period_steps: StepActionPeriod = 10
    """Log every this many optimizer steps (and on the last step), or ``"last_step"`` / ``"disable"``."""
    tracker: AnyTrackerConfig = JsonlTrackerConfig()
    """Where metrics are recorded."""


class EvaluationConfig(_Config):
    """Validation during training: the task's loss and metrics over the validation split, every so many steps."""

    period_steps: StepActionPeriod = "disable"
    """Validate every this many optimizer steps (and after the last step), ``"last_step"`` or ``"disable"``; logged
    as ``val/loss`` and ``val/metrics/...`` and drawn in ``loss.png``."""
    num_batches: PositiveInt | None = None
    """Validation batches (of ``batching.global_batch_size`` samples, in order) per validation; ``None``: every whole
    batch of the validation split."""


# --- Model, determinism, GC, checkpoints, clipping, profiling, timeouts --------------------------------------


class ModelStageFactoryConfig(_Config):
    """Where the model's initial weights come from."""

    source_checkpoint: Path | None = None
    """A safetensors directory to load initial weights from; ``None`` keeps the fresh initialization."""


class DeterminismConfig(_Config):
    """Seeds and determinism switches."""

    seed: int = Field(0, ge=0, le=2**64 - 1)
    """The base seed of the run's random key (and of Python, numpy and torch generators): an int from 0 to
    2**64 - 1 (what ``torch.manual_seed`` and numpy's generators take)."""
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


class ActivationCheckpointingConfig(_Config):
    """What the backward recomputes instead of keeping, per repeated block (``d9dfn.step.ActivationCheckpointing``).

    It needs the repeated blocks, so it composes with the pipeline schedules that run each stage's backward whole
    (``gpipe``, ``1f1b`` without ``zero_bubble``, ``looped_bfs``) and is refused, naming them, with the ones that split
    it into I and W (``1f1b`` with ``zero_bubble``, ``zero_bubble_v``, ``dual_pipe_v``), which trace each stage whole.
    """

    policy: Literal["none", "full", "selective", "budget"] = "none"
    """``none``: keep every activation; ``full``: a checkpointed block keeps its inputs and reruns its forward in the
    backward; ``selective``: it keeps the matmul and attention outputs (``save``) and reruns the rest; ``budget``:
    the compiler keeps at most ``memory_budget`` of the activations (compiled runs only)."""
    every: PositiveInt = 1
    """Checkpoint every this many repeated blocks, from the first (1: all of them)."""
    save: tuple[str, ...] = SAVED_BY_SELECTIVE
    """``selective``: the aten ops (by name) whose outputs are kept."""
    memory_budget: float = Field(0.5, gt=0.0, le=1.0)
    """``budget``: the fraction of the activations the compiler may keep."""

    def policy_value(self) -> ActivationCheckpointing | None:
        """This config for ``make_train_step(activation_checkpointing=)``: ``None`` for ``none``."""
        if self.policy == "none":
            return None
        return ActivationCheckpointing(self.policy, self.every, self.save, self.memory_budget)


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
    step: NonNegativeInt | Literal["newest-intact"] | None = None
    """The checkpoint's step; ``None``: the newest (refused if corrupted); ``"newest-intact"``: the newest intact."""


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
