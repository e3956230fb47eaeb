"""Your files as the job's dataset (``data.files``): the settings, and the provider that reads, tokenizes (once,
cached), cuts, splits and packs them before anything is built.

:class:`FilesProvider` does all of it when it is made, so bad data is refused in one line (exit 2) before the model
is built or anything compiles, and says what it did in a few ``d9dfn: data:`` lines on stderr. The pieces are in
:mod:`d9dfn.data` (``tokenize_files``, ``cut_documents``, ``PackedDataset``, ...); ``docs/design/data.md`` says why.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from d9dfn._torch import static_shapes as torch_static_shapes
from d9dfn.config import FrozenConfig
from d9dfn.data import (
    BufferSortedDataset,
    ByteTokenizer,
    CutReport,
    DataError,
    DocumentDataset,
    PackedDataset,
    PadCollate,
    Pieces,
    TokenizedFiles,
    Tokenizer,
    collate_rows,
    cut_documents,
    select_pieces,
    tokenize_files,
)
from d9dfn.loop import InitializeDatasetContext, InitializeDatasetResult, is_main_process

__all__ = [
    "DEFAULT_VALIDATION_FRACTION",
    "FilesConfig",
    "FilesProvider",
    "data_cache_dir",
    "pad_multiple",
    "static_shapes",
]

DEFAULT_VALIDATION_FRACTION = 0.05
"""The documents held out for validation when neither ``data.validation_files`` nor a fraction is given."""

BUFFER_BATCHES = 64
"""With packing off, documents are sorted by length within buffers of this many global batches (d9d's
``BufferSortedDataset``): batches of similar lengths, in random order."""


class FilesConfig(FrozenConfig):
    """Your files as the dataset: read, tokenized once (cached on disk), cut to ``seq_len`` and packed."""

    files: tuple[str, ...] = Field(min_length=1)
    """Paths or globs (``**`` crosses folders), relative to the working directory: ``.jsonl`` (a JSON object per line),
    ``.parquet``, a folder of datasets' ``save_to_disk``, any other file as plain text (one document per file)."""
    validation_files: tuple[str, ...] | None = None
    """Validation documents from these files; ``None``: a held-out fraction of ``files`` (validation_fraction)."""
    validation_fraction: float | None = Field(None, gt=0.0, lt=1.0)
    """The fraction of ``files``' documents held out for validation (picked by a hash of each record, so the same on
    every run); ``None``: 0.05. Only without validation_files."""
    format: Literal["auto", "text", "prompt_completion", "chat"] = "auto"
    """The records' format: ``text`` (loss on every token), ``prompt_completion`` (loss on the completion only),
    ``chat`` (``messages`` rendered with the chat template; loss on the assistant turns only); ``auto``: from each
    file's first record (``messages``, else ``prompt`` and ``completion``, else ``text``)."""
    seq_len: int = Field(128, ge=2)
    """Tokens per training row; longer plain-text documents are cut into pieces, longer prompt/completion and chat
    documents truncated (the log says how many)."""
    packing: bool = True
    """Pack documents into full rows (position ids restart per document, attention never crosses documents); false:
    one document per row, padded, in batches of similar lengths."""
    chat_template: str | None = None
    """A Jinja chat template (Hugging Face's format) for chat records; ``None``: the tokenizer's (the byte tokenizer
    has none)."""
    cache_dir: Path | None = None
    """Where tokenized files are kept; ``None``: ``$XDG_CACHE_HOME/d9dfn/data`` or ``~/.cache/d9dfn/data``."""

    @model_validator(mode="after")
    def _one_validation_source(self) -> FilesConfig:
        if self.validation_files is not None and self.validation_fraction is not None:
            raise ValueError(
                f"data.validation_files and data.validation_fraction={self.validation_fraction} are both set, but a "
                "fraction is held out of data.files only without validation files; drop one of them"
            )
        return self


def data_cache_dir(config: FilesConfig) -> Path:
    """Where the token cache lives: ``data.cache_dir``, else ``$XDG_CACHE_HOME/d9dfn/data``, else
    ``~/.cache/d9dfn/data``."""
    if config.cache_dir is not None:
        return config.cache_dir
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "d9dfn" / "data"


def pad_multiple(seq_len: int) -> int:
    """With packing off, batches are padded to a multiple of this: a quarter of ``seq_len`` rounded up to 8, so a run
    compiles at most 4 shapes (``dynamic=False`` regions; dynamo's recompile limit is 8).

    >>> pad_multiple(128), pad_multiple(100), pad_multiple(16)
    (32, 32, 8)
    """
    return max(8, -(-seq_len // 32) * 8)


def static_shapes(data: Any) -> contextlib.AbstractContextManager[Any]:
    """Where the step compiles for your files with packing off: each of the (at most 4) padded lengths as a graph of
    its own. dynamo would make the length symbolic at the second one (``automatic_dynamic_shapes``), and torch 2.13's
    FX graph cache then warns, at every start, that it cannot load such a graph back. Elsewhere: nothing changes."""
    if isinstance(data, FilesConfig) and not data.packing:
        return torch_static_shapes()
    return contextlib.nullcontext()


def _say(line: str) -> None:
    if is_main_process():
        print(f"d9dfn: data: {line}", file=sys.stderr, flush=True)


class FilesProvider:
    """The job's dataset from ``data.files``: prepared when made (read, tokenized or read from the cache, cut, split,
    packed), then the train or validation split on each call.

    Args:
        config: the ``data`` section.
        tokenizer: how text becomes ids (default: UTF-8 bytes, the default model's 256 ids).
        vocab_size: the model's embedding rows: the tokenizer's ids must fit.
        max_positions: the model's longest sequence: ``seq_len`` must fit.
        say: where the ``d9dfn: data:`` lines go (default: stderr, on the main process).

    Raises:
        ValueError: bad data or settings, in one line naming the file, the line and the fix (:class:`DataError`).
    """

    def __init__(
        self,
        config: FilesConfig,
        tokenizer: Tokenizer | None = None,
        *,
        vocab_size: int,
        max_positions: int,
        say: Callable[[str], None] = _say,
    ) -> None:
        tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.config, self.tokenizer = config, tokenizer
        self.lines: list[str] = []  # what it did, said once every check has passed: bad data is one line alone
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"data: the tokenizer has {tokenizer.vocab_size} ids but the model's embedding has {vocab_size} rows, "
                "so some tokens have no embedding; train a model of this tokenizer's vocabulary, or use the model's "
                "own tokenizer"
            )
        if config.seq_len > max_positions:
            raise DataError(
                f"data.seq_len={config.seq_len} is longer than the model's {max_positions} positions; set "
                f"--set data.seq_len={max_positions} (or less)"
            )
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.pad_id = 0 if pad_id is None else pad_id
        cache = data_cache_dir(config)
        train = self._tokenize(config.files, "data.files", cache)
        pieces, report = cut_documents(train.offsets, train.splittable, train.loss, config.seq_len)
        _say_cut(report, config.seq_len, self.lines.append)
        if config.validation_files is not None:
            validation = self._tokenize(config.validation_files, "data.validation_files", cache)
            val_pieces, val_report = cut_documents(
                validation.offsets, validation.splittable, validation.loss, config.seq_len
            )
            _say_cut(val_report, config.seq_len, self.lines.append, "validation: ")
            self.splits = {"train": (train, pieces), "validation": (validation, val_pieces)}
        else:
            fraction = config.validation_fraction or DEFAULT_VALIDATION_FRACTION
            held = _held_out(train.holdout, pieces, fraction)
            self.splits = {
                "train": (train, select_pieces(pieces, ~held)),
                "validation": (train, select_pieces(pieces, held)),
            }
        for split, (_, chosen) in self.splits.items():
            if len(chosen) == 0:
                where = "data.validation_files" if split == "validation" and config.validation_files else "data.files"
                fix = (
                    "raise data.validation_fraction or pass data.validation_files"
                    if split == "validation" and config.validation_files is None
                    else f"add documents with a target within data.seq_len={config.seq_len} tokens to {where}"
                )
                raise DataError(f"data: the {split} split has no document; {fix}")
        self.datasets = {
            split: self._dataset(tokenized, chosen, split) for split, (tokenized, chosen) in self.splits.items()
        }
        rows = self.datasets["train"]
        num_positions = int(self.splits["train"][1].num_positions.sum())
        if isinstance(rows, PackedDataset):
            self.lines.append(
                f"packed {len(self.splits['train'][1]):,} training documents (or their pieces) into {len(rows):,} "
                f"rows of {config.seq_len} ({rows.num_pad() / (len(rows) * config.seq_len):.2%} padding)"
            )
        else:
            self.lines.append(
                f"{len(rows):,} training documents, one per row, padded to a multiple of "
                f"{pad_multiple(config.seq_len)} in batches of similar lengths ({num_positions:,} positions)"
            )
        for line in self.lines:
            say(line)

    def _tokenize(self, files: tuple[str, ...], setting: str, cache: Path) -> TokenizedFiles:
        tokenized = tokenize_files(
            files,
            self.tokenizer,
            cache_dir=cache,
            format=self.config.format,
            chat_template=self.config.chat_template,
            setting=setting,
        )
        what = f"{tokenized.num_documents:,} documents ({len(tokenized.tokens):,} tokens) of {setting}"
        if tokenized.built:
            self.lines.append(f"tokenized {what} in {tokenized.seconds:.2f} s; cached in {tokenized.path}")
        else:
            self.lines.append(
                f"read {what} from the cache {tokenized.path} in {tokenized.seconds:.2f} s (nothing tokenized)"
            )
        return tokenized

    def _dataset(self, tokenized: TokenizedFiles, pieces: Pieces, split: str) -> PackedDataset | DocumentDataset:
        description = {"cache_key": tokenized.key, "split": split}
        if self.config.packing:
            return PackedDataset(
                tokenized.tokens,
                tokenized.loss,
                pieces,
                self.config.seq_len,
                pad_id=self.pad_id,
                description=description,
            )
        return DocumentDataset(tokenized.tokens, tokenized.loss, pieces, seed=0, description=description)

    def __call__(self, context: InitializeDatasetContext) -> InitializeDatasetResult:
        """The ``context.split`` split (``train`` or ``validation``); with packing off, train batches come from
        :class:`~d9dfn.data.BufferSortedDataset` (of the global batch size), which the loop then reads in order."""
        dataset: Any = self.datasets["validation" if context.split != "train" else "train"]
        if self.config.packing:
            return InitializeDatasetResult(dataset=dataset, collator=collate_rows)
        collate = PadCollate(self.pad_id, pad_multiple(self.config.seq_len), self.config.seq_len)
        if context.split != "train":
            return InitializeDatasetResult(dataset=dataset, collator=collate)
        dataset = DocumentDataset(
            dataset.tokens, dataset.loss, dataset.pieces, seed=context.seed, description=dataset.description
        )
        batch = context.per_rank_batch_size * context.dp_size
        sorted_ = BufferSortedDataset(dataset, buffer_size=batch * BUFFER_BATCHES, pack_size=batch, seed=context.seed)
        return InitializeDatasetResult(dataset=sorted_, collator=collate, shuffle=False)


def _held_out(holdout: np.ndarray, pieces: Pieces, fraction: float) -> np.ndarray:
    """(P,) whether each piece is held out: its document's hash mixed with its number in the document (splitmix64),
    below ``fraction`` of ``2**64``, so that the pieces of one long document spread over both splits."""
    with np.errstate(over="ignore"):
        mixed = holdout[pieces.documents].astype(np.uint64) ^ (
            pieces.index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        )
        mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        mixed = mixed ^ (mixed >> np.uint64(31))
    return mixed < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


def _say_cut(report: CutReport, seq_len: int, say: Callable[[str], None], split: str = "") -> None:
    """The log's line about documents cut to ``seq_len``, when any was."""
    said = []
    if report.num_split:
        said.append(
            f"{report.num_split:,} plain-text documents longer than seq_len={seq_len} cut into "
            f"{report.num_split_pieces:,} pieces"
        )
    if report.num_truncated:
        said.append(
            f"{report.num_truncated:,} prompt/completion or chat documents longer than seq_len={seq_len} truncated "
            f"({report.num_truncated_tokens:,} tokens dropped)"
        )
    if report.num_too_short:
        said.append(f"{report.num_too_short:,} documents of fewer than 2 tokens skipped")
    if report.num_no_target:
        said.append(f"{report.num_no_target:,} pieces with no target within seq_len={seq_len} dropped")
    if said:
        say(f"{split}{'; '.join(said)}")
