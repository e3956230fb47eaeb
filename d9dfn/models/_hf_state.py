"""The shared decoder's tensor names and Hugging Face's (every family that configures it: Qwen3, Llama, Mistral,
Qwen2): the same but for HF's ``model.`` prefix on everything except ``lm_head``.

HF's rotary ``inv_freq`` buffers are rebuilt from the config by HF and recomputed per call by ``Qwen3LM``, so no
file needs them. ``tests/test_hf.py`` checks the logits of each family against ``transformers``, both ways.

>>> import torch
>>> from d9dfn.models import Qwen3Config
>>> untied = Qwen3Config.tiny(tie_word_embeddings=False)
>>> sorted(to_hf_state({"norm.weight": torch.ones(2), "lm_head.weight": torch.ones(3, 2)}, untied))
['lm_head.weight', 'model.norm.weight']
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from d9dfn.models._decoder_config import Qwen3Config

__all__ = ["from_hf_state", "to_hf_state"]

_PREFIX = "model."


def to_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """``Qwen3LM`` state-dict names → HF's (every family): ``model.`` before all but ``lm_head``. A tied model has no
    ``lm_head.weight`` (its head reads the embedding), and gets none: what ``save_pretrained`` writes for a tied
    model, which ``from_pretrained`` ties again (``config.json``'s ``tie_word_embeddings``)."""
    return {(name if name.startswith("lm_head.") else _PREFIX + name): tensor for name, tensor in state.items()}


def from_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF tensor names (every family) → ``Qwen3LM``'s (names without ``model.`` pass through).

    A tied model drops the file's ``lm_head.weight`` after checking that it is the embedding.

    Raises:
        ValueError: the model is tied but the file's ``lm_head.weight`` differs from its embedding.
    """
    out = {(name.removeprefix(_PREFIX)): tensor for name, tensor in state.items()}
    out = {name: t for name, t in out.items() if not name.startswith("rotary_emb.")}  # HF-side buffers, if saved
    head = out.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None:
        embedding = out.get("embed_tokens.weight")
        if embedding is not None and not torch.equal(head, embedding):
            raise ValueError(
                "the checkpoint's lm_head.weight differs from its embed_tokens.weight, but the model ties them "
                "(tie_word_embeddings=True); build the model with tie_word_embeddings=False to load an untied head"
            )
        del out["lm_head.weight"]
    return out
