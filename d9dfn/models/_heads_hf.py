"""Heads against Hugging Face's ``*ForSequenceClassification``: ``config.json`` fields and tensor names, both ways.

Pure dictionaries in, dictionaries out, as ``_hf.py``: the backbone's names go through the family's own mapping
(``Family.to_hf_state`` / ``from_hf_state``, which put HF's ``model.`` prefix on and off), ``score.weight`` is the
same on both sides. ``tests/test_heads.py`` checks the logits against ``transformers``, bit for bit, both ways.

>>> from d9dfn.models import Qwen3Config
>>> hf = to_hf_classifier_config(Qwen3Config.tiny(), "qwen3", num_labels=3, pad_token_id=0)
>>> hf["architectures"], hf["id2label"]["2"], hf["pad_token_id"]
(['Qwen3ForSequenceClassification'], 'LABEL_2', 0)
>>> config, num_labels, pad = from_hf_classifier_config(hf)
>>> config == Qwen3Config.tiny(), num_labels, pad
(True, 3, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9dfn.models._decoder_config import Qwen3Config
from d9dfn.models._family import Family
from d9dfn.models._hf import from_hf_config, to_hf_config
from d9dfn.models._registry import FAMILIES

__all__ = [
    "classifier_architecture",
    "classifier_from_hf_state",
    "classifier_to_hf_state",
    "from_hf_classifier_config",
    "to_hf_classifier_config",
]

_BACKBONE = "model."
_HEAD = ("score.",)


def classifier_architecture(family: Family[Any]) -> str:
    """The family's ``transformers`` classification class: its causal LM's with ``ForSequenceClassification``.

    >>> classifier_architecture(FAMILIES["llama"])
    'LlamaForSequenceClassification'
    """
    return family.hf.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"


def classifier_to_hf_state(
    state: Mapping[str, torch.Tensor], family: Family[Any], config: Any
) -> dict[str, torch.Tensor]:
    """A :class:`~d9dfn.models.SequenceClassifier`'s state-dict names → Hugging Face's: the backbone's (``model.…``)
    through the family's mapping, ``score.weight`` as it is.

    Raises:
        ValueError: a name that is neither the backbone's nor the score's.
    """
    backbone = {name.removeprefix(_BACKBONE): t for name, t in state.items() if name.startswith(_BACKBONE)}
    head = {name: t for name, t in state.items() if name.startswith(_HEAD)}
    _check_names(state, backbone, head, "classifier_to_hf_state")
    return {**family.to_hf_state(backbone, config), **head}


def classifier_from_hf_state(
    state: Mapping[str, torch.Tensor], family: Family[Any], config: Any
) -> dict[str, torch.Tensor]:
    """Hugging Face's ``*ForSequenceClassification`` names → a :class:`~d9dfn.models.SequenceClassifier`'s: the
    family's mapping under ``model.``, ``score.weight`` as it is. A causal LM's ``lm_head.weight``, if the file has
    one, is dropped (a classifier has no LM head)."""
    head = {name: t for name, t in state.items() if name.startswith(_HEAD)}
    rest = {name: t for name, t in state.items() if not name.startswith(_HEAD)}
    backbone = family.from_hf_state(rest, config)
    return {**{_BACKBONE + name: t for name, t in backbone.items() if not name.startswith("lm_head.")}, **head}


def _check_names(state: Mapping[str, Any], backbone: Mapping[str, Any], head: Mapping[str, Any], fn: str) -> None:
    if len(backbone) + len(head) != len(state):
        other = sorted(name for name in state if not name.startswith((_BACKBONE, *_HEAD)))
        raise ValueError(
            f"{fn}: {other} are neither the backbone's (model.…) nor the score's (score.weight); pass a "
            "SequenceClassifier's state dict"
        )


def to_hf_classifier_config(
    config: Qwen3Config,
    family: str | None = None,
    *,
    num_labels: int,
    pad_token_id: int | None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The ``config.json`` that makes ``transformers.AutoModelForSequenceClassification`` build the same classifier:
    the backbone's (:func:`~d9dfn.models.to_hf_config`), the family's ``*ForSequenceClassification`` class,
    ``num_labels`` classes (``id2label`` / ``label2id`` as ``LABEL_i``) and ``pad_token_id`` (its ``last`` pooling
    reads it).

    Raises:
        ValueError: as :func:`~d9dfn.models.to_hf_config`.
    """
    hf = to_hf_config(config, family, dtype=dtype)
    labels = {str(index): f"LABEL_{index}" for index in range(num_labels)}
    return {
        **hf,
        "architectures": [classifier_architecture(FAMILIES[hf["model_type"]])],
        "id2label": labels,
        "label2id": {label: int(index) for index, label in labels.items()},
        "pad_token_id": pad_token_id,
    }


def from_hf_classifier_config(hf: Mapping[str, Any], **overrides: Any) -> tuple[Qwen3Config, int, int | None]:
    """A ``*ForSequenceClassification`` ``config.json``'s backbone config (:func:`~d9dfn.models.from_hf_config`), its
    number of labels (``id2label``'s, else ``num_labels``, else transformers' default 2) and its ``pad_token_id``.

    Raises:
        ValueError: as :func:`~d9dfn.models.from_hf_config`.
    """
    config = from_hf_config(hf, **overrides)
    id2label = hf.get("id2label")
    num_labels = len(id2label) if isinstance(id2label, Mapping) else int(hf.get("num_labels", 2))
    pad = hf.get("pad_token_id")
    return config, num_labels, None if pad is None else int(pad)
