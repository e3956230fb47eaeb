"""``d9dfn export --format peft``: a LoRA run's adapters in the PEFT library's format, for ``peft.PeftModel``.

The folder holds ``adapter_model.safetensors`` (PEFT's names: ``base_model.model.`` before the Hugging Face name of the
adapted module, then ``lora_A.weight`` / ``lora_B.weight``, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and ``adapter_config.json`` (``peft_type`` LORA,
``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` as the adapted modules' full Hugging Face names,
``base_model_name_or_path`` the run's ``model.source``). ``PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(base), folder)`` then computes what the run's model does. Only LoRA travels this way: a run that also
trains base weights (``method: full``) or stacks LoRA methods with different settings is refused, naming the export
that carries it (``--format hf``, merged).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9dfn.loop import atomic_write
from d9dfn.models import FAMILIES, FullTune, LoRA, PeftMethod, Qwen3Config, lora_modules

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "check_peft_export", "export_adapter", "peft_state"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def check_peft_export(methods: Sequence[PeftMethod], who: str) -> LoRA:
    """The one LoRA setting an adapter file can carry; raise (one line, the fix) when ``methods`` have none, train
    base weights too, or differ in rank, alpha or dropout."""
    loras = [m for m in methods if isinstance(m, LoRA)]
    if not loras:
        raise ValueError(
            f"{who}: the run has no LoRA adapters (trainer.peft holds no method 'lora'); export its weights with "
            "--format hf"
        )
    full = [m.targets for m in methods if isinstance(m, FullTune)]
    if full:
        raise ValueError(
            f"{who}: the run also trains base weights (trainer.peft method 'full', targets {full}), which an adapter "
            "file does not carry; export the merged model with --format hf"
        )
    settings = {(m.rank, m.alpha, m.dropout) for m in loras}
    if len(settings) > 1:
        raise ValueError(
            f"{who}: the run's LoRA methods differ in (rank, alpha, dropout) {sorted(settings)}, and one adapter file "
            "carries one setting; export the merged model with --format hf"
        )
    return loras[0]


def peft_state(
    model: nn.Module, params: Mapping[str, torch.Tensor], family: str, config: Qwen3Config
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The adapters of ``params`` (an adapted ``model``'s) under PEFT's names, and the adapted modules' Hugging Face
    names (``target_modules``)."""
    to_hf_state = FAMILIES[family].to_hf_state
    state: dict[str, torch.Tensor] = {}
    targets: list[str] = []
    for name in lora_modules(model):
        # The module's Hugging Face name: its weight's, through the family's mapping, without ".weight".
        (hf_weight,) = to_hf_state({f"{name}.weight": params[f"{name}.weight"]}, config)
        hf_name = hf_weight.removesuffix(".weight")
        targets.append(hf_name)
        for factor in ("lora_A", "lora_B"):
            state[f"{_PREFIX}{hf_name}.{factor}.weight"] = params[f"{name}.{factor}.weight"].detach().cpu().clone()
    return state, targets


def export_adapter(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    out_dir: Path,
    family: str,
    config: Qwen3Config,
    *,
    source: Path | None,
) -> Path:
    """Write ``out_dir/adapter_model.safetensors`` and ``adapter_config.json`` for the adapters of ``params``; returns
    the weights' path."""
    from safetensors.torch import save_file

    lora = next(m for m in lora_modules(model).values())
    state, targets = peft_state(model, params, family, config)
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if source is None else str(source),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    file = out_dir / ADAPTER_WEIGHTS
    save_file(state, str(file), metadata={"format": "pt"})
    os.chmod(file, 0o644)
    atomic_write(out_dir / ADAPTER_CONFIG, json.dumps(adapter_config, indent=2))
    return file
