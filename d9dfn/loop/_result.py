"""``TrainResult``: what ``Trainer.train`` returns."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from d9dfn.step import TrainState

__all__ = ["TrainResult"]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What ``Trainer.train`` returns: the final state, the task's result and where the run's files are."""

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
