"""Real multi-process tests on CPU: fork ranks that join a gloo process group; fail, never hang."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _init(rank: int, world_size: int, init_file: str, timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    # A short timeout: a peer that died makes a collective fail within it instead of hanging.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist


def _run_ranks(worker: Callable, world_size: int, tmp_path: Any, *args: Any, timeout_s: float = 120.0) -> None:
    """Fork ``world_size`` ranks of ``worker(rank, world_size, init_file, *args)``; fail (never hang) on error."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # fork, not spawn: children that re-import torch take ~15 s on a 2-core runner, forked ones start at once.
    context = mp.start_processes(
        worker,
        args=(world_size, str(tmp_path / "store"), *args),
        nprocs=world_size,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0, grace_period=2.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"_run_ranks: {worker.__name__} did not finish within {timeout_s} s")
