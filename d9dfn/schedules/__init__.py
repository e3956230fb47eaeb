"""Learning-rate schedules: pure functions of a 0-d step tensor, safe to call inside a compiled step.

d9d's piecewise multiplier schedule is built from plain values, not a builder: a list of phases
(:func:`steps`, :func:`percentage`, :func:`rest`) with curves (:func:`linear`, :func:`cosine`,
:func:`exponential`, :func:`poly`), mirroring d9d's ``PiecewiseSchedulerConfig`` one to one.

>>> import torch
>>> from d9dfn import schedules
>>> multiplier = schedules.piecewise(
...     0.0, [schedules.percentage(0.1, 1.0, schedules.linear()), schedules.rest(0.0, schedules.cosine())], 100
... )
>>> lr = schedules.scale(multiplier, 0.1)
>>> lr(torch.tensor(5)), lr(torch.tensor(10)), lr(torch.tensor(55))
(tensor(0.0500), tensor(0.1000), tensor(0.0500))
"""

from d9dfn.schedules._piecewise import (
    Curve,
    PercentagePhase,
    Phase,
    RestPhase,
    StepsPhase,
    constant,
    cosine,
    exponential,
    linear,
    percentage,
    piecewise,
    poly,
    rest,
    scale,
    steps,
    warmup_cosine,
)

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
