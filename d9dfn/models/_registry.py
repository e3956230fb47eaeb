"""The catalogue: every model family by name (:data:`FAMILIES`), the one table that the job's ``model.family``, the
Hugging Face mapping (a ``config.json``'s ``model_type``) and ``d9dfn export --format hf`` look families up in.

Adding a family: a folder ``d9dfn/models/<name>/`` whose :class:`~d9dfn.models.Family` names its config, model,
tensor-name mapping and plan (its own where it has them: a ``qwen3_moe`` its MoE model, config, expert layouts and
plan; the shared decoder's where it is a configuration of it, as ``llama``), and its entry in the tuple below (with
its import). Nothing else names the families: the job's validation, ``from_hf_config``, ``check_hf_config``,
``to_hf_config`` and export read this table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from d9dfn.models._family import Family, HFFamily
from d9dfn.models.llama import LLAMA
from d9dfn.models.mistral import MISTRAL
from d9dfn.models.qwen2 import QWEN2
from d9dfn.models.qwen3 import QWEN3
from d9dfn.models.qwen3_moe import QWEN3_MOE

__all__ = ["FAMILIES", "HF_FAMILIES"]

FAMILIES: Mapping[str, Family[Any]] = {family.name: family for family in (QWEN3, LLAMA, MISTRAL, QWEN2, QWEN3_MOE)}
"""Family name (``model.family``, HF's ``model_type``) → its :class:`~d9dfn.models.Family`, in order of preference:
a model that several families express exports as the first (``to_hf_config``), e.g. Llama before Mistral."""


class _HFView(Mapping[str, HFFamily]):
    """Each family's Hugging Face conventions (``FAMILIES[name].hf``), read from :data:`FAMILIES` at every lookup."""

    def __getitem__(self, name: str) -> HFFamily:
        return FAMILIES[name].hf

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)

    def __repr__(self) -> str:
        return f"HF_FAMILIES({', '.join(self)})"


HF_FAMILIES: Mapping[str, HFFamily] = _HFView()
"""HF ``model_type`` → its :class:`HFFamily`: :data:`FAMILIES`' Hugging Face sides, a read-only view of it."""
