"""``BatchLoader``: a ``StatefulBatchIterator``'s batches, loaded by ``torch.utils.data.DataLoader`` workers.

The iterator stays the one owner of the order and of the position. The ``DataLoader`` gets a batch
sampler that replays the iterator's :meth:`~StatefulBatchIterator.next_indices` from the consumed
position on, so workers load (and optionally pin) exactly the batches the iterator would have served, in
the same order; the position moves by one batch each time the loop *receives* a batch, never when a
worker prefetches one. A checkpoint therefore records the batches consumed, and a resumed run continues
with the next one, bit-exactly, whatever was in flight when it stopped.
"""

from __future__ import annotations

import copy
import signal
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from d9dfn._types import Batch
from d9dfn.data._datasets import for_epoch
from d9dfn.data._iterator import StatefulBatchIterator

__all__ = ["BatchLoader"]


class _EpochItems:
    """The dataset as workers see it: ``items[(epoch, i)]`` is item ``i`` of the epoch-``epoch`` view."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._view: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if self._view is None or self._view[0] != epoch:
            self._view = (epoch, for_epoch(self.dataset, epoch))
        return self._view[1][index]


class _PlannedBatches:
    """A batch sampler: from the iterator's position at ``iter()`` time, the keys of every batch it would serve."""

    def __init__(self, source: StatefulBatchIterator[Any]) -> None:
        self.source = source
        self.num_planned = 0
        """Batches handed to the workers so far (consumed + in flight), for tests and diagnostics."""

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        planner = copy.copy(self.source)  # the same settings and position; advancing it leaves the source alone
        while True:
            try:
                epoch, picked = planner.next_indices()
            except StopIteration:
                return
            self.num_planned += 1
            yield [(epoch, index) for index in picked]


def _ignore_stop_signals(worker_id: int) -> None:
    """In a worker: SIGINT and SIGTERM are for the process that owns it, which stops it with :meth:`BatchLoader.close`.

    A Ctrl-C reaches the whole process group and ``torchrun`` signals a rank's group, workers included; a worker
    that died of it would fail the owner's next batch while the owner finishes its step and checkpoint.
    """
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)


class BatchLoader:
    """The batches of ``iterator``, loaded by ``num_workers`` processes (the same batches, order and position).

    It has the iterator's interface (``next``, ``len``, ``state``, ``restore``, ``close``); ``state()`` is the
    iterator's, counting batches this loader has returned, not those prefetched.

    Args:
        iterator: the stateful iterator that owns the order and the position (it is advanced in place).
        num_workers: worker processes (0 loads in this process, which still allows pinning).
        pin_memory: copy each batch into page-locked memory (faster host-to-GPU copies; needs an accelerator,
            torch warns and skips it otherwise).
        persistent_workers: keep the workers alive between epochs of a finite iterator (and across
            :meth:`restore`) instead of starting new ones.
        prefetch_factor: batches each worker loads ahead (ignored with ``num_workers=0``).

    The dataset and ``collate_fn`` go to the workers, so under the ``spawn``/``forkserver`` start methods they
    must be picklable.

    >>> it = StatefulBatchIterator(list(range(10)), batch_size=4, seed=0)
    >>> loader = BatchLoader(StatefulBatchIterator(list(range(10)), batch_size=4, seed=0), num_workers=1)
    >>> [b.tolist() for b in loader] == [b.tolist() for b in it]
    True
    >>> loader.close()
    """

    def __init__(
        self,
        iterator: StatefulBatchIterator[Any],
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int = 2,
    ) -> None:
        if persistent_workers and num_workers == 0:
            raise ValueError(
                "BatchLoader: persistent_workers=True needs num_workers > 0 (there are no workers to keep); pass "
                "num_workers >= 1 or persistent_workers=False"
            )
        self.iterator = iterator
        self.sampler = _PlannedBatches(iterator)
        self.data_loader: DataLoader[Any] = DataLoader(
            _EpochItems(iterator.dataset),  # type: ignore[arg-type]  # a map-style dataset keyed by (epoch, i)
            batch_sampler=self.sampler,  # an iterable of index lists is all a batch sampler needs
            collate_fn=iterator.collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
        )
        self._live: Iterator[Batch] | None = None

    @property
    def num_batches_per_epoch(self) -> int:
        """Batches in one epoch (the iterator's)."""
        return self.iterator.num_batches_per_epoch

    def __len__(self) -> int:
        return len(self.iterator)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if self._live is None:
            self._live = iter(self.data_loader)  # plans from the consumed position
        try:
            batch = next(self._live)
        except StopIteration:
            self._live = None
            self.iterator.next_indices()  # at a finite epoch's end: moves to the next epoch, raises StopIteration
            raise AssertionError("BatchLoader: the workers ran out of batches before the iterator did") from None
        self.iterator.next_indices()  # one batch consumed: the position the next checkpoint records
        return batch

    def state(self) -> dict[str, Any]:
        """The iterator's position after the batches returned so far (see ``StatefulBatchIterator.state``)."""
        return self.iterator.state()

    def restore(self, state: dict[str, Any]) -> None:
        """Move to ``state``'s position; batches in flight are dropped and loading restarts from there."""
        self.iterator.restore(state)
        self._live = None  # a new DataLoader iterator plans from the restored position

    def close(self) -> None:
        """Stop the workers (persistent ones included); the loader can be iterated again afterwards."""
        self._live = None
        live = getattr(self.data_loader, "_iterator", None)  # the persistent workers' iterator, if any
        if live is not None:
            live._shutdown_workers()
            self.data_loader._iterator = None
