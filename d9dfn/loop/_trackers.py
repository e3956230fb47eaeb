"""Trackers: where a run's metric records go (``logging.tracker``).

A :class:`Tracker` receives the records the loop writes once per logging period (one dict per step, each
with a ``step``). Its :meth:`~Tracker.position` is saved in every checkpoint (``log_lines``) and handed back
to :meth:`~Tracker.truncate` on resume, so records a killed run wrote after its last checkpoint are not
repeated. Two trackers ship: :class:`JsonlTracker` (``metrics.jsonl`` in the run directory) and
:class:`NullTracker` (records nothing; the progress bar still shows the loss).

The protocol is the extension point for other backends (TensorBoard, Weights & Biases, MLflow): a class
with these five methods, built by a provider of your own. d9dfn ships none of them, so it adds no
dependency; a backend that cannot forget records (``truncate``) should at least tag them with the step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from d9dfn.config import JsonlTrackerConfig, NullTrackerConfig
from d9dfn.loop._run_dir import atomic_write

__all__ = ["JsonlTracker", "NullTracker", "Tracker", "build_tracker"]


@runtime_checkable
class Tracker(Protocol):
    """Receives a run's metric records; its position makes a resumed run's records exact."""

    def log(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Record ``records`` (dicts of JSON numbers, each with a ``step``) durably, in order."""
        ...

    def position(self) -> int:
        """How much has been recorded so far: the value a checkpoint saves (``log_lines``)."""
        ...

    def truncate(self, position: int) -> None:
        """Forget everything recorded after ``position`` (a checkpoint's; 0 when no checkpoint exists)."""
        ...

    def records(self) -> list[dict[str, Any]] | None:
        """Everything recorded, for the loss plot; ``None`` when this tracker cannot read it back."""
        ...

    def close(self) -> None:
        """Flush and release resources; called once when the run ends."""
        ...


class JsonlTracker:
    """Append-only JSON lines: one object per line, each with a ``step``; the position is the line count.

    >>> import tempfile
    >>> tracker = JsonlTracker(Path(tempfile.mkdtemp()) / "metrics.jsonl")
    >>> tracker.log([{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}])
    >>> tracker.position()
    2
    >>> tracker.truncate(1)
    >>> tracker.records()
    [{'step': 1, 'loss': 2.5}]
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)

    def log(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` and close the file (so a kill loses at most a half-written last line)."""
        if not records:
            return
        with self.path.open("a", encoding="utf-8") as file:
            for record in records:
                file.write(json.dumps(record, sort_keys=False) + "\n")

    def position(self) -> int:
        """How many complete lines the file holds."""
        return self.path.read_bytes().count(b"\n")

    def truncate(self, position: int) -> None:
        """Keep the first ``position`` lines (and drop any half-written last line); atomic (a new file renamed over)."""
        data = self.path.read_bytes()
        lines = data.split(b"\n")[:position]
        kept = b"".join(line + b"\n" for line in lines)
        if kept != data:  # nothing to forget: leave the file alone
            atomic_write(self.path, kept)

    def records(self) -> list[dict[str, Any]]:
        """All records."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def close(self) -> None:
        """Nothing to release: every ``log`` closes the file."""


class NullTracker:
    """Records nothing: position 0, nothing to read back (so no loss plot).

    >>> tracker = NullTracker()
    >>> tracker.log([{"step": 1, "loss": 2.5}])
    >>> tracker.position(), tracker.records()
    (0, None)
    """

    def log(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Drop ``records``."""

    def position(self) -> int:
        """Always 0."""
        return 0

    def truncate(self, position: int) -> None:
        """Nothing to forget."""

    def records(self) -> list[dict[str, Any]] | None:
        """``None``: nothing was kept."""
        return None

    def close(self) -> None:
        """Nothing to release."""


def build_tracker(config: JsonlTrackerConfig | NullTrackerConfig, run_dir: Path, *, enabled: bool = True) -> Tracker:
    """The tracker ``logging.tracker`` names, writing under ``run_dir``; a :class:`NullTracker` when not ``enabled``.

    Only the main process records (``enabled``): the other ranks hold the same values.

    >>> build_tracker(NullTrackerConfig(), Path("runs/x"))  # doctest: +ELLIPSIS
    <d9dfn.loop._trackers.NullTracker object at ...>
    """
    if not enabled:
        return NullTracker()
    match config:
        case JsonlTrackerConfig(filename=filename):
            return JsonlTracker(run_dir / filename)
        case NullTrackerConfig():
            return NullTracker()
        case _:
            raise TypeError(
                f"build_tracker: {type(config).__name__} is not a tracker config; pass JsonlTrackerConfig or "
                "NullTrackerConfig (logging.tracker.provider 'jsonl' or 'null')"
            )
