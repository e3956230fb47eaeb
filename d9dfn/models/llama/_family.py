"""Llama (``LlamaForCausalLM``; Llama 2, 3, 3.1 with its ``llama3`` rotary scaling): a configuration of the shared
decoder (``d9dfn.models.Qwen3LM``, ``models/_decoder.py``) without q/k norm, with biases on q, k, v and o only
with HF's ``attention_bias``, and no sliding window. Its own here: the Hugging Face conventions and transformers'
defaults; the model, its config and its plan are the shared decoder's."""

from __future__ import annotations

from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER, Qwen3LM, decoder_backbone, decoder_config
from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import Family, HFFamily
from d9dfn.models._hf_state import from_hf_state, to_hf_state

__all__ = ["LLAMA"]

_HF = HFFamily(
    architecture="LlamaForCausalLM",
    qk_norm=False,
    bias="attention_bias",
    window="none",
    defaults={  # transformers 5's LlamaConfig defaults (tests/test_hf.py compares them)
        "vocab_size": 32_000,
        "hidden_size": 4096,
        "intermediate_size": 11_008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    fixed={"mlp_bias": False},
)

LLAMA: Family[Qwen3Config] = Family(
    name="llama",
    hf=_HF,
    config=decoder_config(_HF),
    model=Qwen3LM,
    to_hf_state=to_hf_state,
    from_hf_state=from_hf_state,
    plan=DECODER_PLAN,
    sums_over=DECODER_SUMS_OVER,
    backbone=decoder_backbone,
)
