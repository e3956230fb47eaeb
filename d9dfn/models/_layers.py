"""Building blocks of the reference models: late-initialized layers, rotary embeddings, pure dropout.

Every layer allocates its parameters with ``torch.empty`` and fills them only in ``reset_parameters()``,
so a model can be built under ``torch.device("meta")``, moved with ``to_empty(device=...)`` and then
initialized (d9d's ``ModuleLateInit``), and a direct build draws exactly the same random numbers as that
late init. Layers never draw from torch's global RNG in ``forward``: dropout masks come from
:mod:`d9dfn.prng` keys, so eager and compiled runs agree.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from d9dfn import prng

__all__ = ["Embedding", "Linear", "RMSNorm", "RopeScaling", "apply_rope", "dropout", "rope_cos_sin"]


class Linear(nn.Module):
    """A linear map whose weight is drawn from ``N(0, init_std²)`` by ``reset_parameters``; its optional bias
    (Qwen2's query/key/value projections) starts at zero, as in Hugging Face's init.

    >>> layer = Linear(4, 3, init_std=0.02, bias=True)
    >>> layer.reset_parameters()
    >>> layer(torch.ones(2, 4)).shape, bool(layer.bias.eq(0).all())
    (torch.Size([2, 3]), True)
    """

    def __init__(self, in_features: int, out_features: int, *, init_std: float, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def reset_parameters(self) -> None:
        """Draw the weight from ``N(0, init_std²)``; zero the bias (it draws nothing: a bias-free model's init
        is unchanged)."""
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        bias = ", bias=True" if self.bias is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, init_std={self.init_std:g}{bias}"


class Embedding(nn.Module):
    """A token embedding table drawn from ``N(0, init_std²)`` by ``reset_parameters``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def reset_parameters(self) -> None:
        """Draw the table from ``N(0, init_std²)``."""
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # (B, T) -> (B, T, D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, init_std={self.init_std:g}"


class RMSNorm(nn.Module):
    """Root-mean-square normalization over the last dimension, computed in float32, with a learned scale.

    >>> norm = RMSNorm(4, eps=1e-6)
    >>> norm.reset_parameters()
    >>> torch.allclose(norm(torch.full((1, 4), 3.0)), torch.ones(1, 4))
    True
    """

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 (bf16 sums of squares lose too much), scale in the input's dtype.
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)
        return normed * self.weight

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps:g}"


_ROPE_KINDS = ("linear", "llama3")
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A stretch of the rotary frequencies for contexts longer than pretraining's (Hugging Face's
    ``rope_parameters``), applied to the inverse frequencies, so it costs nothing per call.

    ``linear`` divides every frequency by ``factor`` (positions interpolated). ``llama3`` (Llama 3.1's scheme)
    divides the low frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
    ``factor``, keeps the high ones (wavelength below ``original_max_position_embeddings / high_freq_factor``)
    and blends the ones between; Meta's reference values are factor 8, 1, 4 and 8192.

    Attributes:
        kind: ``"linear"`` or ``"llama3"``.
        factor: how much longer the context is; > 0.
        low_freq_factor: ``llama3`` only (``None`` for ``linear``).
        high_freq_factor: ``llama3`` only; greater than ``low_freq_factor``.
        original_max_position_embeddings: ``llama3`` only: pretraining's context length.

    Raises:
        ValueError: an unknown kind, a factor out of range, or a ``llama3`` field missing or given to ``linear``.

    >>> RopeScaling("llama3", 8.0, 1.0, 4.0, 8192).kind
    'llama3'
    >>> RopeScaling("yarn", 4.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: RopeScaling: kind='yarn' is not implemented; choose linear or llama3
    """

    kind: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _ROPE_KINDS:
            raise ValueError(f"RopeScaling: kind={self.kind!r} is not implemented; choose {' or '.join(_ROPE_KINDS)}")
        values = {name: getattr(self, name) for name in ("factor", *_LLAMA3_FIELDS)}
        wanted = ("factor", *_LLAMA3_FIELDS) if self.kind == "llama3" else ("factor",)
        for name, value in values.items():
            if name not in wanted:
                if value is not None:
                    raise ValueError(f"RopeScaling: {name}={value!r} is a llama3 field; leave it None for {self.kind}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"RopeScaling: {self.kind} needs {name} > 0, got {value!r}")
        if self.kind == "llama3" and not self.low_freq_factor < self.high_freq_factor:  # type: ignore[operator]
            raise ValueError(
                f"RopeScaling: llama3 needs low_freq_factor < high_freq_factor, got {self.low_freq_factor} and "
                f"{self.high_freq_factor}; Meta's values are 1.0 and 4.0"
            )

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The stretched inverse frequencies, in ``inv_freq``'s dtype (the ops of HF's float32 computation)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        low, high, original = self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings
        assert low is not None, "RopeScaling.__post_init__ checks the llama3 fields"
        assert high is not None
        assert original is not None
        wavelen = 2 * math.pi / inv_freq
        long = wavelen > original / low  # low frequencies: interpolated by the factor
        short = wavelen < original / high  # high frequencies: kept
        scaled = torch.where(long, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)  # 0 at the long end, 1 at the short end
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        return torch.where(~short & ~long, blended, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding cosines and sines for ``position_ids``, in float32, computed on the fly.

    Computing them per call (instead of caching tables in buffers) keeps the model free of buffers, works
    right after ``to_empty`` from the meta device, and keeps the angles in float32 when the weights are
    cast to bf16. Inside a compiled step the computation fuses into a few elementwise kernels.

    Args:
        position_ids: integer positions, any shape ``S``.
        head_dim: the (even) size of each attention head.
        theta: the RoPE base; frequency ``i`` is ``theta ** (-2i / head_dim)``.
        scaling: how the frequencies are stretched (:class:`RopeScaling`); ``None``: not at all.

    Returns:
        ``(cos, sin)``, each of shape ``S + (head_dim // 2,)``.

    >>> cos, sin = rope_cos_sin(torch.arange(3), head_dim=4, theta=10_000.0)
    >>> cos.shape, bool(cos[0].eq(1).all()), bool(sin[0].eq(0).all())
    (torch.Size([3, 2]), True, True)
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (head_dim / 2,)
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # S -> S + (head_dim / 2,)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., i], x[..., i + head_dim/2])`` by the angles behind ``cos``/``sin``.

    This is the "rotate half" layout of Qwen, Llama and GPT-NeoX (not GPT-J's interleaved pairs). The
    rotation runs in float32 and the result has ``x``'s dtype.

    Args:
        x: ``(..., head_dim)``.
        cos: broadcastable to ``(..., head_dim // 2)``.
        sin: like ``cos``.

    >>> cos, sin = rope_cos_sin(torch.tensor([0]), head_dim=2, theta=10_000.0)
    >>> apply_rope(torch.tensor([[1.0, 2.0]]), cos, sin)
    tensor([[1., 2.]])
    """
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def dropout(x: torch.Tensor, p: float, key: torch.Tensor) -> torch.Tensor:
    """Inverted dropout with a mask drawn from ``key``: the same key gives the same mask, eager or compiled.

    Each element is kept with probability ``1 - p`` and scaled by ``1 / (1 - p)``, so the expectation is
    ``x``. ``p`` is a config constant (a Python float), fixed for the life of a compiled step.

    >>> x = torch.ones(4, 1000)
    >>> y = dropout(x, 0.25, prng.key(0))
    >>> bool(torch.equal(y, dropout(x, 0.25, prng.key(0)))), 0.7 < float(y.ne(0).float().mean()) < 0.8
    (True, True)
    """
    keep = prng.uniform(key, x.shape) >= p
    return torch.where(keep, x / (1.0 - p), torch.zeros((), dtype=x.dtype, device=x.device))
