"""Real multi-process tests on CPU: fork ranks that join a gloo process group; fail, never hang."""

from __future__ import annotations

import datetime
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _init(rank: int, world_size: int, init_file: str, timeout_s: float = 30.0) -> Any:
    import torch.distributed as dist
    from torch._inductor import config as inductor_config

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    # Nor the parent's pool of compile workers (inherited half-alive by fork: a compiled step then waits forever).
    inductor_config.compile_threads = 1
    # A short timeout: a peer that died makes a collective fail within it instead of hanging.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist


def _run_ranks(
    worker: Callable, world_size: int, tmp_path: Any, *args: Any, timeout_s: float = 120.0, clean: bool = False
) -> None:
    """Start ``world_size`` ranks of ``worker(rank, world_size, init_file, *args)``; fail (never hang) on error.

    ``clean=True`` starts them from a forkserver that has never touched tensorstore instead of forking the
    pytest worker: tensorstore (under orbax) aborts a forked child that uses it once the parent has, so
    ranks that save checkpoints need it. The server imports torch, orbax and the worker's module once, so
    each rank still starts in well under a second.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if clean:
        tests = os.path.dirname(os.path.abspath(__file__))
        if tests not in sys.path:
            sys.path.insert(0, tests)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # what d9dfn sets before importing orbax, for the preload
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed.tensor", "orbax.checkpoint", "d9dfn.loop", worker.__module__]
        )
    # fork, not spawn: children that re-import torch take ~15 s on a 2-core runner, forked ones start at once.
    context = mp.start_processes(
        worker,
        # A fresh rendezvous file per launch: a second group of another size on a used file would hang.
        args=(world_size, str(tmp_path / f"store-{uuid.uuid4().hex}"), *args),
        nprocs=world_size,
        join=False,
        start_method="forkserver" if clean else "fork",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0, grace_period=2.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"_run_ranks: {worker.__name__} did not finish within {timeout_s} s")
