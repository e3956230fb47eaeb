"""``compose``: several named metrics as one, over a dict of their states."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9dfn._types import PyTree
from d9dfn.metrics._base import Metric

__all__ = ["compose"]


def compose(metrics: Mapping[str, Metric]) -> Metric:
    """One :class:`Metric` over ``{name: state}`` made of named metrics (d9d's ``ComposeMetric``).

    ``update(state, inputs)`` takes ``inputs = {name: args}``: a tuple of positional arguments or a
    mapping of keyword arguments for that metric's ``update``. Metrics whose name is absent keep
    their state, so one step may update only some of them. ``compute`` returns ``{name: result}``
    and ``merge`` merges name by name. States and results keep the order of ``metrics``.

    Args:
        metrics: the metrics by name; names become the keys of states and results.

    Returns:
        A :class:`Metric` whose state is ``{name: that metric's state}``.

    Raises:
        TypeError: if a value is not a :class:`Metric`; from ``update``, if an entry of ``inputs``
            is neither a tuple nor a mapping.
        ValueError: from ``update``, if ``inputs`` names a metric that is not composed.

    >>> from d9dfn.metrics import accuracy, mean
    >>> m = compose({"loss": mean(), "acc": accuracy()})
    >>> logits, target = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1])
    >>> state = m.update(m.init(), {"loss": (torch.tensor([0.5, 1.5]),), "acc": (logits, target)})
    >>> m.compute(state)
    {'loss': tensor(1.), 'acc': tensor(0.5000)}
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"compose: expected a mapping of names to metrics, got {type(metrics).__name__}")
    for name, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TypeError(
                f"compose: metrics[{name!r}] is a {type(metric).__name__}, not a Metric; build it with a factory "
                f"such as d9dfn.metrics.mean()"
            )
    metrics = dict(metrics)

    def init(device: torch.device | str | None = None) -> dict[str, PyTree]:
        return {name: metric.init(device) for name, metric in metrics.items()}

    def update(
        state: Mapping[str, PyTree], inputs: Mapping[str, tuple[Any, ...] | Mapping[str, Any]]
    ) -> dict[str, PyTree]:
        unknown = [name for name in inputs if name not in metrics]
        if unknown:
            raise ValueError(
                f"compose.update: inputs name metrics {unknown} that are not composed; known: {list(metrics)}"
            )
        new_state = dict(state)
        for name, args in inputs.items():
            if isinstance(args, tuple):
                new_state[name] = metrics[name].update(state[name], *args)
            elif isinstance(args, Mapping):
                new_state[name] = metrics[name].update(state[name], **args)
            else:
                raise TypeError(
                    f"compose.update: inputs[{name!r}] is a {type(args).__name__}; pass a tuple of positional "
                    f"arguments, e.g. (value,), or a dict of keyword arguments"
                )
        return new_state

    def compute(state: Mapping[str, PyTree]) -> dict[str, PyTree]:
        return {name: metric.compute(state[name]) for name, metric in metrics.items()}

    def merge(a: Mapping[str, PyTree], b: Mapping[str, PyTree]) -> dict[str, PyTree]:
        return {name: metric.merge(a[name], b[name]) for name, metric in metrics.items()}

    return Metric(init=init, update=update, compute=compute, merge=merge)
