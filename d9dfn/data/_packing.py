"""Documents into training rows: cut to the row's length, then packed with their boundaries kept, or padded.

A document of ``n`` tokens gives ``n - 1`` (input, label) positions: inputs ``tokens[:-1]``, labels ``tokens[1:]``
(``-100`` where the label token carries no loss). A row holds ``seq_len`` positions.

- :func:`cut_documents`: a plain-text document longer than a row is cut into consecutive pieces of ``seq_len + 1``
  tokens that overlap by one (every token after the first is a label once, as ``ByteWindowDataset``'s windows); a
  prompt/completion or chat is truncated to its first ``seq_len + 1`` tokens. Pieces with no target are dropped.
- :func:`pack`: pieces into rows of ``seq_len`` positions, best-fit decreasing (deterministic).
- :class:`PackedDataset`: a row as ``input_ids``, ``labels``, ``position_ids`` (restarting at 0 in every piece) and
  ``document_ids`` (the piece's number in the row; the padding after the last piece is a document of its own), so the
  model attends within a document only (``Qwen3LM(document_ids=...)``) and a packed piece computes what it computes
  alone. :func:`unpack_row` gives the pieces back.
- :class:`DocumentDataset` + :class:`PadCollate`: with packing off, a piece per item, padded to the batch's longest
  (rounded up, so few shapes compile); wrapped in :class:`~d9dfn.data.BufferSortedDataset` for batches of similar
  lengths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "CutReport",
    "DocumentDataset",
    "PackedDataset",
    "PadCollate",
    "Pieces",
    "collate_rows",
    "cut_documents",
    "pack",
    "select_pieces",
    "unpack_row",
]

IGNORE_INDEX = -100
"""A label that carries no loss (``d9dfn.tasks.IGNORE_INDEX``)."""


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Slices of the flat token arrays: piece ``i`` is ``tokens[starts[i]:stops[i]]`` (at least 2 tokens), of
    document ``documents[i]``, ``index[i]``-th piece of it."""

    starts: np.ndarray
    stops: np.ndarray
    documents: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_positions(self) -> np.ndarray:
        """(P,) input positions of each piece: its tokens minus one."""
        return self.stops - self.starts - 1


@dataclasses.dataclass(frozen=True)
class CutReport:
    """What :func:`cut_documents` did, for the log."""

    num_documents: int
    num_split: int
    """Plain-text documents longer than a row, cut into pieces."""
    num_split_pieces: int
    """The pieces they gave."""
    num_truncated: int
    """Prompt/completion or chat documents longer than a row, truncated."""
    num_truncated_tokens: int
    """Tokens dropped by truncation."""
    num_too_short: int
    """Documents of fewer than 2 tokens: no label."""
    num_no_target: int
    """Pieces without a target within the row (a prompt longer than a row), dropped."""


def cut_documents(
    offsets: np.ndarray, splittable: np.ndarray, loss: np.ndarray, seq_len: int
) -> tuple[Pieces, CutReport]:
    """The pieces of every document for rows of ``seq_len`` positions, and what was cut.

    Args:
        offsets: (D + 1,) document starts in the flat arrays, then their length.
        splittable: (D,) 1 where a long document is cut into pieces (plain text), 0 where it is truncated.
        loss: (N,) 1 where a token is a target.
        seq_len: positions in a row.

    >>> offsets = np.array([0, 10, 13])
    >>> pieces, report = cut_documents(offsets, np.array([1, 0]), np.ones(13, np.uint8), 4)
    >>> pieces.starts.tolist(), pieces.stops.tolist(), report.num_split, report.num_split_pieces
    ([0, 4, 8, 10], [5, 9, 10, 13], 1, 3)
    """
    if seq_len < 1:
        raise ValueError(f"cut_documents: seq_len is {seq_len}; pass an int >= 1")
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    split = np.asarray(splittable, dtype=bool)
    # (D,) pieces per document: ceil((n - 1) / seq_len) for plain text, 1 otherwise; none below 2 tokens.
    positions = np.maximum(lengths - 1, 0)
    counts = np.where(split, -(-positions // seq_len), np.minimum(positions, 1))
    documents = np.repeat(np.arange(len(lengths)), counts)
    first = np.cumsum(counts) - counts  # (D,) the first piece's number of each document
    index = np.arange(counts.sum()) - np.repeat(first, counts)
    starts = offsets[:-1][documents] + index * seq_len
    stops = np.minimum(starts + seq_len + 1, offsets[1:][documents])
    # Targets of a piece: the labels tokens[start + 1:stop]; a cumulative sum counts them without a loop.
    cumulative = np.concatenate(([0], np.cumsum(np.asarray(loss, dtype=np.int64))))
    has_target = cumulative[stops] - cumulative[starts + 1] > 0
    long = lengths > seq_len + 1
    report = CutReport(
        num_documents=len(lengths),
        num_split=int((long & split).sum()),
        num_split_pieces=int(counts[long & split].sum()),
        num_truncated=int((long & ~split).sum()),
        num_truncated_tokens=int((lengths - (seq_len + 1))[long & ~split].sum()),
        num_too_short=int((lengths < 2).sum()),
        num_no_target=int((~has_target).sum()),
    )
    keep = has_target
    return Pieces(starts[keep], stops[keep], documents[keep], index[keep]), report


def select_pieces(pieces: Pieces, keep: np.ndarray) -> Pieces:
    """The pieces where ``keep`` is true, in order."""
    return Pieces(pieces.starts[keep], pieces.stops[keep], pieces.documents[keep], pieces.index[keep])


def pack(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Items of ``lengths`` into rows of ``capacity``: best-fit decreasing, deterministic (ties by index).

    Each item goes, longest first, into the fullest row that still has room for it, else into a new row; rows are
    returned in the order they were opened, each with its items in the order they were placed.

    Raises:
        ValueError: an item longer than ``capacity`` or shorter than 1.

    >>> pack([3, 5, 2, 4], capacity=7)
    [[1, 2], [3, 0]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (int(lengths.max()) > capacity or int(lengths.min()) < 1):
        raise ValueError(
            f"pack: items must have lengths in [1, {capacity}], got [{int(lengths.min())}, {int(lengths.max())}]; "
            "cut the documents first (cut_documents)"
        )
    rows: list[list[int]] = []
    # by_free[f]: the rows (their numbers) with f positions free; has_free[f] whether there is one.
    by_free: list[list[int]] = [[] for _ in range(capacity + 1)]
    has_free = np.zeros(capacity + 1, dtype=bool)
    free: list[int] = []
    for item in np.lexsort((np.arange(len(lengths)), -lengths)).tolist():
        size = int(lengths[item])
        room = int(np.argmax(has_free[size:])) + size if has_free[size:].any() else -1
        if room < 0:
            row = len(rows)
            rows.append([item])
            free.append(capacity - size)
        else:
            row = by_free[room].pop()
            has_free[room] = bool(by_free[room])
            rows[row].append(item)
            free[row] -= size
        if free[row] > 0:
            by_free[free[row]].append(row)
            has_free[free[row]] = True
    return rows


class PackedDataset:
    """Rows of packed pieces: ``{"input_ids", "labels", "position_ids", "document_ids"}``, each ``(seq_len,)`` int64.

    Args:
        tokens: (N,) token ids; loss: (N,) target flags (the flat arrays of :func:`~d9dfn.data.tokenize_files`).
        pieces: the pieces to pack (:func:`cut_documents`).
        seq_len: positions per row.
        pad_id: the input id of padding.
        description: what the rows are made of (e.g. the cache key), checked at resume with the iterator's position.

    >>> tokens = np.arange(10)
    >>> pieces, _ = cut_documents(np.array([0, 4, 10]), np.array([1, 1]), np.ones(10, np.uint8), 8)
    >>> row = PackedDataset(tokens, np.ones(10, np.uint8), pieces, 8, pad_id=0)[0]
    >>> row["input_ids"].tolist(), row["position_ids"].tolist(), row["document_ids"].tolist()
    ([4, 5, 6, 7, 8, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1])
    """

    def __init__(
        self,
        tokens: np.ndarray,
        loss: np.ndarray,
        pieces: Pieces,
        seq_len: int,
        *,
        pad_id: int,
        description: dict[str, Any] | None = None,
    ) -> None:
        self.tokens, self.loss, self.pieces, self.seq_len, self.pad_id = tokens, loss, pieces, seq_len, pad_id
        rows = pack(pieces.num_positions, seq_len)
        self.row_offsets = np.cumsum([0, *map(len, rows)]).astype(np.int64)
        self.row_pieces = np.fromiter((p for row in rows for p in row), dtype=np.int64, count=int(self.row_offsets[-1]))
        self.description = description or {}

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def row(self, index: int) -> np.ndarray:
        """The piece numbers of row ``index``, in the row's order."""
        return self.row_pieces[self.row_offsets[index] : self.row_offsets[index + 1]]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"PackedDataset: index {index} is outside [0, {len(self)})")
        size = self.seq_len
        ids = np.full(size, self.pad_id, dtype=np.int64)
        labels = np.full(size, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(size, dtype=np.int64)
        documents = np.zeros(size, dtype=np.int64)
        at = 0
        pieces = self.row(index)
        for number, piece in enumerate(pieces.tolist()):
            start, stop = int(self.pieces.starts[piece]), int(self.pieces.stops[piece])
            tokens = np.asarray(self.tokens[start:stop], dtype=np.int64)
            targets = np.asarray(self.loss[start + 1 : stop], dtype=bool)
            n = stop - start - 1
            ids[at : at + n] = tokens[:-1]
            labels[at : at + n] = np.where(targets, tokens[1:], IGNORE_INDEX)
            positions[at : at + n] = np.arange(n)
            documents[at : at + n] = number
            at += n
        documents[at:] = len(pieces)  # the padding: a document of its own, never attended by the others
        positions[at:] = np.arange(size - at)
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
            "document_ids": torch.from_numpy(documents),
        }

    def sort_key(self, index: int) -> int:
        """Every row has ``seq_len`` positions."""
        return self.seq_len

    def num_pad(self) -> int:
        """Padding positions over all rows."""
        return len(self) * self.seq_len - int(self.pieces.num_positions.sum())

    def state(self) -> dict[str, Any]:
        """A JSON description, checked at resume: another packing is another data stream."""
        return {"kind": "packed", "seq_len": self.seq_len, "rows": len(self), **self.description}


def unpack_row(row: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A packed row's pieces as ``(input_ids, labels)`` pairs, in order, the padding left out (its labels are all
    ignored): the inverse of packing, read from ``document_ids`` and ``position_ids``.

    >>> row = {"input_ids": torch.tensor([5, 6, 7, 0]), "labels": torch.tensor([6, 7, 8, -100]),
    ...        "position_ids": torch.tensor([0, 1, 0, 0]), "document_ids": torch.tensor([0, 0, 1, 2])}
    >>> [(i.tolist(), l.tolist()) for i, l in unpack_row(row)]
    [([5, 6], [6, 7]), ([7], [8])]
    """
    documents = row["document_ids"]
    out = []
    for number in torch.unique_consecutive(documents).tolist():
        where = documents == number
        labels = row["labels"][where]
        if bool((labels == IGNORE_INDEX).all()) and number == int(documents[-1]):
            continue  # the trailing padding
        assert bool((row["position_ids"][where] == torch.arange(int(where.sum()))).all()), "positions restart per piece"
        out.append((row["input_ids"][where], labels))
    return out


class DocumentDataset:
    """Pieces one per item, ``{"input_ids": (n,), "labels": (n,)}``, in an order shuffled per epoch (``for_epoch``),
    with ``sort_key`` their length: the items :class:`~d9dfn.data.BufferSortedDataset` buckets by length.

    >>> pieces, _ = cut_documents(np.array([0, 3, 8]), np.array([1, 1]), np.ones(8, np.uint8), 8)
    >>> dataset = DocumentDataset(np.arange(8), np.ones(8, np.uint8), pieces, seed=0)
    >>> sorted(dataset.sort_key(i) for i in range(len(dataset)))
    [2, 4]
    """

    def __init__(
        self,
        tokens: np.ndarray,
        loss: np.ndarray,
        pieces: Pieces,
        *,
        seed: int,
        epoch: int = 0,
        description: dict[str, Any] | None = None,
    ) -> None:
        self.tokens, self.loss, self.pieces, self.seed, self.epoch = tokens, loss, pieces, seed, epoch
        self.order = np.random.default_rng([seed, epoch, 1]).permutation(len(pieces))
        self.description = description or {}

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        piece = int(self.order[index])
        start, stop = int(self.pieces.starts[piece]), int(self.pieces.stops[piece])
        tokens = np.asarray(self.tokens[start:stop], dtype=np.int64)
        targets = np.asarray(self.loss[start + 1 : stop], dtype=bool)
        labels = np.where(targets, tokens[1:], IGNORE_INDEX)
        return {"input_ids": torch.from_numpy(tokens[:-1].copy()), "labels": torch.from_numpy(labels)}

    def sort_key(self, index: int) -> int:
        """The item's positions."""
        return int(self.pieces.num_positions[self.order[index]])

    def for_epoch(self, epoch: int) -> DocumentDataset:
        """The same pieces in ``epoch``'s order."""
        return DocumentDataset(
            self.tokens, self.loss, self.pieces, seed=self.seed, epoch=epoch, description=self.description
        )

    def num_positions(self) -> int:
        return int(self.pieces.num_positions.sum())

    def state(self) -> dict[str, Any]:
        """A JSON description, checked at resume."""
        return {"kind": "documents", "seed": self.seed, "items": len(self), **self.description}


@dataclasses.dataclass(frozen=True)
class PadCollate:
    """Stack items of different lengths: ``input_ids`` padded with ``pad_id``, ``labels`` with ``-100``, to the
    longest item rounded up to a multiple of ``multiple`` (at most ``max_len``): few distinct shapes to compile.

    >>> batch = PadCollate(pad_id=0, multiple=4, max_len=8)(
    ...     [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([2, 3])},
    ...      {"input_ids": torch.tensor([4, 5, 6, 7, 8]), "labels": torch.tensor([5, 6, 7, 8, 9])}])
    >>> batch["input_ids"].tolist()
    [[1, 2, 0, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 0, 0, 0]]
    """

    pad_id: int
    multiple: int
    max_len: int

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(int(item["input_ids"].shape[0]) for item in items)
        size = min(-(-longest // self.multiple) * self.multiple, self.max_len)
        out = {
            "input_ids": torch.full((len(items), size), self.pad_id, dtype=torch.int64),
            "labels": torch.full((len(items), size), IGNORE_INDEX, dtype=torch.int64),
        }
        for row, item in enumerate(items):
            for name in out:
                out[name][row, : item[name].shape[0]] = item[name]
        return out


def collate_rows(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows of one length (packed rows) into ``(B, T)`` tensors, key by key."""
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}
