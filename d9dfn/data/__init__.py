"""Data: map-style dataset views (data-parallel shards, length-bucketed shuffles), padding, and the
resumable ``StatefulBatchIterator`` whose position is two integers, and ``BatchLoader``, which loads its
batches in ``DataLoader`` worker processes without changing them or their order; ``DeviceBatches`` moves them to
the device one batch ahead of the loop.

Every order here is a pure function of a seed, an epoch and an index: no torch global RNG, no pickled
generator state, so a run resumes bit-exactly.
"""

from d9dfn.data._datasets import (
    BufferSortedDataset,
    MapDataset,
    ShardedDataset,
    SortKeyDataset,
    pad_stack_1d,
    shard_dataset_data_parallel,
)
from d9dfn.data._device import DeviceBatches, to_device
from d9dfn.data._iterator import StatefulBatchIterator
from d9dfn.data._loader import BatchLoader

__all__ = [
    "BatchLoader",
    "BufferSortedDataset",
    "DeviceBatches",
    "MapDataset",
    "ShardedDataset",
    "SortKeyDataset",
    "StatefulBatchIterator",
    "pad_stack_1d",
    "shard_dataset_data_parallel",
    "to_device",
]
