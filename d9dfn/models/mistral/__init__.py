"""The mistral family: its catalogue entry (``d9dfn.models.FAMILIES["mistral"]``)."""

from d9dfn.models.mistral._family import MISTRAL

__all__ = ["MISTRAL"]
