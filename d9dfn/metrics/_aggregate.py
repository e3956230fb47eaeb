"""Running sums and means: ``sum_metric``, ``mean`` and ``weighted_mean``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn.metrics._base import Metric, add_states, as_tensor, safe_divide

__all__ = ["MeanState", "SumState", "WeightedMeanState", "mean", "sum_metric", "weighted_mean"]


class SumState(NamedTuple):
    """The running total of every value seen."""

    total: torch.Tensor  # () in the metric's dtype


class MeanState(NamedTuple):
    """The running total and the number of values it sums."""

    total: torch.Tensor  # () in the metric's dtype
    count: torch.Tensor  # type: ignore[assignment]  # () int64, exact; public name, shadows tuple.count


class WeightedMeanState(NamedTuple):
    """The running Σ value·weight and Σ weight."""

    weighted_total: torch.Tensor  # () in the metric's dtype
    weight: torch.Tensor  # () in the metric's dtype


def _check_float_dtype(fn: str, dtype: torch.dtype) -> None:
    if not dtype.is_floating_point:
        raise TypeError(f"{fn}: dtype must be a floating dtype, got {dtype}; pass e.g. dtype=torch.float32")


def sum_metric(*, dtype: torch.dtype = torch.float32) -> Metric:
    """The sum of every element of every value passed to ``update`` (d9d's ``SumMetric``).

    Args:
        dtype: the accumulator's dtype; inputs are cast to it before summing (bf16 losses sum in float32).

    Returns:
        A :class:`Metric` whose ``update(state, value)`` adds ``value.sum()`` and whose ``compute`` is
        the 0-d total.

    >>> m = sum_metric()
    >>> m.compute(m.update(m.update(m.init(), torch.tensor([1.0, 2.0])), 3.0))
    tensor(6.)
    """
    _check_float_dtype("sum_metric", dtype)

    def init(device: torch.device | str | None = None) -> SumState:
        return SumState(total=torch.zeros((), dtype=dtype, device=device))

    def update(state: SumState, value: torch.Tensor | float) -> SumState:
        value = as_tensor("sum_metric.update: value", value, state.total.device)
        return SumState(total=state.total + value.to(dtype).sum())

    def compute(state: SumState) -> torch.Tensor:
        return state.total

    return Metric(init=init, update=update, compute=compute, merge=add_states)


def mean(*, dtype: torch.dtype = torch.float32) -> Metric:
    """The mean of every element of every value passed to ``update``; 0 before any element was seen.

    Args:
        dtype: the dtype of the running total and of the result.

    Returns:
        A :class:`Metric` whose ``update(state, value)`` adds ``value.sum()`` and ``value.numel()``.

    >>> m = mean()
    >>> m.compute(m.update(m.update(m.init(), torch.tensor([1.0, 2.0])), torch.tensor(6.0)))
    tensor(3.)
    """
    _check_float_dtype("mean", dtype)

    def init(device: torch.device | str | None = None) -> MeanState:
        return MeanState(
            total=torch.zeros((), dtype=dtype, device=device), count=torch.zeros((), dtype=torch.int64, device=device)
        )

    def update(state: MeanState, value: torch.Tensor | float) -> MeanState:
        value = as_tensor("mean.update: value", value, state.total.device)
        return MeanState(total=state.total + value.to(dtype).sum(), count=state.count + value.numel())

    def compute(state: MeanState) -> torch.Tensor:
        return safe_divide(state.total, state.count)

    return Metric(init=init, update=update, compute=compute, merge=add_states)


def weighted_mean(*, dtype: torch.dtype = torch.float32) -> Metric:
    """The weighted mean Σ value·weight / Σ weight over every update (d9d's ``WeightedMeanMetric``).

    ``update(state, value, weight=None)``: ``weight`` broadcasts against ``value`` (a per-sequence
    weight against per-token values, or a 0-d weight for a whole batch); ``None`` weighs every
    element 1. A microbatch's loss with its token count as weight gives the logged loss Σ w·loss / Σ w. The
    result is 0 while Σ weight is 0.

    Args:
        dtype: the dtype of both running sums and of the result.

    Returns:
        A :class:`Metric` over a :class:`WeightedMeanState`.

    Raises:
        ValueError: from ``update``, if ``weight`` does not broadcast against ``value``.

    >>> m = weighted_mean()
    >>> s = m.update(m.init(), torch.tensor(2.0), torch.tensor(3.0))
    >>> m.compute(m.update(s, torch.tensor(4.0), torch.tensor(1.0)))
    tensor(2.5000)
    """
    _check_float_dtype("weighted_mean", dtype)

    def init(device: torch.device | str | None = None) -> WeightedMeanState:
        zero = torch.zeros((), dtype=dtype, device=device)
        return WeightedMeanState(weighted_total=zero, weight=zero.clone())

    def update(
        state: WeightedMeanState, value: torch.Tensor | float, weight: torch.Tensor | float | None = None
    ) -> WeightedMeanState:
        value = as_tensor("weighted_mean.update: value", value, state.weight.device).to(dtype)
        if weight is None:
            weight = torch.ones_like(value)
        weight = as_tensor("weighted_mean.update: weight", weight, state.weight.device).to(dtype)
        try:
            shape = torch.broadcast_shapes(value.shape, weight.shape)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        except RuntimeError as err:
            raise ValueError(
                f"weighted_mean.update: weight of shape {tuple(weight.shape)} does not broadcast against value of "
                f"shape {tuple(value.shape)}; pass one weight per value or a weight that broadcasts (e.g. 0-d)"
            ) from err
        return WeightedMeanState(
            weighted_total=state.weighted_total + (value * weight).sum(),
            weight=state.weight + weight.expand(shape).sum(),
        )

    def compute(state: WeightedMeanState) -> torch.Tensor:
        return safe_divide(state.weighted_total, state.weight)

    return Metric(init=init, update=update, compute=compute, merge=add_states)
