"""``TrainResult``: what ``Trainer.train`` returns."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from d9dfn._pytree import tree_leaves
from d9dfn.step import TrainState

__all__ = ["TrainResult"]

_SHOWN_CHARS = 200
"""How much of the task's result ``repr`` shows."""


@dataclasses.dataclass(frozen=True, repr=False)
class TrainResult:
    """What ``Trainer.train`` returns: the final state, the task's result and where the run's files are.

    Its ``repr`` summarizes (``print(trainer.train())`` would otherwise print every parameter and moment): the
    state as its step and the sizes of its parts; the fields themselves hold everything.
    """

    state: TrainState
    task_result: Any
    run_dir: Path
    steps_run: int
    plot_path: Path | None
    steps_skipped: int = 0
    """Steps of this call whose update was skipped as non-finite (``skip_nonfinite``); logged as ``skipped``."""
    first_step_s: float | None = None
    """Seconds this call's first step took, compilation included (``None`` when no step ran)."""
    step_s: float | None = None
    """Seconds per warm step after the first, checkpoint saves and validation excluded (``None``: fewer than 2
    steps ran, or none after the first before the last logged record)."""

    def __repr__(self) -> str:
        task = repr(self.task_result)
        task = task if len(task) <= _SHOWN_CHARS else task[: _SHOWN_CHARS - 3] + "..."
        fields = [
            f"run_dir={str(self.run_dir)!r}",
            f"steps_run={self.steps_run}",
            f"steps_skipped={self.steps_skipped}",
            f"state={_state_summary(self.state)}",
            f"task_result={task}",
            f"plot_path={str(self.plot_path) if self.plot_path is not None else None!r}",
            f"first_step_s={_seconds(self.first_step_s)}",
            f"step_s={_seconds(self.step_s)}",
        ]
        return f"TrainResult({', '.join(fields)})"


def _seconds(value: float | None) -> str:
    return "None" if value is None else f"{value:.3g}"


def _state_summary(state: Any) -> str:
    """``TrainState(step=20, params=11 tensors / 1.2e+04 elements, ...)``: the parts' sizes, no values."""
    if not isinstance(state, TrainState):
        return type(state).__name__
    step = int(state.step) if isinstance(state.step, torch.Tensor) and state.step.numel() == 1 else state.step
    parts = [f"step={step}"]
    for name in ("params", "buffers", "opt_state", "metric_state"):
        tensors = [leaf for leaf in tree_leaves(getattr(state, name)) if isinstance(leaf, torch.Tensor)]
        parts.append(f"{name}={len(tensors)} tensors / {sum(t.numel() for t in tensors):.3g} elements")
    return f"TrainState({', '.join(parts)})"
