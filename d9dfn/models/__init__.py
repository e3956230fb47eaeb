"""Reference models: a small Qwen3-dense style decoder-only LM for examples, tests and benchmarks, and its
mapping to and from Hugging Face's ``Qwen3ForCausalLM`` (config fields and tensor names)."""

from d9dfn.models._hf import (
    HF_FIELDS,
    check_hf_config,
    qwen3_from_hf_config,
    qwen3_from_hf_state,
    qwen3_to_hf_config,
    qwen3_to_hf_state,
)
from d9dfn.models._qwen3 import Qwen3Config, Qwen3LM, flops_per_token, num_parameters

__all__ = [
    "HF_FIELDS",
    "Qwen3Config",
    "Qwen3LM",
    "check_hf_config",
    "flops_per_token",
    "num_parameters",
    "qwen3_from_hf_config",
    "qwen3_from_hf_state",
    "qwen3_to_hf_config",
    "qwen3_to_hf_state",
]
