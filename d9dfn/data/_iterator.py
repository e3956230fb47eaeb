"""A resumable batch iterator: the data stream's position as two integers (epoch, index).

Orders come from ``numpy.random.default_rng([seed, epoch])`` (PCG64 seeded by a ``SeedSequence``): the
same on every machine for a given NumPy release (see ``_datasets.py`` for the views it iterates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic

import numpy as np
from torch.utils.data import default_collate

from d9dfn._types import Batch
from d9dfn.data._datasets import MapDataset, T_co, describe, for_epoch

__all__ = ["StatefulBatchIterator"]


_CHECKED_FIELDS = ("seed", "batch_size", "num_items", "shuffle", "drop_last", "dataset")


class StatefulBatchIterator(Generic[T_co]):
    """Collated batches in a seeded order whose exact position is a small JSON dict (resume bit-exact).

    Epoch ``e`` visits the items in ``default_rng([seed, e]).permutation(N)`` order (or in index order
    with ``shuffle=False``, e.g. over a :class:`BufferSortedDataset`, which shuffles itself) and serves
    them ``batch_size`` at a time through ``collate_fn``. The position is ``(epoch, index)``, with
    ``index`` the number of items of the epoch already served; :meth:`state` returns it with the settings
    it depends on, and :meth:`restore` / :meth:`from_state` continue from it exactly.

    A finite iterator (the default) stops at the end of each epoch and moves to the next, so
    ``for batch in it`` runs one epoch per loop; ``infinite=True`` runs on through the epochs (take
    ``total_steps`` batches with ``itertools.islice``). A dataset with ``for_epoch(e)`` (the views in this
    module) is asked for its epoch-``e`` version at each epoch.

    Args:
        dataset: a map-style dataset.
        batch_size: items per batch.
        collate_fn: turns a list of items into a batch (default: ``torch.utils.data.default_collate``).
        seed: the shuffle seed.
        shuffle: visit items in a seeded random order per epoch rather than index order.
        drop_last: skip a final batch with fewer than ``batch_size`` items.
        infinite: run through epochs without stopping.
        part: ``(index, count)``: load and yield only part ``index`` of ``count`` consecutive, equal parts of
            every batch (a data-parallel rank's rows of the global batch; ``batch_size`` must divide by
            ``count``). The order and the state are those of the whole batches, equal on every rank, so a
            run resumes on any number of ranks where it stopped.

    Raises:
        ValueError: ``batch_size < 1``, or ``infinite=True`` with no batch in an epoch.

    >>> import torch
    >>> it = StatefulBatchIterator(list(range(10)), batch_size=4, seed=0)
    >>> first = next(it)
    >>> it.state()["epoch"], it.state()["index"]
    (0, 4)
    >>> resumed = StatefulBatchIterator.from_state(list(range(10)), it.state(), batch_size=4, seed=0)
    >>> bool(torch.equal(next(resumed), next(it)))
    True
    """

    def __init__(
        self,
        dataset: MapDataset[T_co],
        *,
        batch_size: int,
        collate_fn: Callable[[list[T_co]], Batch] = default_collate,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        infinite: bool = False,
        part: tuple[int, int] = (0, 1),
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"StatefulBatchIterator: batch_size is {batch_size}; pass an int >= 1")
        index, count = part
        if count < 1 or not 0 <= index < count or batch_size % count:
            raise ValueError(
                f"StatefulBatchIterator: part={part!r} with batch_size={batch_size}; pass (index, count) with "
                f"0 <= index < count and batch_size a multiple of count (data-parallel ranks split each batch)"
            )
        if count > 1 and not drop_last:
            raise ValueError(
                f"StatefulBatchIterator: part={part!r} needs drop_last=True: a short final batch would leave some "
                "ranks fewer (or no) rows than the others"
            )
        self.part = part
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.infinite = infinite
        self.num_items = len(dataset)
        if infinite and self.num_batches_per_epoch == 0:
            raise ValueError(
                f"StatefulBatchIterator: {self.num_items} items make no batch of {batch_size} "
                f"(drop_last={drop_last}), so an infinite iterator would never yield; use a larger dataset, "
                f"a smaller batch_size or drop_last=False"
            )
        self._epoch = 0
        self._index = 0
        self._order_cache: tuple[int, np.ndarray, Any] | None = None

    @property
    def num_batches_per_epoch(self) -> int:
        """Batches in one epoch."""
        if self.drop_last:
            return self.num_items // self.batch_size
        return -(-self.num_items // self.batch_size)

    def __len__(self) -> int:
        return self.num_batches_per_epoch

    def _epoch_view(self, epoch: int) -> tuple[np.ndarray, Any]:
        """The item order and the dataset view of ``epoch``, computed once per epoch."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                order = np.arange(self.num_items)
            self._order_cache = (epoch, order, for_epoch(self.dataset, epoch))
        return self._order_cache[1], self._order_cache[2]

    def _epoch_end(self) -> int:
        """The index at which the current epoch has no batch left."""
        return self.num_batches_per_epoch * self.batch_size if self.drop_last else self.num_items

    def __iter__(self) -> StatefulBatchIterator[T_co]:
        return self

    def __next__(self) -> Batch:
        epoch, picked = self.next_indices()
        view = self._epoch_view(epoch)[1]
        return self.collate_fn([view[i] for i in picked])

    def next_indices(self) -> tuple[int, list[int]]:
        """Move the position on by one batch without loading it: ``(epoch, this part's item indices)``.

        ``__next__`` loads what this returns (``for_epoch(dataset, epoch)[i]`` for each index, then
        ``collate_fn``); a loader with worker processes plans batches with it ahead of loading them.

        Raises:
            StopIteration: at the end of an epoch of a finite iterator (the position moves to the next epoch).
        """
        if self._index >= self._epoch_end():
            self._epoch, self._index = self._epoch + 1, 0
            if not self.infinite:
                raise StopIteration
        order, _ = self._epoch_view(self._epoch)
        picked = order[self._index : self._index + self.batch_size].tolist()
        self._index += len(picked)
        index, count = self.part
        size = len(picked) // count  # whole batches only when count > 1 (drop_last)
        return self._epoch, picked[index * size : (index + 1) * size]  # this rank's consecutive rows

    def close(self) -> None:
        """Release loading resources: nothing here (``BatchLoader`` stops its workers)."""

    def state(self) -> dict[str, Any]:
        """The position (``epoch``, ``index``) and the settings it is only valid with; JSON-serializable."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset": describe(self.dataset),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Move to the position in ``state`` (from :meth:`state`), checking that the settings agree.

        Raises:
            ValueError: ``state`` lacks a field, or was taken with a different seed, batch size, dataset
                length, shuffle, drop_last or dataset description (which would give other batches).
        """
        mine = self.state()
        for name in ("epoch", "index", *_CHECKED_FIELDS):
            if name not in state:
                raise ValueError(
                    f"StatefulBatchIterator.restore: state has no {name!r} (keys: {sorted(state)}); pass a dict "
                    f"made by StatefulBatchIterator.state()"
                )
        for name in _CHECKED_FIELDS:
            if state[name] != mine[name]:
                raise ValueError(
                    f"StatefulBatchIterator.restore: the saved data position has {name}={state[name]!r} but this "
                    f"iterator has {name}={mine[name]!r}; resume with the data settings of the saved run, or "
                    f"start without restoring the data position"
                )
        epoch, index = state["epoch"], state["index"]
        if not (isinstance(epoch, int) and isinstance(index, int) and epoch >= 0 and 0 <= index <= self.num_items):
            raise ValueError(
                f"StatefulBatchIterator.restore: position epoch={epoch!r}, index={index!r} is not a valid place in "
                f"{self.num_items} items; pass a dict made by StatefulBatchIterator.state()"
            )
        self._epoch, self._index = epoch, index

    @classmethod
    def from_state(cls, dataset: MapDataset[T_co], state: dict[str, Any], **kwargs: Any) -> StatefulBatchIterator[T_co]:
        """A new iterator over ``dataset`` (settings in ``kwargs``) positioned at ``state``."""
        iterator = cls(dataset, **kwargs)
        iterator.restore(state)
        return iterator
