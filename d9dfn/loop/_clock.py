"""Wall-clock timing of a ``train()`` call, and ``timings.jsonl``, where the run directory keeps it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["TIMINGS_FILE", "Clock"]

TIMINGS_FILE = "timings.jsonl"
"""Wall-clock figures of every ``train()`` call, one JSON line each, in the run directory (kept out of the
tracker's records so that ``metrics.jsonl`` stays byte-identical across kills and resumes)."""


class Clock:
    """Wall-clock timing of one ``train()`` call: the first step (compilation included) and the warm steps after
    it, measured at the flushes (each waits for the steps of its period; no sync is added), with checkpoint saves
    and validation timed apart."""

    def __init__(self, start_step: int = 0) -> None:
        self.start_step = start_step
        self.first_step_s: float | None = None
        self.apart = {"checkpoint_s": 0.0, "validation_s": 0.0}
        self._warm_from = 0.0  # when the first step returned
        self._warm = (0.0, 0)  # (seconds of warm steps, warm steps) at the last flush

    def first_step_done(self, seconds: float | None) -> None:
        self.first_step_s = seconds
        self._warm_from = time.perf_counter()

    @contextlib.contextmanager
    def excluded(self, what: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.apart[what] += time.perf_counter() - started

    def flushed(self, position: int) -> None:
        if self.first_step_s is None:
            return
        seconds = time.perf_counter() - self._warm_from - sum(self.apart.values())
        self._warm = (seconds, position - self.start_step - 1)

    def step_s(self) -> float | None:
        seconds, steps = self._warm
        return seconds / steps if steps > 0 else None

    def record(self) -> dict[str, Any]:
        """The ``timings.jsonl`` line: the steps timed (to the last flush), first and warm steps' seconds, the rest."""
        seconds, steps = self._warm
        return {
            "start_step": self.start_step,
            "end_step": self.start_step + 1 + steps,
            "first_step_s": round(self.first_step_s or 0.0, 3),
            "step_s": None if steps <= 0 else round(seconds / steps, 6),
            **{name: round(value, 3) for name, value in self.apart.items()},
        }
