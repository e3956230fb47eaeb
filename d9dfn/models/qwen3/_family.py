"""Qwen3 (``Qwen3ForCausalLM``): the shared decoder (``d9dfn.models.Qwen3LM``, ``models/_decoder.py``) as it is by
default: per-head RMSNorm on queries and keys, biases on q, k, v and o only with HF's ``attention_bias``, a
sliding window only with ``use_sliding_window`` (from layer ``max_window_layers`` on). Its own here: the Hugging
Face conventions and transformers' defaults; the model, its config and its plan are the shared decoder's."""

from __future__ import annotations

from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER, Qwen3LM, decoder_backbone, decoder_config
from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import Family, HFFamily
from d9dfn.models._hf_state import from_hf_state, to_hf_state

__all__ = ["QWEN3"]

_HF = HFFamily(
    architecture="Qwen3ForCausalLM",
    qk_norm=True,
    bias="attention_bias",
    window="use_sliding_window",
    # transformers 5's Qwen3Config defaults (tests/test_hf.py compares them): a file that omits
    # num_hidden_layers describes a 32-layer model to HF, whatever d9dfn meant.
    defaults={
        "vocab_size": 151_936,
        "hidden_size": 4096,
        "intermediate_size": 22_016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32_768,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
)

QWEN3: Family[Qwen3Config] = Family(
    name="qwen3",
    hf=_HF,
    config=decoder_config(_HF),
    model=Qwen3LM,
    to_hf_state=to_hf_state,
    from_hf_state=from_hf_state,
    plan=DECODER_PLAN,
    sums_over=DECODER_SUMS_OVER,
    backbone=decoder_backbone,
)
