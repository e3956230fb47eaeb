"""The qwen3_moe family: Hugging Face's ``Qwen3MoeForCausalLM`` (``d9dfn.models.FAMILIES["qwen3_moe"]``): the shared
decoder with mixture-of-experts MLPs; its model, config, tensor names (both expert layouts) and plan live here."""

from d9dfn.models.qwen3_moe._config import Qwen3MoeConfig
from d9dfn.models.qwen3_moe._family import QWEN3_MOE, QWEN3_MOE_PLAN
from d9dfn.models.qwen3_moe._hf_state import ExpertLayout, from_hf_state, to_hf_state
from d9dfn.models.qwen3_moe._model import Experts, Qwen3MoeDecoderLayer, Qwen3MoeLM, SparseMoeBlock
from d9dfn.models.qwen3_moe._moe import (
    GROUPED_BF16_TOLERANCE,
    RouterLoad,
    Routing,
    balance_bias,
    drop_over_capacity,
    expert_capacity,
    experts,
    experts_dense,
    experts_grouped,
    experts_reference,
    load_balancing_loss,
    route,
    router_load,
    uses_grouped,
)

__all__ = [
    "GROUPED_BF16_TOLERANCE",
    "QWEN3_MOE",
    "QWEN3_MOE_PLAN",
    "ExpertLayout",
    "from_hf_state",
    "to_hf_state",
    "Experts",
    "Qwen3MoeConfig",
    "Qwen3MoeDecoderLayer",
    "Qwen3MoeLM",
    "RouterLoad",
    "Routing",
    "SparseMoeBlock",
    "balance_bias",
    "drop_over_capacity",
    "expert_capacity",
    "experts",
    "experts_dense",
    "experts_grouped",
    "experts_reference",
    "load_balancing_loss",
    "route",
    "router_load",
    "uses_grouped",
]
