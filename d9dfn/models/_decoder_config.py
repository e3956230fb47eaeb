"""The sizes of the reference model (:class:`Qwen3Config`, with its presets) and what they cost: parameters, FLOPs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from d9dfn.models._layers import RopeScaling

__all__ = ["Qwen3Config", "flops_per_token", "num_parameters"]

_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_seq_len",
)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """The sizes of a :class:`Qwen3LM`; the defaults are a byte-level LM that trains on a CPU in minutes.

    Attributes:
        vocab_size: number of token ids; 256 is byte-level (one token per UTF-8 byte).
        hidden_size: width of the residual stream.
        num_layers: number of decoder blocks.
        num_heads: number of query heads.
        num_kv_heads: number of key/value heads; divides ``num_heads`` (grouped-query attention).
        head_dim: size of each head; even (rotary pairs). Independent of ``hidden_size``, as in Qwen3.
        intermediate_size: hidden width of the SwiGLU MLP.
        max_seq_len: the longest sequence the model accepts.
        rope_theta: the rotary base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: share the embedding table with the LM head.
        dropout: residual and embedding dropout probability; applied only when a ``dropout_key`` is passed.
        initializer_range: std of the normal init; output projections use
            ``initializer_range / sqrt(2 * num_layers)`` (GPT-2's residual scaling).
        qk_norm: per-head RMSNorm on queries and keys before the rotation (Qwen3); ``False`` for Llama,
            Mistral and Qwen2.
        qkv_bias: biases on the query, key and value projections (Qwen2; zero at init).
        o_proj_bias: a bias on the attention's output projection (Llama's ``attention_bias`` sets both).
        rope_scaling: how the rotary frequencies are stretched (:class:`~d9dfn.models.RopeScaling`, e.g.
            Llama 3.1's ``llama3``); ``None``: not at all.

    Raises:
        ValueError: a size is not a positive int, ``num_heads`` is not a multiple of ``num_kv_heads``,
            ``head_dim`` is odd, or a float is out of range.

    >>> Qwen3Config.tiny().hidden_size
    32
    >>> Qwen3Config(num_heads=4, num_kv_heads=3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Qwen3Config: num_heads=4 is not a multiple of num_kv_heads=3; ... divisor of num_heads: 1, 2, 4
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    initializer_range: float = 0.02
    qk_norm: bool = True
    qkv_bias: bool = False
    o_proj_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3Config: {name}={value!r} must be a positive int; pass e.g. {name}=1")
        if self.num_heads % self.num_kv_heads:
            divisors = ", ".join(str(d) for d in range(1, self.num_heads + 1) if self.num_heads % d == 0)
            raise ValueError(
                f"Qwen3Config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                f"set num_kv_heads to a divisor of num_heads: {divisors}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"Qwen3Config: head_dim={self.head_dim} is odd, but rotary embeddings rotate pairs; "
                f"use an even head_dim such as {self.head_dim + 1}"
            )
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"Qwen3Config: {name}={value!r} must be a positive finite number")
        if not isinstance(self.dropout, int | float) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise ValueError(f"Qwen3Config: dropout={self.dropout!r} must be in [0, 1); use 0.0 to disable dropout")
        for name in ("tie_word_embeddings", "qk_norm", "qkv_bias", "o_proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Qwen3Config: {name}={getattr(self, name)!r} must be a bool (True or False)")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"Qwen3Config: rope_scaling={self.rope_scaling!r} must be None or a d9dfn.models.RopeScaling, "
                "e.g. RopeScaling('llama3', 8.0, 1.0, 4.0, 8192)"
            )

    def mlp_parameters(self, index: int, *, active: bool = False) -> int:
        """The weights of layer ``index``'s MLP (``active``: those one token multiplies with: the same here; an MoE
        config counts the router and ``top_k`` experts of all)."""
        return 3 * self.hidden_size * self.intermediate_size

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen3Config:
        """A model for unit tests: hidden 32, 2 layers, 4 query / 2 key-value heads of 8 (~27k params)."""
        sizes = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
        return cls(**{**sizes, "intermediate_size": 64, "max_seq_len": 64, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> Qwen3Config:
        """The CPU default (the same as ``Qwen3Config()``): hidden 128, 4 layers, 4 / 2 heads of 32 (~0.8M)."""
        return cls(**overrides)

    @classmethod
    def medium(cls, **overrides: Any) -> Qwen3Config:
        """A GPU-sized byte LM: hidden 512, 8 layers, 8 / 4 heads of 64, context 1024 (~21M params)."""
        sizes = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "head_dim": 64}
        return cls(**{**sizes, "intermediate_size": 1536, "max_seq_len": 1024, **overrides})

    @classmethod
    def qwen3_0_6b(cls, **overrides: Any) -> Qwen3Config:
        """The shapes of Qwen3-0.6B (151936-token vocabulary, 28 layers, 16 / 8 heads of 128; ~596M params)."""
        sizes = {"vocab_size": 151_936, "hidden_size": 1024, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8}
        shape = {"head_dim": 128, "intermediate_size": 3072, "max_seq_len": 40_960, "rope_theta": 1_000_000.0}
        return cls(**{**sizes, **shape, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen3Config:
        """The preset called ``name`` (``tiny``, ``small``, ``medium``, ``qwen3_0_6b``), for command-line flags.

        >>> Qwen3Config.preset("tiny", num_layers=3).num_layers
        3
        """
        presets = {"tiny": cls.tiny, "small": cls.small, "medium": cls.medium, "qwen3_0_6b": cls.qwen3_0_6b}
        if name not in presets:
            raise ValueError(f"Qwen3Config.preset: unknown preset {name!r}; choose one of {', '.join(presets)}")
        return presets[name](**overrides)


def _attention_params(config: Qwen3Config) -> int:
    return config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)


def num_parameters(config: Qwen3Config) -> int:
    """The number of parameters of ``Qwen3LM(config)`` (a tied head counts once).

    >>> num_parameters(Qwen3Config.tiny()), num_parameters(Qwen3Config.tiny(qk_norm=False, qkv_bias=True))
    (26816, 26912)
    """
    qk_norms = 2 * config.head_dim if config.qk_norm else 0
    biases = config.head_dim * (config.num_heads + 2 * config.num_kv_heads) if config.qkv_bias else 0
    biases += config.hidden_size if config.o_proj_bias else 0
    per_layer = _attention_params(config) + 2 * config.hidden_size + qk_norms + biases
    mlps = sum(config.mlp_parameters(index) for index in range(config.num_layers))
    head = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    embed = config.vocab_size * config.hidden_size
    return embed + config.num_layers * per_layer + mlps + config.hidden_size + head


def flops_per_token(config: Qwen3Config, seq_len: int) -> float:
    """Model FLOPs per token of one training step (forward + backward) at sequence length ``seq_len``.

    PaLM's count (Chowdhery et al. 2022, appendix B), the usual basis of MFU:
    ``6 * N + 12 * num_layers * num_heads * head_dim * seq_len``, where ``N`` counts the weights of every
    matrix multiply (attention and MLP projections and the LM head, tied or not; the embedding lookup is
    free; an MoE layer counts the router and the ``top_k`` experts a token goes through), 6 is 2 FLOPs per
    multiply-add times 3 for the forward and the two backward matmuls, and the second term is ``q @ k.T`` and
    ``probs @ v``. Like PaLM it does not halve the attention term for the
    causal mask, and it ignores norms, biases, activations, rotary embeddings and softmax.

    Args:
        config: the model's sizes.
        seq_len: the training sequence length, in ``[1, max_seq_len]``.

    Raises:
        ValueError: ``seq_len`` is out of range.

    >>> cfg = Qwen3Config.tiny()
    >>> flops_per_token(cfg, 64) == 6 * (2 * 9216 + 256 * 32) + 12 * 2 * 4 * 8 * 64
    True
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= config.max_seq_len:
        raise ValueError(
            f"flops_per_token: seq_len={seq_len!r} must be an int in [1, max_seq_len={config.max_seq_len}]; "
            "pass the training sequence length"
        )
    mlps = sum(config.mlp_parameters(index, active=True) for index in range(config.num_layers))
    matmul_params = config.num_layers * _attention_params(config) + mlps + config.hidden_size * config.vocab_size
    attention = 12 * config.num_layers * config.num_heads * config.head_dim * seq_len
    return float(6 * matmul_params + attention)
