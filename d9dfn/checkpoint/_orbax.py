"""orbax, as d9dfn uses it: imported on first use on JAX's CPU backend, its event loops drained, its errors brief."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["await_tmp_cleanup", "brief", "draining_event_loops", "load_orbax"]


def load_orbax() -> ModuleType:
    """Import orbax on first use (it imports JAX, about a second), on JAX's CPU backend only."""
    # orbax asks JAX for the process index; JAX must not probe or grab the accelerators torch uses.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    # orbax logs every save at INFO through absl; keep that out of an application that logs at INFO
    # unless someone chose a level for absl already.
    absl_logger = logging.getLogger("absl")
    if absl_logger.level == logging.NOTSET:
        absl_logger.setLevel(logging.WARNING)
    return ocp


def await_tmp_cleanup(manager: Any) -> None:
    """Wait for the removal of partial saves that ``CheckpointManager`` starts in a thread when it is made.

    orbax (0.12) waits for it only inside its next ``save``: until then a ``<step>.orbax-checkpoint-tmp``
    left by a kill may or may not still be there, depending on the thread's luck. The store waits at once,
    so a store that was just opened has a clean directory. (orbax has no public call for this.)
    """
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait is not None:
        wait()


@contextlib.contextmanager
def draining_event_loops() -> Iterator[None]:
    """orbax's ``asyncio_utils.run_sync``, but the loop finishes its other tasks before it is closed.

    orbax reads a PyTree item by gathering one tensorstore read per array in a fresh event loop, closed as
    soon as the gather raises. When one array file is truncated, the other reads are still in flight; each
    one that completes later calls ``loop.call_soon_threadsafe`` on the closed loop, and tensorstore prints
    ``RuntimeError: Event loop is closed``: a second, spurious traceback after our clean error.
    Here the loop waits for those reads (their errors are dropped: the first one is reported) before closing.
    """
    from orbax.checkpoint._src import asyncio_utils

    original = asyncio_utils.run_sync

    def run_sync(coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:  # inside a running loop: orbax's own path (nest_asyncio / uvloop thread)
            return original(coro)
        loop = asyncio.new_event_loop()
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(coro)
        finally:
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            asyncio.set_event_loop(None)
            loop.close()

    asyncio_utils.run_sync = run_sync
    try:
        yield
    finally:
        asyncio_utils.run_sync = original


def brief(error: BaseException) -> str:
    """An exception as one line short enough to read (tensorstore appends its whole JSON spec)."""
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + " ..."
