"""The default job's corpus: the Python standard library's own source, as bytes (a vocabulary of 256), cut into
training windows (:class:`ByteWindowDataset`); or its text through a tokenizer, ``model.source``'s
(:func:`token_stream`, :class:`TokenWindowDataset`).

Every machine that runs d9dfn has it, so ``d9dfn train`` needs no download. The files are the ``*.py``
under ``sysconfig.get_paths()["stdlib"]`` minus tests and installed packages. Which file goes to
validation, and in which order files are taken, is decided by a SHA-256 of its relative path, so the
corpus is the same on every machine with the **same Python version and the same stdlib files**. Another
Python version (or a distribution that patches or trims its stdlib) gives another corpus; compare
:attr:`Corpus.fingerprint` to tell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from d9dfn.data import ByteTokenizer, Tokenizer

__all__ = [
    "VOCAB_SIZE",
    "ByteWindowDataset",
    "Corpus",
    "TokenWindowDataset",
    "decode_bytes",
    "stdlib_corpus",
    "stdlib_source_files",
    "token_stream",
]

VOCAB_SIZE = ByteTokenizer.vocab_size
"""Byte-level: every token is one byte (256 ids)."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def _digest(salt: str, relpath: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}:{relpath}".encode()).digest()[:8], "big")


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The ``*.py`` files under ``root`` (default: this Python's stdlib) as sorted relative POSIX paths.

    Directories named ``test``, ``tests``, ``idle_test``, ``site-packages``, ``dist-packages``,
    ``__pycache__`` or starting with ``.`` are skipped.

    >>> "json/decoder.py" in stdlib_source_files()
    True
    """
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(base)
        found.extend((rel / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Two byte strings and where they came from."""

    train: bytes
    """Training bytes: the train files, each behind a ``# <path>`` line."""
    validation: bytes
    """Validation bytes, from files that are never in ``train``."""
    train_files: tuple[str, ...]
    """Relative paths in ``train``, in order (the last one may be cut short)."""
    validation_files: tuple[str, ...]
    """Relative paths in ``validation``, in order."""
    python_version: str
    """The Python version whose stdlib this is; another version gives another corpus."""

    @property
    def fingerprint(self) -> str:
        """SHA-256 of both splits: equal fingerprints mean equal corpora."""
        return hashlib.sha256(self.train + b"\0" + self.validation).hexdigest()


def _take(base: Path, files: Sequence[str], budget: int) -> tuple[bytes, tuple[str, ...]]:
    """Concatenate ``files`` (each behind a ``# path`` line) until ``budget`` bytes, cutting the last one."""
    chunks, taken, size = [], [], 0
    for rel in files:
        if size >= budget:
            break
        text = (base / rel).read_bytes()
        chunk = b"# " + rel.encode() + b"\n" + text + (b"" if text.endswith(b"\n") else b"\n")
        chunk = chunk[: budget - size]
        chunks.append(chunk)
        taken.append(rel)
        size += len(chunk)
    return b"".join(chunks), tuple(taken)


def stdlib_corpus(
    *, max_bytes: int = 2_000_000, validation_every: int = 10, root: str | os.PathLike[str] | None = None
) -> Corpus:
    """Read the stdlib corpus: about one file in ``validation_every`` is validation, ``max_bytes`` in all.

    Files are split by a hash of their path, then taken in a hashed (so mixed) order until the split's
    budget is spent: ``max_bytes // validation_every`` for validation and the rest for training. Only
    the files needed are read, so small budgets are fast.

    Raises:
        ValueError: ``validation_every < 2`` or ``max_bytes < validation_every``, or no source files.

    >>> corpus = stdlib_corpus(max_bytes=20_000)
    >>> len(corpus.train), len(corpus.validation)
    (18000, 2000)
    >>> set(corpus.train_files) & set(corpus.validation_files)
    set()
    """
    if validation_every < 2 or max_bytes < validation_every:
        raise ValueError(
            f"stdlib_corpus: validation_every={validation_every}, max_bytes={max_bytes}; pass validation_every "
            f">= 2 (one file in that many is validation) and max_bytes >= validation_every"
        )
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files = stdlib_source_files(base)
    if not files:
        raise ValueError(f"stdlib_corpus: no *.py files under {base}; pass root= a directory of Python sources")
    ordered = sorted(files, key=lambda rel: (_digest("order", rel), rel))
    validation = [rel for rel in ordered if _digest("split", rel) % validation_every == 0]
    train = [rel for rel in ordered if _digest("split", rel) % validation_every != 0]
    validation_budget = max_bytes // validation_every
    train_bytes, train_files = _take(base, train, max_bytes - validation_budget)
    validation_bytes, validation_files = _take(base, validation, validation_budget)
    return Corpus(train_bytes, validation_bytes, train_files, validation_files, platform.python_version())


class ByteWindowDataset:
    """Fixed windows of ``seq_len + 1`` bytes as ``{"input_ids", "labels"}`` int64 tensors (labels shifted by one).

    Window ``i`` starts at byte ``i * stride`` (default ``stride = seq_len``: every byte after the first
    is a label exactly once). ``sort_key`` is the constant ``seq_len``, so the dataset also works under
    :class:`~d9dfn.data._datasets.BufferSortedDataset`.

    Raises:
        ValueError: ``seq_len`` or ``stride`` below 1, or fewer than ``seq_len + 1`` bytes.

    >>> ds = ByteWindowDataset(b"hello world", seq_len=4)
    >>> len(ds), ds[1]["input_ids"].tolist(), decode_bytes(ds[1]["labels"])
    (2, [111, 32, 119, 111], ' wor')
    """

    def __init__(self, data: bytes, seq_len: int, *, stride: int | None = None) -> None:
        stride = seq_len if stride is None else stride
        if seq_len < 1 or stride < 1:
            raise ValueError(f"ByteWindowDataset: seq_len={seq_len}, stride={stride}; pass ints >= 1")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"ByteWindowDataset: {len(data)} bytes hold no window of seq_len + 1 = {seq_len + 1} bytes; "
                f"lower seq_len or read more bytes (stdlib_corpus(max_bytes=...))"
            )
        # bytearray: torch.frombuffer warns on read-only buffers such as bytes.
        self._data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (self._data.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"ByteWindowDataset: index {index} is outside [0, {len(self)})")
        start = index * self.stride
        window = self._data[start : start + self.seq_len + 1].to(torch.int64)  # (T + 1,)
        return {"input_ids": window[:-1], "labels": window[1:]}

    def sort_key(self, index: int) -> int:
        """Every window has ``seq_len`` tokens."""
        return self.seq_len


def decode_bytes(ids: torch.Tensor | Sequence[int]) -> str:
    """Turn byte ids back into text (invalid UTF-8 becomes U+FFFD): :meth:`ByteTokenizer.decode
    <d9dfn.data.ByteTokenizer.decode>`, for a tensor too.

    Raises:
        ValueError: an id outside ``[0, 256)``.

    >>> decode_bytes(torch.tensor([104, 105]))
    'hi'
    """
    return ByteTokenizer().decode(ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)


def token_stream(tokenizer: Tokenizer, texts: Iterable[str]) -> torch.Tensor:
    """The texts' ids one after another, as one (N,) int64 tensor (each text encoded on its own, no special token).

    >>> token_stream(ByteTokenizer(), ["ab", "c"]).tolist()
    [97, 98, 99]
    """
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
    return torch.tensor(ids, dtype=torch.int64)


class TokenWindowDataset:
    """Fixed windows of ``seq_len + 1`` ids of a token stream as ``{"input_ids", "labels"}`` int64 tensors (labels
    shifted by one); window ``i`` starts at id ``i * stride`` (default ``seq_len``: every id after the first is a
    label exactly once). ``sort_key`` is the constant ``seq_len``, as for :class:`ByteWindowDataset`.

    Raises:
        ValueError: ``seq_len`` or ``stride`` below 1, or fewer than ``seq_len + 1`` ids.

    >>> ds = TokenWindowDataset(torch.arange(10), seq_len=4)
    >>> len(ds), ds[1]["input_ids"].tolist(), ds[1]["labels"].tolist()
    (2, [4, 5, 6, 7], [5, 6, 7, 8])
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, *, stride: int | None = None, what: str = "the text") -> None:
        stride = seq_len if stride is None else stride
        if seq_len < 1 or stride < 1:
            raise ValueError(f"TokenWindowDataset: seq_len={seq_len}, stride={stride}; pass ints >= 1")
        if ids.numel() < seq_len + 1:
            raise ValueError(
                f"TokenWindowDataset: {what} is {ids.numel()} tokens, which hold no window of seq_len + 1 = "
                f"{seq_len + 1}; lower data.seq_len or read more text (data.max_bytes)"
            )
        self._ids = ids.reshape(-1).to(torch.int64)
        self.seq_len = seq_len
        self.stride = stride

    def __len__(self) -> int:
        return (self._ids.numel() - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"TokenWindowDataset: index {index} is outside [0, {len(self)})")
        start = index * self.stride
        window = self._ids[start : start + self.seq_len + 1]  # (T + 1,)
        return {"input_ids": window[:-1], "labels": window[1:]}

    def sort_key(self, index: int) -> int:
        """Every window has ``seq_len`` tokens."""
        return self.seq_len
