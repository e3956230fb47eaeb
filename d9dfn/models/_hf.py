"""The shared decoder (``Qwen3LM``) and Hugging Face's Llama-family decoders: their ``config.json`` fields.

Pure dictionaries in, dictionaries out: nothing here imports ``transformers`` or touches a file (the edge
reads and writes them: ``d9dfn export --format hf``, ``model_stage_factory.source_checkpoint``).

What differs between the families ``Qwen3LM`` computes exactly (``Qwen3ForCausalLM``, ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``) is each family's own :class:`HFFamily`, in its folder
(``d9dfn/models/llama/``, ...) and looked up by ``model_type`` in the catalogue (``d9dfn.models.FAMILIES``): the
class name, q/k norm, which biases, how a sliding window is switched on, and transformers' defaults for the fields
a file leaves out. What they share is written once, here: the size fields (:data:`HF_FIELDS`), the rotary
parameters, the features refused; and the tensor names, in ``_hf_state.py``. ``tests/test_hf.py`` checks the
logits of each family against ``transformers``, both ways.

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
from typing import Any

from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import HFFamily
from d9dfn.models._layers import RopeScaling
from d9dfn.models._registry import FAMILIES

__all__ = ["HF_FIELDS", "check_hf_config", "from_hf_config", "to_hf_config"]

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


_ROPE_TYPES = ("default", "linear", "llama3")

Fix = Callable[[str, Any], str]
"""How to set a ``Qwen3Config`` field to a value, in the caller's words (a job says ``--set model.…``)."""


def _python_fix(name: str, value: Any) -> str:
    return f"build the model with {name}={value!r} (Qwen3Config)"


def _family(hf: Mapping[str, Any]) -> tuple[str, HFFamily]:
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(
            f"the HF config.json has model_type={model_type!r}; d9dfn loads model_type {', '.join(FAMILIES)} "
            "only (for another architecture, train the HF model itself through a model provider)"
        )
    return model_type, FAMILIES[model_type].hf


def _extra_value(hf: Mapping[str, Any], names: tuple[str, ...], family: HFFamily) -> Any:
    """A family field's value in the file (the first of its names there), else transformers' default; a JSON list
    becomes a tuple (``mlp_only_layers``)."""
    value = next((hf[name] for name in names if hf.get(name) is not None), family.defaults.get(names[0]))
    return tuple(value) if isinstance(value, list) else value


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


def _switches(config: Qwen3Config, family: HFFamily) -> tuple[dict[str, bool], dict[str, bool]]:
    """The switches ``family`` builds for ``config`` (with its ``attention_bias`` where it has one); the model's."""
    expressed = family.switches(config.qkv_bias)
    return expressed, {name: getattr(config, name) for name in expressed}


def _family_of(config: Qwen3Config) -> str | None:
    """The first family of the catalogue that expresses ``config``'s switches, ``None`` when none does."""
    for name, family in FAMILIES.items():
        expressed, wanted = _switches(config, family.hf)
        if expressed == wanted and type(config) is family.config_type:
            return name
    return None


def to_hf_config(
    config: Qwen3Config,
    family: str | None = None,
    *,
    source: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` that makes ``transformers.AutoModelForCausalLM`` build the same model.

    Residual dropout (``config.dropout``) has no HF counterpart and is not carried: an exported model is for
    inference, where neither applies dropout.

    A model built from a Hugging Face ``config.json`` (``from_hf_config``) is written back as that file, ``source``:
    every field as it was (``max_position_embeddings``, rope, ``tie_word_embeddings``, token ids, fields d9dfn does
    not read) but ``dtype`` (and transformers 4's ``torch_dtype``), which the exported tensors define. Without it
    the file is built from ``config``, whose ``max_seq_len`` (the sequences trained on) becomes
    ``max_position_embeddings``.

    Args:
        config: the model.
        family: a family of the catalogue (``d9dfn.models.FAMILIES``); ``None``: the first one that expresses
            the model's switches (``qwen3`` with q/k norm, ``qwen2`` for q/k/v biases without an o bias, else
            ``llama``); with ``source``, its ``model_type``.
        source: the ``config.json`` the model was built from; it must describe ``config`` (``check_hf_config``).
        dtype: the exported tensors' dtype (``"float32"``, ``"bfloat16"``).

    Raises:
        ValueError: an unknown family, or one that cannot express the model (e.g. ``mistral`` with q/k norm); a
            ``source`` of another family or that describes another model (naming the field).

    >>> source = {**to_hf_config(Qwen3Config.tiny()), "max_position_embeddings": 512, "bos_token_id": 1}
    >>> back = to_hf_config(from_hf_config(source, max_seq_len=32), source=source)
    >>> back["max_position_embeddings"], back["bos_token_id"], back == source
    (512, 1, True)
    """
    if source is not None:
        if family is not None and source.get("model_type") != family:
            raise ValueError(
                f"to_hf_config: the source config.json has model_type={source.get('model_type')!r}, not "
                f"family={family!r}; pass the family it names, or family=None"
            )
        check_hf_config(config, source)
        out = {**source, "dtype": dtype}
        if "torch_dtype" in source:
            out["torch_dtype"] = dtype
        return out
    default = _family_of(config)
    no_family = (
        "no family of d9dfn.models.FAMILIES builds it; export d9dfn's format instead (d9dfn export --format d9dfn)"
    )
    if family is None:
        if default is None:
            switches = {name: getattr(config, name) for name in ("qk_norm", "qkv_bias", "o_proj_bias")}
            raise ValueError(f"to_hf_config: the model has {switches}; {no_family}")
        family = default
    if family not in FAMILIES:
        raise ValueError(f"to_hf_config: family={family!r}; choose one of {', '.join(FAMILIES)}")
    spec = FAMILIES[family].hf
    if type(config) is not FAMILIES[family].config_type:
        fix = f"export it as family={default!r}" if default else no_family
        raise ValueError(
            f"to_hf_config: family={family!r} builds a {FAMILIES[family].config_type.__name__}, the model is a "
            f"{type(config).__name__}; {fix}"
        )
    for name, value in spec.implements.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"to_hf_config: the model has {name}={getattr(config, name)!r}, which {spec.architecture} does not "
                f"implement (only {value!r}); export d9dfn's format instead (d9dfn export --format d9dfn)"
            )
    hf: dict[str, Any] = {"architectures": [spec.architecture], "model_type": family}
    hf.update({names[0]: _json(getattr(config, name)) for name, names in spec.fields.items()})
    hf.update({hf_name: getattr(config, name) for name, hf_name in HF_FIELDS.items() if name != "rope_theta"})
    if spec.bias == "attention_bias":
        hf["attention_bias"] = config.qkv_bias
    expressed, wanted = _switches(config, spec)
    if wanted != expressed:
        fix = f"export it as family={default!r}" if default else no_family
        raise ValueError(f"to_hf_config: {spec.architecture} builds {expressed} but the model has {wanted}; {fix}")
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
            "dtype": dtype,
        }
    )
    if config.rope_scaling is not None:
        hf["rope_scaling"] = rope
    hf.update(spec.fixed)
    if spec.window == "use_sliding_window":
        hf["use_sliding_window"] = False
    elif spec.window == "sliding_window":
        hf["sliding_window"] = None
    return hf


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def from_hf_config(hf: Mapping[str, Any], **overrides: Any) -> Qwen3Config:
    """The :class:`Qwen3Config` of an HF ``config.json`` of a family in ``d9dfn.models.FAMILIES``, built by that
    family's config builder (transformers' defaults for the fields the file leaves out; ``max_seq_len`` is its
    ``max_position_embeddings`` unless overridden).

    Raises:
        ValueError: a feature ``Qwen3LM`` does not implement, naming the field: another ``model_type``, a rope type
            other than default, linear and llama3, a partial rotary embedding, an MLP bias, another activation,
            or a sliding window shorter than ``max_seq_len`` (pass ``max_seq_len`` at most the window).
    """
    model_type, family = _check_supported(hf)
    fields = {name: _hf_value(hf, hf_name, family) for name, hf_name in HF_FIELDS.items()}
    fields["rope_theta"] = float(fields["rope_theta"])
    fields["max_seq_len"] = _hf_value(hf, "max_position_embeddings", family)
    fields.update(_architecture(hf, family))
    fields.update({name: _extra_value(hf, names, family) for name, names in family.fields.items()})
    if "initializer_range" in hf:
        fields["initializer_range"] = hf["initializer_range"]
    config: Qwen3Config = FAMILIES[model_type].config(**{**fields, **overrides})
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
    described += [(name, names[0], _extra_value(hf, names, family)) for name, names in family.fields.items()]
    if type(config) is not FAMILIES[model_type].config_type:
        raise ValueError(
            f"the HF config.json is a {family.architecture} (model_type {model_type!r}), which is a "
            f"{FAMILIES[model_type].config_type.__name__}, but the model is a {type(config).__name__}; "
            f"{fix('family', model_type)}, or load a checkpoint of this model"
        )
    for name, hf_name, theirs in described:
        ours = getattr(config, name)
        if _same(ours, theirs):
            continue
        if name in HF_FIELDS or name in family.fields:
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
