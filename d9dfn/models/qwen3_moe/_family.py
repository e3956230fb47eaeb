"""Qwen3-MoE (``Qwen3MoeForCausalLM``): a model of its own (``Qwen3MoeLM``: the shared decoder with MoE MLPs), its
config (``Qwen3MoeConfig``), its tensor names in both expert layouts and its plan, all in this folder."""

from __future__ import annotations

from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER
from d9dfn.models._family import Family, HFFamily, Plan
from d9dfn.models.qwen3_moe._config import Qwen3MoeConfig
from d9dfn.models.qwen3_moe._hf_state import from_hf_state, to_hf_state
from d9dfn.models.qwen3_moe._model import Qwen3MoeLM

__all__ = ["QWEN3_MOE", "QWEN3_MOE_PLAN"]

QWEN3_MOE_PLAN: Plan = {
    **DECODER_PLAN,  # attention, norms, embedding, head, and the dense MLP of mlp_only / skipped layers
    "layers.*.mlp.gate.weight": ("expert_logits", "embed"),
    "layers.*.mlp.experts.gate_up_proj": ("experts", "expert_mlp", "embed"),
    "layers.*.mlp.experts.down_proj": ("experts", "embed", "expert_mlp"),
    "layers.*.mlp.shared_expert.gate_proj.weight": ("mlp", "embed"),
    "layers.*.mlp.shared_expert.up_proj.weight": ("mlp", "embed"),
    "layers.*.mlp.shared_expert.down_proj.weight": ("embed", "mlp"),
    "layers.*.mlp.shared_expert_gate.weight": ("shared_gate", "embed"),
}
"""The shared decoder's plan and the experts': ``experts`` is the stacked experts' dimension (what expert parallelism
shards: ``d9dfn.parallel.EXPERT_PARALLEL_RULES``), ``expert_logits`` the router's output (one score per expert,
computed whole on every rank), ``expert_mlp`` an expert's hidden width (2I for the fused gate and up rows),
``shared_gate`` the shared expert's one gate output."""

_HF = HFFamily(
    architecture="Qwen3MoeForCausalLM",
    qk_norm=True,
    bias="attention_bias",
    window="use_sliding_window",
    # transformers 5's Qwen3MoeConfig defaults (tests/test_qwen3_moe.py compares them).
    defaults={
        "vocab_size": 151_936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32_768,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "max_window_layers": 0,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
    fields={
        "num_experts": ("num_experts", "num_local_experts"),
        "num_experts_per_tok": ("num_experts_per_tok",),
        "moe_intermediate_size": ("moe_intermediate_size",),
        "norm_topk_prob": ("norm_topk_prob",),
        "decoder_sparse_step": ("decoder_sparse_step",),
        "mlp_only_layers": ("mlp_only_layers",),
        "router_aux_loss_coef": ("router_aux_loss_coef",),
    },
    # Transformers' class has no balancing bias (it would choose other experts) and no capacity limit (it drops none).
    implements={
        "scoring": "softmax",
        "shared_expert_intermediate_size": 0,
        "load_balance_bias_rate": 0.0,
        "capacity_factor": None,
    },
)


def _config(**fields: object) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**_HF.switches(), **fields})  # type: ignore[arg-type]


QWEN3_MOE: Family[Qwen3MoeConfig] = Family(
    name="qwen3_moe",
    hf=_HF,
    config=_config,
    model=Qwen3MoeLM,
    to_hf_state=to_hf_state,
    from_hf_state=from_hf_state,
    plan=QWEN3_MOE_PLAN,
    sums_over=DECODER_SUMS_OVER,
    config_type=Qwen3MoeConfig,
)
