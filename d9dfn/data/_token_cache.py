"""Files tokenized once: flat token arrays on disk, memory-mapped, keyed by what they depend on.

:func:`tokenize_files` turns files into documents (:mod:`d9dfn.data._records`), documents into token ids and loss
flags, and keeps them under ``cache_dir/<key>/`` as raw arrays (``tokens.bin``, ``loss.bin``, ``offsets.bin``, ...)
with a ``meta.json`` that says each array's dtype and length. The key is a SHA-256 of the tokenizer's fingerprint,
the content of every file (in order), the record format and the chat template: a second start with the same inputs
reads the arrays (memory-mapped, nothing tokenized); a changed file, tokenizer or template is another key.

Crash-safe: an entry is written whole into a temporary folder beside the others and renamed into place (a rename
is atomic), so a reader sees a complete entry or none. An entry whose files do not have the sizes its ``meta.json``
says (truncated, half-copied) is a miss, and is rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from d9dfn.data._records import Document, RecordFormat, expand_files, holdout_value, read_documents
from d9dfn.data._tokenizer import Tokenizer

__all__ = ["CACHE_VERSION", "TokenizedFiles", "encode_document", "files_digest", "tokenize_files"]

CACHE_VERSION = 1
"""Part of every key: raise it when the arrays' layout or the way documents are tokenized changes."""

_ARRAYS = ("tokens", "loss", "offsets", "splittable", "holdout")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedFiles:
    """Documents as flat arrays: document ``d``'s tokens are ``tokens[offsets[d]:offsets[d + 1]]``.

    Attributes:
        tokens: (N,) token ids (``uint16`` for vocabularies up to 65,536, else ``int32``), memory-mapped.
        loss: (N,) ``uint8``: 1 where the token is a target of the loss (the completion, the assistant turns).
        offsets: (D + 1,) ``int64`` document starts in ``tokens``, then ``N``.
        splittable: (D,) ``uint8``: 1 for a plain-text document (cut into pieces when longer than a row), 0 for a
            prompt/completion or chat (truncated).
        holdout: (D,) ``uint64``: where the document falls in ``[0, 2**64)`` for a held-out fraction.
        key: the cache key (a SHA-256).
        path: the cache entry's folder.
        built: ``True`` when this call tokenized the files, ``False`` when it read the cache.
        seconds: how long this call took.
    """

    tokens: np.ndarray
    loss: np.ndarray
    offsets: np.ndarray
    splittable: np.ndarray
    holdout: np.ndarray
    key: str
    path: Path
    built: bool
    seconds: float

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


def files_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (their relative paths and bytes, sorted by path)."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file != path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def tokenize_files(
    files: Sequence[str],
    tokenizer: Tokenizer,
    *,
    cache_dir: Path,
    format: RecordFormat | Literal["auto"] = "auto",
    chat_template: str | None = None,
    setting: str = "data.files",
    base: Path | None = None,
) -> TokenizedFiles:
    """The documents of ``files`` (paths or globs) as token arrays, from ``cache_dir`` when tokenized before.

    Args:
        files: paths or globs (:func:`~d9dfn.data.expand_files`).
        tokenizer: any :class:`~d9dfn.data.Tokenizer`.
        cache_dir: where entries live (created if missing).
        format: the records' format, or ``"auto"`` (from each file's first record).
        chat_template: renders chats; ``None``: the tokenizer's own.
        setting: the setting that named ``files``, for messages.
        base: where relative paths start (default: the working directory).

    Raises:
        DataError: bad data (:func:`~d9dfn.data.read_documents`), or no file.
    """
    started = time.perf_counter()
    paths = expand_files(files, setting=setting, base=base)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    key = _key(paths, tokenizer, format, template)
    entry = cache_dir / key
    found = _read_entry(entry, key)
    if found is not None:
        return dataclasses.replace(found, seconds=time.perf_counter() - started)
    special = dict(tokenizer.special_tokens)
    documents = (
        doc for path in paths for doc in read_documents(path, format=format, chat_template=template, special=special)
    )
    _write_entry(cache_dir, key, documents, tokenizer)
    built = _read_entry(entry, key)
    if built is None:  # written and renamed just now: only a file removed under our feet gets here
        raise OSError(f"tokenize_files: the cache entry {entry} cannot be read back after writing it; check the disk")
    return dataclasses.replace(built, built=True, seconds=time.perf_counter() - started)


def _key(paths: Sequence[Path], tokenizer: Tokenizer, format: str, template: str | None) -> str:
    described = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer.fingerprint(),
        "special_ids": [tokenizer.bos_id, tokenizer.eos_id],
        "format": format,
        "chat_template": template,
        "files": [files_digest(path) for path in paths],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _ids(encoded: Sequence[int]) -> np.ndarray:
    if isinstance(encoded, bytes | bytearray):  # the byte tokenizer: the bytes are the ids
        return np.frombuffer(encoded, dtype=np.uint8)
    return np.asarray(encoded, dtype=np.int64).reshape(-1)


def encode_document(document: Document, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """A document's ids and loss flags: its parts encoded one by one, between the tokenizer's BOS and EOS (with
    loss) for a plain-text or prompt/completion document; a chat is what its template rendered, nothing added."""
    ids: list[np.ndarray] = []
    loss: list[np.ndarray] = []
    wrap = document.kind != "chat"
    if wrap and tokenizer.bos_id is not None:
        ids.append(np.array([tokenizer.bos_id]))
        loss.append(np.zeros(1, dtype=np.uint8))
    for part in document.parts:
        encoded = _ids(tokenizer.encode(part.text))
        ids.append(encoded)
        loss.append(np.full(len(encoded), int(part.loss), dtype=np.uint8))
    if wrap and tokenizer.eos_id is not None:
        ids.append(np.array([tokenizer.eos_id]))
        loss.append(np.ones(1, dtype=np.uint8))
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    return np.concatenate(ids), np.concatenate(loss)


def _write_entry(cache_dir: Path, key: str, documents: Any, tokenizer: Tokenizer) -> None:
    """Tokenize ``documents`` into a temporary folder, then rename it to ``cache_dir/key`` (replacing a damaged one)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cache_dir / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        dtype = _token_dtype(tokenizer.vocab_size)
        offsets, splittable, holdout = [0], [], []
        with (temporary / "tokens.bin").open("wb") as tokens, (temporary / "loss.bin").open("wb") as loss:
            for document in documents:
                ids, flags = encode_document(document, tokenizer)
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
                    raise ValueError(
                        f"tokenize_files: {document.where}: the tokenizer gave ids outside [0, {tokenizer.vocab_size}) "
                        "(its vocab_size); fix the tokenizer's vocab_size"
                    )
                tokens.write(ids.astype(dtype).tobytes())
                loss.write(flags.tobytes())
                offsets.append(offsets[-1] + len(ids))
                splittable.append(int(document.kind == "text"))
                holdout.append(holdout_value(document.key))
            _sync(tokens, loss)
        arrays: dict[str, np.ndarray] = {
            "offsets": np.asarray(offsets, dtype=np.int64),
            "splittable": np.asarray(splittable, dtype=np.uint8),
            "holdout": np.asarray(holdout, dtype=np.uint64),
        }
        for name, array in arrays.items():
            with (temporary / f"{name}.bin").open("wb") as file:
                file.write(array.tobytes())
                _sync(file)
        meta = {
            "key": key,
            "dtypes": {"tokens": dtype.str, "loss": "|u1", **{name: a.dtype.str for name, a in arrays.items()}},
            "lengths": {"tokens": offsets[-1], "loss": offsets[-1], **{name: len(a) for name, a in arrays.items()}},
        }
        with (temporary / "meta.json").open("w") as file:
            json.dump(meta, file)
            _sync(file)
        _move_into_place(temporary, cache_dir / key)
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)


def _sync(*files: Any) -> None:
    for file in files:
        file.flush()
        os.fsync(file.fileno())


def _move_into_place(temporary: Path, entry: Path) -> None:
    """Rename ``temporary`` to ``entry``; a damaged ``entry`` is moved aside first, a sound one (another process
    wrote it meanwhile) kept."""
    if entry.exists():
        if _read_entry(entry, entry.name) is not None:
            return  # another process finished first: its arrays are the same
        aside = entry.with_name(f".damaged-{entry.name}-{uuid.uuid4().hex[:8]}")
        os.replace(entry, aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(temporary, entry)
    except OSError:
        if _read_entry(entry, entry.name) is None:  # not a race lost to a sound entry
            raise


def _read_entry(entry: Path, key: str) -> TokenizedFiles | None:
    """The entry's arrays, memory-mapped, or ``None`` when it is missing or damaged (a size that does not match
    ``meta.json``, offsets that do not add up)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("key") != key:
            return None
        arrays = {}
        for name in _ARRAYS:
            dtype, length = np.dtype(meta["dtypes"][name]), int(meta["lengths"][name])
            path = entry / f"{name}.bin"
            if path.stat().st_size != dtype.itemsize * length:
                return None
            arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    offsets = arrays["offsets"]
    num_documents = len(offsets) - 1
    if (
        num_documents < 0
        or offsets[0] != 0
        or offsets[-1] != len(arrays["tokens"])
        or len(arrays["splittable"]) != num_documents
        or len(arrays["holdout"]) != num_documents
        or bool(np.any(np.diff(offsets) < 0))
    ):
        return None
    return TokenizedFiles(**arrays, key=key, path=entry, built=False, seconds=0.0)
