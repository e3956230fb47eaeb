"""``Qwen3LM`` and Hugging Face's ``Qwen3ForCausalLM``: their ``config.json`` fields and tensor names.

Pure dictionaries in, dictionaries out: nothing here imports ``transformers`` or touches a file (the edge
reads and writes them: ``d9dfn export --format hf``, ``model_stage_factory.source_checkpoint``).

The two models compute the same function when their configs agree on the fields in :data:`HF_FIELDS`
(``tests/test_hf.py`` checks the logits against ``transformers``). Names differ only by HF's ``model.``
prefix on everything but ``lm_head``; HF's rotary ``inv_freq`` buffers are rebuilt from ``rope_theta`` by
HF and recomputed per call by ``Qwen3LM``, so no file carries them.

>>> from d9dfn.models import Qwen3Config
>>> hf = qwen3_to_hf_config(Qwen3Config.tiny(tie_word_embeddings=False))
>>> hf["model_type"], hf["num_hidden_layers"], hf["rope_parameters"]["rope_theta"]
('qwen3', 2, 10000.0)
>>> qwen3_from_hf_config(hf) == Qwen3Config.tiny(tie_word_embeddings=False)
True
>>> check_hf_config(Qwen3Config.tiny(), {**hf, "rms_norm_eps": 1e-5})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: the HF config.json does not match the model: rms_norm_eps is 1e-05 there but 1e-06 here; ...
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from d9dfn.models._qwen3 import Qwen3Config

__all__ = [
    "HF_FIELDS",
    "check_hf_config",
    "qwen3_from_hf_config",
    "qwen3_from_hf_state",
    "qwen3_to_hf_config",
    "qwen3_to_hf_state",
]

HF_FIELDS: Mapping[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
"""``Qwen3Config`` field → HF ``Qwen3Config`` field, for every field that changes what the model computes."""

# What transformers' Qwen3Config assumes for a field that config.json leaves out: a file that omits
# num_hidden_layers describes a 32-layer model to HF, whatever d9dfn meant (the bug this module fixes).
_HF_DEFAULTS: Mapping[str, Any] = {
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
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}

_PREFIX = "model."


def qwen3_to_hf_config(config: Qwen3Config) -> dict[str, Any]:
    """The ``config.json`` that makes ``transformers.AutoModelForCausalLM`` build the same model.

    Residual dropout (``config.dropout``) has no HF counterpart and is not carried: an exported model is for
    inference, where neither applies dropout.
    """
    hf = {hf_name: getattr(config, name) for name, hf_name in HF_FIELDS.items() if name != "rope_theta"}
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **hf,
        "max_position_embeddings": config.max_seq_len,
        # transformers 5 reads rope_parameters; 4.x read rope_theta at the top level: write both.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": config.initializer_range,
        "dtype": "float32",
    }


def _hf_value(hf: Mapping[str, Any], name: str) -> Any:
    if name == "rope_theta":
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" in rope:
            return rope["rope_theta"]
    return hf.get(name, _HF_DEFAULTS.get(name))


def _check_supported(hf: Mapping[str, Any]) -> None:
    """Refuse HF features ``Qwen3LM`` does not implement, naming the field."""
    if hf.get("model_type", "qwen3") != "qwen3":
        raise ValueError(
            f"the HF config.json has model_type={hf['model_type']!r}; Qwen3LM loads model_type 'qwen3' only "
            "(for another architecture, train the HF model itself through a model provider)"
        )
    rope = dict(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = hf.get("rope_scaling")
    if rope_type != "default" or scaling:
        raise ValueError(
            f"the HF config.json sets rope scaling ({rope_type=}, rope_scaling={scaling!r}); Qwen3LM implements "
            "the default rotary embedding only: use a checkpoint without rope scaling"
        )
    expected = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
    for name, value in expected.items():
        if _hf_value(hf, name) != value:
            raise ValueError(
                f"the HF config.json has {name}={hf[name]!r}; Qwen3LM implements {name}={value!r} only: "
                "use a checkpoint with that setting"
            )


def qwen3_from_hf_config(hf: Mapping[str, Any], **overrides: Any) -> Qwen3Config:
    """The :class:`Qwen3Config` of an HF Qwen3 ``config.json`` (HF's defaults for the fields it leaves out).

    Raises:
        ValueError: a feature ``Qwen3LM`` does not implement (another ``model_type``, rope scaling, a bias,
            sliding windows, another activation), naming the field.
    """
    _check_supported(hf)
    fields = {name: _hf_value(hf, hf_name) for name, hf_name in HF_FIELDS.items()}
    fields["rope_theta"] = float(fields["rope_theta"])
    fields["max_seq_len"] = _hf_value(hf, "max_position_embeddings")
    if "initializer_range" in hf:
        fields["initializer_range"] = hf["initializer_range"]
    return Qwen3Config(**{**fields, **overrides})


def check_hf_config(config: Qwen3Config, hf: Mapping[str, Any]) -> None:
    """Raise unless the HF ``config.json`` ``hf`` describes the model ``config`` builds.

    Compared: every field in :data:`HF_FIELDS` (floats to a relative 1e-9), and ``max_seq_len`` must not
    exceed HF's ``max_position_embeddings``. Dropout and the init scale do not change a loaded model's
    outputs and are not compared.

    Raises:
        ValueError: naming the first field that differs, both values and the fix; or an unsupported feature.
    """
    _check_supported(hf)
    for name, hf_name in HF_FIELDS.items():
        ours, theirs = getattr(config, name), _hf_value(hf, hf_name)
        same = (
            math.isclose(float(ours), float(theirs), rel_tol=1e-9)
            if isinstance(ours, float) and isinstance(theirs, int | float) and not isinstance(theirs, bool)
            else ours == theirs
        )
        if not same:
            where = "" if hf_name in hf or name == "rope_theta" else " (HF's default: the file leaves it out)"
            raise ValueError(
                f"the HF config.json does not match the model: {hf_name} is {theirs!r} there{where} but {ours!r} "
                f"here; build the model with {name}={theirs!r} (Qwen3Config), or load a checkpoint of this model"
            )
    limit = _hf_value(hf, "max_position_embeddings")
    if config.max_seq_len > limit:
        raise ValueError(
            f"the HF config.json has max_position_embeddings={limit} but the model's max_seq_len is "
            f"{config.max_seq_len}; set max_seq_len <= {limit}"
        )


def qwen3_to_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """``Qwen3LM`` state-dict names → HF's: ``model.`` before all but ``lm_head``; a tied model gets an
    ``lm_head.weight`` (the embedding) so that a strict HF load finds every name."""
    out = {(name if name.startswith("lm_head.") else _PREFIX + name): tensor for name, tensor in state.items()}
    if config.tie_word_embeddings and "lm_head.weight" not in out and _PREFIX + "embed_tokens.weight" in out:
        out["lm_head.weight"] = out[_PREFIX + "embed_tokens.weight"].clone()  # safetensors refuses shared memory
    return out


def qwen3_from_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """HF ``Qwen3ForCausalLM`` tensor names → ``Qwen3LM``'s (names without ``model.`` pass through).

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
