"""Text to token ids and back (:class:`Tokenizer`), and the two tokenizers d9dfn knows: bytes and Hugging Face's.

Everything that turns text into ids reads a tokenizer through this small interface only: the files' data path
(records → documents → token arrays → packed rows), the job's stdlib corpus, its sample and its reports. It gives text
to ids with no special token added and ids back to text, the special ids (``bos_id``, ``eos_id``, ``pad_id``, each
possibly ``None``), a chat template (Hugging Face's Jinja format) with the strings it may name (``bos_token``, ...),
the vocabulary size (checked against the model's embedding), a fingerprint (part of the token cache's key), and for
messages and reports its name and what one id is (``unit``). :class:`ByteTokenizer` is the default job's (256 byte ids,
no special id, no template); :class:`HFTokenizer` is a Hugging Face folder's (:meth:`HFTokenizer.from_folder`, what
``model.source`` loads).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]

_EXTRA = "pip install 'd9dfn[hf]'"


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back, the special ids, a chat template and a fingerprint: all d9dfn reads of one."""

    @property
    def name(self) -> str:
        """Where it comes from, for messages (``"bytes"``, a tokenizer's file)."""
        ...

    @property
    def unit(self) -> str:
        """What one id is, for reports (``"byte"``, ``"token"``): ``d9dfn infer`` prints ``nats/{unit}``."""
        ...

    @property
    def vocab_size(self) -> int:
        """Ids run over ``[0, vocab_size)``: the model's embedding must hold at least this many rows."""
        ...

    @property
    def bos_id(self) -> int | None:
        """Put before each plain-text and prompt/completion document; ``None``: nothing."""
        ...

    @property
    def eos_id(self) -> int | None:
        """Put after each plain-text and prompt/completion document (with loss); ``None``: nothing."""
        ...

    @property
    def pad_id(self) -> int | None:
        """The input id of padding (its label is always ignored); ``None``: ``eos_id``, else 0."""
        ...

    @property
    def chat_template(self) -> str | None:
        """A Jinja chat template (Hugging Face's ``tokenizer_config.json`` format); ``None``: none."""
        ...

    @property
    def special_tokens(self) -> Mapping[str, str]:
        """The strings a chat template may name (``bos_token``, ``eos_token``, ...)."""
        ...

    def encode(self, text: str, /) -> Sequence[int]:
        """``text``'s ids, with no special token added."""
        ...

    def decode(self, ids: Sequence[int], /) -> str:
        """The text of ``ids`` (special tokens kept as their strings)."""
        ...

    def fingerprint(self) -> str:
        """A string that changes whenever ``encode`` or the special ids may (the token cache's key holds it)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids (256 of them), no special id, no chat template: the default job's tokenizer.

    >>> tokenizer = ByteTokenizer()
    >>> list(tokenizer.encode("hé")), tokenizer.decode([104, 195, 169]), tokenizer.vocab_size, tokenizer.eos_id
    ([104, 195, 169], 'hé', 256, None)
    """

    name = "bytes"
    unit = "byte"
    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = None
    special_tokens: Mapping[str, str] = {}

    def encode(self, text: str, /) -> bytes:
        return text.encode("utf-8")  # bytes is a sequence of ints: the ids themselves

    def decode(self, ids: Sequence[int], /) -> str:
        """The bytes' text; invalid UTF-8 (a sample cut mid-character) becomes U+FFFD.

        Raises:
            ValueError: an id outside ``[0, 256)``.
        """
        values = list(ids)
        bad = [value for value in values if not 0 <= value < self.vocab_size]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids {bad[:5]} are outside [0, {self.vocab_size}); pass byte ids")
        return bytes(values).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes:utf-8"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (a Hugging Face ``tokenizer.json``) with its special tokens and chat template.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (anything with ``encode(text, add_special_tokens=False).ids``,
            ``decode(ids, skip_special_tokens=False)``, ``get_vocab(with_added_tokens=True)``, ``token_to_id`` and
            ``to_str``).
        bos_token, eos_token, pad_token: the special tokens' strings (``tokenizer_config.json``'s), or ``None``.
        chat_template: a Jinja chat template, or ``None``.
        name: where it comes from, for messages (:meth:`from_folder`: the file it read).

    Raises:
        ValueError: a special token the tokenizer's vocabulary does not hold.
    """

    unit = "token"

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        name: str = "a tokenizers.Tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.chat_template = chat_template
        tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        self.special_tokens: Mapping[str, str] = {key: text for key, text in tokens.items() if text is not None}
        ids: dict[str, int | None] = {}
        for key, text in tokens.items():
            ids[key] = None if text is None else tokenizer.token_to_id(text)
            if text is not None and ids[key] is None:
                raise ValueError(
                    f"HFTokenizer: {key} {text!r} is not in the vocabulary of {name}; fix {key} in "
                    "tokenizer_config.json (or pass the token the tokenizer holds)"
                )
        self.bos_id, self.eos_id, self.pad_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        # One more than the largest id, not the number of entries: an embedding needs a row for every id there is.
        self.vocab_size: int = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @classmethod
    def from_folder(cls, folder: str | Path, *, context: str = "HFTokenizer.from_folder") -> HFTokenizer:
        """The tokenizer of a Hugging Face folder, as ``model.source`` loads it: ``tokenizer.json`` (the
        ``tokenizers`` package) with the special tokens and chat template of ``tokenizer_config.json`` (or
        ``chat_template.jinja``); without ``tokenizer.json`` (a SentencePiece ``tokenizer.model``, ``vocab.json`` +
        ``merges.txt``), what ``transformers.AutoTokenizer`` reads there, offline, with its special tokens and template.

        Args:
            folder: the folder.
            context: what the error messages start with (the job passes ``"model.source"``).

        Raises:
            FileNotFoundError: no tokenizer files in ``folder``.
            ValueError: the package that reads them is missing (``pip install 'd9dfn[hf]'``), they do not load, an
                unreadable ``tokenizer_config.json``, or a special token not in the vocabulary.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return _from_transformers(folder, context)
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ValueError(
                f"{context}: reading {path} needs the tokenizers package, which is not installed: {_EXTRA}"
            ) from None
        try:
            tokenizer = _Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises its own Exception type
            raise ValueError(f"{context}: {path} is not a tokenizer tokenizers reads ({error}); restore it") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(f"{context}: {config_path} is not JSON ({error}); restore it") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(
            tokenizer,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            chat_template=template if isinstance(template, str) else None,
            name=str(path),
        )

    def encode(self, text: str, /) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], /) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def fingerprint(self) -> str:
        described = json.dumps({"tokens": dict(self.special_tokens), "template": self.chat_template}, sort_keys=True)
        return "hf:" + hashlib.sha256((self.tokenizer.to_str() + described).encode()).hexdigest()


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` object ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_AUTO_FILES = ("tokenizer_config.json", "tokenizer.model", "vocab.json")
"""The files that tell a folder without ``tokenizer.json`` has a tokenizer ``AutoTokenizer`` may read."""


def _from_transformers(folder: Path, context: str) -> HFTokenizer:
    """:meth:`HFTokenizer.from_folder` for a folder without ``tokenizer.json``: ``AutoTokenizer``'s, offline. A fast
    one (the usual case: ``transformers`` converts SentencePiece and GPT-2 files) is its ``tokenizers.Tokenizer``; a
    Python one goes through :class:`_PythonTokenizer`."""
    found = [name for name in _AUTO_FILES if (folder / name).is_file()]
    if not found:
        what = "is not a folder" if not folder.is_dir() else "has no tokenizer"
        raise FileNotFoundError(
            f"{context}: {folder} {what} (tokenizer.json, or tokenizer_config.json with its files); copy the model's "
            "tokenizer files into the folder (AutoTokenizer.from_pretrained(...).save_pretrained)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"{context}: {folder} has no tokenizer.json, and reading {found[0]} needs the transformers package, which "
            f"is not installed: {_EXTRA}"
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises many kinds here (OSError, ValueError, ImportError)
        message = str(error).replace("\n", " ")
        raise ValueError(
            f"{context}: AutoTokenizer cannot read {folder} ({message}); fix its tokenizer files"
        ) from None
    backend = auto.backend_tokenizer if getattr(auto, "is_fast", False) else _PythonTokenizer(auto, folder)
    tokens = {key: getattr(auto, key, None) for key in ("bos_token", "eos_token", "pad_token")}
    template = auto.chat_template
    return HFTokenizer(
        backend,
        **{key: value if isinstance(value, str) else None for key, value in tokens.items()},
        chat_template=template if isinstance(template, str) else None,
        name=str(folder / found[0]),
    )


class _PythonTokenizer:
    """A ``transformers`` tokenizer that has no ``tokenizers.Tokenizer`` (a Python one: ByT5, CANINE, ...) behind
    what :class:`HFTokenizer` calls on one."""

    def __init__(self, auto: Any, folder: Path) -> None:
        self.auto = auto
        # The class and the bytes of the files it read, hashed now: what its encoding depends on (the cache's key).
        names = {*getattr(auto, "vocab_files_names", {}).values(), *_AUTO_FILES}
        names |= {"special_tokens_map.json", "added_tokens.json"}
        files = {
            name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in sorted(name for name in names if isinstance(name, str))
            if (folder / name).is_file()
        }
        self._described = json.dumps({"class": type(auto).__name__, "files": files}, sort_keys=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        return _Encoding(list(self.auto.encode(text, add_special_tokens=add_special_tokens)))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.auto.decode(ids, skip_special_tokens=skip_special_tokens))

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self.auto.get_vocab())  # transformers' includes the added tokens

    def token_to_id(self, token: str) -> int | None:
        return self.auto.get_vocab().get(token)

    def to_str(self) -> str:
        return self._described


class _Encoding(NamedTuple):
    """What ``tokenizers.Tokenizer.encode`` returns, as far as :class:`HFTokenizer` reads it."""

    ids: list[int]
