"""Numerical helpers that more than one core package needs (the step, the metrics).

A helper lands here, rather than in one of its users, when the users are siblings: the step must not
import ``d9dfn.metrics`` to divide, and the metrics must not import the step.
"""

from __future__ import annotations

import torch

__all__ = ["safe_divide"]


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, and 0 wherever the denominator is 0 (no NaN, no host sync).

    Integer numerators (counts) give float32; floating ones keep their dtype. A step whose every token is
    masked (``Σw = 0``) contributes nothing; a metric that saw nothing reports 0.

    >>> safe_divide(torch.tensor([1, 3]), torch.tensor([0, 4]))
    tensor([0.0000, 0.7500])
    """
    numerator = numerator.to(torch.float32) if not numerator.is_floating_point() else numerator
    denominator = denominator.to(numerator.dtype)
    is_zero = denominator == 0
    # Divide by 1 where the denominator is 0 so that no inf/NaN appears even transiently (gradients, anomaly mode).
    return torch.where(is_zero, torch.zeros_like(numerator), numerator / torch.where(is_zero, 1, denominator))
