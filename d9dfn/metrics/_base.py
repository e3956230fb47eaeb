"""The metric vocabulary: ``Metric``, a NamedTuple of four pure functions, and the helpers every metric shares.

A metric is made by a factory (``accuracy(top_k=5)``), the way an optax transform is. Its state is a
NamedTuple of tensors with fixed shapes that holds *sufficient statistics* (counts, sums, histograms),
never ratios, so that two states combine by adding their leaves: ``merge`` adds two local states
(microbatches, eval shards) and :func:`d9dfn.metrics.reduce` all-reduces them with SUM across ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from d9dfn._numerics import safe_divide  # the core step divides the same way; one owner
from d9dfn._types import PyTree

__all__ = [
    "Metric",
    "MetricComputeFn",
    "MetricInitFn",
    "MetricMergeFn",
    "MetricUpdateFn",
    "add_states",
    "as_tensor",
    "safe_divide",
]


class MetricInitFn(Protocol):
    """Builds an empty state (all sufficient statistics zero) on ``device``; the default device if ``None``."""

    def __call__(self, device: torch.device | str | None = None) -> PyTree: ...


class MetricUpdateFn(Protocol):
    """Folds one batch of inputs into a state; pure and compilable: no host syncs, no in-place writes."""

    def __call__(self, state: PyTree, /, *args: Any, **kwargs: Any) -> PyTree: ...


class MetricComputeFn(Protocol):
    """Turns a state into results: a tree of 0-d or 1-d tensors, still on the device (no ``.item()``)."""

    def __call__(self, state: PyTree, /) -> PyTree: ...


class MetricMergeFn(Protocol):
    """Combines two states as if one had seen both inputs; commutative and associative."""

    def __call__(self, a: PyTree, b: PyTree, /) -> PyTree: ...


class Metric(NamedTuple):
    """A metric: four pure functions made by a factory (``accuracy()``, ``confusion_matrix(10)``).

    The loop owns the state: ``init`` it, ``update`` it every step, ``reduce`` it across ranks and
    ``compute`` it once per logging period, then ``init`` again. Replace one function to customize,
    e.g. ``metric._replace(compute=my_compute)``.

    >>> from d9dfn.metrics import mean
    >>> m = mean()
    >>> s = m.update(m.init(), torch.tensor([1.0, 2.0]))
    >>> m.compute(m.merge(s, m.update(m.init(), torch.tensor([6.0]))))
    tensor(3.)
    """

    init: MetricInitFn
    update: MetricUpdateFn
    compute: MetricComputeFn
    merge: MetricMergeFn


StateT = TypeVar("StateT")


def add_states(a: StateT, b: StateT) -> StateT:
    """Merge two states of the same metric by adding their leaves (every d9dfn state is sum-mergeable)."""
    # Imported here: the pytree module registers d9dfn's namespace, the facade imports us early.
    from d9dfn._pytree import tree_map

    merged: StateT = tree_map(torch.add, a, b)  # tree_map keeps the structure, so the state's type
    return merged


def as_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """``value`` as a tensor on ``device`` (Python numbers become tensors; tensors on a device stay there)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float)):
        return torch.as_tensor(value, device=device)
    raise TypeError(f"{name}: expected a tensor or a Python number, got {type(value).__name__}; pass a torch.Tensor")
