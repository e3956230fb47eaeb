"""Reference models: a small Qwen3-dense style decoder-only LM for examples, tests and benchmarks (switches make it
Llama, Mistral or Qwen2), and its mapping to and from Hugging Face's ``*ForCausalLM`` folders of those families
(config fields and tensor names)."""

from d9dfn.models._hf import (
    HF_FAMILIES,
    HF_FIELDS,
    HFFamily,
    check_hf_config,
    from_hf_config,
    from_hf_state,
    to_hf_config,
    to_hf_state,
)
from d9dfn.models._layers import RopeScaling
from d9dfn.models._decoder import Qwen3LM
from d9dfn.models._decoder_config import Qwen3Config, flops_per_token, num_parameters

__all__ = [
    "HF_FAMILIES",
    "HF_FIELDS",
    "HFFamily",
    "Qwen3Config",
    "Qwen3LM",
    "RopeScaling",
    "check_hf_config",
    "flops_per_token",
    "from_hf_config",
    "from_hf_state",
    "num_parameters",
    "to_hf_config",
    "to_hf_state",
]
