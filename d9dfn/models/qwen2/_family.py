"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): a configuration of the shared decoder (``d9dfn.models.Qwen3LM``,
``models/_decoder.py``) without q/k norm, with biases on q, k and v always and never on o, and a sliding window
only with ``use_sliding_window`` (from layer ``max_window_layers`` on). Its own here: the Hugging Face conventions
and transformers' defaults; the model, its config and its plan are the shared decoder's."""

from __future__ import annotations

from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER, Qwen3LM, decoder_backbone, decoder_config
from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import Family, HFFamily
from d9dfn.models._hf_state import from_hf_state, to_hf_state

__all__ = ["QWEN2"]

_HF = HFFamily(
    architecture="Qwen2ForCausalLM",
    qk_norm=False,
    bias="qkv",
    window="use_sliding_window",
    defaults={  # transformers 5's Qwen2Config defaults (tests/test_hf.py compares them)
        "vocab_size": 151_936,
        "hidden_size": 4096,
        "intermediate_size": 22_016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32_768,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
)

QWEN2: Family[Qwen3Config] = Family(
    name="qwen2",
    hf=_HF,
    config=decoder_config(_HF),
    model=Qwen3LM,
    to_hf_state=to_hf_state,
    from_hf_state=from_hf_state,
    plan=DECODER_PLAN,
    sums_over=DECODER_SUMS_OVER,
    backbone=decoder_backbone,
)
