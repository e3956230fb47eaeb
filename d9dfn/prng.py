"""Pure, counter-based random numbers from a key tensor, the same in eager and compiled code.

torch's generators are global state, and the compiled and eager RNG streams differ, so a pure step
cannot use them for dropout or stochastic rounding. A d9dfn key is a 0-d ``int64`` tensor holding a 32-bit
value; randomness is a hash of (key, element index) in integer arithmetic that inductor and eager
evaluate identically. Every intermediate stays below 2**63, so no signed overflow happens anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["bernoulli", "fold_in", "key", "random_bits", "split", "uniform"]

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D  # odd multipliers below 2**31: products with 32-bit values fit in int64.
_M2 = 0x5BD1E995
_GOLDEN = 0x1E3779B9


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def key(seed: int) -> torch.Tensor:
    """A key from a Python seed (done once, at the edge).

    >>> key(0).dtype, key(0).shape
    (torch.int64, torch.Size([]))
    """
    return _mix(torch.tensor(seed & _MASK32, dtype=torch.int64))


def fold_in(k: torch.Tensor, data: torch.Tensor | int) -> torch.Tensor:
    """A new key that depends on ``k`` and ``data`` (a step number, a microbatch index, a layer id).

    >>> bool(fold_in(key(0), 1) != fold_in(key(0), 2))
    True
    """
    data = torch.as_tensor(data, dtype=torch.int64, device=k.device) & _MASK32
    return _mix(k ^ _mix((data + _GOLDEN) & _MASK32))


def split(k: torch.Tensor, num: int = 2) -> tuple[torch.Tensor, ...]:
    """``num`` independent keys derived from ``k``."""
    return tuple(fold_in(k, i + 0x51ED) for i in range(num))


def random_bits(
    k: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    *,
    offset: Sequence[Any] | None = None,
    whole: Sequence[int] | None = None,
) -> torch.Tensor:
    """Uniform 32-bit values (as ``int64``) of ``shape``: each a hash of ``k`` and the element's row-major index.

    With ``offset`` and ``whole`` the values are the block of ``random_bits(k, whole)`` that starts at ``offset`` and
    has ``shape``, computed without the whole: a tensor split any way (a ``DTensor`` shard at its global offset,
    whose entries may be a simulated rank's symbolic ints) draws the same values as the unsplit one.

    >>> k = key(0)
    >>> bool((random_bits(k, (2, 3), offset=(2, 1), whole=(4, 4)) == random_bits(k, (4, 4))[2:, 1:]).all())
    True
    """
    if offset is None and whole is None:
        numel = 1
        for dim in shape:
            numel *= dim
        counter = torch.arange(numel, dtype=torch.int64, device=k.device)
    else:
        if offset is None or whole is None or not len(offset) == len(whole) == len(shape):
            raise ValueError(
                f"random_bits: shape {tuple(shape)}, offset {offset} and whole {whole} must all be given, one entry "
                f"per dim (the block's shape, its start in the whole tensor, the whole tensor's shape)"
            )
        counter = _block_indices(tuple(shape), offset, tuple(whole), k.device)
    return _mix(_mix((counter * _GOLDEN + k) & _MASK32) ^ k).reshape(shape)


def _block_indices(
    shape: tuple[int, ...], offset: Sequence[Any], whole: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The row-major indices in ``whole`` of the block of ``shape`` at ``offset``: a sum of one broadcast range per
    dim (no tensor of ``whole``'s size). ``(2, 3)`` at ``(2, 1)`` in ``(4, 4)`` -> ``[[9, 10, 11], [13, 14, 15]]``."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        rows = (torch.arange(shape[dim], dtype=torch.int64, device=device) + offset[dim]) * stride
        index = index + rows.view((-1,) + (1,) * (len(shape) - 1 - dim))
        stride *= whole[dim]
    return index.expand(shape)


def uniform(k: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform floats in ``[0, 1)`` with 24 random bits each.

    >>> u = uniform(key(0), (10_000,))
    >>> 0.48 < float(u.mean()) < 0.52
    True
    """
    return ((random_bits(k, shape) >> 8).to(torch.float32) * (1.0 / (1 << 24))).to(dtype)


def bernoulli(k: torch.Tensor, p: float | torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Booleans that are ``True`` with probability ``p``."""
    return uniform(k, shape) < p
