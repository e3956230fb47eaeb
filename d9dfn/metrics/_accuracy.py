"""Top-k classification accuracy from logits and integer targets."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn.metrics._base import Metric, add_states, safe_divide

__all__ = ["AccuracyState", "accuracy", "check_logits_and_target", "target_rank"]


class AccuracyState(NamedTuple):
    """How many counted targets were hit, and how many were counted."""

    correct: torch.Tensor  # () int64
    total: torch.Tensor  # () int64


def check_logits_and_target(fn: str, logits: torch.Tensor, target: torch.Tensor) -> None:
    """Raise unless ``logits`` is (..., C) floating and ``target`` is the matching (...) integer tensor."""
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(
            f"{fn}: logits and target must be tensors, got {type(logits).__name__} and {type(target).__name__}"
        )
    if logits.ndim < 1 or not logits.is_floating_point():
        raise ValueError(
            f"{fn}: logits must be a floating tensor (..., C) with classes last, got dtype {logits.dtype} and shape "
            f"{tuple(logits.shape)}; pass the model's scores, not predicted labels"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(
            f"{fn}: target must hold integer class indices, got dtype {target.dtype}; cast it with .long()"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{fn}: target of shape {tuple(target.shape)} does not match logits of shape {tuple(logits.shape)}; "
            f"target must have logits' shape without the last (class) dimension, i.e. {tuple(logits.shape[:-1])}"
        )


def target_rank(logits: torch.Tensor, safe_target: torch.Tensor) -> torch.Tensor:
    """Each target's 0-based rank among its row's classes: (..., C), (...) -> (...) int64.

    A class outranks the target if its logit is larger, or equal with a smaller index: the order of a
    stable descending sort, so rank 0 is exactly ``argmax`` and ties never depend on the kernel. A
    target whose logit is NaN gets rank C: it is never counted as predicted.
    """
    target_logit = logits.gather(-1, safe_target.unsqueeze(-1))  # (..., 1)
    classes = torch.arange(logits.shape[-1], device=logits.device)  # (C,)
    beats = (logits > target_logit) | ((logits == target_logit) & (classes < safe_target.unsqueeze(-1)))
    return torch.where(target_logit.squeeze(-1).isnan(), logits.shape[-1], beats.sum(-1))


def accuracy(top_k: int = 1, ignore_index: int | None = None) -> Metric:
    """The fraction of targets among the ``top_k`` highest logits of their row; 0 before any target.

    ``update(state, logits, target)`` takes logits (N, C) or (N, ..., C), classes last (token-level
    logits of a language model fit as they are), and integer targets of shape (N,) or (N, ...).
    Targets equal to ``ignore_index`` are not counted; every other target must lie in ``[0, C)``.
    Ties are broken as ``argmax`` breaks them, by the smaller class index. The state holds two
    int64 counts, so any number of updates and ranks add up exactly.

    Args:
        top_k: a target counts as correct if fewer than ``top_k`` classes outrank it.
        ignore_index: a target value to skip (e.g. -100 for padding), or ``None`` to count every target.

    Returns:
        A :class:`Metric` over an :class:`AccuracyState`; ``compute`` gives a 0-d float32 tensor.

    Raises:
        ValueError: if ``top_k < 1``; from ``update``, if the shapes or dtypes do not fit.

    >>> m = accuracy(ignore_index=-100)
    >>> logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    >>> m.compute(m.update(m.init(), logits, torch.tensor([0, 0, -100])))
    tensor(0.5000)
    """
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"accuracy: top_k must be an int >= 1, got {top_k!r}; pass top_k=1 for plain accuracy")

    def init(device: torch.device | str | None = None) -> AccuracyState:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return AccuracyState(correct=zero, total=zero.clone())

    def update(state: AccuracyState, logits: torch.Tensor, target: torch.Tensor) -> AccuracyState:
        check_logits_and_target("accuracy.update", logits, target)
        if ignore_index is None:
            valid = torch.ones_like(target, dtype=torch.bool)
            safe_target = target
        else:
            valid = target != ignore_index
            # Ignored positions still go through gather: point them at class 0, then mask them out.
            safe_target = torch.where(valid, target, 0)
        hit = (target_rank(logits, safe_target) < top_k) & valid
        return AccuracyState(correct=state.correct + hit.sum(), total=state.total + valid.sum())

    def compute(state: AccuracyState) -> torch.Tensor:
        return safe_divide(state.correct, state.total)

    return Metric(init=init, update=update, compute=compute, merge=add_states)
