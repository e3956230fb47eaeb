"""What the loop feeds the step: padding, DP-sharded views, length-bucketed shuffling and a resumable iterator.

Every order here is a pure function of a seed, an epoch and an index: no torch global RNG, no pickled
generator state. A dataset view (:class:`ShardedDataset`, :class:`BufferSortedDataset`) is therefore
immutable and its ``state()`` is only a description to check against at resume, while the position of
the data stream lives in one place, :class:`StatefulBatchIterator`, as two integers (epoch, index).

Orders come from ``numpy.random.default_rng([seed, epoch, ...])`` (PCG64 seeded by a ``SeedSequence``):
the same on every machine for a given NumPy release. NumPy does not promise that a ``Generator``'s
stream never changes between releases, so a resume across a NumPy upgrade may see a different order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

__all__ = [
    "BufferSortedDataset",
    "MapDataset",
    "ShardedDataset",
    "SortKeyDataset",
    "pad_stack_1d",
    "shard_dataset_data_parallel",
]

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class MapDataset(Protocol[T_co]):
    """A map-style dataset: a length and items by index (``torch.utils.data.Dataset`` with ``__len__``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> T_co: ...


@runtime_checkable
class SortKeyDataset(MapDataset[T_co], Protocol[T_co]):
    """A map-style dataset that can say how long an item is without building it (d9d's sort-key protocol)."""

    def sort_key(self, index: int, /) -> Any: ...


def for_epoch(dataset: Any, epoch: int) -> Any:
    """``dataset`` as it should look in ``epoch``: views with an epoch-dependent order define ``for_epoch``."""
    for_epoch = getattr(dataset, "for_epoch", None)
    return dataset if for_epoch is None else for_epoch(epoch)


def describe(dataset: Any) -> dict[str, Any] | None:
    """The description a view gives of itself (``state()``), or ``None`` for plain datasets."""
    state = getattr(dataset, "state", None)
    return None if state is None else state()


def pad_stack_1d(
    items: Sequence[torch.Tensor],
    pad_value: float | bool,
    *,
    padding_side: Literal["right", "left"] = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into one ``(len(items), max_len)`` tensor, padding the short ones.

    Args:
        items: 1-D tensors of one dtype and device.
        pad_value: what fills the padding (``0`` for ids, ``-100`` for ignored labels, ``False`` for masks).
        padding_side: ``"right"`` keeps the items at the start of each row, ``"left"`` at the end.
        pad_to_multiple_of: round ``max_len`` up to a multiple of this (fewer distinct shapes to compile).

    Raises:
        ValueError: no items, a non-positive ``pad_to_multiple_of``, an item that is not 1-D, mixed dtypes.

    >>> pad_stack_1d([torch.tensor([1, 2, 3]), torch.tensor([4])], -100, pad_to_multiple_of=4)
    tensor([[   1,    2,    3, -100],
            [   4, -100, -100, -100]])
    """
    if len(items) == 0:
        raise ValueError("pad_stack_1d: got no items; pass at least one 1-D tensor")
    if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
        raise ValueError(f"pad_stack_1d: pad_to_multiple_of is {pad_to_multiple_of}; pass None or an int >= 1")
    if padding_side not in ("right", "left"):
        raise ValueError(f'pad_stack_1d: padding_side is {padding_side!r}; pass "right" or "left"')
    first = items[0]
    for i, item in enumerate(items):
        if item.dim() != 1:
            raise ValueError(f"pad_stack_1d: item [{i}] has shape {tuple(item.shape)}, not 1-D; flatten or split it")
        if item.dtype != first.dtype:
            raise ValueError(
                f"pad_stack_1d: item [{i}] has dtype {item.dtype} but item [0] has {first.dtype}; "
                f"convert the items to one dtype first"
            )
    max_len = max(item.shape[0] for item in items)
    if pad_to_multiple_of is not None:
        max_len = -(-max_len // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(items), max_len), pad_value, dtype=first.dtype, device=first.device)
    for i, item in enumerate(items):
        n = item.shape[0]
        if padding_side == "right":
            out[i, :n] = item
        else:
            out[i, max_len - n :] = item
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedDataset(Generic[T_co]):
    """The share of ``dataset`` that data-parallel rank ``shard`` of ``num_shards`` reads.

    ``mode="sequential"`` deals items round-robin (rank r gets r, r+W, r+2W, ...); ``mode="chunked"`` gives
    each rank one contiguous block of ``ceil(N / W)`` items. With ``pad=True`` (the default) every rank
    has ``ceil(N / W)`` items, so no rank runs out of batches before the others and hangs a collective:
    the ``W * ceil(N / W) - N`` missing positions repeat the dataset from its start (d9d repeats the
    last item instead, and its unpadded ``chunked`` length goes negative for some sizes).

    >>> [ShardedDataset(range(5), num_shards=2, shard=1)[i] for i in range(3)]
    [1, 3, 0]
    >>> list(ShardedDataset(range(5), num_shards=2, shard=1, mode="chunked", pad=False))
    [3, 4]
    """

    dataset: MapDataset[T_co]
    num_shards: int
    shard: int
    mode: Literal["sequential", "chunked"] = "sequential"
    pad: bool = True

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"ShardedDataset: num_shards is {self.num_shards}; pass the data-parallel size (>= 1)")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(
                f"ShardedDataset: shard {self.shard} is outside [0, {self.num_shards}); pass the data-parallel rank"
            )
        if self.mode not in ("sequential", "chunked"):
            raise ValueError(f'ShardedDataset: mode is {self.mode!r}; pass "sequential" or "chunked"')

    def _per_shard(self) -> int:
        return -(-len(self.dataset) // self.num_shards)

    def _position(self, index: int) -> int:
        """Where item ``index`` of this shard sits in the (padded) sequence of all shards' items."""
        if self.mode == "sequential":
            return index * self.num_shards + self.shard
        return self.shard * self._per_shard() + index

    def __len__(self) -> int:
        total, per_shard = len(self.dataset), self._per_shard()
        if self.pad:
            return per_shard
        if self.mode == "sequential":
            return len(range(self.shard, total, self.num_shards))
        return max(0, min(total, (self.shard + 1) * per_shard) - self.shard * per_shard)

    def base_index(self, index: int) -> int:
        """The index in the wrapped dataset that item ``index`` of this shard reads."""
        if not 0 <= index < len(self):
            raise IndexError(f"ShardedDataset: index {index} is outside [0, {len(self)}) for shard {self.shard}")
        return self._position(index) % len(self.dataset)

    def __getitem__(self, index: int) -> T_co:
        return self.dataset[self.base_index(index)]

    def sort_key(self, index: int) -> Any:
        """The wrapped dataset's sort key of item ``index`` of this shard."""
        return self.dataset.sort_key(self.base_index(index))  # type: ignore[attr-defined]

    def for_epoch(self, epoch: int) -> ShardedDataset[T_co]:
        """This view over ``dataset.for_epoch(epoch)`` when the wrapped dataset shuffles per epoch."""
        return dataclasses.replace(self, dataset=for_epoch(self.dataset, epoch))

    def state(self) -> dict[str, Any]:
        """A JSON description, checked at resume (a different shard count means a different data stream)."""
        return {
            "kind": "sharded",
            "num_shards": self.num_shards,
            "shard": self.shard,
            "mode": self.mode,
            "pad": self.pad,
            "dataset": describe(self.dataset),
        }


def shard_dataset_data_parallel(
    dataset: MapDataset[T_co],
    group: Any = None,
    *,
    mode: Literal["sequential", "chunked"] = "sequential",
    pad: bool = True,
) -> ShardedDataset[T_co]:
    """Shard ``dataset`` over the data-parallel ``group`` (default: the world), or not at all on one process.

    >>> len(shard_dataset_data_parallel(range(10)))
    10
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        num_shards, shard = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    else:
        num_shards, shard = 1, 0
    return ShardedDataset(dataset, num_shards=num_shards, shard=shard, mode=mode, pad=pad)


@dataclasses.dataclass(frozen=True, eq=False)
class BufferSortedDataset(Generic[T_co]):
    """d9d's length-bucketed shuffle: batches of similar lengths (little padding), served in random order.

    The items are cut into consecutive buffers of ``buffer_size``. Within a buffer they are sorted by
    ``(sort_key, random tie-breaker)``, cut into packs of ``pack_size`` (usually the global batch size),
    and both the order of the full packs and the order inside each pack are shuffled (a short pack, at
    the end of the data, stays last). Unlike d9d, whose
    generator advances as buffers are visited (so its order depends on access history and its state is a
    pickled RNG), the order of buffer ``b`` is a pure function of ``(seed, epoch, b)``: any index can be
    read at any time, and nothing but the configuration needs to be checkpointed.

    Args:
        dataset: the items; must have ``sort_key(i)`` (e.g. a token count).
        buffer_size: items sorted together; a multiple of ``pack_size``.
        pack_size: items served together, so of similar length.
        seed: the shuffle seed.
        epoch: which epoch's order to serve; :class:`StatefulBatchIterator` sets it through ``for_epoch``.

    >>> class Lengths(list):
    ...     def sort_key(self, i):
    ...         return self[i]
    >>> ds = BufferSortedDataset(Lengths([5, 1, 4, 2, 3, 0]), buffer_size=6, pack_size=2, seed=0)
    >>> sorted(sorted(ds[i] for i in (j, j + 1)) for j in range(0, 6, 2))
    [[0, 1], [2, 3], [4, 5]]
    """

    dataset: SortKeyDataset[T_co]
    buffer_size: int
    pack_size: int
    seed: int = 0
    epoch: int = 0
    _cache: dict[int, list[int]] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pack_size < 1 or self.buffer_size < 1 or self.buffer_size % self.pack_size != 0:
            raise ValueError(
                f"BufferSortedDataset: buffer_size {self.buffer_size} is not a positive multiple of pack_size "
                f"{self.pack_size}; a partial pack would mix lengths inside a batch. Round buffer_size to a "
                f"multiple of pack_size (usually the global batch size)"
            )
        if not callable(getattr(self.dataset, "sort_key", None)):
            raise TypeError(
                f"BufferSortedDataset: {type(self.dataset).__name__} has no sort_key(index) method; add one that "
                f"returns the item's length (or any comparable key)"
            )

    def __len__(self) -> int:
        return len(self.dataset)

    def buffer_order(self, buffer: int) -> list[int]:
        """The wrapped dataset's indices in the order this view serves buffer number ``buffer``."""
        if buffer not in self._cache:
            start = buffer * self.buffer_size
            indices = list(range(start, min(start + self.buffer_size, len(self.dataset))))
            rng = np.random.default_rng([self.seed, self.epoch, buffer])
            ties = rng.random(len(indices))
            keys = [(self.dataset.sort_key(i), float(t)) for i, t in zip(indices, ties, strict=True)]
            ordered = [indices[j] for j in sorted(range(len(indices)), key=keys.__getitem__)]
            packs = [ordered[k : k + self.pack_size] for k in range(0, len(ordered), self.pack_size)]
            # Only full packs change places: a short last pack stays last, so batches of pack_size counted
            # from the buffer's start never straddle two packs (d9d may move it into the middle).
            num_full = len(ordered) // self.pack_size
            pack_order = [*rng.permutation(num_full).tolist(), *range(num_full, len(packs))]
            order: list[int] = []
            for p in pack_order:
                pack = packs[p]
                order.extend(pack[q] for q in rng.permutation(len(pack)).tolist())
            # Keep only the buffer being read: access is sequential, and memory stays O(buffer_size).
            self._cache.clear()
            self._cache[buffer] = order
        return self._cache[buffer]

    def base_index(self, index: int) -> int:
        """The index in the wrapped dataset that item ``index`` reads."""
        if not 0 <= index < len(self):
            raise IndexError(f"BufferSortedDataset: index {index} is outside [0, {len(self)})")
        return self.buffer_order(index // self.buffer_size)[index % self.buffer_size]

    def __getitem__(self, index: int) -> T_co:
        return self.dataset[self.base_index(index)]

    def sort_key(self, index: int) -> Any:
        """The wrapped dataset's sort key of item ``index``."""
        return self.dataset.sort_key(self.base_index(index))

    def for_epoch(self, epoch: int) -> BufferSortedDataset[T_co]:
        """The same view with ``epoch``'s order (a fresh shuffle of every buffer)."""
        return BufferSortedDataset(
            for_epoch(self.dataset, epoch), self.buffer_size, self.pack_size, seed=self.seed, epoch=epoch
        )

    def state(self) -> dict[str, Any]:
        """A JSON description, checked at resume: the order depends on nothing else."""
        return {
            "kind": "buffer_sorted",
            "buffer_size": self.buffer_size,
            "pack_size": self.pack_size,
            "seed": self.seed,
            "dataset": describe(self.dataset),
        }
