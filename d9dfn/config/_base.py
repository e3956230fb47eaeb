"""The base every loop config shares, and the one error type config mistakes become."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "FrozenConfig"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path, the problem and the fix."""


class FrozenConfig(BaseModel):
    """Shared settings: frozen, unknown keys rejected, field docstrings become descriptions."""

    # coerce_numbers_to_str: `--set run.name=123` parses 123 as JSON; a name field should still take it.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)
