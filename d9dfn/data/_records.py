"""Your files as documents: which files, their records, each record's format, and its text split into loss parts.

A file is read by its kind: ``.jsonl`` / ``.ndjson`` (a JSON object per line), ``.parquet`` (a row per record, needs
``pyarrow``), a folder written by Hugging Face ``datasets``' ``save_to_disk`` (a row per record, needs ``datasets``),
and any other file as plain text (the whole file is one document). A record's format comes from its fields (or is
set): ``text`` (plain text, loss on every token), ``prompt`` + ``completion`` (loss on the completion only) or
``messages`` (a chat rendered with a Jinja chat template, loss on the assistant turns only).

A document is a tuple of :class:`Part` (text, whether its tokens carry loss). Every refusal is one
:class:`DataError` line naming the file, the line (or row) and the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FORMATS",
    "DataError",
    "Document",
    "Part",
    "RecordFormat",
    "expand_files",
    "read_documents",
    "read_records",
    "render_chat",
]

RecordFormat = Literal["text", "prompt_completion", "chat"]
FORMATS: tuple[RecordFormat, ...] = ("text", "prompt_completion", "chat")
"""The record formats, in the order detection tries them from the last: ``messages`` wins over ``prompt``/
``completion``, which win over ``text``."""

_FIELDS: dict[RecordFormat, tuple[str, ...]] = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
}
_JSONL = (".jsonl", ".ndjson")
_HF_MARKERS = ("dataset_info.json", "state.json")


class DataError(ValueError):
    """Bad data, in one line: the file, the line or row, what is wrong and the fix."""


@dataclasses.dataclass(frozen=True)
class Part:
    """A run of a document's text, and whether its tokens are targets of the loss."""

    text: str
    loss: bool


@dataclasses.dataclass(frozen=True)
class Document:
    """One record as text parts; ``kind`` says how it was made, ``key`` (bytes of the record) picks its split."""

    parts: tuple[Part, ...]
    kind: RecordFormat
    key: bytes
    where: str
    """``train.jsonl line 12``: for the messages."""


def expand_files(patterns: Sequence[str], *, setting: str = "data.files", base: Path | None = None) -> list[Path]:
    """The files (and ``datasets`` folders) that ``patterns`` name, in the order given, each once.

    A pattern with ``*``, ``?`` or ``[`` is a glob (``**`` crosses folders), sorted; any other is a path that must
    exist. Relative paths are taken from ``base`` (default: the working directory).

    Raises:
        DataError: a missing path, a glob that matches nothing, an empty file, a folder that is not a ``datasets``
            folder.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "b.txt").write_text("b"), (folder / "a.txt").write_text("a")
    >>> [p.name for p in expand_files(["*.txt", "a.txt"], base=folder)]
    ['a.txt', 'b.txt']
    """
    where = Path.cwd() if base is None else base
    found: list[Path] = []
    for pattern in patterns:
        # Relative paths stay relative (as the user wrote them, in messages) unless a base is given.
        full = os.path.expanduser(pattern) if base is None else str(base / os.path.expanduser(pattern))
        if glob.has_magic(pattern):
            matched = [Path(p) for p in sorted(glob.glob(full, recursive=True))]
            matched = [p for p in matched if p.is_file() or _is_hf_folder(p)]
            if not matched:
                raise DataError(
                    f"{setting}: {pattern!r} matches no file (looked under {where}); fix the pattern, or pass the "
                    "files' paths"
                )
        else:
            path = Path(full)
            if not path.exists():
                raise DataError(f"{setting}: {pattern} does not exist (looked under {where}); fix the path")
            if path.is_dir() and not _is_hf_folder(path):
                raise DataError(
                    f"{setting}: {pattern} is a folder but not one written by datasets' save_to_disk (it has no "
                    f"{' or '.join(_HF_MARKERS)}); pass its files, e.g. {pattern.rstrip('/')}/*.jsonl"
                )
            matched = [path]
        for path in matched:
            if path.is_file() and path.stat().st_size == 0:
                raise DataError(f"{setting}: {path} is empty; remove it from {setting} or give it records")
            if path not in found:
                found.append(path)
    return found


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def read_documents(
    path: Path, *, format: RecordFormat | Literal["auto"], chat_template: str | None, special: Mapping[str, str]
) -> Iterator[Document]:
    """The documents of one file, in order: its records turned into text parts by their format.

    Args:
        path: a file or a ``datasets`` folder (:func:`expand_files`).
        format: the records' format, or ``"auto"``: detected from the first record's fields.
        chat_template: the Jinja template that renders chats (``None``: a chat record is refused).
        special: the strings the template may name (``bos_token``, ``eos_token``).

    Raises:
        DataError: text that is not UTF-8, a line that is not a JSON object, a record without the format's fields
            or with a field of the wrong type, a chat without a template, a file without a record.
    """
    detected: RecordFormat | None = None if format == "auto" else format
    count = 0
    for where, key, record in _records(path):
        if isinstance(record, str):  # a plain-text file: one text document
            yield Document((Part(record, True),), "text", key, where)
            count += 1
            continue
        if detected is None:
            detected = _detect(record, where)
        yield Document(_parts(record, detected, where, chat_template, special), detected, key, where)
        count += 1
    if count == 0:
        raise DataError(f"{path} holds no record; remove it from the files or give it records")


def read_records(path: Path, *, setting: str = "data.files") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(where, record)`` for every record of a JSONL or Parquet file or a ``datasets`` folder, in order: ``where``
    says ``train.jsonl line 12`` (or ``row 12``) for messages. For jobs whose records are not documents (a label per
    text: ``d9dfn.jobs.ClassificationJobConfig``).

    Raises:
        DataError: a plain-text file (it has no fields), text that is not UTF-8, a line that is not a JSON object,
            a file without a record.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "a.jsonl"
    >>> _ = path.write_text('{"text": "hi", "label": 1}\\n')
    >>> [(where.split()[-2:], record["label"]) for where, record in read_records(path)]
    [(['line', '1'], 1)]
    """
    count = 0
    for where, _, record in _records(path):
        if isinstance(record, str):
            raise DataError(
                f"{setting}: {path} is plain text, which has no fields to read; pass JSONL (one JSON object per line), "
                "Parquet or a datasets folder"
            )
        count += 1
        yield where, record
    if count == 0:
        raise DataError(f"{path} holds no record; remove it from {setting} or give it records")


def _records(path: Path) -> Iterator[tuple[str, bytes, Any]]:
    """``(where, key, record)`` for every record of ``path``: ``record`` is a dict, or a str for a plain-text file."""
    if path.is_dir():
        yield from _hf_rows(path)
    elif path.suffix.lower() in _JSONL:
        yield from _jsonl(path)
    elif path.suffix.lower() == ".parquet":
        yield from _parquet_rows(path)
    elif path.suffix.lower() == ".json":
        raise DataError(
            f"{path}: .json files are not read (a JSON array has no line to name in a message); write one object per "
            "line as .jsonl (e.g. jq -c '.[]' file.json > file.jsonl)"
        )
    else:
        data = path.read_bytes()
        yield f"{path}", data, _decode(data, path, 1)


def _decode(data: bytes, path: Path, first_line: int) -> str:
    """``data`` as UTF-8 (a byte-order mark dropped), or a :class:`DataError` naming the line of the first bad byte."""
    try:
        return data.decode("utf-8-sig" if first_line == 1 else "utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data[: error.start].count(b"\n")
        raise DataError(
            f"{path} line {line}: byte 0x{data[error.start]:02x} is not UTF-8 text; convert the file to UTF-8 "
            f"(e.g. iconv -f latin1 -t utf-8) or remove it from the files"
        ) from None


def _jsonl(path: Path) -> Iterator[tuple[str, bytes, Any]]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            text = _decode(raw, path, number)
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as error:
                raise DataError(
                    f"{path} line {number}: not JSON ({error}); fix the line (JSONL: one JSON object per line)"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"{path} line {number}: a JSON {type(record).__name__}, not an object; write one object per line, "
                    'e.g. {"text": "..."}'
                )
            yield f"{path} line {number}", raw.strip(), record


def _parquet_rows(path: Path) -> Iterator[tuple[str, bytes, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow; pip install 'd9dfn[data]' (or pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid and OSErrors: not a Parquet file
        raise DataError(f"{path}: not a Parquet file ({error}); pass a Parquet file or rename it") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", _row_key(row), row


def _hf_rows(path: Path) -> Iterator[tuple[str, bytes, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a datasets folder needs the datasets package; pip install 'd9dfn[data]' (or datasets)"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(
            f"{path}: a DatasetDict of splits {sorted(loaded)}; pass one split's folder, e.g. "
            f"{path / next(iter(loaded))}"
        )
    for number, row in enumerate(loaded, start=1):
        yield f"{path} row {number}", _row_key(row), row


def _row_key(row: Mapping[str, Any]) -> bytes:
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode()


def _detect(record: Mapping[str, Any], where: str) -> RecordFormat:
    for format in reversed(FORMATS):
        if all(record.get(name) is not None for name in _FIELDS[format]):
            return format
    fields = ", ".join(sorted(str(key) for key, value in record.items() if value is not None)) or "none"
    raise DataError(
        f"{where}: the record has none of the fields d9dfn reads (text; prompt and completion; messages), it has: "
        f"{fields}; rename the field, or convert the records"
    )


def _field(record: Mapping[str, Any], name: str, format: RecordFormat, where: str) -> Any:
    if record.get(name) is None:  # a Parquet or datasets row holds every column, null where a record has none
        fields = ", ".join(sorted(str(key) for key, value in record.items() if value is not None)) or "none"
        raise DataError(
            f"{where}: the record has no {name!r} field (it has: {fields}), which the {format} format needs; give "
            "every record that field, or set data.format to the records' format"
        )
    return record[name]


def _string(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} is a {type(value).__name__}, not a string; write it as text")
    return value


def _parts(
    record: Mapping[str, Any],
    format: RecordFormat,
    where: str,
    chat_template: str | None,
    special: Mapping[str, str],
) -> tuple[Part, ...]:
    if format == "text":
        return (Part(_string(_field(record, "text", format, where), "text", where), True),)
    if format == "prompt_completion":
        prompt = _string(_field(record, "prompt", format, where), "prompt", where)
        completion = _string(_field(record, "completion", format, where), "completion", where)
        return (Part(prompt, False), Part(completion, True))
    messages = _field(record, "messages", format, where)
    if chat_template is None:
        raise DataError(
            f"{where}: a chat record (messages) but the tokenizer has no chat template; set data.chat_template to a "
            "Jinja chat template, or use a tokenizer whose tokenizer_config.json has one"
        )
    _check_messages(messages, where)
    return render_chat(messages, chat_template, special, where=where)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: \'messages\' is not a non-empty list; write it as [{{"role": ..., "content": ...}}]')
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(
                f"{where}: messages[{index}] is not an object with a string 'role'; write "
                '{"role": "user", "content": "..."}'
            )
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: messages[{index}]['content'] is not a string; write the message's text")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: the chat has no assistant message, so nothing to learn; add one or drop the record")


def render_chat(
    messages: Sequence[Mapping[str, Any]], template: str, special: Mapping[str, str], *, where: str = "chat"
) -> tuple[Part, ...]:
    """A chat rendered by ``template``, cut into parts: the assistant turns carry loss, the rest does not.

    An assistant turn is what the template adds to the conversation before it when given that turn, after the
    generation prompt (``add_generation_prompt=True``): the render of ``messages[:i]`` with the prompt must be a
    prefix of the render of ``messages[:i + 1]``, which must be a prefix of the whole conversation's render.

    Raises:
        DataError: a template that does not render or that does not extend a conversation by appending to it.

    >>> template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}" \\
    ...     "{% if add_generation_prompt %}<assistant>{% endif %}"
    >>> chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    >>> [(part.text, part.loss) for part in render_chat(chat, template, {})]
    [('<user>hi</s><assistant>', False), ('yo</s>', True)]
    """
    compiled = _compiled(template)

    def render(upto: int, prompt: bool) -> str:
        try:
            text: str = compiled.render(messages=list(messages[:upto]), add_generation_prompt=prompt, **special)
        except Exception as error:  # jinja2's errors and the template's own raise_exception
            raise DataError(
                f"{where}: the chat template fails on this chat ({type(error).__name__}: {error}); fix the record or "
                "the template (data.chat_template)"
            ) from None
        return text

    whole = render(len(messages), False)
    parts: list[Part] = []
    done = 0  # characters of `whole` already in parts
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(index, True), render(index + 1, False)
        if not (after.startswith(before) and whole.startswith(after) and len(before) >= done):
            raise DataError(
                f"{where}: the chat template does not render a conversation as its earlier turns followed by the new "
                f"one (messages[{index}]), so the assistant turns cannot be found; use a template that appends turns"
            )
        parts.extend(p for p in (Part(whole[done : len(before)], False), Part(whole[len(before) : len(after)], True)))
        done = len(after)
    parts.append(Part(whole[done:], False))
    return tuple(part for part in parts if part.text)


_TEMPLATES: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    """``template`` compiled once, in a sandbox, with Hugging Face's ``raise_exception`` and JSON ``tojson``."""
    if template not in _TEMPLATES:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise DataError("a chat template needs jinja2; pip install jinja2") from None

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        environment.globals["raise_exception"] = raise_exception
        try:
            _TEMPLATES[template] = environment.from_string(template)
        except Exception as error:  # jinja2.TemplateSyntaxError
            raise DataError(f"the chat template is not valid Jinja ({error}); fix data.chat_template") from None
    return _TEMPLATES[template]


def holdout_value(key: bytes) -> int:
    """A document's place in ``[0, 2**64)``, from its bytes: a held-out fraction ``f`` takes the values below
    ``f * 2**64``, so equal records fall in the same split.

    >>> holdout_value(b"a") == holdout_value(b"a") != holdout_value(b"b")
    True
    """
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
