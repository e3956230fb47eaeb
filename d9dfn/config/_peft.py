"""Parameter-efficient fine-tuning from JSON (the LM job's ``trainer.peft``): a list of methods, stacked in order as
d9d's ``PeftStackConfig``, each chosen by ``method``; :func:`build_peft` turns them into
``d9dfn.models.LoRA`` / ``FullTune`` values."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Literal, assert_never

from pydantic import Field, field_validator

from d9dfn.config._base import FrozenConfig as _Config
from d9dfn.models import FullTune, LoRA, PeftMethod

__all__ = ["AnyPeftConfig", "FullTuneConfig", "LoRAConfig", "build_peft"]


def _regex(targets: str) -> str:
    try:
        re.compile(targets)
    except re.error as error:
        raise ValueError(
            f"{targets!r} is not a regular expression ({error}); give one such as 'q_proj|v_proj'"
        ) from None
    return targets


class LoRAConfig(_Config):
    """LoRA adapters on the linear maps ``targets`` matches (d9d's ``LoRAConfig``); their base weights freeze."""

    method: Literal["lora"]
    """The method kind."""
    targets: str
    """A regular expression over module names, matched (``fullmatch``) against the full name
    (``layers.0.self_attn.q_proj``) or its last part (``q_proj``): e.g. ``q_proj|k_proj|v_proj|o_proj``."""
    rank: int = Field(8, ge=1)
    """The adapters' inner dimension (PEFT's ``r``)."""
    alpha: float = Field(16.0, gt=0.0)
    """The scale's numerator: the adapter's product is multiplied by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (pure: masks come from the step's key; PEFT's ``lora_dropout``)."""

    @field_validator("targets")
    @classmethod
    def _targets_are_a_regex(cls, targets: str) -> str:
        return _regex(targets)


class FullTuneConfig(_Config):
    """Every param of the modules ``targets`` matches trains (d9d's ``FullTuneConfig``): e.g. the final norm beside
    LoRA adapters."""

    method: Literal["full"]
    """The method kind."""
    targets: str
    """A regular expression over module names (full name or last part, ``fullmatch``): e.g. ``norm|lm_head``."""

    @field_validator("targets")
    @classmethod
    def _targets_are_a_regex(cls, targets: str) -> str:
        return _regex(targets)


AnyPeftConfig = Annotated[LoRAConfig | FullTuneConfig, Field(discriminator="method")]
"""One method of ``trainer.peft``, chosen by ``method`` (``lora`` or ``full``)."""


def build_peft(configs: Sequence[LoRAConfig | FullTuneConfig]) -> tuple[PeftMethod, ...]:
    """The ``d9dfn.models`` methods ``configs`` describe, in order.

    >>> build_peft([LoRAConfig(method="lora", targets="q_proj", rank=4)])
    (LoRA(targets='q_proj', rank=4, alpha=16.0, dropout=0.0),)
    """
    methods: list[PeftMethod] = []
    for config in configs:
        match config:
            case LoRAConfig():
                methods.append(LoRA(config.targets, rank=config.rank, alpha=config.alpha, dropout=config.dropout))
            case FullTuneConfig():
                methods.append(FullTune(config.targets))
            case _:
                assert_never(config)
    return tuple(methods)
