"""What the data path needs of a tokenizer (:class:`Tokenizer`), and the two it knows: bytes and ``tokenizers``.

The files' data path (records → documents → token arrays → packed rows) reads a tokenizer through this small
interface only: text to ids with no special token added, the special ids (``bos_id``, ``eos_id``, ``pad_id``, each
possibly ``None``), a chat template (Hugging Face's Jinja format) with the strings it may name (``bos_token``, ...),
the vocabulary size (checked against the model's embedding) and a fingerprint (part of the token cache's key).
:class:`ByteTokenizer` is the default job's (256 byte ids, no special id, no template); :class:`HFTokenizer` wraps a
``tokenizers.Tokenizer`` (a Hugging Face folder's ``tokenizer.json``, :func:`HFTokenizer.from_folder`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids, the special ids, a chat template and a fingerprint: all the data path reads."""

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

    def fingerprint(self) -> str:
        """A string that changes whenever ``encode`` or the special ids may (the token cache's key holds it)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids (256 of them), no special id, no chat template: the default job's tokenizer.

    >>> tokenizer = ByteTokenizer()
    >>> list(tokenizer.encode("hé")), tokenizer.vocab_size, tokenizer.eos_id
    ([104, 195, 169], 256, None)
    """

    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = None
    special_tokens: Mapping[str, str] = {}

    def encode(self, text: str, /) -> bytes:
        return text.encode("utf-8")  # bytes is a sequence of ints: the ids themselves

    def fingerprint(self) -> str:
        return "bytes:utf-8"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (a Hugging Face ``tokenizer.json``) with its special tokens and chat template.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (anything with ``encode(text, add_special_tokens=False).ids``,
            ``get_vocab_size(with_added_tokens=True)``, ``token_to_id`` and ``to_str``).
        bos_token, eos_token, pad_token: the special tokens' strings (``tokenizer_config.json``'s), or ``None``.
        chat_template: a Jinja chat template, or ``None``.

    Raises:
        ValueError: a special token the tokenizer's vocabulary does not hold.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        tokens = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        self.special_tokens: Mapping[str, str] = {name: text for name, text in tokens.items() if text is not None}
        ids: dict[str, int | None] = {}
        for name, text in tokens.items():
            ids[name] = None if text is None else tokenizer.token_to_id(text)
            if text is not None and ids[name] is None:
                raise ValueError(
                    f"HFTokenizer: {name} {text!r} is not in the tokenizer's vocabulary; fix {name} in "
                    "tokenizer_config.json (or pass the token the tokenizer holds)"
                )
        self.bos_id, self.eos_id, self.pad_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """The tokenizer of a Hugging Face folder: ``tokenizer.json``, with the special tokens and the chat template
        of ``tokenizer_config.json`` (or ``chat_template.jinja``) when present.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``folder``.
            ValueError: an unreadable ``tokenizer_config.json``, or a special token not in the vocabulary.
            ImportError: the ``tokenizers`` package is missing.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"HFTokenizer.from_folder: {path} is missing; pass a Hugging Face folder that holds tokenizer.json"
            )
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ImportError(
                "HFTokenizer.from_folder: reading tokenizer.json needs the tokenizers package; pip install tokenizers "
                "(or d9dfn[hf])"
            ) from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(f"HFTokenizer.from_folder: {config_path} is not JSON ({error}); restore it") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(
            _Tokenizer.from_file(str(path)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            chat_template=template if isinstance(template, str) else None,
        )

    def encode(self, text: str, /) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def fingerprint(self) -> str:
        described = json.dumps({"tokens": dict(self.special_tokens), "template": self.chat_template}, sort_keys=True)
        return "hf:" + hashlib.sha256((self.tokenizer.to_str() + described).encode()).hexdigest()


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` object ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
