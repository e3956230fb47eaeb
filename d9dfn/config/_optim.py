"""Config-driven optimizers and learning-rate schedules (d9d's ``loop/auto``): configs and ``build_*``."""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, assert_never

import torch
from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator, model_validator

from d9dfn import optim, schedules
from d9dfn._types import Schedule, Transform
from d9dfn.config._base import FrozenConfig as _Config

__all__ = [
    "AdamConfig",
    "AdamWConfig",
    "AnyCurveConfig",
    "AnyPhaseConfig",
    "AutoLRSchedulerConfig",
    "AutoOptimizerConfig",
    "CosineCurveConfig",
    "ExponentialCurveConfig",
    "LinearCurveConfig",
    "PercentagePhaseConfig",
    "PiecewiseLRSchedulerConfig",
    "PiecewiseSchedulerConfig",
    "PolyCurveConfig",
    "RestPhaseConfig",
    "SGDConfig",
    "StepsPhaseConfig",
    "StochasticAdamWConfig",
    "build_lr_schedule",
    "build_optimizer",
]

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
    fused: bool | None = None
    """Run the update as torch's fused kernel (one call for every param, not compiled): ``true``, ``false`` (compiled
    into the step), or ``null`` (the default): fused for params on the CPU, where it compiles nothing and runs
    about as fast, compiled on a GPU."""


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
    fused: bool | None = None
    """Run the update as torch's fused kernel (one call for every param, not compiled): ``true``, ``false`` (compiled
    into the step), or ``null`` (the default): fused for params on the CPU, where it compiles nothing and runs
    about as fast, compiled on a GPU."""


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
                fused=config.fused,
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
                fused=config.fused,
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
