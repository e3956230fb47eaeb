"""The process-wide switches a run turns on for its duration: determinism, manual GC and the profiler.

``Trainer.train`` and ``Inference.infer`` enter the same context managers (so ``determinism``, ``gc`` and
``profiling`` mean the same in both jobs), and each puts back what it found when the run ends, error or not:
these are process-global, and a test suite or a notebook runs several jobs in one process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from d9dfn.config import ProfilingConfig, StepActionPeriod, should_do_action

__all__ = ["collect_garbage", "deterministic_algorithms", "manual_gc", "profile", "reseed_torch", "torch_rng_restored"]


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(True)`` when ``enabled``; then restore.

    The previous setting (and its ``warn_only`` flag) comes back on exit. On CUDA, deterministic cuBLAS
    also needs ``CUBLAS_WORKSPACE_CONFIG`` before cuBLAS starts
    (https://docs.pytorch.org/docs/stable/notes/randomness.html): when a GPU is visible and the variable is
    unset, this sets it to ``:4096:8`` (a value already set is kept; it must come before the first GPU matmul).

    >>> with deterministic_algorithms(True):
    ...     torch.are_deterministic_algorithms_enabled()
    True
    >>> torch.are_deterministic_algorithms_enabled()
    False
    """
    if not enabled:
        yield
        return
    if torch.cuda.is_available() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        # cuBLAS reads it when its handle is made (the first GPU matmul): without it a deterministic run
        # fails there. Setting it costs a little workspace memory; a value the user set is kept.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)


@contextlib.contextmanager
def manual_gc() -> Iterator[None]:
    """Automatic garbage collection off for the block, a full collection at entry and exit.

    The loop collects at ``gc.period_steps`` with :func:`collect_garbage`, so collection pauses land between
    steps on every rank at once rather than at random points inside one rank's step.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        if was_enabled:
            gc.enable()


def collect_garbage(period: StepActionPeriod, *, step: int, total_steps: int) -> bool:
    """Collect the young generations when ``period`` says ``step`` is due (not forced on the last step).

    Returns whether it collected.
    """
    if should_do_action(period, step=step, total_steps=total_steps, on_last_step=False):
        gc.collect(1)
        return True
    return False


@contextlib.contextmanager
def profile(profiling: ProfilingConfig | None) -> Iterator[Any]:
    """A ``torch.profiler.profile`` on ``profiling``'s cycle (``None`` when off); call ``.step()`` per step.

    Each cycle of ``period_steps`` steps waits, warms up for ``warmup_steps`` and records ``active_steps``,
    then writes ``traces_dir/trace_step<N>.json`` (a Chrome trace).
    """
    if profiling is None or not profiling.enabled:
        yield None
        return
    traces = Path(profiling.traces_dir)
    traces.mkdir(parents=True, exist_ok=True)
    schedule = torch.profiler.schedule(
        wait=max(profiling.period_steps - profiling.warmup_steps - profiling.active_steps, 0),
        warmup=profiling.warmup_steps,
        active=profiling.active_steps,
    )
    with warnings.catch_warnings():
        # Each cycle reporting only its own events is what we want; torch warns about it once.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        with torch.profiler.profile(
            schedule=schedule,
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(traces / f"trace_step{prof.step_num}.json")),
        ) as profiler:
            yield profiler


def reseed_torch(seed: int, step: int, rank: int) -> None:
    """Seed torch's global RNGs (CPU and every CUDA device) from ``(seed, step, rank)`` alone.

    ``Trainer`` calls it before every step. A model that draws from torch's RNG in ``forward`` (a Hugging
    Face model's dropout, ``nn.Dropout``) then draws the same numbers at step ``k`` whether the run went
    straight through or resumed from a checkpoint: the RNG state is a function of the step, so there is
    nothing to save and a resume on another number of ranks is just as exact for the ranks it has. Each
    rank draws differently. (d9dfn's own models take pure ``d9dfn.prng`` keys instead, which are also
    identical eager and compiled; torch's RNG is not: inductor draws with its own generator.)

    >>> reseed_torch(0, 3, 0); a = torch.rand(2)
    >>> reseed_torch(0, 3, 0); bool(torch.equal(a, torch.rand(2)))
    True
    """
    state = np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0]
    torch.manual_seed(int(state))


@contextlib.contextmanager
def torch_rng_restored() -> Iterator[None]:
    """Put torch's global RNG states (CPU, and CUDA when initialized) back as they were when the block ends."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
