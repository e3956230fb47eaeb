"""Text to token ids and back (:class:`Codec`): the job's 256 bytes (:data:`BYTES`) or a folder's tokenizer; and the
token stream a codec makes of text, cut into training windows (:class:`TokenWindowDataset`).

This is the seam between a tokenizer and the job's data: :func:`token_stream` takes a codec and texts and gives one
stream of ids, whatever reads the texts (the stdlib corpus today, a user's files later).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch

from d9dfn.jobs._corpus import VOCAB_SIZE, decode_bytes

__all__ = ["BYTES", "Codec", "TokenWindowDataset", "token_stream"]


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a job turns text into token ids and back.

    Attributes:
        name: where it comes from, for messages (``"bytes"``, or the tokenizer's file).
        encode: text → ids (no special tokens added).
        decode: ids → text.
        num_ids: one more than the largest id ``encode`` can give (the rows an embedding needs).
        unit: what one id is, for reports (``"byte"``, ``"token"``).
    """

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    num_ids: int
    unit: str = "token"


BYTES = Codec("bytes", lambda text: list(text.encode()), decode_bytes, VOCAB_SIZE, unit="byte")
"""The byte-level job's codec: UTF-8 bytes, 256 ids.

>>> BYTES.encode("hé"), BYTES.decode([104, 195, 169])
([104, 195, 169], 'hé')
"""


def token_stream(codec: Codec, texts: Iterable[str]) -> torch.Tensor:
    """The texts' ids one after another, as one (N,) int64 tensor (each text encoded on its own).

    >>> token_stream(BYTES, ["ab", "c"]).tolist()
    [97, 98, 99]
    """
    ids: list[int] = []
    for text in texts:
        ids.extend(codec.encode(text))
    return torch.tensor(ids, dtype=torch.int64)


class TokenWindowDataset:
    """Fixed windows of ``seq_len + 1`` ids of a token stream as ``{"input_ids", "labels"}`` int64 tensors (labels
    shifted by one); window ``i`` starts at id ``i * stride`` (default ``seq_len``: every id after the first is a
    label exactly once). ``sort_key`` is the constant ``seq_len``, as for ``ByteWindowDataset``.

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
