"""Qwen3-MoE tensor names against Hugging Face's, in both expert layouts.

d9dfn's names are transformers 5's without the ``model.`` prefix: the fused layout, ``mlp.experts.gate_up_proj``
(E, 2I, H) (the gate's rows, then the up projection's) and ``mlp.experts.down_proj`` (E, H, I). transformers 4 saved
one module per expert, ``mlp.experts.<e>.{gate,up,down}_proj.weight`` ((I, H), (I, H), (H, I)): :func:`from_hf_state`
reads either (per layer, by the names it finds), :func:`to_hf_state` writes the fused one unless asked.

>>> import torch
>>> from d9dfn.models.qwen3_moe import Qwen3MoeConfig
>>> config = Qwen3MoeConfig.tiny()
>>> state = {"layers.0.mlp.experts.gate_up_proj": torch.randn(4, 64, 16), "layers.0.mlp.experts.down_proj":
...          torch.randn(4, 16, 32)}
>>> v4 = to_hf_state(state, config, layout="per_expert")
>>> sorted(v4)[:2]
['model.layers.0.mlp.experts.0.down_proj.weight', 'model.layers.0.mlp.experts.0.gate_proj.weight']
>>> v4["model.layers.0.mlp.experts.3.gate_proj.weight"].shape
torch.Size([32, 16])
>>> back = from_hf_state(v4, config)
>>> all(torch.equal(back[name], state[name]) for name in state)
True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

import torch

from d9dfn.models._hf_state import from_hf_state as decoder_from_hf_state
from d9dfn.models._hf_state import to_hf_state as decoder_to_hf_state
from d9dfn.models.qwen3_moe._config import Qwen3MoeConfig

__all__ = ["ExpertLayout", "from_hf_state", "to_hf_state"]

ExpertLayout = Literal["fused", "per_expert"]
"""How a Hugging Face folder stores the experts: transformers 5's ``fused`` tensors, or transformers 4's
``per_expert`` modules."""

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def to_hf_state(
    state: Mapping[str, torch.Tensor], config: Qwen3MoeConfig, layout: ExpertLayout = "fused"
) -> dict[str, torch.Tensor]:
    """``Qwen3MoeLM`` names → Hugging Face's: ``model.`` before all but ``lm_head`` (as the dense families), the
    experts fused (transformers 5) or one module per expert (``layout="per_expert"``, transformers 4)."""
    out = decoder_to_hf_state(state, config)
    if layout == "fused":
        return out
    split: dict[str, torch.Tensor] = {}
    for name, tensor in out.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for index, fused in enumerate(tensor.unbind(0)):  # (2I, H) -> gate (I, H), up (I, H)
                gate, up = fused.chunk(2, dim=0)
                split[f"{prefix}.{index}.gate_proj.weight"] = gate.contiguous()
                split[f"{prefix}.{index}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            split.update(
                {f"{prefix}.{i}.down_proj.weight": down.contiguous() for i, down in enumerate(tensor.unbind(0))}
            )
        else:
            split[name] = tensor
    return split


def from_hf_state(state: Mapping[str, torch.Tensor], config: Qwen3MoeConfig) -> dict[str, torch.Tensor]:
    """Hugging Face names (either expert layout) → ``Qwen3MoeLM``'s.

    Raises:
        ValueError: a layer whose per-expert tensors do not number ``num_experts`` each, naming the layer and the
            experts missing.
    """
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            fused[name] = tensor
            continue
        prefix, index, proj = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(proj, {})[index] = tensor
    for prefix, projs in experts.items():
        for proj in ("gate", "up", "down"):
            missing = sorted(set(range(config.num_experts)) - set(projs.get(proj, {})))
            if missing or len(projs.get(proj, {})) != config.num_experts:
                raise ValueError(
                    f"the checkpoint's {prefix} holds {proj}_proj weights of experts "
                    f"{sorted(projs.get(proj, {}))} but the model has num_experts={config.num_experts} "
                    f"(missing {missing}); load a checkpoint of this model"
                )
        stacked = {proj: torch.stack([projs[proj][i] for i in range(config.num_experts)]) for proj in projs}
        fused[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)  # (E, 2I, H)
        fused[f"{prefix}.down_proj"] = stacked["down"]  # (E, H, I)
    return decoder_from_hf_state(fused, config)
