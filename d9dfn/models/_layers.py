"""Building blocks of the reference models: late-initialized layers, rotary embeddings, pure dropout.

Every layer allocates its parameters with ``torch.empty`` and fills them only in ``reset_parameters()``,
so a model can be built under ``torch.device("meta")``, moved with ``to_empty(device=...)`` and then
initialized (d9d's ``ModuleLateInit``), and a direct build draws exactly the same random numbers as that
late init. Layers never draw from torch's global RNG in ``forward``: dropout masks come from
:mod:`d9dfn.prng` keys, so eager and compiled runs agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d9dfn import prng

__all__ = ["Embedding", "Linear", "RMSNorm", "apply_rope", "dropout", "rope_cos_sin"]


class Linear(nn.Module):
    """A bias-free linear map whose weight is drawn from ``N(0, init_std²)`` by ``reset_parameters``.

    >>> layer = Linear(4, 3, init_std=0.02)
    >>> layer.reset_parameters()
    >>> layer(torch.ones(2, 4)).shape
    torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out_features: int, *, init_std: float) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def reset_parameters(self) -> None:
        """Draw the weight from ``N(0, init_std²)``."""
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, init_std={self.init_std:g}"


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


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding cosines and sines for ``position_ids``, in float32, computed on the fly.

    Computing them per call (instead of caching tables in buffers) keeps the model free of buffers, works
    right after ``to_empty`` from the meta device, and keeps the angles in float32 when the weights are
    cast to bf16. Inside a compiled step the computation fuses into a few elementwise kernels.

    Args:
        position_ids: integer positions, any shape ``S``.
        head_dim: the (even) size of each attention head.
        theta: the RoPE base; frequency ``i`` is ``theta ** (-2i / head_dim)``.

    Returns:
        ``(cos, sin)``, each of shape ``S + (head_dim // 2,)``.

    >>> cos, sin = rope_cos_sin(torch.arange(3), head_dim=4, theta=10_000.0)
    >>> cos.shape, bool(cos[0].eq(1).all()), bool(sin[0].eq(0).all())
    (torch.Size([3, 2]), True, True)
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (head_dim / 2,)
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
