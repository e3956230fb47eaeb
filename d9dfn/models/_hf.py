"""``Qwen3LM`` and Hugging Face's Llama-family decoders: their ``config.json`` fields and tensor names.

Pure dictionaries in, dictionaries out: nothing here imports ``transformers`` or touches a file (the edge
reads and writes them: ``d9dfn export --format hf``, ``model_stage_factory.source_checkpoint``).

One table, :data:`HF_FAMILIES`, owns what differs between the families ``Qwen3LM`` computes exactly
(``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``): the class name,
q/k norm, which biases, how a sliding window is switched on, and transformers' defaults for the fields a
file leaves out. What they share is written once: the size fields (:data:`HF_FIELDS`), the rotary
parameters, and the tensor names, which differ from ``Qwen3LM``'s only by HF's ``model.`` prefix on
everything but ``lm_head`` (HF's rotary ``inv_freq`` buffers are rebuilt from the config by HF and
recomputed per call by ``Qwen3LM``, so no file carries them). ``tests/test_hf.py`` checks the logits of each
family against ``transformers``, both ways.

>>> from d9dfn.models import Qwen3Config
>>> hf = to_hf_config(Qwen3Config.tiny(tie_word_embeddings=False))
>>> hf["architectures"], hf["num_hidden_layers"], hf["rope_parameters"]["rope_theta"]
(['Qwen3ForCausalLM'], 2, 10000.0)
>>> from_hf_config(hf) == Qwen3Config.tiny(tie_word_embeddings=False)
True
>>> from_hf_config({**hf, "model_type": "llama"}).qk_norm
False
>>> check_hf_config(Qwen3Config.tiny(), {**hf, "rms_norm_eps": 1e-5})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: the HF config.json does not match the model: rms_norm_eps is 1e-05 there but 1e-06 here; ...
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from d9dfn.models._layers import RopeScaling
from d9dfn.models._decoder_config import Qwen3Config

__all__ = [
    "HF_FAMILIES",
    "HF_FIELDS",
    "HFFamily",
    "check_hf_config",
    "from_hf_config",
    "from_hf_state",
    "to_hf_config",
    "to_hf_state",
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
"""``Qwen3Config`` field → HF config field, for every size field that changes what the model computes (the same in
every family; the architecture switches ``qk_norm``, ``qkv_bias``, ``o_proj_bias`` and ``rope_scaling`` follow
from the family and ``rope_parameters``)."""

_ARCHITECTURE_FIELDS = ("qk_norm", "qkv_bias", "o_proj_bias", "rope_scaling")


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """What one Hugging Face decoder family adds to the shared fields: ``Qwen3LM`` computes it exactly.

    Attributes:
        architecture: the ``transformers`` class (``config.json``'s ``architectures``).
        qk_norm: per-head RMSNorm on queries and keys (``Qwen3Config.qk_norm``).
        bias: ``"attention_bias"``: that flag puts biases on q, k, v and o (``qkv_bias`` and ``o_proj_bias``);
            ``"qkv"``: q, k and v always have one, o never (Qwen2); ``"none"``: no bias (Mistral).
        window: how a sliding window is switched on: ``"use_sliding_window"`` (that flag, for the layers from
            ``max_window_layers`` or those ``layer_types`` names), ``"sliding_window"`` (on unless null), ``"none"``.
        defaults: what ``transformers`` assumes for a field ``config.json`` leaves out; ``head_dim`` and
            ``num_key_value_heads`` missing here are derived (``hidden_size // num_attention_heads`` and
            ``num_attention_heads``).
    """

    architecture: str
    qk_norm: bool
    bias: Literal["attention_bias", "qkv", "none"]
    window: Literal["use_sliding_window", "sliding_window", "none"]
    defaults: Mapping[str, Any]

    def switches(self, attention_bias: bool = False) -> dict[str, bool]:
        """The ``Qwen3Config`` switches this family builds (``attention_bias``: the file's flag, where it has one).

        >>> HF_FAMILIES["qwen2"].switches()
        {'qk_norm': False, 'qkv_bias': True, 'o_proj_bias': False}
        """
        qkv, o = (attention_bias, attention_bias) if self.bias == "attention_bias" else (self.bias == "qkv", False)
        return {"qk_norm": self.qk_norm, "qkv_bias": qkv, "o_proj_bias": o}


# transformers 5's defaults (tests/test_hf.py compares them with its config classes): a file that omits
# num_hidden_layers describes a 32-layer model to HF, whatever d9dfn meant.
_SHARED_DEFAULTS: Mapping[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_QWEN_DEFAULTS: Mapping[str, Any] = {
    **_SHARED_DEFAULTS,
    "vocab_size": 151_936,
    "intermediate_size": 22_016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32_768,
    "sliding_window": 4096,
    "max_window_layers": 28,
}

HF_FAMILIES: Mapping[str, HFFamily] = {
    "qwen3": HFFamily(
        architecture="Qwen3ForCausalLM",
        qk_norm=True,
        bias="attention_bias",
        window="use_sliding_window",
        defaults={**_QWEN_DEFAULTS, "head_dim": 128},
    ),
    "llama": HFFamily(
        architecture="LlamaForCausalLM",
        qk_norm=False,
        bias="attention_bias",
        window="none",
        defaults={
            **_SHARED_DEFAULTS,
            "vocab_size": 32_000,
            "intermediate_size": 11_008,
            "max_position_embeddings": 2048,
        },
    ),
    "mistral": HFFamily(
        architecture="MistralForCausalLM",
        qk_norm=False,
        bias="none",
        window="sliding_window",
        defaults={
            **_SHARED_DEFAULTS,
            "vocab_size": 32_000,
            "intermediate_size": 14_336,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131_072,
            "sliding_window": 4096,
        },
    ),
    "qwen2": HFFamily(
        architecture="Qwen2ForCausalLM", qk_norm=False, bias="qkv", window="use_sliding_window", defaults=_QWEN_DEFAULTS
    ),
}
"""HF ``model_type`` → its :class:`HFFamily`: the decoders that load into and export from ``Qwen3LM``."""

_PREFIX = "model."
_ROPE_TYPES = ("default", "linear", "llama3")

Fix = Callable[[str, Any], str]
"""How to set a ``Qwen3Config`` field to a value, in the caller's words (a job says ``--set model.…``)."""


def _python_fix(name: str, value: Any) -> str:
    return f"build the model with {name}={value!r} (Qwen3Config)"


def _family(hf: Mapping[str, Any]) -> tuple[str, HFFamily]:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_FAMILIES:
        raise ValueError(
            f"the HF config.json has model_type={model_type!r}; Qwen3LM loads model_type {', '.join(HF_FAMILIES)} "
            "only (for another architecture, train the HF model itself through a model provider)"
        )
    return model_type, HF_FAMILIES[model_type]


def _hf_value(hf: Mapping[str, Any], name: str, family: HFFamily) -> Any:
    if name == "rope_theta":
        return _rope_parameters(hf).get("rope_theta", hf.get("rope_theta", family.defaults["rope_theta"]))
    value = hf.get(name)
    if value is None:
        value = family.defaults.get(name)
    if value is None and name == "head_dim":
        value = _hf_value(hf, "hidden_size", family) // _hf_value(hf, "num_attention_heads", family)
    if value is None and name == "num_key_value_heads":
        value = _hf_value(hf, "num_attention_heads", family)
    return value


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 takes a 4.x-style rope_scaling over rope_parameters, rope_theta from either or the top level.
    return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})


def _rope_scaling(hf: Mapping[str, Any], family: HFFamily) -> RopeScaling | None:
    """The file's rope scaling, or a refusal naming what ``Qwen3LM`` does not implement."""
    rope = _rope_parameters(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"the HF config.json sets rope_type={kind!r} (rope_parameters={rope!r}); Qwen3LM implements "
            f"{', '.join(_ROPE_TYPES)} rotary embeddings only: use a checkpoint with one of those"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"the HF config.json sets partial_rotary_factor={rope['partial_rotary_factor']!r}; Qwen3LM rotates the "
            "whole head (1.0) only: use a checkpoint without a partial rotary embedding"
        )
    if kind == "default":
        return None
    # transformers' own default: pretraining's context is max_position_embeddings when the file does not say.
    rope.setdefault("original_max_position_embeddings", _hf_value(hf, "max_position_embeddings", family))
    fields = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [name for name in fields if name not in rope]
    if missing:
        raise ValueError(
            f"the HF config.json sets rope_type={kind!r} without {', '.join(missing)} (rope_parameters={rope!r}); "
            "transformers needs them too: complete rope_parameters"
        )
    if kind == "linear":
        return RopeScaling("linear", rope["factor"])
    return RopeScaling(
        "llama3",
        rope["factor"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    )


def _sliding_window(hf: Mapping[str, Any], family: HFFamily) -> int | None:
    """The window HF's attention would use on some layer, ``None`` when every layer attends to all positions."""
    if family.window == "none":
        return None
    window: int | None = hf["sliding_window"] if "sliding_window" in hf else family.defaults["sliding_window"]
    if family.window == "sliding_window" or window is None:
        return window
    if not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    first = _hf_value(hf, "max_window_layers", family)  # layers from max_window_layers on slide
    return window if first < _hf_value(hf, "num_hidden_layers", family) else None


def _check_supported(hf: Mapping[str, Any]) -> tuple[str, HFFamily]:
    """The file's family; refuse HF features ``Qwen3LM`` does not implement, naming the field."""
    model_type, family = _family(hf)
    for name, value in {"hidden_act": "silu", "mlp_bias": False}.items():
        found = hf.get(name, value)
        if found != value:
            raise ValueError(
                f"the HF config.json has {name}={found!r}; Qwen3LM implements {name}={value!r} only: "
                "use a checkpoint with that setting"
            )
    _rope_scaling(hf, family)
    return model_type, family


def _architecture(hf: Mapping[str, Any], family: HFFamily) -> dict[str, Any]:
    """The ``Qwen3Config`` switches and rope scaling an HF ``config.json`` describes."""
    return {**family.switches(bool(hf.get("attention_bias", False))), "rope_scaling": _rope_scaling(hf, family)}


def _check_window(config: Qwen3Config, hf: Mapping[str, Any], family: HFFamily, fix: Fix) -> None:
    window = _sliding_window(hf, family)
    if window is not None and window < config.max_seq_len:
        raise ValueError(
            f"the HF config.json sets sliding_window={window} ({family.architecture} attends to the last {window} "
            f"positions only) but the model's max_seq_len is {config.max_seq_len}; Qwen3LM has no sliding window, "
            f"and the two agree on sequences of at most {window}: {fix('max_seq_len', window)}"
        )


def _family_of(config: Qwen3Config) -> str:
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias and not config.o_proj_bias else "llama"


def to_hf_config(config: Qwen3Config, family: str | None = None) -> dict[str, Any]:
    """The ``config.json`` that makes ``transformers.AutoModelForCausalLM`` build the same model.

    Residual dropout (``config.dropout``) has no HF counterpart and is not carried: an exported model is for
    inference, where neither applies dropout.

    Args:
        config: the model.
        family: an :data:`HF_FAMILIES` key; ``None``: ``qwen3`` with q/k norm, else ``qwen2`` for q/k/v biases
            without an o bias, else ``llama``.

    Raises:
        ValueError: an unknown family, or one that cannot express the model (e.g. ``mistral`` with q/k norm).
    """
    family = _family_of(config) if family is None else family
    if family not in HF_FAMILIES:
        raise ValueError(f"to_hf_config: family={family!r}; choose one of {', '.join(HF_FAMILIES)}")
    spec = HF_FAMILIES[family]
    hf: dict[str, Any] = {"architectures": [spec.architecture], "model_type": family}
    hf.update({hf_name: getattr(config, name) for name, hf_name in HF_FIELDS.items() if name != "rope_theta"})
    if spec.bias == "attention_bias":
        hf["attention_bias"] = config.qkv_bias
    expressed = spec.switches(config.qkv_bias)
    wanted = {name: getattr(config, name) for name in expressed}
    if wanted != expressed:
        raise ValueError(
            f"to_hf_config: {spec.architecture} builds {expressed} but the model has {wanted}; export it as family="
            f"{_family_of(config)!r}"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling is not None:
        scaling = {k: v for k, v in dataclasses.asdict(config.rope_scaling).items() if v is not None}
        rope = {**rope, "rope_type": scaling.pop("kind"), **scaling}
    hf.update(
        {
            "max_position_embeddings": config.max_seq_len,
            # transformers 5 reads rope_parameters; 4.x read rope_theta and rope_scaling at the top level: write all.
            "rope_parameters": rope,
            "rope_theta": rope["rope_theta"],
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": config.initializer_range,
            "dtype": "float32",
        }
    )
    if config.rope_scaling is not None:
        hf["rope_scaling"] = rope
    if family == "llama":
        hf["mlp_bias"] = False
    if spec.window == "use_sliding_window":
        hf["use_sliding_window"] = False
    elif spec.window == "sliding_window":
        hf["sliding_window"] = None
    return hf


def from_hf_config(hf: Mapping[str, Any], **overrides: Any) -> Qwen3Config:
    """The :class:`Qwen3Config` of an HF ``config.json`` of a family in :data:`HF_FAMILIES` (transformers' defaults
    for the fields it leaves out; ``max_seq_len`` is its ``max_position_embeddings`` unless overridden).

    Raises:
        ValueError: a feature ``Qwen3LM`` does not implement, naming the field: another ``model_type``, a rope type
            other than default, linear and llama3, a partial rotary embedding, an MLP bias, another activation,
            or a sliding window shorter than ``max_seq_len`` (pass ``max_seq_len`` at most the window).
    """
    _, family = _check_supported(hf)
    fields = {name: _hf_value(hf, hf_name, family) for name, hf_name in HF_FIELDS.items()}
    fields["rope_theta"] = float(fields["rope_theta"])
    fields["max_seq_len"] = _hf_value(hf, "max_position_embeddings", family)
    fields.update(_architecture(hf, family))
    if "initializer_range" in hf:
        fields["initializer_range"] = hf["initializer_range"]
    config = Qwen3Config(**{**fields, **overrides})
    _check_window(config, hf, family, lambda name, value: f"pass {name}={value} (from_hf_config(hf, {name}=...))")
    return config


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) and isinstance(theirs, int | float) and not isinstance(theirs, bool):
        return math.isclose(ours, float(theirs), rel_tol=1e-9)
    return bool(ours == theirs)


def check_hf_config(config: Qwen3Config, hf: Mapping[str, Any], *, fix: Fix | None = None) -> None:
    """Raise unless the HF ``config.json`` ``hf`` describes the model ``config`` builds.

    Compared: every field in :data:`HF_FIELDS` (floats to a relative 1e-9), the family's architecture (q/k norm,
    biases) and the rope scaling; ``max_seq_len`` must not exceed HF's ``max_position_embeddings`` nor a sliding
    window. Dropout and the init scale do not change a loaded model's outputs and are not compared.

    Args:
        config: the model.
        hf: the parsed ``config.json``.
        fix: how the message tells the caller to set a field (given its name and the value that matches the
            file); by default ``build the model with name=value (Qwen3Config)``.

    Raises:
        ValueError: naming the first field that differs, both values and the fix; or an unsupported feature.
    """
    fix = fix or _python_fix
    model_type, family = _check_supported(hf)
    architecture = _architecture(hf, family)
    described: list[tuple[str, str, Any]] = [
        (name, hf_name, _hf_value(hf, hf_name, family)) for name, hf_name in HF_FIELDS.items()
    ]
    described += [(name, name, architecture[name]) for name in _ARCHITECTURE_FIELDS]
    for name, hf_name, theirs in described:
        ours = getattr(config, name)
        if _same(ours, theirs):
            continue
        if name in HF_FIELDS:
            where = "" if hf_name in hf or name == "rope_theta" else " (HF's default: the file leaves it out)"
        elif name == "rope_scaling":
            where = f" (rope_parameters={_rope_parameters(hf) or None})"
        elif name != "qk_norm" and family.bias == "attention_bias":
            where = f" (attention_bias={hf.get('attention_bias', False)!r})"
        else:
            where = f" (model_type {model_type!r})"
        raise ValueError(
            f"the HF config.json does not match the model: {hf_name} is {theirs!r} there{where} but {ours!r} "
            f"here; {fix(name, theirs)}, or load a checkpoint of this model"
        )
    limit = _hf_value(hf, "max_position_embeddings", family)
    if config.max_seq_len > limit:
        raise ValueError(
            f"the HF config.json has max_position_embeddings={limit} but the model's max_seq_len is "
            f"{config.max_seq_len}; at most {limit}: {fix('max_seq_len', limit)}"
        )
    _check_window(config, hf, family, fix)


def to_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3Config) -> dict[str, torch.Tensor]:
    """``Qwen3LM`` state-dict names → HF's (every family): ``model.`` before all but ``lm_head``; a tied model
    gets an ``lm_head.weight`` (the embedding) so that a strict HF load finds every name."""
    out = {(name if name.startswith("lm_head.") else _PREFIX + name): tensor for name, tensor in state.items()}
    if config.tie_word_embeddings and "lm_head.weight" not in out and _PREFIX + "embed_tokens.weight" in out:
        out["lm_head.weight"] = out[_PREFIX + "embed_tokens.weight"].clone()  # safetensors refuses shared memory
    return out


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
