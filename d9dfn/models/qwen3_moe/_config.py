"""The sizes of a Qwen3-MoE model (:class:`Qwen3MoeConfig`): the shared decoder's, and the experts'."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from d9dfn.models._decoder_config import Qwen3Config

__all__ = ["Qwen3MoeConfig"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """A :class:`~d9dfn.models.Qwen3Config` whose MLPs are mixtures of experts (Hugging Face's ``Qwen3MoeConfig``).

    ``intermediate_size`` stays the width of the dense MLP of the layers that have one (``mlp_only_layers``, or
    those ``decoder_sparse_step`` skips). Layer ``i`` is sparse when ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0`` (HF's rule).

    Attributes:
        num_experts: routed experts per MoE layer.
        num_experts_per_tok: experts each token goes to (``top_k``).
        moe_intermediate_size: each expert's SwiGLU hidden width.
        norm_topk_prob: renormalize the ``top_k`` routing weights to sum to one.
        scoring: ``softmax`` over the experts (Qwen3-MoE) or ``sigmoid`` per expert (DeepSeek-V3's scoring).
        decoder_sparse_step: every this many layers is an MoE layer.
        mlp_only_layers: layer indices that keep a dense MLP.
        shared_expert_intermediate_size: width of a shared SwiGLU expert that every token goes through, gated by
            ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE's); 0: none (Qwen3-MoE).
        router_aux_loss_coef: the weight of the auxiliary load-balancing loss in the training loss.
        load_balance_bias_rate: the step size of the auxiliary-loss-free balancing bias (DeepSeek-V3): each MoE layer
            then holds a per-expert bias (``mlp.expert_bias``, a buffer the train state carries) added to the scores
            for the choice of experts only, moved by this much toward balance after each optimizer step
            (``Qwen3MoeLM.state_update``); 0: no bias (the model has no such buffer).
        capacity_factor: each expert takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)`` token
            copies per layer call (``_moe.expert_capacity``); the copies beyond it are dropped (their expert output
            is zero, the residual carries the token on). ``None``: dropless.

    Raises:
        ValueError: as :class:`Qwen3Config`, or ``num_experts_per_tok`` above ``num_experts``, a size that is not a
            positive int, a layer index out of range.

    >>> Qwen3MoeConfig.tiny().moe_layers()
    (0, 1)
    >>> Qwen3MoeConfig.tiny(num_experts_per_tok=5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Qwen3MoeConfig: num_experts_per_tok=5 is more than num_experts=4; ...
    """

    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    scoring: str = "softmax"
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    load_balance_bias_rate: float = 0.0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3MoeConfig: {name}={value!r} must be a positive int; pass e.g. {name}=1")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig: num_experts_per_tok={self.num_experts_per_tok} is more than num_experts="
                f"{self.num_experts}; route each token to at most num_experts experts"
            )
        size = self.shared_expert_intermediate_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                f"Qwen3MoeConfig: shared_expert_intermediate_size={size!r} must be an int >= 0 (0: no shared expert)"
            )
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"Qwen3MoeConfig: scoring={self.scoring!r}; choose 'softmax' or 'sigmoid'")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"Qwen3MoeConfig: norm_topk_prob={self.norm_topk_prob!r} must be a bool")
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
            raise ValueError(f"Qwen3MoeConfig: router_aux_loss_coef={coef!r} must be a finite number >= 0")
        rate = self.load_balance_bias_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < math.inf:
            raise ValueError(
                f"Qwen3MoeConfig: load_balance_bias_rate={rate!r} must be a finite number >= 0; pass e.g. 0.001, or 0 "
                "for no balancing bias"
            )
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor < math.inf
        ):
            raise ValueError(
                f"Qwen3MoeConfig: capacity_factor={factor!r} must be a finite number > 0; pass e.g. 1.25, or None for "
                "dropless experts"
            )
        layers = tuple(self.mlp_only_layers)
        object.__setattr__(self, "mlp_only_layers", layers)  # a JSON list arrives as a list
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig: mlp_only_layers={list(layers)} names {bad}, not layers of 0..{self.num_layers - 1}"
            )

    def is_sparse(self, index: int) -> bool:
        """Whether layer ``index`` is an MoE layer (HF's ``Qwen3MoeDecoderLayer`` rule)."""
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0

    def mlp_parameters(self, index: int, *, active: bool = False) -> int:
        """Layer ``index``'s MLP weights: the dense MLP's, or the router, the experts (``active``: the ``top_k`` a
        token goes through) and the shared expert with its gate.

        >>> config = Qwen3MoeConfig.tiny()  # hidden 16, 4 experts of 32, top-2
        >>> config.mlp_parameters(0), config.mlp_parameters(0, active=True)
        (6208, 3136)
        """
        if not self.is_sparse(index):
            return super().mlp_parameters(index, active=active)
        hidden, experts = self.hidden_size, self.num_experts_per_tok if active else self.num_experts
        shared = (
            3 * hidden * self.shared_expert_intermediate_size + hidden if self.shared_expert_intermediate_size else 0
        )
        return hidden * self.num_experts + experts * 3 * hidden * self.moe_intermediate_size + shared

    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the MoE layers."""
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen3MoeConfig:
        """A model for unit tests: hidden 16, 2 layers, 4 experts of width 32, top-2."""
        sizes = {"hidden_size": 16, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 48}
        return cls(**{**sizes, **moe, "max_seq_len": 64, **overrides})
