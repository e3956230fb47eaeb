"""The loop's configuration: frozen pydantic models at the edge, ``build_*`` functions, and ``load_config``.

Every model is frozen and rejects unknown keys. Union-typed sections are discriminated by a tag key
(``name`` for optimizers and schedulers, ``provider`` for trackers, ``schedule`` for pipeline schedules,
``mode`` for schedule phases, ``type`` for curves) and turned into d9dfn objects by an exhaustive
``match`` in a ``build_*`` function; the pure core never sees a config object.

A config is loaded by :func:`load_config` from a JSON (or YAML) file plus ``a.b.c=value`` overrides; any
mistake becomes one :class:`ConfigError` that names each bad field's path, what was wrong and the fix.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, Union, assert_never, get_args, get_origin

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from d9dfn import optim, schedules
from d9dfn._types import Schedule, Transform
from d9dfn.loop._periods import StepActionPeriod

__all__ = [
    "AdamConfig",
    "AdamWConfig",
    "AnyCurveConfig",
    "AnyPhaseConfig",
    "AnyPipelineScheduleConfig",
    "AnyTrackerConfig",
    "AutoLRSchedulerConfig",
    "AutoOptimizerConfig",
    "BatchMaths",
    "BatchingConfig",
    "CheckpointingConfig",
    "ConfigError",
    "CosineCurveConfig",
    "DataLoadingConfig",
    "DeterminismConfig",
    "DeviceMeshParameters",
    "DualPipeVScheduleConfig",
    "ExponentialCurveConfig",
    "GPipeScheduleConfig",
    "GarbageCollectionConfig",
    "GradientClippingConfig",
    "InferenceCheckpointingConfig",
    "InferenceConfig",
    "Interleaved1F1BScheduleConfig",
    "JsonlTrackerConfig",
    "LinearCurveConfig",
    "LoggingConfig",
    "LoopedBFSScheduleConfig",
    "ModelStageFactoryConfig",
    "NullTrackerConfig",
    "PercentagePhaseConfig",
    "PiecewiseLRSchedulerConfig",
    "PiecewiseSchedulerConfig",
    "PipeliningConfig",
    "PolyCurveConfig",
    "ProfilingConfig",
    "RestPhaseConfig",
    "RunConfig",
    "SGDConfig",
    "StepsPhaseConfig",
    "StochasticAdamWConfig",
    "TimeoutConfig",
    "TrainerConfig",
    "ZeroBubbleVScheduleConfig",
    "batch_maths",
    "build_lr_schedule",
    "build_optimizer",
    "load_config",
]

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path, the problem and the fix."""


class _Config(BaseModel):
    """Shared settings: frozen, unknown keys rejected, field docstrings become descriptions."""

    # coerce_numbers_to_str: `--set run.name=123` parses 123 as JSON; a name field should still take it.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)


# --- Run, batching, data ------------------------------------------------------------------------------------


class RunConfig(_Config):
    """What the run is called and what the tracker records about it."""

    name: str = "d9dfn"
    """The run's name; also its directory under ``checkpointing.save_dir`` (one path component)."""
    description: str | None = None
    """A free-text note stored with the run's hyperparameters."""
    hparams: dict[str, JsonValue] = Field(default_factory=dict)
    """Extra hyperparameters to record with the run (JSON values)."""

    @field_validator("name")
    @classmethod
    def _name_is_one_path_component(cls, name: str) -> str:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(
                f"run.name {name!r} must be a non-empty directory name without '/' or '\\' (it names the run's "
                f"directory); use e.g. 'my-run'"
            )
        return name


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
    """How batches are loaded (torch ``DataLoader`` options)."""

    num_workers: NonNegativeInt = 0
    """Worker processes that load samples; 0 loads them in the main process."""
    pin_memory: bool = False
    """Put batches in page-locked memory (faster host-to-GPU copies)."""
    persistent_workers: bool = False
    """Keep the worker processes alive between epochs (needs ``num_workers`` > 0)."""

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
    """Where the model's initial weights come from and what its checkpoints hold."""

    source_checkpoint: Path | None = None
    """A safetensors directory to load initial weights from; ``None`` keeps the fresh initialization."""
    checkpoint_only_trainable_parameters: bool = False
    """Save only trainable parameters in checkpoints (frozen weights come from ``source_checkpoint``)."""


class DeterminismConfig(_Config):
    """Seeds and determinism switches."""

    seed: int = 0
    """The base seed of the run's random key (and of Python, numpy and torch generators)."""
    deterministic_algorithms: bool = False
    """Call ``torch.use_deterministic_algorithms(True)``: slower kernels, bitwise-repeatable results."""


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
    """Scale gradients down so that their global L2 norm is at most this; ``None`` does not clip."""
    log_period_steps: StepActionPeriod = 10
    """Log the gradient norm every this many optimizer steps, or ``"last_step"`` / ``"disable"``."""


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


# --- Optimizers ---------------------------------------------------------------------------------------------

_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
_UnitFloat = Annotated[float, Field(ge=0.0, le=1.0)]
_STATE_DTYPES = ("float32", "bfloat16")


class AdamWConfig(_Config):
    """AdamW (decoupled weight decay)."""

    name: Literal["adamw"]
    """The optimizer kind."""
    lr: PositiveFloat
    """The base learning rate (the schedule multiplies it)."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: NonNegativeFloat = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegativeFloat = 1e-2
    """Decoupled weight decay coefficient."""
    amsgrad: bool = False
    """Use the maximum of past second moments (AMSGrad)."""
    maximize: bool = False
    """Maximize the objective instead of minimizing it."""


class AdamConfig(_Config):
    """Adam (L2 weight decay added to the gradient, or decoupled if asked)."""

    name: Literal["adam"]
    """The optimizer kind."""
    lr: PositiveFloat
    """The base learning rate (the schedule multiplies it)."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: NonNegativeFloat = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegativeFloat = 0.0
    """Weight decay coefficient."""
    amsgrad: bool = False
    """Use the maximum of past second moments (AMSGrad)."""
    maximize: bool = False
    """Maximize the objective instead of minimizing it."""
    decoupled_weight_decay: bool = False
    """Decay the weights directly (as AdamW) instead of adding the decay to the gradient."""


class SGDConfig(_Config):
    """Stochastic gradient descent with optional momentum."""

    name: Literal["sgd"]
    """The optimizer kind."""
    lr: PositiveFloat
    """The base learning rate (the schedule multiplies it)."""
    momentum: _UnitFloat = 0.0
    """Momentum factor in [0, 1]; 0 turns momentum off."""
    dampening: _UnitFloat = 0.0
    """Dampening of the gradient's contribution to the momentum, in [0, 1]."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 weight decay added to the gradient."""
    nesterov: bool = False
    """Use Nesterov momentum (needs momentum > 0 and dampening 0)."""
    maximize: bool = False
    """Maximize the objective instead of minimizing it."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDConfig:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov=true needs momentum > 0 and dampening = 0, got momentum={self.momentum}, dampening="
                f"{self.dampening}; set momentum (e.g. 0.9) and dampening=0, or nesterov=false"
            )
        return self


class StochasticAdamWConfig(_Config):
    """AdamW whose low-precision params and states are updated with stochastic rounding."""

    name: Literal["stochastic_adamw"]
    """The optimizer kind."""
    lr: PositiveFloat
    """The base learning rate (the schedule multiplies it)."""
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: NonNegativeFloat = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: NonNegativeFloat = 1e-2
    """Decoupled weight decay coefficient."""
    state_dtype: str
    """The dtype of the moment estimates: ``"float32"`` or ``"bfloat16"`` (rounded stochastically)."""

    @field_validator("state_dtype")
    @classmethod
    def _is_supported_dtype(cls, name: str) -> str:
        if name not in _STATE_DTYPES:
            raise ValueError(f"state_dtype {name!r} is not supported; use one of {', '.join(map(repr, _STATE_DTYPES))}")
        return name


AutoOptimizerConfig = Annotated[
    AdamWConfig | AdamConfig | SGDConfig | StochasticAdamWConfig, Field(discriminator="name")
]
"""An optimizer, chosen by ``name``; parse one alone with ``TypeAdapter(AutoOptimizerConfig)``."""


def build_optimizer(
    config: AdamWConfig | AdamConfig | SGDConfig | StochasticAdamWConfig,
    lr: float | Schedule | None = None,
    *,
    key: torch.Tensor | int | None = None,
) -> Transform:
    """The d9dfn optimizer transform that ``config`` describes.

    Args:
        config: an optimizer config.
        lr: the learning rate: a constant, or a schedule of the 0-d step tensor (see
            :func:`build_lr_schedule`); ``None`` uses ``config.lr`` as a constant.
        key: a ``d9dfn.prng`` key (or an int seed) for stochastic rounding; required by ``stochastic_adamw``
            only.

    Raises:
        ValueError: ``stochastic_adamw`` without a ``key``.
    """
    lr = config.lr if lr is None else lr
    match config:
        case AdamWConfig():
            return optim.adamw(
                lr=lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                amsgrad=config.amsgrad,
                maximize=config.maximize,
            )
        case AdamConfig():
            return optim.adam(
                lr=lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                amsgrad=config.amsgrad,
                maximize=config.maximize,
                decoupled_weight_decay=config.decoupled_weight_decay,
            )
        case SGDConfig():
            return optim.sgd(
                lr=lr,
                momentum=config.momentum,
                dampening=config.dampening,
                weight_decay=config.weight_decay,
                nesterov=config.nesterov,
                maximize=config.maximize,
            )
        case StochasticAdamWConfig():
            if key is None:
                raise ValueError(
                    "build_optimizer: stochastic_adamw needs a random key for stochastic rounding; pass "
                    "key=d9dfn.prng.key(seed) (e.g. the run's determinism.seed)"
                )
            return optim.stochastic_adamw(
                lr=lr,
                betas=config.betas,
                eps=config.eps,
                weight_decay=config.weight_decay,
                state_dtype=getattr(torch, config.state_dtype),
                key=key,
            )
        case _:
            assert_never(config)


# --- Learning-rate schedules --------------------------------------------------------------------------------


class LinearCurveConfig(_Config):
    """A straight line from the phase's start multiplier to its target."""

    type: Literal["linear"]
    """The curve kind."""


class CosineCurveConfig(_Config):
    """Half a cosine from the phase's start multiplier to its target."""

    type: Literal["cosine"]
    """The curve kind."""


class ExponentialCurveConfig(_Config):
    """A straight line in log space (multipliers clamped at 1e-8 so that 0 works)."""

    type: Literal["exponential"]
    """The curve kind."""


class PolyCurveConfig(_Config):
    """``start + (target - start) * progress ** power``."""

    type: Literal["poly"]
    """The curve kind."""
    power: PositiveFloat = 2.0
    """The exponent of the progress."""


AnyCurveConfig = Annotated[
    LinearCurveConfig | CosineCurveConfig | ExponentialCurveConfig | PolyCurveConfig, Field(discriminator="type")
]
"""How a phase moves from its start multiplier to its target, chosen by ``type``."""


class StepsPhaseConfig(_Config):
    """A phase of a fixed number of steps."""

    mode: Literal["steps"]
    """The phase kind."""
    steps: PositiveInt
    """The phase's length in optimizer steps."""
    target_multiplier: NonNegativeFloat
    """The multiplier of the base learning rate at the phase's end."""
    curve: AnyCurveConfig
    """How the multiplier moves there."""


class PercentagePhaseConfig(_Config):
    """A phase that lasts until a fraction of the job's steps."""

    mode: Literal["percentage"]
    """The phase kind."""
    percentage: Annotated[float, Field(ge=0.0, le=1.0)]
    """The fraction of ``total_steps`` (in [0, 1]) at which the phase ends."""
    target_multiplier: NonNegativeFloat
    """The multiplier of the base learning rate at the phase's end."""
    curve: AnyCurveConfig
    """How the multiplier moves there."""


class RestPhaseConfig(_Config):
    """The last phase: it runs until ``total_steps``."""

    mode: Literal["rest"]
    """The phase kind."""
    target_multiplier: NonNegativeFloat
    """The multiplier of the base learning rate at the last step."""
    curve: AnyCurveConfig
    """How the multiplier moves there."""


AnyPhaseConfig = Annotated[StepsPhaseConfig | PercentagePhaseConfig | RestPhaseConfig, Field(discriminator="mode")]
"""One phase of a piecewise schedule, chosen by ``mode``."""


class PiecewiseSchedulerConfig(_Config):
    """A learning-rate multiplier made of consecutive phases (warmup, hold, decay...)."""

    initial_multiplier: NonNegativeFloat
    """The multiplier at step 0."""
    phases: tuple[AnyPhaseConfig, ...] = Field(min_length=1)
    """The phases, in order; a ``rest`` phase may only come last."""

    @model_validator(mode="after")
    def _rest_is_last_and_percentages_increase(self) -> PiecewiseSchedulerConfig:
        for index, phase in enumerate(self.phases[:-1]):
            if isinstance(phase, RestPhaseConfig):
                raise ValueError(
                    f"phases.{index} is a 'rest' phase but {len(self.phases) - 1 - index} phase(s) follow it; "
                    f"a rest phase runs to the end, so move it last or remove the phases after it"
                )
        percentages = [(i, p.percentage) for i, p in enumerate(self.phases) if isinstance(p, PercentagePhaseConfig)]
        for (_, before), (index, after) in itertools.pairwise(percentages):
            if after < before:
                raise ValueError(
                    f"phases.{index} ends at percentage {after}, before an earlier phase's {before}; percentage "
                    f"phases must not go backwards, so reorder them"
                )
        return self


class PiecewiseLRSchedulerConfig(_Config):
    """A piecewise schedule of the base learning rate."""

    name: Literal["piecewise"]
    """The scheduler kind."""
    scheduler: PiecewiseSchedulerConfig
    """The phases."""


AutoLRSchedulerConfig = Annotated[PiecewiseLRSchedulerConfig, Field(discriminator="name")]
"""A learning-rate scheduler, chosen by ``name`` (only ``"piecewise"`` so far)."""


def build_lr_schedule(config: PiecewiseLRSchedulerConfig, total_steps: int, *, base_lr: float = 1.0) -> Schedule:
    """The learning-rate schedule ``step -> base_lr * multiplier(step)`` that ``config`` describes.

    With the default ``base_lr=1.0`` it is the bare multiplier, which an optimizer built with
    ``lr=lambda step: config.lr * multiplier(step)`` scales.

    Args:
        config: a scheduler config.
        total_steps: the job's number of optimizer steps (percentage and rest phases depend on it).
        base_lr: the learning rate that the multipliers scale.

    Raises:
        ValueError: the phases do not fit in ``total_steps`` (raised by ``d9dfn.schedules``).

    >>> config = PiecewiseLRSchedulerConfig.model_validate_json(
    ...     '{"name": "piecewise", "scheduler": {"initial_multiplier": 0, "phases": ['
    ...     '{"mode": "steps", "steps": 10, "target_multiplier": 1, "curve": {"type": "linear"}},'
    ...     '{"mode": "rest", "target_multiplier": 0, "curve": {"type": "cosine"}}]}}'
    ... )
    >>> lr = build_lr_schedule(config, total_steps=110, base_lr=0.1)
    >>> lr(torch.tensor(5)), lr(torch.tensor(60))
    (tensor(0.0500), tensor(0.0500))
    """
    match config:
        case PiecewiseLRSchedulerConfig():
            phases = [_build_phase(phase) for phase in config.scheduler.phases]
            multiplier = schedules.piecewise(config.scheduler.initial_multiplier, phases, total_steps)
            return multiplier if base_lr == 1.0 else schedules.scale(multiplier, base_lr)
        case _:
            assert_never(config)


def _build_phase(config: StepsPhaseConfig | PercentagePhaseConfig | RestPhaseConfig) -> Any:
    curve = _build_curve(config.curve)
    match config:
        case StepsPhaseConfig():
            return schedules.steps(config.steps, config.target_multiplier, curve)
        case PercentagePhaseConfig():
            return schedules.percentage(config.percentage, config.target_multiplier, curve)
        case RestPhaseConfig():
            return schedules.rest(config.target_multiplier, curve)
        case _:
            assert_never(config)


def _build_curve(config: LinearCurveConfig | CosineCurveConfig | ExponentialCurveConfig | PolyCurveConfig) -> Any:
    match config:
        case LinearCurveConfig():
            return schedules.linear()
        case CosineCurveConfig():
            return schedules.cosine()
        case ExponentialCurveConfig():
            return schedules.exponential()
        case PolyCurveConfig():
            return schedules.poly(config.power)
        case _:
            assert_never(config)


# --- Device mesh and batch maths ----------------------------------------------------------------------------


class DeviceMeshParameters(_Config):
    """Degrees of parallelism; their product (without ``expert_parallel``) is the number of processes."""

    pipeline_parallel: PositiveInt = 1
    """Pipeline stages."""
    data_parallel_replicate: PositiveInt = 1
    """Data-parallel replicas that each hold a full copy of the params (DDP)."""
    data_parallel_shard: PositiveInt = 1
    """Data-parallel ranks that shard params, grads and optimizer states (FSDP)."""
    context_parallel_replicate: PositiveInt = 1
    """Context-parallel ranks with replicated params."""
    context_parallel_shard: PositiveInt = 1
    """Context-parallel ranks with sharded params."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel ranks."""
    expert_parallel: PositiveInt = 1
    """Expert-parallel ranks, carved out of the data, context and tensor dimensions (it must divide them)."""

    @model_validator(mode="after")
    def _experts_divide(self) -> DeviceMeshParameters:
        non_pipeline = self.world_size // self.pipeline_parallel
        if non_pipeline % self.expert_parallel:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} does not divide data_parallel_replicate * "
                f"data_parallel_shard * context_parallel_replicate * context_parallel_shard * tensor_parallel = "
                f"{non_pipeline}; choose an expert_parallel that divides {non_pipeline}"
            )
        return self

    @property
    def world_size(self) -> int:
        """The number of processes the mesh needs.

        >>> DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=4).world_size
        8
        """
        return (
            self.pipeline_parallel
            * self.data_parallel_replicate
            * self.data_parallel_shard
            * self.context_parallel_replicate
            * self.context_parallel_shard
            * self.tensor_parallel
        )

    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that see different samples (replicate x shard)."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def is_distributed(self) -> bool:
        """Whether the job needs more than one process."""
        return self.world_size > 1


class BatchMaths(NamedTuple):
    """How one optimizer step's samples are split across ranks and microbatches."""

    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    microbatch_size: int
    """Samples per forward/backward pass on one rank."""
    data_parallel_size: int
    """Ranks that see different samples."""
    per_rank_batch_size: int
    """Samples per optimizer step on one rank: ``microbatch_size * num_microbatches``."""
    num_microbatches: int
    """Microbatches per rank per step: ``global_batch_size / (data_parallel_size * microbatch_size)``."""
    num_microbatches_gradient_accumulation: int
    """Microbatches accumulated in one step without pipelining (1 with pipelining)."""
    num_microbatches_pipelining: int
    """Microbatches fed through the pipeline schedule (1 without pipelining)."""


def batch_maths(
    *, global_batch_size: int, microbatch_size: int, data_parallel_size: int = 1, pipelining: bool = False
) -> BatchMaths:
    """Derive per-rank batch size and microbatch counts from the batching config and the data-parallel size.

    Args:
        global_batch_size: samples per optimizer step over all ranks.
        microbatch_size: samples per forward/backward pass on one rank.
        data_parallel_size: ranks that see different samples (``DeviceMeshParameters.data_parallel_size``).
        pipelining: whether a pipeline schedule consumes the microbatches (else they are accumulated).

    Raises:
        ValueError: a size below 1, or ``global_batch_size`` not a multiple of ``data_parallel_size *
            microbatch_size``.

    >>> batch_maths(global_batch_size=32, microbatch_size=4, data_parallel_size=2).num_microbatches
    4
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("microbatch_size", microbatch_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_maths: {name}={value!r} must be an int >= 1")
    samples_per_pass = data_parallel_size * microbatch_size
    if global_batch_size % samples_per_pass:
        raise ValueError(
            f"batch_maths: global_batch_size={global_batch_size} is not a multiple of data_parallel_size="
            f"{data_parallel_size} x microbatch_size={microbatch_size} = {samples_per_pass}; set "
            f"batching.global_batch_size to a multiple of {samples_per_pass} or reduce batching.microbatch_size"
        )
    num_microbatches = global_batch_size // samples_per_pass
    return BatchMaths(
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        data_parallel_size=data_parallel_size,
        per_rank_batch_size=global_batch_size // data_parallel_size,
        num_microbatches=num_microbatches,
        num_microbatches_gradient_accumulation=1 if pipelining else num_microbatches,
        num_microbatches_pipelining=num_microbatches if pipelining else 1,
    )


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
    """Initial weights and checkpoint contents."""
    determinism: DeterminismConfig = DeterminismConfig()
    """Seed and determinism switches."""
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
    skip_nonfinite: bool = False
    """Skip the update of a step whose loss or gradient norm is NaN/inf (else the run stops with an error)."""

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
    """Initial weights (used when no checkpoint is loaded)."""
    determinism: DeterminismConfig = DeterminismConfig()
    """Seed and determinism switches."""
    gc: GarbageCollectionConfig = GarbageCollectionConfig()
    """Manual garbage collection period."""
    checkpointing: InferenceCheckpointingConfig = InferenceCheckpointingConfig()
    """The training checkpoint to load."""
    profiling: ProfilingConfig | None = None
    """``torch.profiler`` traces; ``None`` for none."""
    timeout: TimeoutConfig = TimeoutConfig()
    """Collective-communication timeouts."""
    compile: bool = True
    """Run the step under ``torch.compile``."""

    def batch_maths(self, mesh: DeviceMeshParameters) -> BatchMaths:
        """The batch arithmetic of this config on ``mesh`` (inference does not pipeline here)."""
        return batch_maths(
            global_batch_size=self.batching.global_batch_size,
            microbatch_size=self.batching.microbatch_size,
            data_parallel_size=mesh.data_parallel_size,
        )


# --- Loading ------------------------------------------------------------------------------------------------


def load_config(
    cls: type[ConfigT], path: Path | str | None = None, overrides: Sequence[str] = (), *, default: ConfigT | None = None
) -> ConfigT:
    """Read a config of type ``cls`` from ``path`` (JSON, or YAML if PyYAML is installed), apply overrides.

    Args:
        cls: the config model, e.g. :class:`TrainerConfig`.
        path: a ``.json`` / ``.yaml`` / ``.yml`` file; ``None`` starts from ``default`` (or from no keys).
        overrides: ``"a.b.c=value"`` strings applied in order; ``value`` is parsed as JSON (``3``, ``1e-4``,
            ``true``, ``null``, ``{"name": "sgd", "lr": 0.1}``), and taken as a plain string if that fails.
            List items are addressed by index (``lr_scheduler.scheduler.phases.0.steps=10``).
        default: the config used when ``path`` is ``None`` (e.g. the CLI's embedded default job).

    Raises:
        ConfigError: a missing or unreadable file, a malformed override, or a config that does not validate;
            the message lists every bad field by its dotted path, the problem and the fix.

    >>> load_config(TrainerConfig, None, ["optimizer.name=sgd", "optimizer.lr=0.1"]).optimizer.lr
    0.1
    """
    data: Any = {} if default is None else default.model_dump(mode="json")
    source = "the defaults"
    if path is not None:
        path = Path(path)
        data = _read_file(path)
        source = str(path)
    data = copy.deepcopy(data)
    for override in overrides:
        _apply_override(data, override)
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        # A list whose items failed also reports "too short" (it counts the valid items): noise.
        errors = [
            err
            for err in errors
            if err["type"] != "too_short"
            or not any(other["loc"][: len(err["loc"])] == err["loc"] and other is not err for other in errors)
        ]
        lines = [_describe_error(cls, err) for err in errors]
        header = f"load_config: {cls.__name__} from {source}"
        if overrides:
            header += f" with overrides {list(overrides)}"
        raise ConfigError(f"{header} is invalid ({len(lines)} error(s)):\n" + "\n".join(lines)) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"load_config: config file {str(path)!r} {what}; pass the path of a JSON or YAML file")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"load_config: {str(path)!r} is YAML but PyYAML is not installed; `pip install pyyaml` or convert "
                f"the file to JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"load_config: {str(path)!r} is not valid YAML: {error}; fix the syntax") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"load_config: {str(path)!r} is not valid JSON: {error.msg} at line {error.lineno}, column "
                f"{error.colno}; fix the syntax there"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"load_config: {str(path)!r} holds a {type(data).__name__}, not an object; the top level must be "
            f'an object of sections such as {{"optimizer": {{...}}}}'
        )
    return data


def _apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in ``data`` (our own fresh copy), creating missing objects on the way."""
    key, sep, raw = override.partition("=")
    segments = key.strip().split(".")
    if not sep or not all(segments):
        raise ConfigError(
            f"load_config: override {override!r} is not of the form a.b.c=value; write e.g. batching.microbatch_size=4"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node: Any = data
    for depth, segment in enumerate(segments):
        where = ".".join(segments[:depth]) or "the top level"
        if isinstance(node, list):
            if not segment.isdigit() or int(segment) >= len(node):
                raise ConfigError(
                    f"load_config: override {override!r}: {where} is a list of {len(node)} item(s) and "
                    f"{segment!r} is not an index into it; use an index from 0 to {len(node) - 1}"
                )
            segment = int(segment)
        elif not isinstance(node, dict):
            raise ConfigError(
                f"load_config: override {override!r}: {where} is {node!r}, not an object; set the whole value "
                f"instead, e.g. {where}={{...}}"
            )
        if depth == len(segments) - 1:
            node[segment] = value
        else:
            if isinstance(node, dict) and node.get(segment) is None:
                node[segment] = {}  # a missing or null section: start it empty, its defaults fill the rest
            node = node[segment]


def _strip_annotated(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> tuple[Any, ...]:
    annotation = _strip_annotated(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in get_args(annotation) if a is not type(None))
    return (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tagged_member(members: tuple[Any, ...], segment: Any) -> Any:
    """The member of a discriminated union whose tag (a ``Literal`` field's value) is ``segment``."""
    for member in members:
        if _is_model(member):
            for field in member.model_fields.values():
                if get_origin(field.annotation) is Literal and segment in get_args(field.annotation):
                    return member
    return None


def _tags(annotation: Any) -> list[str]:
    """The tags of a discriminated union's members (every ``Literal`` value of their fields)."""
    return [
        str(tag)
        for member in _union_members(annotation)
        if _is_model(member)
        for field in member.model_fields.values()
        if get_origin(field.annotation) is Literal
        for tag in get_args(field.annotation)
    ]


def _locate(cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Turn a pydantic error location into the user's dotted key path (union tags and labels dropped).

    Returns the path, the model whose field the last segment names (for "allowed keys" hints), and the
    annotation found at the path (``None`` past the schema).
    """
    path: list[str] = []
    node: Any = cls
    owner: type[BaseModel] | None = None
    after_tag = False  # a tag is followed by a key (a key may happen to equal the tag)
    for segment in loc:
        owner = None
        if node is None:
            path.append(str(segment))
            continue
        members = _union_members(node)
        tagged = _tagged_member(members, segment)
        if not after_tag and (len(members) > 1 or (tagged is not None and segment not in tagged.model_fields)):
            # A discriminated union's tag, or a plain union's member label: not a key the user wrote.
            node, after_tag = tagged, True
            continue
        after_tag = False
        node = members[0]
        origin = get_origin(node)
        if _is_model(node):
            owner = node
            field = node.model_fields.get(segment)
            node = field.annotation if field is not None else None
        elif origin in (tuple, list) and isinstance(segment, int):
            args = get_args(node)
            if origin is list or (len(args) == 2 and args[1] is Ellipsis):
                node = args[0]
            else:
                node = args[segment] if segment < len(args) else None
        elif origin is dict:
            node = get_args(node)[1]
        else:
            node = None
        path.append(str(segment))
    return path, owner, node


def _describe_error(cls: type[BaseModel], err: Any) -> str:
    path_segments, owner, node = _locate(cls, tuple(err["loc"]))
    path = ".".join(path_segments) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(path_segments[-1], allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        line = f"  {path}: unknown key; {hint}allowed keys here: {', '.join(allowed)}; remove or rename it"
        if owner is not None and _tags(owner):
            # Often a leftover of another kind after `section.name=other`: the whole section must change.
            parent = ".".join(path_segments[:-1])
            line += f" (to switch kinds, replace the whole section: {parent}={{...}})"
        return line
    if kind == "missing":
        field = owner.model_fields.get(path_segments[-1]) if owner is not None else None
        about = ""
        if field is not None and field.description:
            about = f" ({field.description.replace('``', '').rstrip('.')})"
        return f"  {path}: required but missing{about}; add it to the config or override {path}=VALUE"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = str(err.get("ctx", {}).get("discriminator", "")).strip("'")
        options = ", ".join(repr(tag) for tag in _tags(node))
        got = f"{key}={err['input'].get(key)!r} is not a known kind" if kind == "union_tag_invalid" else f"no {key!r}"
        return f"  {path}: {got}; set {path}.{key} to one of {options}"
    message = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind in ("value_error", "assertion_error"):
        return f"  {path}: {message}"
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"  {path}: {message}, got {shown}; fix it in the config or override {path}=VALUE"
