"""Data: map-style dataset views (data-parallel shards, length-bucketed shuffles), padding, and the
resumable ``StatefulBatchIterator`` whose position is two integers, and ``BatchLoader``, which loads its
batches in ``DataLoader`` worker processes without changing them or their order; ``DeviceBatches`` moves them to
the device one batch ahead of the loop.

Every order here is a pure function of a seed, an epoch and an index: no torch global RNG, no pickled
generator state, so a run resumes bit-exactly.

Your files as a dataset: :func:`tokenize_files` reads plain text, prompt/completion and chat records (JSONL, Parquet,
``datasets`` folders) through a :class:`Tokenizer` into memory-mapped token arrays cached on disk; :func:`cut_documents`
and :class:`PackedDataset` pack them into rows whose documents never see one another (``document_ids``), or
:class:`DocumentDataset` and :class:`PadCollate` pad them (``docs/design/data.md``).
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
from d9dfn.data._packing import (
    CutReport,
    DocumentDataset,
    PackedDataset,
    PadCollate,
    Pieces,
    collate_rows,
    cut_documents,
    pack,
    select_pieces,
    unpack_row,
)
from d9dfn.data._records import DataError, Document, Part, expand_files, read_documents, read_records, render_chat
from d9dfn.data._token_cache import TokenizedFiles, encode_document, tokenize_files
from d9dfn.data._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "BatchLoader",
    "BufferSortedDataset",
    "ByteTokenizer",
    "CutReport",
    "DataError",
    "DeviceBatches",
    "Document",
    "DocumentDataset",
    "HFTokenizer",
    "MapDataset",
    "PackedDataset",
    "PadCollate",
    "Part",
    "Pieces",
    "ShardedDataset",
    "SortKeyDataset",
    "StatefulBatchIterator",
    "TokenizedFiles",
    "Tokenizer",
    "collate_rows",
    "cut_documents",
    "encode_document",
    "expand_files",
    "pack",
    "pad_stack_1d",
    "read_documents",
    "read_records",
    "render_chat",
    "select_pieces",
    "shard_dataset_data_parallel",
    "to_device",
    "tokenize_files",
    "unpack_row",
]
