"""The run's outputs for people: a progress bar, the loss plot and flat metric names (trackers: ``_trackers.py``).

Everything here runs on the main process only and at most once per logging period: the loop hands over
tensors gathered over the period, and one ``tolist()`` per period is the only host sync.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from d9dfn._pytree import tree_flatten_with_path, tree_leaves
from d9dfn.loop._run_dir import atomic_write
from d9dfn.pipeline import Costs, Program, simulate

__all__ = ["ProgressBar", "flatten_scalars", "plot_loss", "plot_pipeline", "tokens_in"]


def flatten_scalars(tree: Any, prefix: str = "") -> dict[str, float]:
    """Flatten a tree of 0-d tensors / numbers into ``{"a/b": float}`` (d9d joins names with ``/``).

    >>> flatten_scalars({"acc": torch.tensor(0.5), "f1": {"macro": 1}}, prefix="val")
    {'val/acc': 0.5, 'val/f1/macro': 1.0}
    """
    paths, leaves, _ = tree_flatten_with_path(tree)
    out = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if leaf is None:
            continue
        name = "/".join(str(part) for part in ((prefix,) if prefix else ()) + tuple(path)) or "value"
        value = leaf.detach().float().cpu() if isinstance(leaf, torch.Tensor) else torch.tensor(float(leaf))
        if value.ndim == 0:
            out[name] = float(value)
        else:  # per-class vectors: one scalar per entry
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(value.flatten().tolist())})
    return out


def tokens_in(batch: Any) -> int:
    """Tokens in a batch, for the progress bar: ``input_ids`` or ``tokens``, else the leading batch size."""
    for key in ("input_ids", "tokens"):  # d9d / HF and Megatron names
        if isinstance(batch, dict) and isinstance(batch.get(key), torch.Tensor):
            return batch[key].numel()
    leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim > 0]
    return leaves[0].shape[0] if leaves else 1


class ProgressBar:
    """A one-line progress bar on stderr: step, loss, tokens/s and ETA; silent off the main process.

    While the first step runs (compilation, for a compiled step) there is no bar and no ETA, only a status line
    ``train: compiling (first step)… 00:42`` whose elapsed time a daemon thread refreshes every ``tick_s`` seconds
    (:meth:`first_step`); the bar, its rate and its ETA start once that step is done, so they count warm steps
    only. The thread only redraws text: it touches no tensor and adds no host sync.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        unit: str = "step",
        tick_s: float | None = None,
        leave: bool = True,
    ) -> None:
        self.enabled = enabled
        self.total = total
        self.desc = desc
        self.unit = unit
        self.leave = leave  # False: the bar clears itself when closed (one drawn below another, as validation)
        # A terminal redraws in place every second; a log file gets a line every 30 s, not a line a second.
        self.tick_s = tick_s if tick_s is not None else (1.0 if sys.stderr.isatty() else 30.0)
        self._bar: Any = None
        self._start = time.perf_counter()
        self._start_step = initial
        self._initial = initial
        self.first_step_s: float | None = None
        """Seconds the first step took (compilation included), once :meth:`first_step` has returned."""
        self.ticker: _Ticker | None = None  # the status line while the first step runs

    @contextlib.contextmanager
    def first_step(self, what: str = "compiling (first step)") -> Iterator[None]:
        """Show ``desc: what… elapsed`` while the block runs (the first step), then start the bar.

        Times the block into :attr:`first_step_s` on every process (the bar itself only where ``enabled``).
        """
        started = time.perf_counter()
        ticker = self.ticker = _Ticker(f"{self.desc}: {what}…", self.tick_s) if self.enabled else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.close()
        self.first_step_s = time.perf_counter() - started
        self._start = time.perf_counter()  # rates and the ETA count the warm steps only
        self._start_step = self._initial + 1

    def update(self, step: int, *, tokens: int = 0, loss: float | None = None, skipped: int = 0) -> None:
        """Advance to ``step`` (1-based count of steps done); ``loss`` is the last logged value.

        ``tokens`` per step give a tokens/s figure (0: none); ``skipped`` (steps whose update was skipped as
        non-finite so far) is shown once it is above 0; the first step's time, once known, stays in the postfix.
        """
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            # Started after the first step: tqdm's clock, rate and ETA never see the compilation.
            self._bar = tqdm(
                total=self.total,
                initial=self._start_step if self.first_step_s is not None else self._initial,
                desc=self.desc,
                unit=self.unit,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=self.leave,
            )
        postfix: dict[str, str] = {}
        elapsed = time.perf_counter() - self._start
        if tokens and step > self._start_step and elapsed > 0:
            postfix["tok/s"] = f"{tokens * (step - self._start_step) / elapsed:,.0f}"
        if loss is not None and math.isfinite(loss):
            postfix["loss"] = f"{loss:.4f}"
        if skipped:
            postfix["skipped"] = str(skipped)
        if self.first_step_s is not None:
            postfix[f"first {self.unit}"] = f"{self.first_step_s:.1f}s"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Ticker:
    """A status line with its elapsed time, redrawn from a daemon thread until :meth:`close`."""

    def __init__(self, text: str, tick_s: float) -> None:
        from tqdm import tqdm

        # No total, no rate, no ETA: the text and the time since it started.
        self._bar = tqdm(total=None, bar_format=text + " {elapsed}", file=sys.stderr, leave=False, dynamic_ncols=True)
        self._stop = threading.Event()
        self.ticked = threading.Event()  # set at every redraw (tests wait on it instead of sleeping)
        self._thread = threading.Thread(target=self._run, args=(tick_s,), name="d9dfn-progress", daemon=True)
        self._thread.start()

    def _run(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            self._bar.refresh()
            self.ticked.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._bar.close()


def plot_loss(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Plot ``loss`` (and ``val/loss`` if present) against ``step`` into a PNG.

    Returns the path, or ``None`` (after a one-line notice) when matplotlib is not installed: it is the
    optional ``plot`` extra.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("d9dfn: matplotlib is not installed; skipping the loss plot (pip install 'd9dfn[plot]')")
        return None
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1.0)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda file: fig.savefig(file, format="png"))  # a rewrite on resume: never torn
    plt.close(fig)
    return path


_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:cyan", "W": "tab:green"}


def plot_pipeline(program: Program, path: str | Path, costs: Costs | None = None) -> Path:
    """Draw ``program``'s simulated timeline (``d9dfn.pipeline.render`` as bars, one per action) into a PNG.

    Needs matplotlib (the ``plot`` extra), imported here only; uses no pyplot state.

    Raises:
        ImportError: matplotlib is not installed (``pip install d9dfn[plot]``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plot_pipeline: needs matplotlib; install the plot extra (pip install 'd9dfn[plot]')"
        ) from exc
    timeline = simulate(program, costs)
    figure = Figure(figsize=(max(6.0, timeline.makespan * 0.35), 0.6 * program.num_ranks + 1.0))
    axes = figure.add_subplot()
    for rank, row in enumerate(timeline.intervals):
        for start, finish, action in row:
            axes.broken_barh([(start, finish - start)], (rank - 0.4, 0.8), color=_COLOURS[action.kind], ec="white")
            axes.text((start + finish) / 2, rank, str(action), ha="center", va="center", fontsize=6, color="white")
    axes.set_yticks(range(program.num_ranks), [f"rank {rank}" for rank in range(program.num_ranks)])
    axes.invert_yaxis()
    axes.set_xlabel("time")
    axes.set_title(
        f"makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%}, "
        f"peak activations {list(timeline.peak_activations)}"
    )
    path = Path(path)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path
