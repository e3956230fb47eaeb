"""The Qwen3-MoE model: the shared decoder (``models/_decoder.py``) with mixture-of-experts MLPs.

:class:`SparseMoeBlock` holds the parameters (Hugging Face transformers 5's names and fused expert layout:
``mlp.gate.weight`` (E, H), ``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)) and calls
the pure functions of ``_moe.py``; :class:`Qwen3MoeDecoderLayer` returns its residual stream and its layer's
:class:`~d9dfn.models.qwen3_moe.RouterLoad`, so nothing is written into a buffer and the block compiles once (the
per-block runner finds it: ``d9dfn.step.find_repeated_blocks``). :class:`Qwen3MoeLM` sums the loads of its MoE
layers and returns, beside the logits, ``aux_loss`` (HF's load-balancing loss, unweighted) and ``expert_counts``
(MoE layers, E): what the task weights into the loss and logs.

With ``load_balance_bias_rate > 0`` each MoE block holds ``expert_bias`` (E,), a buffer its forward only reads (it
declares it in ``read_only_buffers``, so the per-block runner still compiles the block once): the train state carries
it, and :meth:`Qwen3MoeLM.state_update` is the pure update the train step applies after the optimizer from the
step's ``expert_counts`` (``docs/design/step.md``, "Block state").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from d9dfn._types import Buffers, PipelineStageInfo, StateUpdate
from d9dfn.models._decoder import Qwen3Attention, Qwen3DecoderLayer, Qwen3LM, Qwen3MLP, _init_children, layer_keys
from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._layers import Linear, RMSNorm, dropout
from d9dfn.models.qwen3_moe._config import Qwen3MoeConfig
from d9dfn.models.qwen3_moe._moe import (
    RouterLoad,
    Routing,
    balance_bias,
    drop_over_capacity,
    expert_capacity,
    experts,
    load_balancing_loss,
    route,
    router_load,
)
from d9dfn.parallel._experts import ExpertParallel, dispatch_experts

__all__ = ["Experts", "Qwen3MoeDecoderLayer", "Qwen3MoeLM", "SparseMoeBlock"]


class Experts(nn.Module):
    """The routed experts' weights, fused as transformers 5 stores them: ``gate_up_proj`` (E, 2I, H), the gate's rows
    then the up projection's, and ``down_proj`` (E, H, I)."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        size, hidden = config.moe_intermediate_size, config.hidden_size
        self.std = config.initializer_range
        self.out_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden, size))

    def reset_parameters(self) -> None:
        """Normal init; the down projections scaled by 1/√(2·layers) as the dense MLP's."""
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=self.std)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.out_std)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and an optional gated shared expert: (B, T, H) -> ((B, T, H), RouterLoad).

    With ``config.load_balance_bias_rate > 0`` it holds ``expert_bias`` (E,) float32, zeros at first: added to the
    router's scores for the choice of experts (``_moe.route``), never written by the forward. With
    ``config.capacity_factor`` the copies over an expert's capacity are dropped (``_moe.drop_over_capacity``).
    """

    read_only_buffers = ("expert_bias",)
    """The buffers this module's forward only reads (``d9dfn.step.find_repeated_blocks`` compiles a block holding
    them once like any other): the balancing bias changes between steps, by the train step's state update."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k, self.scoring, self.normalize = config.num_experts_per_tok, config.scoring, config.norm_topk_prob
        self.num_experts = config.num_experts
        self.capacity_factor = config.capacity_factor
        bias = torch.zeros(config.num_experts) if config.load_balance_bias_rate > 0 else None
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias)
        self.expert_parallel: ExpertParallel | None = None
        """The expert group when the experts are sharded over one (set by the loop from the plan:
        ``d9dfn.parallel.expert_parallel_of``); ``None``: this rank computes every expert."""
        self.gate = Linear(config.hidden_size, config.num_experts, init_std=config.initializer_range)
        self.experts = Experts(config)
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                Qwen3Config.tiny(),
                **{**_decoder_fields(config), "intermediate_size": config.shared_expert_intermediate_size},
            )
            self.shared_expert: Qwen3MLP | None = Qwen3MLP(shared)
            self.shared_expert_gate: Linear | None = Linear(config.hidden_size, 1, init_std=config.initializer_range)
        else:
            self.shared_expert, self.shared_expert_gate = None, None

    def reset_parameters(self) -> None:
        """Re-initialize the router, the experts and the shared expert; the balancing bias back to zeros."""
        for child in self.children():
            child.reset_parameters()  # type: ignore[operator]
        if self.expert_bias is not None:
            with torch.no_grad():
                self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterLoad]:
        """(B, T, H) -> (B, T, H) and the layer's load (the copies routed, before any drop)."""
        tokens = x.reshape(-1, x.shape[-1])  # (B·T, H)
        logits = self.gate(tokens)
        routing = route(logits, self.top_k, scoring=self.scoring, normalize=self.normalize, bias=self.expert_bias)  # type: ignore[arg-type]
        load = router_load(routing, self.num_experts)
        if self.capacity_factor is not None:  # static: the capacity is a Python int of the shapes
            capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            routing, dropped = drop_over_capacity(routing, self.num_experts, capacity)
            load = load._replace(dropped=dropped)
        out = self.routed_experts(tokens, routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + F.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view_as(x), load

    def routed_experts(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(T, H) -> (T, H): the routed experts' weighted outputs; with the experts sharded over an expert group, this
        rank's experts on the copies routed to them from the whole group (``d9dfn.parallel.dispatch_experts``)."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        ep = self.expert_parallel
        if ep is None or tokens.is_meta:
            # On meta (a pipeline's boundary shapes, ``d9dfn.pipeline.stage_io_shapes``, run on the stage's skeleton
            # with the whole model's expert shapes): the dispatch gives (T, H) in x's dtype, as the whole experts do.
            return experts(tokens, routing, gate_up, down)
        if gate_up.shape[0] * ep.size != self.num_experts:
            raise ValueError(
                f"SparseMoeBlock: {gate_up.shape[0]} local experts on each of {ep.size} expert-parallel ranks, but the "
                f"layer routes to {self.num_experts}; shard the experts with the plan's rules "
                "(d9dfn.parallel.EXPERT_PARALLEL_RULES), or unset expert_parallel"
            )

        def local(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            top1 = Routing(weights=weights[:, None], experts=ids[:, None], probs=weights[:, None])
            return experts(rows, top1, gate_up, down)

        return dispatch_experts(tokens, routing.experts, routing.weights, gate_up.shape[0], local, ep)


def _decoder_fields(config: Qwen3MoeConfig) -> dict[str, Any]:
    return {field: getattr(config, field) for field in Qwen3Config.__dataclass_fields__}


class Qwen3MoeDecoderLayer(nn.Module):
    """A pre-norm block whose MLP is a :class:`SparseMoeBlock`: ``x + attn(norm(x))``, then ``h + moe(norm(h))``;
    returns the residual stream and the layer's :class:`RouterLoad` (the block's only state, returned, not kept)."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config)

    def reset_parameters(self) -> None:
        """Re-initialize the norms, the attention and the MoE block."""
        _init_children(self)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_key: torch.Tensor | None = None,
        mlp_key: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterLoad]:
        """(B, T, D) -> (B, T, D) and the load; dropout on a branch whose key is given, as ``Qwen3DecoderLayer``."""
        branch: torch.Tensor = self.self_attn(self.input_layernorm(x), cos, sin, mask, attn_key)
        if attn_key is not None and self.dropout > 0:
            branch = dropout(branch, self.dropout, attn_key)
        h = x + branch
        branch, load = self.mlp(self.post_attention_layernorm(h))
        if mlp_key is not None and self.dropout > 0:
            branch = dropout(branch, self.dropout, mlp_key)
        return h + branch, load


class Qwen3MoeLM(Qwen3LM):
    """Hugging Face's ``Qwen3MoeForCausalLM`` as a :class:`~d9dfn.models.Qwen3LM`: MoE blocks where
    ``config.is_sparse(i)``, dense blocks elsewhere. ``forward`` returns ``{"logits", "aux_loss", "expert_counts"}``:
    ``aux_loss`` (0-d float32) is HF's load-balancing loss over the model's MoE layers (unweighted: the task
    multiplies it by ``router_aux_loss_coef``), ``expert_counts`` (MoE layers, E) float32 the token copies routed to
    each expert in each MoE layer; with a ``capacity_factor`` also ``expert_dropped`` (MoE layers, E), the copies each
    expert dropped.

    In pipeline stages (``stage``) the earlier stages' load travels with the hidden states (:meth:`forward`), so
    the last stage returns what the whole model returns.

    Raises:
        ValueError: a model without any MoE layer.

    >>> torch.manual_seed(0) and None
    >>> out = Qwen3MoeLM(Qwen3MoeConfig.tiny())(torch.zeros(2, 5, dtype=torch.long))
    >>> out["logits"].shape, out["expert_counts"].shape, out["expert_counts"].sum().item()
    (torch.Size([2, 5, 256]), torch.Size([2, 4]), 40.0)
    """

    config: Qwen3MoeConfig

    def __init__(self, config: Qwen3MoeConfig, stage: PipelineStageInfo | None = None, **kwargs: object) -> None:
        if not config.moe_layers():
            raise ValueError(
                f"Qwen3MoeLM: no layer of {config.num_layers} is an MoE layer (decoder_sparse_step="
                f"{config.decoder_sparse_step}, mlp_only_layers={list(config.mlp_only_layers)}); use the dense "
                "family qwen3, or make a layer sparse"
            )
        super().__init__(config, stage, **kwargs)  # type: ignore[arg-type]

    def make_layer(self, config: Qwen3Config, index: int) -> nn.Module:
        """An MoE block where ``config.is_sparse(index)``, the dense one elsewhere."""
        assert isinstance(config, Qwen3MoeConfig)
        return Qwen3MoeDecoderLayer(config) if config.is_sparse(index) else Qwen3DecoderLayer(config)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        expert_counts: torch.Tensor | None = None,
        router_prob_sums: torch.Tensor | None = None,
        expert_dropped: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        dropout_key: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """As :meth:`Qwen3LM.forward`, with ``aux_loss`` and ``expert_counts`` beside the logits.

        In pipeline stages the load of the earlier stages' MoE layers travels with the hidden states (the auxiliary
        loss pools every layer's counts and probabilities, so no stage can finish it alone): a stage before the last
        returns ``expert_counts`` (its and the earlier stages' MoE layers, E), ``router_prob_sums`` (E,), the
        probabilities summed over those layers' tokens (differentiable: the last stage's aux loss reaches the earlier
        routers through it) and, with a capacity, ``expert_dropped``; the next stage takes them as inputs.
        """
        h, cos, sin, masks = self.prologue(input_ids, hidden_states, position_ids, document_ids, dropout_key)
        loads: list[RouterLoad] = []
        for name, layer in self.layers.items():
            keys = layer_keys(dropout_key, int(name))
            # By index, not by class: the step may have wrapped the layer (a per-block gather under FSDP).
            if self.config.is_sparse(int(name)):
                h, load = layer(h, cos, sin, *keys, *masks)
                loads.append(load)
            else:
                h = layer(h, cos, sin, *keys, *masks)
        out = self.epilogue(h, dropout_key=dropout_key)
        num_experts, capacity = self.config.num_experts, self.config.capacity_factor is not None
        tokens = h.shape[0] * h.shape[1]
        counts = (
            torch.stack([load.counts for load in loads]) if loads else h.new_zeros(0, num_experts, dtype=torch.float32)
        )
        if expert_counts is not None:  # the earlier stages' layers first: the whole model's layer order
            counts = torch.cat([expert_counts, counts])
        _check_carried(self.stage_info.current_stage, expert_counts, router_prob_sums, expert_dropped)
        # The earlier layers' sum first, then this stage's in layer order: the one-stage model's order of additions.
        prob_sums = sum(
            (load.prob_sums for load in loads),
            h.new_zeros(num_experts, dtype=torch.float32) if router_prob_sums is None else router_prob_sums,
        )
        dropped = None
        if capacity:
            dropped = torch.stack([load.dropped for load in loads]) if loads else torch.zeros_like(counts[:0])  # type: ignore[misc]
            if expert_dropped is not None:
                dropped = torch.cat([expert_dropped, dropped])
        if "logits" not in out and self.stage_info.num_stages > 1 and not self.stage_info.is_current_stage_last:
            out.update(expert_counts=counts, router_prob_sums=prob_sums)
            if dropped is not None:
                out["expert_dropped"] = dropped
            return out
        total = RouterLoad(counts.sum(0), prob_sums, torch.tensor(float(tokens * counts.shape[0]), device=h.device))
        out["aux_loss"] = load_balancing_loss(total)
        out["expert_counts"] = counts  # (MoE layers, E)
        if dropped is not None:
            out["expert_dropped"] = dropped
        return out

    def state_update(self) -> StateUpdate | None:
        """The auxiliary-loss-free balancing as the train step's :class:`~d9dfn.StateUpdate`: after the optimizer,
        each MoE layer's ``expert_bias`` moves by ``load_balance_bias_rate`` toward balance (``_moe.balance_bias``)
        from that layer's row of ``expert_counts``, summed over the step's microbatches and data-parallel ranks.
        ``None`` without a bias (``load_balance_bias_rate=0``). The rows are the whole model's MoE layers in order (what
        the last pipeline stage returns); under pipeline ranks each updates the biases of the stages it holds.
        """
        rate = self.config.load_balance_bias_rate
        if rate <= 0:
            return None
        layers = self.config.moe_layers()
        names = tuple(f"layers.{index}.mlp.expert_bias" for index in layers)

        def update(buffers: Buffers, sums: dict[str, torch.Tensor]) -> Buffers:
            counts = sums["expert_counts"]  # (MoE layers, E), in the layers' order
            new = dict(buffers)
            for row, name in enumerate(names):
                if name in buffers:  # another pipeline rank's stage holds it otherwise
                    new[name] = balance_bias(buffers[name], counts[row], rate)
            return new

        shapes = {"expert_counts": (len(layers), self.config.num_experts)}
        return StateUpdate(outputs=("expert_counts",), update=update, shapes=shapes)


def _check_carried(stage: int, *carried: torch.Tensor | None) -> None:
    """The load from the earlier stages arrives in float32, or the step cast it (a static fact of the trace)."""
    for tensor in carried:
        if tensor is not None and tensor.dtype != torch.float32:
            raise ValueError(
                f"Qwen3MoeLM: pipeline stage {stage} received the earlier stages' expert load in {tensor.dtype}: a "
                "precision policy casts what crosses the stages to its compute dtype, which rounds token counts "
                "above 256 in bfloat16; pipeline an MoE model with --set trainer.precision.compute_dtype=float32, or "
                "train it without trainer.pipelining"
            )
