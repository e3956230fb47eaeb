"""Batches onto the device: ``to_device`` for one batch, ``DeviceBatches`` for the loop, one batch ahead.

On a GPU the loop's step is asynchronous: the host enqueues it and goes on. ``DeviceBatches`` uses that time to
load the next batch and start its host-to-device copy on a side stream, so the copy overlaps the step instead of
queueing behind it on the compute stream. The compute stream waits for the copy through a CUDA event (no host
sync), and the batch's memory is marked as used by that stream (``record_stream``), so the caching allocator
does not hand it out while the step still reads it.

A batch taken ahead has left the loader, so the loader's position is one batch past what the loop consumed:
``DeviceBatches.state()`` is the position before that batch, which is what a checkpoint must record for an exact
resume.
"""

from __future__ import annotations

from typing import Any

import torch

from d9dfn._pytree import tree_leaves, tree_map
from d9dfn._types import Batch
from d9dfn.data._iterator import StatefulBatchIterator
from d9dfn.data._loader import BatchLoader

__all__ = ["DeviceBatches", "to_device"]


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of ``batch`` on ``device``: a no-op on the CPU, an asynchronous copy to a GPU.

    The copy is ``non_blocking``: from pinned memory (``data_loading.pin_memory``) it does not wait for the
    GPU, so the host goes on loading the next batch while the step runs (the loop adds no host sync).
    """
    if device.type == "cpu":
        return batch
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)


class DeviceBatches:
    """``count`` batches of ``loader`` on ``device``; :meth:`prefetch` takes the next one ahead.

    The loop calls ``next`` for a step's batch, enqueues the step, then :meth:`prefetch`: the next batch is loaded
    and, on CUDA, copied on a side stream while the step runs. ``next`` returns the batch taken ahead (the current
    stream waits for its copy), or loads one now when none is. Never more than ``count`` batches are taken from
    ``loader``, so nothing is loaded past the loop's last step.

    Args:
        loader: the resumable iterator or loader (``state()``/``restore()``) that owns the order and position.
        device: where the batches go (the CPU: no copy, nothing else changes).
        count: how many batches the loop will take.

    >>> items = StatefulBatchIterator(list(range(6)), batch_size=2, shuffle=False)
    >>> batches = DeviceBatches(items, torch.device("cpu"), 2)
    >>> next(batches).tolist()
    [0, 1]
    >>> batches.prefetch()  # [2, 3] left the iterator; the position is still after [0, 1]
    >>> items.state()["index"], batches.state()["index"]
    (4, 2)
    >>> next(batches).tolist()
    [2, 3]
    >>> batches.prefetch()  # the last of count: nothing more is taken
    >>> items.state()["index"], batches.state()["index"]
    (4, 4)
    """

    def __init__(self, loader: StatefulBatchIterator[Any] | BatchLoader, device: torch.device, count: int) -> None:
        if count < 0:
            raise ValueError(f"DeviceBatches: count={count}; pass the number of batches the loop takes (>= 0)")
        self.loader = loader
        self.device = device
        self.remaining = count
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # (the loader's position before this batch, the batch on the device, its copy's event on CUDA)
        self._ahead: tuple[dict[str, Any], Batch, torch.cuda.Event | None] | None = None

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> Batch:
        if self._ahead is None:
            if self.remaining == 0:
                raise StopIteration
            self.prefetch()
        assert self._ahead is not None  # prefetch took one: remaining > 0
        _, batch, copied = self._ahead
        self._ahead = None
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)  # the step reads the batch only after its copy
            for leaf in tree_leaves(batch):
                if isinstance(leaf, torch.Tensor):
                    leaf.record_stream(stream)  # allocated on the side stream, read on this one
        return batch

    def prefetch(self) -> None:
        """Take the next batch from the loader and start its copy to the device, unless one is held or none is left."""
        if self._ahead is not None or self.remaining == 0:
            return
        position = self.loader.state()
        host = next(self.loader)
        self.remaining -= 1
        if self.stream is None:
            self._ahead = (position, to_device(host, self.device), None)
            return
        with torch.cuda.stream(self.stream):
            batch = to_device(host, self.device)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._ahead = (position, batch, copied)

    def state(self) -> dict[str, Any]:
        """The loader's position after the batches ``next`` returned (not counting one taken ahead)."""
        return self._ahead[0] if self._ahead is not None else self.loader.state()
