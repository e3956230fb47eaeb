"""The qwen3 family: its catalogue entry (``d9dfn.models.FAMILIES["qwen3"]``)."""

from d9dfn.models.qwen3._family import QWEN3

__all__ = ["QWEN3"]
