"""Trackers: where a run's metric records go (``logging.tracker``).

A :class:`Tracker` receives the records the loop writes once per logging period (one dict per step, each
with a ``step``). Its :meth:`~Tracker.position` is saved in every checkpoint (``log_lines``) and handed back
to :meth:`~Tracker.truncate` on resume, so records a killed run wrote after its last checkpoint are not
repeated. Three trackers ship: :class:`JsonlTracker` (``metrics.jsonl`` in the run directory),
:class:`TensorBoardTracker` (the same JSON lines, mirrored into TensorBoard event files; the optional ``tb`` extra)
and :class:`NullTracker` (records nothing; the progress bar still shows the loss).

The protocol is the extension point for other backends (Weights & Biases, MLflow): a class with these five
methods, built by a provider of your own. A backend that cannot forget records (``truncate``) can do as
:class:`TensorBoardTracker` does: keep the JSON lines as the record and rewrite its own copy from them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from d9dfn.config import JsonlTrackerConfig, NullTrackerConfig, TensorBoardTrackerConfig
from d9dfn.loop._run_dir import atomic_write

__all__ = ["JsonlTracker", "NullTracker", "TensorBoardTracker", "Tracker", "build_tracker"]


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


class TensorBoardTracker:
    """:class:`JsonlTracker`'s records, mirrored into TensorBoard event files under ``log_dir`` (one scalar per key).

    The JSON lines are the record: :meth:`position`, :meth:`truncate` and :meth:`records` are theirs. An event
    file cannot forget events, so :meth:`truncate` deletes ``log_dir``'s event files and writes the kept records
    again into a new one (which starts with a purge of every earlier step, so a TensorBoard that is watching drops
    what it had read): a resumed run shows each step once, with the values of ``metrics.jsonl`` (as float32,
    TensorBoard's scalar type). Values that are not numbers (``None``, strings) are not written.

    Needs the ``tensorboard`` package (``pip install 'd9dfn[tb]'``); torch's ``SummaryWriter`` writes the files.

    Raises:
        ValueError: ``tensorboard`` is not installed (from the constructor, before the run starts).
    """

    def __init__(self, path: Path, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "logging.tracker.provider 'tensorboard' needs the tensorboard package, which is not installed: "
                "pip install 'd9dfn[tb]' (or choose provider 'jsonl')"
            ) from None
        self._summary_writer = SummaryWriter
        self._jsonl = JsonlTracker(path)
        self.path = path
        self.log_dir = log_dir
        self._writer: Any = None

    def _open(self, purge_step: int | None = None) -> Any:
        if self._writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._summary_writer(log_dir=str(self.log_dir), purge_step=purge_step)
        return self._writer

    def _write(self, records: Sequence[Mapping[str, Any]]) -> None:
        writer = self._open()
        for record in records:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    writer.add_scalar(key, float(value), global_step=record["step"])
        writer.flush()

    def log(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Append ``records`` to the JSON lines, then to the event file (flushed)."""
        if not records:
            return
        self._jsonl.log(records)
        self._write(records)

    def position(self) -> int:
        """The JSON lines' position."""
        return self._jsonl.position()

    def truncate(self, position: int) -> None:
        """Cut the JSON lines back to ``position`` and rewrite the event files from the lines kept."""
        self._jsonl.truncate(position)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for old in self.log_dir.glob("events.out.tfevents.*") if self.log_dir.is_dir() else ():
            old.unlink()
        self._open(purge_step=0)  # a watching TensorBoard forgets every step it has read
        kept = self._jsonl.records()
        if kept:
            self._write(kept)

    def records(self) -> list[dict[str, Any]]:
        """The JSON lines' records."""
        return self._jsonl.records()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


AnyTracker = JsonlTrackerConfig | NullTrackerConfig | TensorBoardTrackerConfig


def build_tracker(config: AnyTracker, run_dir: Path, *, enabled: bool = True) -> Tracker:
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
        case TensorBoardTrackerConfig(filename=filename, log_dir=log_dir):
            return TensorBoardTracker(run_dir / filename, run_dir / log_dir)
        case NullTrackerConfig():
            return NullTracker()
        case _:
            raise TypeError(
                f"build_tracker: {type(config).__name__} is not a tracker config; pass JsonlTrackerConfig, "
                "TensorBoardTrackerConfig or NullTrackerConfig (logging.tracker.provider 'jsonl', 'tensorboard' or "
                "'null')"
            )
