"""The shared dense decoder: one module tree (``Qwen3LM``) that four families configure (Qwen3, Llama, Mistral, Qwen2).

Architecture (as in Qwen3 dense checkpoints): token embedding; ``num_layers`` pre-norm decoder blocks of
RMSNorm → grouped-query attention (per-head RMSNorm on queries and keys, rotary embeddings, causal
``scaled_dot_product_attention``) → residual, RMSNorm → SwiGLU MLP → residual; a final RMSNorm; an LM
head, optionally tied to the embedding. Parameter names follow Hugging Face's ``Qwen3ForCausalLM`` without
its ``model.`` prefix (``layers.0.self_attn.q_proj.weight``), so checkpoints map by a prefix.

Three switches make it the other Llama-family decoders that share those names (the family folders
``d9dfn/models/llama/``, ``mistral/``, ``qwen2/`` set them): ``qk_norm=False`` (Llama, Mistral, Qwen2),
``qkv_bias`` (Qwen2; Llama's ``attention_bias`` also sets ``o_proj_bias``) and ``rope_scaling`` (Llama 3.1's
``llama3`` frequencies, or ``linear``). :data:`DECODER_PLAN` is the plan of all four.

The model holds no buffers: rotary angles are computed from the positions in every call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from d9dfn import prng
from d9dfn._types import PipelineStageInfo
from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import HFFamily, Plan
from d9dfn.models._layers import Embedding, Linear, RMSNorm, apply_rope, dropout, rope_cos_sin
from d9dfn.models._lora import LoRALinear
from d9dfn.parallel._context import (
    ContextParallel,
    context_indices,
    context_mask,
    context_rank,
    gather_context,
    gather_documents,
)
from d9dfn.parallel._tensor import (
    TensorParallel,
    enter_tensor_parallel,
    gather_sequence,
    leave_tensor_parallel,
    scatter_sequence,
    sequence_rank,
    split_sequence,
    unsplit_sequence,
)
from d9dfn.parallel._vocab import VocabParallelLogits, check_vocab_parallel, vocab_parallel_embedding
from d9dfn.pipeline import distribute_layers

__all__ = [
    "DECODER_PLAN",
    "DECODER_SUMS_OVER",
    "bind_context_parallel",
    "bind_tensor_parallel",
    "Qwen3Attention",
    "Qwen3DecoderLayer",
    "Qwen3LM",
    "Qwen3MLP",
    "decoder_backbone",
    "check_tensor_parallel",
    "decoder_config",
    "document_mask",
    "layer_keys",
    "project",
]

DECODER_PLAN: Plan = {
    "embed_tokens.weight": ("vocab", "embed"),
    "layers.*.input_layernorm.weight": ("embed",),
    # heads / kv_heads: the (num_heads or num_kv_heads) * head_dim rows, head after head.
    "layers.*.self_attn.q_proj.weight": ("heads", "embed"),
    "layers.*.self_attn.q_proj.bias": ("heads",),
    "layers.*.self_attn.k_proj.weight": ("kv_heads", "embed"),
    "layers.*.self_attn.k_proj.bias": ("kv_heads",),
    "layers.*.self_attn.v_proj.weight": ("kv_heads", "embed"),
    "layers.*.self_attn.v_proj.bias": ("kv_heads",),
    "layers.*.self_attn.o_proj.weight": ("embed", "heads"),
    "layers.*.self_attn.o_proj.bias": ("embed",),
    "layers.*.self_attn.q_norm.weight": ("head_dim",),
    "layers.*.self_attn.k_norm.weight": ("head_dim",),
    "layers.*.post_attention_layernorm.weight": ("embed",),
    "layers.*.mlp.gate_proj.weight": ("mlp", "embed"),
    "layers.*.mlp.up_proj.weight": ("mlp", "embed"),
    "layers.*.mlp.down_proj.weight": ("embed", "mlp"),
    "norm.weight": ("embed",),
    "lm_head.weight": ("vocab", "embed"),
}
"""The plan of ``Qwen3LM`` (every switch and pipeline stage): a Linear's weight is (out, in), so ``q_proj`` maps
``embed`` to ``heads`` and ``o_proj`` back. The biases and q/k norms are there only when their switch is on."""

DECODER_SUMS_OVER: Plan = {
    "layers.*.self_attn.q_norm.weight": ("heads",),
    "layers.*.self_attn.k_norm.weight": ("kv_heads",),
    # Applied to every position of the residual stream: split over the sequence between blocks (sequence parallelism).
    "layers.*.input_layernorm.weight": ("sequence",),
    "layers.*.post_attention_layernorm.weight": ("sequence",),
    "layers.*.self_attn.o_proj.bias": ("sequence",),
}
"""The params applied across a dimension they do not have (the family's ``sums_over``): Qwen3's per-head q/k norms
scale every head with one ``head_dim`` vector, so their gradient sums over the heads; split over tensor-parallel
ranks, each rank sums over its own heads only (``d9dfn.parallel.make_plan``'s ``sums_over``). The blocks' norms and
o's bias act on every position between the blocks: with sequence parallelism (the ``sequence`` dimension split by
``d9dfn.parallel.SEQUENCE_PARALLEL_RULES``) each rank sums over its part of the sequence only."""


def decoder_config(hf: HFFamily) -> Callable[..., Qwen3Config]:
    """The config builder of a family of the shared decoder: ``Qwen3Config`` with the family's switches, which the
    fields passed override (a Llama with ``attention_bias``: ``qkv_bias=True, o_proj_bias=True``).

    >>> from d9dfn.models import HF_FAMILIES
    >>> decoder_config(HF_FAMILIES["qwen2"])(hidden_size=64).qkv_bias
    True
    """

    def config(**fields: Any) -> Qwen3Config:
        return Qwen3Config(**{**hf.switches(), **fields})

    return config


def project(layer: nn.Module, x: torch.Tensor, key: torch.Tensor | None, site: int) -> torch.Tensor:
    """``layer(x)``; a layer that wants a key (``layer.keyed``: a LoRA adapter with dropout) gets ``key`` folded with
    ``site`` (its place in the block: the mask of each projection is its own), the others never see one."""
    if key is not None and getattr(layer, "keyed", False):
        out: torch.Tensor = layer(x, prng.fold_in(key, site))
        return out
    plain: torch.Tensor = layer(x)
    return plain


def decoder_backbone(config: Qwen3Config) -> Qwen3LM:
    """The shared decoder without its LM head: ``Qwen3LM(config, lm_head=False)``, mapping ``input_ids`` to the final
    norm's ``{"hidden_states": (B, T, hidden_size)}`` (a family's ``backbone``, under a head of ``models/_heads.py``).

    >>> decoder_backbone(Qwen3Config.tiny())(torch.zeros(1, 3, dtype=torch.long))["hidden_states"].shape
    torch.Size([1, 3, 32])
    """
    return Qwen3LM(config, lm_head=False)


def _init_children(module: nn.Module) -> None:
    # reset_parameters() of a composite re-initializes its whole subtree, in registration order, so
    # that the direct build and the meta → to_empty → reset_parameters() path draw the same numbers.
    for child in module.children():
        # nn.Module.__getattr__ is typed Tensor | Module; every child here defines reset_parameters.
        child.reset_parameters()  # type: ignore[operator]


class Qwen3Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings and, as configured, per-head q/k RMSNorm
    (``q_norm``/``k_norm`` are ``None`` without it) and projection biases."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        std, out_std = config.initializer_range, config.initializer_range / math.sqrt(2 * config.num_layers)
        q_size, kv_size, bias = (
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
            config.qkv_bias,
        )
        self.q_proj = Linear(config.hidden_size, q_size, init_std=std, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_size, init_std=std, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_size, init_std=std, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, init_std=out_std, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.tensor_parallel: TensorParallel | None = None
        """The tensor group when the heads are split over one (:func:`bind_tensor_parallel`): the projections then
        hold this rank's heads (q/k/v rows, o columns) and the output is summed over the group; ``None``: whole."""
        self.context_parallel: ContextParallel | None = None
        """The context group when the sequence is split over one (:func:`bind_context_parallel`): the keys and values
        of every rank are gathered, and ``mask`` (``d9dfn.parallel.context_mask``) masks them by global position."""

    def reset_parameters(self) -> None:
        """Re-initialize the projections and norms."""
        _init_children(self)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (B, T, D); ``cos``/``sin`` broadcastable to (B, T, 1, head_dim / 2); ``mask`` (B | 1, 1, T, T) bool,
        true where a query may attend a key (:func:`document_mask`), ``None``: causal; ``key``: the projections'
        (a LoRA adapter's dropout, :func:`project`). Returns (B, T, D)."""
        tp = self.tensor_parallel
        if tp is not None:  # the gradient of x sums every rank's heads' part; (B, T/n, D) -> (B, T, D) with SP
            x = gather_sequence(x, tp) if tp.sequence else enter_tensor_parallel(x, tp)
        batch, seq, _ = x.shape
        # (B, T, D) -> (B, T, heads, head_dim): normalize each head (Qwen3), rotate, then heads first for SDPA. The
        # heads are the projections' rows / head_dim: all of them, or this rank's under tensor parallelism.
        q = project(self.q_proj, x, key, 1).view(batch, seq, -1, self.head_dim)
        k = project(self.k_proj, x, key, 2).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = project(self.v_proj, x, key, 3).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # at the global positions under context parallelism
        cp = self.context_parallel
        if cp is not None:  # (B, T/cp, kv, 2·head_dim) -> (B, T, kv, 2·head_dim): every rank's keys and values
            assert mask is not None  # Qwen3LM.forward passes context_mask
            kv = gather_context(torch.cat((k, v), dim=-1), cp)
            k, v = kv[..., : self.head_dim], kv[..., self.head_dim :]
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        # enable_gqa lets each group of num_heads / num_kv_heads query heads share one key/value head
        # without materializing repeated k/v.
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        else:  # packed documents (causal within each document), or context parallelism's global causal mask
            out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        heads = out.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, heads · head_dim)
        if tp is None:
            return project(self.o_proj, heads, key, 4)
        # Row-parallel: this rank's columns of o give a part of the output, summed over the group (onto this rank's
        # part of the sequence with SP); the bias once. An adapter's part (A's columns here) is summed with it.
        part = F.linear(heads, self.o_proj.weight)
        if isinstance(self.o_proj, LoRALinear):
            part = part + self.o_proj.delta(heads)  # bind_tensor_parallel refuses its dropout here
        out = _leave(part, tp)
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class Qwen3MLP(nn.Module):
    """The SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        std, out_std = config.initializer_range, config.initializer_range / math.sqrt(2 * config.num_layers)
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, init_std=std)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, init_std=std)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, init_std=out_std)
        self.tensor_parallel: TensorParallel | None = None
        """The tensor group when the width is split over one (:func:`bind_tensor_parallel`): gate/up hold this
        rank's rows, down its columns, and the output is summed over the group; ``None``: whole."""

    def reset_parameters(self) -> None:
        """Re-initialize the three projections."""
        _init_children(self)

    def forward(self, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); ``key``: the projections' (a LoRA adapter's dropout, :func:`project`)."""
        tp = self.tensor_parallel
        if tp is not None:
            x = gather_sequence(x, tp) if tp.sequence else enter_tensor_parallel(x, tp)
        gated = F.silu(project(self.gate_proj, x, key, 1)) * project(self.up_proj, x, key, 2)  # (B, T, I or I / n)
        out = project(self.down_proj, gated, key, 3)
        return out if tp is None else _leave(out, tp)


def _leave(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel output summed over the group: whole (an all-reduce), or this rank's part of the sequence (a
    reduce-scatter) with sequence parallelism."""
    return scatter_sequence(x, tp) if tp.sequence else leave_tensor_parallel(x, tp)


class Qwen3DecoderLayer(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``, each branch with dropout."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def reset_parameters(self) -> None:
        """Re-initialize the norms, the attention and the MLP."""
        _init_children(self)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_key: torch.Tensor | None = None,
        mlp_key: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); a branch gets dropout when its key is given and ``dropout > 0``; ``mask``: the
        attention's (``None``: causal)."""
        branch: torch.Tensor = self.self_attn(self.input_layernorm(x), cos, sin, mask, attn_key)
        if attn_key is not None and self.dropout > 0:
            branch = dropout(branch, self.dropout, attn_key)
        h = x + branch
        branch = self.mlp(self.post_attention_layernorm(h), mlp_key)
        if mlp_key is not None and self.dropout > 0:
            branch = dropout(branch, self.dropout, mlp_key)
        return h + branch


class Qwen3LM(nn.Module):
    """A Qwen3-dense style causal LM; ``forward`` maps token ids to ``{"logits": (B, T, vocab_size)}``.

    Built directly, it is initialized at once (deterministic given ``torch.manual_seed``). Built under
    ``torch.device("meta")``, move it with ``to_empty(device=...)`` and call ``reset_parameters()``: with
    the same seed, the weights equal those of a direct build.

    Dropout is pure: with ``config.dropout > 0`` and a ``dropout_key`` (a :mod:`d9dfn.prng` key), the
    embedding output and each block's attention and MLP branches are dropped with masks from
    ``prng.fold_in(dropout_key, site)``; sites are numbered 0 (embedding), then ``2i + 1`` / ``2i + 2``
    for block ``i``'s attention / MLP. Without a key (evaluation) nothing is dropped, whatever
    ``self.training`` says. Attention probabilities are never dropped (SDPA's dropout uses torch's RNG). A LoRA
    adapter with dropout (``d9dfn.models.apply_peft``) draws its mask from its block's attention or MLP key folded
    with the projection's place (:func:`project`), so it needs the key whatever ``config.dropout`` is.

    Pipeline stages (d9d's contract): with ``stage=PipelineStageInfo(i, n)`` it builds only stage ``i``: its
    decoder blocks (split by :func:`d9dfn.pipeline.distribute_layers` with ``first_stage_cost`` /
    ``last_stage_cost`` virtual layers for the embedding and for the head and loss), the embedding on the
    first stage, the final norm and the head on the last. Layers keep their global index as their name
    (``layers.<i>.…``), so every stage's names are the whole model's. The first stage maps ``input_ids`` to
    ``{"hidden_states"}``, a middle one ``hidden_states`` to ``{"hidden_states"}``, the last to ``{"logits"}``;
    ``position_ids`` and ``dropout_key`` are kwargs that every stage reads. With ``stage=None`` (or one
    stage) it is the whole model, named and behaving as before.

    Args:
        config: the sizes.
        stage: which pipeline stage to build; ``None`` builds the whole model.
        first_stage_cost: virtual layers for the embedding (a lookup: 0 by default).
        last_stage_cost: virtual layers for the final norm, the head and the loss (1 by default).
        lm_head: ``False`` builds a backbone: no LM head (tied or not), and the last stage returns the final
            norm's ``{"hidden_states": (B, T, hidden_size)}`` for a head of its own (``SequenceClassifier``,
            ``SequenceEmbedder``: Hugging Face's ``*Model`` under ``*ForSequenceClassification``).

    Raises:
        ValueError: a stage of ``num_stages > 1`` with ``tie_word_embeddings=True`` (untie to pipeline), or a
            stage that would get no decoder block.

    >>> torch.manual_seed(0) and None
    >>> model = Qwen3LM(Qwen3Config.tiny())
    >>> model(torch.zeros(2, 5, dtype=torch.long))["logits"].shape
    torch.Size([2, 5, 256])
    >>> last = Qwen3LM(Qwen3Config.tiny(num_layers=3, tie_word_embeddings=False), PipelineStageInfo(1, 2))
    >>> sorted(last.layers), last(hidden_states=torch.zeros(2, 5, 32))["logits"].shape
    (['2'], torch.Size([2, 5, 256]))
    """

    def __init__(
        self,
        config: Qwen3Config,
        stage: PipelineStageInfo | None = None,
        *,
        first_stage_cost: int = 0,
        last_stage_cost: int = 1,
        lm_head: bool = True,
    ) -> None:
        super().__init__()
        stage = PipelineStageInfo(current_stage=0, num_stages=1) if stage is None else stage
        if stage.num_stages > 1 and config.tie_word_embeddings and lm_head:
            raise ValueError(
                f"Qwen3LM: tie_word_embeddings=True shares embed_tokens.weight between the embedding on stage 0 and "
                f"the LM head on stage {stage.num_stages - 1} of {stage.num_stages}, and the gradient of a weight "
                "held by two stages is not summed across them; untie it to pipeline this model: "
                "Qwen3Config(..., tie_word_embeddings=False)"
            )
        self.config = config
        self.stage_info = stage
        self.has_lm_head = lm_head
        first, last = stage.is_current_stage_first, stage.is_current_stage_last
        layer_range = distribute_layers(
            config.num_layers, stage.num_stages, first_stage_cost=first_stage_cost, last_stage_cost=last_stage_cost
        )[stage.current_stage]
        self.embed_tokens = (
            Embedding(config.vocab_size, config.hidden_size, init_std=config.initializer_range) if first else None
        )
        # Keyed by the global index, so a stage's names equal the whole model's (layers.<i>.…).
        self.layers = nn.ModuleDict({str(index): self.make_layer(config, index) for index in layer_range})
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if last else None
        # Tied: the head reads embed_tokens.weight in forward; no second Parameter object shares it, so
        # named_parameters, functional_call and to_empty see each weight exactly once.
        self.lm_head = (
            None
            if config.tie_word_embeddings or not last or not lm_head
            else Linear(config.hidden_size, config.vocab_size, init_std=config.initializer_range)
        )
        self.tensor_parallel: TensorParallel | None = None
        """The tensor group when the blocks are bound to one with sequence parallelism (:func:`bind_tensor_parallel`):
        the residual stream then travels between the blocks split over the sequence (``forward``)."""
        self.context_parallel: ContextParallel | None = None
        """The context group when the sequence is split over one (:func:`bind_context_parallel`): the inputs are this
        rank's part of every sequence (``d9dfn.parallel.split_context``), their positions and the attention mask are
        the global ones (``forward``)."""
        self.reset_parameters()

    def make_layer(self, config: Qwen3Config, index: int) -> nn.Module:
        """Decoder block ``index`` (its global index); a model of its own blocks (``Qwen3MoeLM``) overrides it."""
        return Qwen3DecoderLayer(config)

    def reset_parameters(self) -> None:
        """(Re-)initialize every weight: normal for projections and embeddings, ones for norm scales."""
        modules: tuple[nn.Module | None, ...] = (self.embed_tokens, *self.layers.values(), self.norm, self.lm_head)
        for module in modules:
            if module is not None:
                module.reset_parameters()  # type: ignore[operator]  # nn.Module.__getattr__ types it as a Tensor

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        dropout_key: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Next-token logits for every position (the last stage), or the residual stream (the others).

        Args:
            input_ids: (B, T) integer token ids, ``T <= max_seq_len``; the first stage's input.
            hidden_states: (B, T, hidden_size), the previous stage's output; every other stage's input.
            position_ids: (T,) or (B, T) integer positions; ``arange(T)`` when omitted (pass them for
                packed sequences or an offset). Every stage needs the same ones: pass them as a kwarg.
            document_ids: (T,) or (B, T) integers, equal within a packed document: a position attends only to
                earlier positions of its own document (:func:`document_mask`); ``None``: plain causal attention.
                Pass ``position_ids`` restarting at 0 in each document with them. A kwarg, like ``position_ids``.
            dropout_key: a :mod:`d9dfn.prng` key; dropout is applied only when given and ``dropout > 0``.
                Sites are numbered by global layer index, so every stage split draws the same masks.

        Returns:
            ``{"logits": (B, T, vocab_size)}`` in the weights' dtype on the last stage (the whole model; bound with
            vocabulary parallelism, this rank's columns as a :class:`~d9dfn.parallel.VocabParallelLogits`),
            ``{"hidden_states": (B, T, hidden_size)}`` on the others.

        Raises:
            ValueError: ``input_ids`` is not (B, T) or longer than ``max_seq_len``, ``position_ids``
                does not match it, or the stage got the other stage kind's input.
            TypeError: ``input_ids`` or ``position_ids`` is not an integer tensor.
        """
        tp = self.tensor_parallel  # bound only with sequence or vocabulary parallelism
        given = input_ids if input_ids is not None else hidden_states
        rank = None if tp is None or given is None else sequence_rank(tp, given.device)
        cp = self.context_parallel
        if cp is not None and given is not None:  # this rank's part of each sequence: global positions and mask
            positions = context_indices(given.shape[1] * cp.size, cp.size, context_rank(cp, given.device))  # (T/cp,)
            position_ids = positions if position_ids is None else position_ids
        h, cos, sin, masks = self.prologue(input_ids, hidden_states, position_ids, document_ids, dropout_key, rank)
        if cp is not None and given is not None:  # (B | 1, 1, T/cp, T): queries here, keys of every rank
            if document_ids is None:
                masks = (context_mask(positions, cp.size),)
            else:  # packed rows: causal within each document, the keys' documents gathered from every rank
                documents = document_ids if document_ids.ndim == 2 else document_ids.unsqueeze(0)
                masks = (context_mask(positions, cp.size, documents, gather_documents(documents, cp)),)
        # (B, T, D) -> (B, T/n, D): the blocks' norms and residuals on 1/n (a vocab-parallel embedding scattered it)
        if tp is not None and rank is not None and tp.sequence and not (tp.vocab and self.embed_tokens is not None):
            h = split_sequence(h, tp, rank)
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, *layer_keys(dropout_key, int(name)), *masks)
        if tp is not None and rank is not None and tp.sequence:  # the final norm and the head on the whole sequence
            h = unsplit_sequence(h, tp, rank)
        return self.epilogue(h, rank, dropout_key)

    def prologue(
        self,
        input_ids: torch.Tensor | None,
        hidden_states: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        dropout_key: torch.Tensor | None,
        rank: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """What every block reads: the stage's input (embedded on the first stage), the rotary ``cos``/``sin`` and
        the attention masks (none, or packed documents'). ``rank``: this rank's index in the tensor group (0-d),
        given when the model is bound to one; with vocabulary parallelism the embedding is then this rank's rows'
        part summed over the group (onto this rank's part of the sequence with sequence parallelism)."""
        given = _check_inputs(self.config, self.stage_info, input_ids, hidden_states, position_ids, document_ids)
        # Unpacked: each block is called as before packing existed (the same traced region, bitwise the same).
        masks = () if document_ids is None else (document_mask(document_ids),)
        if position_ids is None:
            position_ids = torch.arange(given.shape[1], device=given.device)
        # Recomputed on every stage from the positions: nothing rotary crosses a stage boundary.
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (B | 1, T, 1, head_dim / 2): broadcast over heads

        # The key reaches every block even without the model's own dropout: a LoRA adapter's dropout draws from it.
        drop_key = dropout_key
        tp = self.tensor_parallel
        if self.embed_tokens is not None:
            if tp is not None and tp.vocab and rank is not None:
                weight = self.embed_tokens.weight  # (V/n, D): this rank's rows
                part = vocab_parallel_embedding(given, weight, rank * weight.shape[0])  # (B, T, D), zeros elsewhere
                h = scatter_sequence(part, tp) if tp.sequence else leave_tensor_parallel(part, tp)
            else:
                h = self.embed_tokens(input_ids)  # (B, T) -> (B, T, D)
            if drop_key is not None and self.config.dropout > 0:  # h is whole here (sequence parallelism refuses it)
                h = dropout(h, self.config.dropout, prng.fold_in(drop_key, 0))
        else:
            assert hidden_states is not None  # _check_inputs
            h = hidden_states
        return h, cos, sin, masks

    def epilogue(
        self, h: torch.Tensor, rank: torch.Tensor | None = None, dropout_key: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """The stage's output from the last block's: ``hidden_states`` (not the last stage, or a backbone), else
        the final norm and the LM head's ``logits``: with vocabulary parallelism (``rank`` given) this rank's columns
        of them, a :class:`~d9dfn.parallel.VocabParallelLogits` (``d9dfn.tasks.token_nll`` reads it). An untied head
        runs as its module (a LoRA adapter on ``lm_head`` adds its product; its dropout draws from ``dropout_key``
        at site ``2 · num_layers + 1``, after every block's)."""
        if self.norm is None:
            return {"hidden_states": h}
        h = self.norm(h)
        if not self.has_lm_head:  # a backbone: a head of its own (d9dfn.models.SequenceClassifier) reads the states
            return {"hidden_states": h}
        tp = self.tensor_parallel
        vocab = tp if tp is not None and tp.vocab and rank is not None else None
        if vocab is not None:  # the gradient of h sums every rank's vocabulary part
            h = enter_tensor_parallel(h, vocab)
        if self.lm_head is not None:  # (B, T, D) -> (B, T, V), or this rank's (B, T, V/n)
            logits = project(self.lm_head, h, dropout_key, 2 * self.config.num_layers + 1)
        else:  # tied: the last stage holds the embedding too (a split refuses tied embeddings)
            assert self.embed_tokens is not None
            logits = F.linear(h, self.embed_tokens.weight)
        if vocab is not None:
            assert rank is not None
            return {"logits": VocabParallelLogits(logits, rank * logits.shape[-1], vocab)}
        return {"logits": logits}


def bind_tensor_parallel(model: nn.Module, tp: TensorParallel | None) -> int:
    """Bind every attention and MLP of the shared decoder in ``model`` to the tensor group ``tp`` (``None``: unbind),
    so that they compute on the local heads and width the plan's :data:`~d9dfn.parallel.TENSOR_PARALLEL_RULES` give
    them and sum their outputs over the group (``d9dfn.parallel.enter_tensor_parallel``); with ``tp.sequence`` the
    ``Qwen3LM`` too, which splits the residual stream over the sequence between its blocks; with ``tp.vocab`` the
    ``Qwen3LM`` too, whose embedding and LM head then compute on their vocabulary rows
    (``d9dfn.parallel.VOCAB_PARALLEL_RULES``). Returns how many attention and MLP modules it bound.

    Raises:
        ValueError: heads, kv-heads or the MLP width that ``tp.size`` does not divide, a projection that is not a
            ``Linear`` or a LoRA adapter on one, or an adapter with dropout on o or down (row-parallel); the message
            names ``--set mesh.tensor_parallel`` and the fix. With
            sequence parallelism: dropout in the blocks, or a model whose forward does not split the sequence. With
            vocabulary parallelism: a ``vocab_size`` that ``tp.size`` does not divide, or a forward of its own.
    """
    bound = 0
    for name, module in model.named_modules():
        if isinstance(module, Qwen3LM):
            if tp is not None and tp.sequence:
                _check_shared_forward(module, "bind_tensor_parallel", "the sequence", "mesh.sequence_parallel=false")
            if tp is not None and tp.vocab:
                _check_shared_forward(module, "bind_tensor_parallel", "the vocabulary", "mesh.tensor_parallel=1")
                check_vocab_parallel(module.config.vocab_size, tp.size)
            module.tensor_parallel = tp if tp is not None and (tp.sequence or tp.vocab) else None
            continue
        if isinstance(module, Qwen3DecoderLayer) and tp is not None and tp.sequence and module.dropout > 0:
            raise ValueError(
                f"bind_tensor_parallel: {name} drops its branches out (model.dropout={module.dropout}), whose masks "
                "sequence parallelism would draw per part of the sequence; set --set mesh.sequence_parallel=false or "
                "model.dropout=0"
            )
        if isinstance(module, Qwen3Attention):
            sizes = {"num_heads": module.num_heads, "num_kv_heads": module.num_kv_heads}
            projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
        elif isinstance(module, Qwen3MLP):
            sizes = {"intermediate_size": module.gate_proj.out_features}
            projections = ("gate_proj", "up_proj", "down_proj")
        else:
            continue
        if tp is not None:
            check_tensor_parallel(sizes, tp.size)
            for projection in projections:
                _check_tensor_parallel_projection(f"{name}.{projection}", getattr(module, projection))
        module.tensor_parallel = tp
        bound += 1
    return bound


_ROW_PARALLEL = ("o_proj", "down_proj")
"""The projections split by input columns under tensor parallelism (their plan rows' ``in`` dim is split)."""


def _check_tensor_parallel_projection(name: str, layer: nn.Module) -> None:
    """A projection tensor parallelism splits: a plain Linear, or a LoRA adapter on one (split with its base,
    ``d9dfn.models.adapter_plan``) without dropout on a row-parallel base, whose input is this rank's columns only
    (one process's mask over the whole input is not drawn there)."""
    if type(layer) is LoRALinear:
        if layer.dropout > 0 and name.rsplit(".", 1)[-1] in _ROW_PARALLEL:
            raise ValueError(
                f"bind_tensor_parallel: {name}'s LoRA adapter drops its input out (dropout={layer.dropout}), which "
                "tensor parallelism splits by columns there; give the o_proj/down_proj targets dropout 0 (a LoRA "
                "method of their own), or set --set mesh.tensor_parallel=1"
            )
        return
    if type(layer) is not Linear:
        raise ValueError(
            f"bind_tensor_parallel: {name} is a {type(layer).__name__}, not a Linear or a LoRA adapter on one; set "
            "--set mesh.tensor_parallel=1"
        )


def bind_context_parallel(model: nn.Module, cp: ContextParallel | None) -> int:
    """Bind the shared decoder in ``model`` to the context group ``cp`` (``None``: unbind): its ``Qwen3LM`` then takes
    this rank's part of every sequence (``d9dfn.parallel.split_context``), rotates and masks at the global positions,
    and each attention gathers every rank's keys and values (``d9dfn.parallel.gather_context``). It composes with
    :func:`bind_tensor_parallel` (either order): each attention then gathers the keys and values of its tensor rank's
    kv-heads over ``cp``, on this context rank's positions (with sequence parallelism, split further over ``tp``
    between the blocks). Returns how many attention modules it bound.

    Raises:
        ValueError: what is not built with context parallelism yet, each in one line naming the setting: a model
            whose forward is its own (``qwen3_moe``), a pipeline stage, dropout, or no shared decoder in ``model``.
    """
    lms = [module for module in model.modules() if isinstance(module, Qwen3LM)]
    if cp is not None:
        if not lms:
            raise ValueError(
                f"bind_context_parallel: {type(model).__name__} holds no shared decoder (Qwen3LM); context "
                "parallelism is built for the dense decoder families only; set --set mesh.context_parallel_shard=1"
            )
        for lm in lms:
            _check_context_parallel(lm)
    for lm in lms:
        lm.context_parallel = cp
    bound = 0
    for module in model.modules():
        if isinstance(module, Qwen3Attention):
            module.context_parallel = cp
            bound += 1
    return bound


def _check_shared_forward(lm: Qwen3LM, where: str, what: str, fix: str, which: str = "") -> None:
    """``lm`` runs the shared ``Qwen3LM.forward``, the one that splits ``what`` when bound; else refused in one line
    naming ``--set fix``."""
    if type(lm).forward is not Qwen3LM.forward:
        raise ValueError(
            f"{where}: {type(lm).__name__} runs its blocks in a forward of its own{which}, which does not split "
            f"{what}; set --set {fix}"
        )


def _check_context_parallel(lm: Qwen3LM) -> None:
    """The combinations context parallelism does not build yet, refused in one line each."""
    where = "bind_context_parallel"
    _check_shared_forward(
        lm, where, "the sequence", "mesh.context_parallel_shard=1 or a dense model.family", " (the qwen3_moe family)"
    )
    if lm.stage_info.num_stages > 1:
        raise ValueError(
            f"{where}: the model is pipeline stage {lm.stage_info.current_stage} of {lm.stage_info.num_stages}; "
            "context parallelism beside a pipeline is not built yet; set --set mesh.pipeline_parallel=1 or "
            "mesh.context_parallel_shard=1"
        )
    if lm.config.dropout > 0:
        raise ValueError(
            f"{where}: model.dropout={lm.config.dropout}: its masks would be drawn per part of the sequence; set "
            "--set model.dropout=0 or mesh.context_parallel_shard=1"
        )


def check_tensor_parallel(sizes: dict[str, int], degree: int) -> None:
    """Each of ``sizes`` (``num_heads``, ``num_kv_heads``, ``intermediate_size``) split evenly over ``degree``
    tensor-parallel ranks, else refused in one line.

    >>> check_tensor_parallel({"num_heads": 4, "num_kv_heads": 2}, 2)
    >>> check_tensor_parallel({"num_heads": 4, "num_kv_heads": 2}, 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: mesh.tensor_parallel=4 does not divide model num_kv_heads=2: ...
    """
    for field, size in sizes.items():
        if size % degree:
            divisors = [d for d in range(1, size + 1) if all(s % d == 0 for s in sizes.values())]
            raise ValueError(
                f"mesh.tensor_parallel={degree} does not divide model {field}={size}: each tensor-parallel rank "
                f"computes the same number of them; set --set mesh.tensor_parallel to one of {divisors}, or a model "
                f"whose {field} is a multiple of {degree}"
            )


def layer_keys(dropout_key: torch.Tensor | None, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Block ``index``'s attention and MLP dropout keys (``None`` without a key): sites ``2i + 1`` and ``2i + 2``,
    numbered by the global index, so every stage split draws the same masks."""
    if dropout_key is None:
        return None, None
    return prng.fold_in(dropout_key, 2 * index + 1), prng.fold_in(dropout_key, 2 * index + 2)


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed documents: query ``i`` may attend key ``j`` when ``j <= i`` and both positions
    hold the same document id (a block-diagonal causal mask).

    Args:
        document_ids: (T,) or (B, T) integers.

    Returns:
        (B | 1, 1, T, T) bool, broadcast over heads by ``scaled_dot_product_attention``.

    >>> document_mask(torch.tensor([0, 0, 1])).int()[0, 0]
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 0, 1]], dtype=torch.int32)
    """
    ids = document_ids if document_ids.ndim == 2 else document_ids.unsqueeze(0)  # (B | 1, T)
    seq = ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()  # (T, T)
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)  # (B, T, 1) == (B, 1, T) -> (B, T, T)
    return (same & causal).unsqueeze(1)  # (B, 1, T, T)


def _check_inputs(
    config: Qwen3Config,
    stage: PipelineStageInfo,
    input_ids: torch.Tensor | None,
    hidden_states: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stage's input (``input_ids`` or ``hidden_states``), checked against its kind and the positions."""
    # Shapes and dtypes only: static under torch.compile, so these checks cost no host sync.
    where = "" if stage.num_stages == 1 else f" (stage {stage.current_stage} of {stage.num_stages})"
    if stage.is_current_stage_first:
        if input_ids is None or hidden_states is not None:
            raise ValueError(
                f"Qwen3LM.forward{where}: the first stage embeds tokens and takes input_ids only; "
                f"got input_ids={'None' if input_ids is None else 'a tensor'} and hidden_states="
                f"{'None' if hidden_states is None else 'a tensor'}; pass the task's inputs {{'input_ids': ...}}"
            )
        if input_ids.ndim != 2:
            raise ValueError(
                f"Qwen3LM.forward{where}: input_ids has shape {tuple(input_ids.shape)}, expected (batch, seq); "
                "add a batch dimension with input_ids.unsqueeze(0)"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"Qwen3LM.forward{where}: input_ids has dtype {input_ids.dtype}, expected torch.long token ids"
            )
        batch, seq = input_ids.shape
        name, given = "input_ids", input_ids
    else:
        if hidden_states is None or input_ids is not None:
            raise ValueError(
                f"Qwen3LM.forward{where}: a later stage takes hidden_states (the previous stage's output) only; "
                f"got input_ids={'None' if input_ids is None else 'a tensor'} and hidden_states="
                f"{'None' if hidden_states is None else 'a tensor'}; pass the previous stage's outputs as inputs"
            )
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != config.hidden_size:
            raise ValueError(
                f"Qwen3LM.forward{where}: hidden_states has shape {tuple(hidden_states.shape)}, expected "
                f"(batch, seq, {config.hidden_size}); pass the previous stage's 'hidden_states' output"
            )
        batch, seq = hidden_states.shape[:2]
        name, given = "hidden_states", hidden_states
    if seq > config.max_seq_len:
        raise ValueError(
            f"Qwen3LM.forward{where}: {name} has {seq} positions, more than max_seq_len={config.max_seq_len}; "
            "truncate the sequences or raise max_seq_len in Qwen3Config"
        )
    for kwarg, ids in (("position_ids", position_ids), ("document_ids", document_ids)):
        if ids is None:
            continue
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"Qwen3LM.forward{where}: {kwarg} has dtype {ids.dtype}, expected an integer dtype")
        shape = tuple(ids.shape)
        if shape not in ((seq,), (1, seq), (batch, seq)):
            raise ValueError(
                f"Qwen3LM.forward{where}: {kwarg} has shape {shape}, but {name} has shape {tuple(given.shape)}; "
                f"pass {kwarg} of shape ({seq},) or ({batch}, {seq})"
            )
    return given
