"""The qwen2 family: its catalogue entry (``d9dfn.models.FAMILIES["qwen2"]``)."""

from d9dfn.models.qwen2._family import QWEN2

__all__ = ["QWEN2"]
