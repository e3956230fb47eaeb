"""The catalogue's vocabulary: a model family as a value (:class:`Family`), its Hugging Face side (:class:`HFFamily`)
and its plan (:data:`Plan`: the logical dimensions of every parameter, which :func:`logical_dims` reads).

A family is what ``model.family`` names: how its config is built, which module it builds, how its ``config.json``
and tensor names map to Hugging Face's, and its plan. Each family's value lives in a folder of its own
(``d9dfn/models/qwen3/``, ``llama/``, ...), and ``d9dfn/models/_registry.py`` lists them by name: the job, the
Hugging Face mapping and ``d9dfn export`` look a family up there and read nothing else of it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, TypeAlias, TypeVar

import torch
from torch import nn

from d9dfn._types import PipelineStageInfo
from d9dfn.models._decoder_config import Qwen3Config

__all__ = ["Family", "HFFamily", "Plan", "StateMap", "logical_dims", "summed_dims"]

ConfigT = TypeVar("ConfigT")

Plan: TypeAlias = Mapping[str, tuple[str, ...]]
"""Parameter-name pattern → the logical dimension of each of the tensor's dimensions, in order.

Patterns are ``fnmatch`` globs over the full parameter names (``layers.*.mlp.up_proj.weight``: ``*`` stands for a
layer index); every parameter of the family's model matches exactly one pattern (:func:`logical_dims` checks it).
Logical dimensions name what a dimension holds (``"vocab"``, ``"embed"``, ``"heads"``, ``"kv_heads"``,
``"head_dim"``, ``"mlp"``), never a mesh axis: a parallel plan maps them to mesh axes by a rules table (MaxText's
and Flax's logical axis rules; ``docs/architecture.md``), so one family's plan serves every layout."""

StateMap: TypeAlias = Callable[[Mapping[str, torch.Tensor], ConfigT], dict[str, torch.Tensor]]
"""``(state, config) -> state``: a state dict's tensor names (and, where a layout differs, its tensors) mapped to
another naming, e.g. the family's names to Hugging Face's."""


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """A Hugging Face decoder family's ``config.json`` conventions: its class, switches, window rule and defaults.

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
        fixed: fields that only this family's ``config.json`` has, at the one value ``Qwen3LM`` implements, which
            an export writes (Llama's ``mlp_bias=False``).
        fields: the family's config fields beyond the shared decoder's (``HF_FIELDS``) → their ``config.json``
            names: the first is written, any is read (``num_experts`` or transformers 5's ``num_local_experts``).
        implements: the family's config fields at the only value its Hugging Face class implements; a model with
            another value has no Hugging Face export (a Qwen3-MoE with a shared expert).
    """

    architecture: str
    qk_norm: bool
    bias: Literal["attention_bias", "qkv", "none"]
    window: Literal["use_sliding_window", "sliding_window", "none"]
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fields: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    implements: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def switches(self, attention_bias: bool = False) -> dict[str, bool]:
        """The ``Qwen3Config`` switches this family builds (``attention_bias``: the file's flag, where it has one).

        >>> from d9dfn.models import HF_FAMILIES
        >>> HF_FAMILIES["qwen2"].switches()
        {'qk_norm': False, 'qkv_bias': True, 'o_proj_bias': False}
        """
        qkv, o = (attention_bias, attention_bias) if self.bias == "attention_bias" else (self.bias == "qkv", False)
        return {"qk_norm": self.qk_norm, "qkv_bias": qkv, "o_proj_bias": o}


@dataclasses.dataclass(frozen=True)
class Family(Generic[ConfigT]):
    """One model family of the catalogue: all that the job, the Hugging Face mapping and export read by its name.

    Attributes:
        name: the family's name: ``model.family`` in a job, ``model_type`` in a Hugging Face ``config.json``.
        hf: its Hugging Face ``config.json`` conventions (class name, switches, window rule, defaults).
        config: ``config(**fields)`` builds the family's config from keyword fields (for the shared decoder,
            :class:`~d9dfn.models.Qwen3Config`'s); the family's own switches come first, so a field passed
            overrides one (a Llama with ``attention_bias``).
        model: ``model(config, stage)`` builds the module: pipeline stage ``stage`` of it, or all of it for
            ``None``.
        to_hf_state: the model's state dict → Hugging Face's tensor names (``d9dfn export --format hf``).
        from_hf_state: a Hugging Face state dict → the model's names (a source checkpoint).
        plan: the logical dimensions of every parameter of the model (:data:`Plan`).
        sums_over: parameter-name pattern → the logical dimensions a parameter is applied across without having them
            (a per-head norm's weight, applied to every head): its gradient sums over them, so a layout that splits
            one of them for compute leaves each rank's gradient partial there (``d9dfn.parallel.make_plan``'s
            ``sums_over``; :func:`summed_dims` reads it). Empty: every parameter's gradient sums over its own
            dimensions and the tokens only.
        config_type: the class ``config`` builds (``Qwen3Config`` for the shared decoder's families): a model's
            config type picks the families that can express it.
        backbone: ``backbone(config)`` builds the model without its LM head, mapping ``input_ids`` to the final
            hidden states ``{"hidden_states": (B, T, hidden_size)}``, with the model's parameter names (Hugging
            Face's ``*Model``): what a head (``d9dfn.models.SequenceClassifier``) sits on; ``None``: the family has
            no heads.

    >>> from d9dfn.models import FAMILIES
    >>> llama = FAMILIES["llama"]
    >>> llama.hf.architecture, llama.config(hidden_size=64).qk_norm
    ('LlamaForCausalLM', False)
    """

    name: str
    hf: HFFamily
    config: Callable[..., ConfigT]
    model: Callable[[ConfigT, PipelineStageInfo | None], nn.Module]
    to_hf_state: StateMap[ConfigT]
    from_hf_state: StateMap[ConfigT]
    plan: Plan
    backbone: Callable[[ConfigT], nn.Module] | None = None
    config_type: type = Qwen3Config
    sums_over: Plan = dataclasses.field(default_factory=dict)


def logical_dims(plan: Plan, params: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """Each parameter's logical dimensions: those of the one pattern of ``plan`` its name matches.

    Args:
        plan: a family's plan.
        params: the model's parameters by full name (``dict(model.named_parameters())``; meta tensors do).

    Returns:
        Parameter name → one logical dimension per tensor dimension.

    Raises:
        ValueError: a parameter that no pattern or several match, or that has another number of dimensions
            than its pattern names.

    >>> plan = {"embed_tokens.weight": ("vocab", "embed"), "layers.*.norm.weight": ("embed",)}
    >>> logical_dims(plan, {"embed_tokens.weight": torch.empty(4, 2), "layers.0.norm.weight": torch.empty(2)})
    {'embed_tokens.weight': ('vocab', 'embed'), 'layers.0.norm.weight': ('embed',)}
    >>> logical_dims(plan, {"lm_head.weight": torch.empty(4, 2)})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: logical_dims: parameter 'lm_head.weight' matches no pattern of the plan; add one ...
    """
    dims: dict[str, tuple[str, ...]] = {}
    for name, param in params.items():
        matched = [pattern for pattern in plan if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"logical_dims: parameter {name!r} matches no pattern of the plan; add one (pattern -> one logical "
                "dimension per tensor dimension) to the family's plan"
            )
        if len(matched) > 1:
            raise ValueError(
                f"logical_dims: parameter {name!r} matches {len(matched)} patterns of the plan "
                f"({', '.join(map(repr, matched))}); make the family's plan's patterns match it once"
            )
        named = plan[matched[0]]
        if len(named) != param.ndim:
            raise ValueError(
                f"logical_dims: parameter {name!r} has {param.ndim} dimensions (shape {tuple(param.shape)}) but "
                f"its pattern {matched[0]!r} names {len(named)}: {named}; give the pattern one logical dimension "
                "per tensor dimension"
            )
        dims[name] = named
    return dims


def summed_dims(sums_over: Plan, params: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    """The logical dimensions each parameter's gradient sums over beyond its own (a family's ``sums_over``): those of
    the patterns its name matches, for the parameters some pattern matches.

    >>> summed_dims({"*.q_norm.weight": ("heads",)}, {"a.q_norm.weight": torch.empty(4), "a.o.weight": torch.empty(4)})
    {'a.q_norm.weight': ('heads',)}
    """
    out: dict[str, tuple[str, ...]] = {}
    for name in params:
        dims = [dim for pattern, named in sums_over.items() if fnmatch.fnmatchcase(name, pattern) for dim in named]
        if dims:
            out[name] = tuple(dims)
    return out
