"""The llama family: its catalogue entry (``d9dfn.models.FAMILIES["llama"]``)."""

from d9dfn.models.llama._family import LLAMA

__all__ = ["LLAMA"]
