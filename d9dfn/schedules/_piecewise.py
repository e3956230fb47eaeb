"""d9d's piecewise multiplier schedule as a pure function of a step tensor, plus small helpers.

Semantics (d9d's ``piecewise_schedule``, ``d9d/lr_scheduler/piecewise/{builder,engine}.py`` in
github.com/d9d-project/d9d): phases follow each other from step 0. A phase
runs from the cursor for ``steps(n)`` steps, until ``int(total_steps · p)`` for ``percentage(p)``, or
until ``total_steps`` for ``rest()``, and moves the multiplier from the previous phase's target to its
own along a curve, with progress ``(step - start) / length``. Before step 0 the schedule gives the
initial multiplier; from the end of the last phase on, the last target. Zero-length phases are skipped.

The built schedule evaluates every phase and picks one with ``torch.where``: no Python branch looks at
the step, so one compiled graph serves every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch

from d9dfn._types import Schedule

__all__ = [
    "Curve",
    "PercentagePhase",
    "Phase",
    "RestPhase",
    "StepsPhase",
    "constant",
    "cosine",
    "exponential",
    "linear",
    "percentage",
    "piecewise",
    "poly",
    "rest",
    "scale",
    "steps",
    "warmup_cosine",
]

_EXP_FLOOR = 1e-8  # exponential curves interpolate logs, so values are clamped away from zero first


@dataclasses.dataclass(frozen=True)
class Curve:
    """How a phase moves from its start value to its end value as progress goes from 0 to 1."""

    kind: Literal["linear", "cosine", "exponential", "poly"]
    power: float = 2.0
    """The exponent of a ``poly`` curve (ignored by the others)."""

    def __call__(self, start: float, end: float, progress: torch.Tensor) -> torch.Tensor:
        """The value at ``progress`` (a float tensor in ``[0, 1]``)."""
        match self.kind:
            case "linear":
                return start + (end - start) * progress
            case "cosine":
                return end + (start - end) * (1.0 + torch.cos(math.pi * progress)) / 2.0
            case "exponential":
                log_start, log_end = math.log(max(start, _EXP_FLOOR)), math.log(max(end, _EXP_FLOOR))
                return torch.exp(log_start + (log_end - log_start) * progress)
            case "poly":
                return start + (end - start) * progress**self.power
            case _:
                raise ValueError(f"Curve: unknown kind {self.kind!r}; use linear(), cosine(), exponential() or poly()")


def linear() -> Curve:
    """A straight line from start to end."""
    return Curve("linear")


def cosine() -> Curve:
    """Half a cosine period from start to end: flat at both ends."""
    return Curve("cosine")


def exponential() -> Curve:
    """A straight line in log space (values below 1e-8 are clamped to 1e-8 first)."""
    return Curve("exponential")


def poly(power: float = 2.0) -> Curve:
    """``start + (end - start) · progress**power``; ``power`` must be positive.

    >>> poly(0.5).power
    0.5
    """
    if isinstance(power, bool) or not isinstance(power, int | float) or not (math.isfinite(power) and power > 0):
        raise ValueError(f"poly: power={power!r} must be a positive finite float; pass e.g. poly(2.0)")
    return Curve("poly", float(power))


@dataclasses.dataclass(frozen=True)
class StepsPhase:
    """A phase lasting ``num_steps`` steps and ending at ``target``."""

    num_steps: int
    target: float
    curve: Curve


@dataclasses.dataclass(frozen=True)
class PercentagePhase:
    """A phase lasting until step ``int(total_steps · percentage)`` and ending at ``target``."""

    percentage: float
    target: float
    curve: Curve


@dataclasses.dataclass(frozen=True)
class RestPhase:
    """A phase lasting until ``total_steps`` and ending at ``target``."""

    target: float
    curve: Curve


Phase: TypeAlias = StepsPhase | PercentagePhase | RestPhase


def steps(num_steps: int, target: float, curve: Curve) -> StepsPhase:
    """A phase of ``num_steps`` (a positive int) steps that ends at multiplier ``target``.

    >>> steps(100, 1.0, linear())
    StepsPhase(num_steps=100, target=1.0, curve=Curve(kind='linear', power=2.0))
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
        raise ValueError(f"steps: num_steps={num_steps!r} must be a positive int; pass e.g. steps(100, 1.0, linear())")
    return StepsPhase(num_steps, _check_target("steps", "target", target), _check_curve("steps", curve))


def percentage(p: float, target: float, curve: Curve) -> PercentagePhase:
    """A phase that ends at step ``int(total_steps · p)`` (``p`` in ``[0, 1]``) at multiplier ``target``."""
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
        raise ValueError(f"percentage: p={p!r} must be a fraction in [0, 1]; pass e.g. percentage(0.1, 1.0, linear())")
    return PercentagePhase(float(p), _check_target("percentage", "target", target), _check_curve("percentage", curve))


def rest(target: float, curve: Curve) -> RestPhase:
    """A phase that lasts until ``total_steps`` and ends at multiplier ``target``."""
    return RestPhase(_check_target("rest", "target", target), _check_curve("rest", curve))


@dataclasses.dataclass(frozen=True)
class _Segment:
    start: int
    end: int
    start_value: float
    end_value: float
    curve: Curve


@dataclasses.dataclass(frozen=True)
class _Piecewise:
    """The schedule :func:`piecewise` returns: segments with positive length and the two boundary values."""

    segments: tuple[_Segment, ...]
    before: float
    after: float

    def __call__(self, step: torch.Tensor) -> torch.Tensor:
        x = _as_float64(self, step)
        out = torch.full_like(x, self.after)
        for seg in self.segments:
            # Clamping keeps every branch finite (poly with fractional powers at negative progress).
            progress = ((x - seg.start) / (seg.end - seg.start)).clamp(0.0, 1.0)
            value = seg.curve(seg.start_value, seg.end_value, progress)
            out = torch.where((x >= seg.start) & (x < seg.end), value, out)
        return torch.where(x < 0, self.before, out).to(torch.float32)


def piecewise(initial_multiplier: float, phases: Sequence[Phase], total_steps: int | None = None) -> Schedule:
    """d9d's piecewise multiplier schedule, as a pure function of a step tensor.

    Args:
        initial_multiplier: the value at step 0 (and before it).
        phases: made by :func:`steps`, :func:`percentage` and :func:`rest`, in order.
        total_steps: the run's length in optimizer steps; needed by percentage and rest phases.

    Returns:
        A schedule: ``step`` (a 0-d tensor, or any shape, evaluated elementwise) -> float32 multiplier.

    Raises:
        ValueError: for no phases, a percentage or rest phase without ``total_steps``, a percentage
            that ends behind the end of the phase before it, or phases that overshoot ``total_steps``.

    >>> import torch
    >>> warmup_then_cosine = piecewise(0.0, [steps(10, 1.0, linear()), rest(0.1, cosine())], total_steps=110)
    >>> warmup_then_cosine(torch.tensor([-5, 0, 5, 10, 60, 110, 500]))
    tensor([0.0000, 0.0000, 0.5000, 1.0000, 0.5500, 0.1000, 0.1000])
    """
    if not phases:
        raise ValueError("piecewise: no phases; pass at least one of steps(...), percentage(...) or rest(...)")
    if total_steps is not None and (
        isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
    ):
        raise ValueError(f"piecewise: total_steps={total_steps!r} must be a positive int (optimizer steps) or None")
    initial = _check_target("piecewise", "initial_multiplier", initial_multiplier)
    cursor, value, segments = 0, initial, []
    for i, phase in enumerate(phases):
        match phase:
            case StepsPhase(num_steps=n):
                end = cursor + n
                what = f"steps({n})"
            case PercentagePhase(percentage=p):
                end = _percentage_end(i, f"percentage({p})", p, total_steps, cursor)
                what = f"percentage({p})"
            case RestPhase():
                end = _percentage_end(i, "rest()", 1.0, total_steps, cursor)
                what = "rest()"
            case _:
                raise TypeError(
                    f"piecewise: phase {i} is a {type(phase).__name__}; build phases with steps(...), "
                    f"percentage(...) or rest(...)"
                )
        if total_steps is not None and end > total_steps:
            raise ValueError(
                f"piecewise: phase {i} ({what}) ends at step {end}, past total_steps={total_steps}; shorten it to at "
                f"most {total_steps - cursor} steps, use rest(...) to fill the run, or raise total_steps"
            )
        if end > cursor:
            segments.append(_Segment(cursor, end, value, phase.target, phase.curve))
        cursor, value = end, phase.target
    return _Piecewise(tuple(segments), before=initial, after=value)


def _percentage_end(i: int, what: str, p: float, total_steps: int | None, cursor: int) -> int:
    if total_steps is None:
        raise ValueError(
            f"piecewise: phase {i} ({what}) needs total_steps; pass total_steps=... or use steps(n, ...) phases only"
        )
    end = int(total_steps * p)
    if end < cursor:
        raise ValueError(
            f"piecewise: phase {i} ({what}) ends at step {end} = int({total_steps} * {p}), behind the cursor at step "
            f"{cursor} where phase {i - 1} ended; raise the percentage to at least {cursor / total_steps:.6g} or "
            f"shorten the phases before it"
        )
    return end


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, step: torch.Tensor) -> torch.Tensor:
        return torch.full_like(_as_float64(self, step), self.value, dtype=torch.float32)


def constant(value: float) -> Schedule:
    """The same value at every step (a float32 tensor shaped like the step).

    >>> import torch
    >>> constant(0.5)(torch.tensor(7))
    tensor(0.5000)
    """
    return _Constant(_check_target("constant", "value", value))


@dataclasses.dataclass(frozen=True)
class _Scaled:
    schedule: Schedule
    factor: float

    def __call__(self, step: torch.Tensor) -> torch.Tensor:
        return self.schedule(step) * self.factor


def scale(schedule: Schedule, factor: float) -> Schedule:
    """``schedule`` times ``factor``: a learning rate from a multiplier (``lr = base_lr · multiplier``).

    >>> import torch
    >>> lr = scale(piecewise(0.0, [steps(4, 1.0, linear())]), 0.1)
    >>> lr(torch.tensor(2))
    tensor(0.0500)
    """
    if not callable(schedule):
        raise TypeError(f"scale: schedule is a {type(schedule).__name__}; pass a Schedule (a function of step)")
    return _Scaled(schedule, _check_target("scale", "factor", factor))


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, *, initial: float = 0.0, final: float = 0.0
) -> Schedule:
    """Linear warmup from ``initial`` to ``peak`` over ``warmup_steps``, then a cosine to ``final`` at ``total_steps``.

    >>> import torch
    >>> warmup_cosine(1.0, 2, 6)(torch.arange(7))
    tensor([0.0000, 0.5000, 1.0000, 0.8536, 0.5000, 0.1464, 0.0000])
    """
    phases: list[Phase] = [rest(final, cosine())]
    if warmup_steps:
        phases.insert(0, steps(warmup_steps, peak, linear()))
    return piecewise(initial if warmup_steps else peak, phases, total_steps)


def _as_float64(schedule: object, step: torch.Tensor) -> torch.Tensor:
    if not isinstance(step, torch.Tensor):
        raise TypeError(
            f"{type(schedule).__name__.lstrip('_').lower()} schedule: step is a {type(step).__name__}; pass a 0-d "
            f"tensor (torch.tensor(step)): a Python int would make a compiled step recompile every step"
        )
    # float64 keeps progress and the curves exact to well past 2**24 steps; the result is float32.
    return step.to(torch.float64)


def _check_target(fn: str, name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{fn}: {name}={value!r} must be a finite float")
    return float(value)


def _check_curve(fn: str, curve: Curve) -> Curve:
    if not isinstance(curve, Curve):
        raise TypeError(
            f"{fn}: curve is a {type(curve).__name__}; pass linear(), cosine(), exponential() or poly(power)"
        )
    return curve
