"""A trained run's model as a plain ``nn.Module``: the provider's model with the checkpoint's weights, for Python
code that wants to call it (``model(input_ids)``) rather than run a job."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from d9dfn.checkpoint import load_weights
from d9dfn.loop._distributed import resolve_device
from d9dfn.loop._providers import InitializeModelStageContext, ModelProvider
from d9dfn.loop._train import load_source_checkpoint, materialize_model

__all__ = ["load_model"]


def load_model(
    model_provider: ModelProvider, run_dir: str | Path, *, step: int | None = None, device: str = "cpu"
) -> nn.Module:
    """The provider's whole model on ``device``, holding a training run's weights at ``step``, in eval mode.

    Any checkpoint restores (whatever the ranks, placements or pipeline layout that saved it): its params and
    buffers are read onto this one module, in the dtypes the run kept them in (a pure-bf16 run's model is bfloat16,
    ``precision.param_dtype``); a base the checkpoint left out (a LoRA run on a ``model.source``) is read from the
    folder it records, through the provider's load mapping, in the run's dtype, and checked against its fingerprint.
    Gradients are off for every parameter.

    Args:
        model_provider: builds the model the run trained (``ModelProvider.initialize_model_stage``).
        run_dir: the run's directory (``checkpointing.save_dir / run.name``, with ``checkpoints/`` in it).
        step: the checkpoint's step; ``None`` loads the newest.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when available).

    Raises:
        FileNotFoundError: the run has no checkpoint, or not that step.
        CheckpointCorruptedError: the checkpoint fails its checks.
    """
    context = InitializeModelStageContext()
    _, model = materialize_model(model_provider, context, resolve_device(device, "device"))
    params, buffers, _ = load_weights(
        Path(run_dir),
        model,
        step,
        load_base=lambda module, folder: load_source_checkpoint(model_provider, context, module, folder),
    )
    saved = {**buffers, **params}  # frozen parameters are among the params of a train state
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.dtype != saved[name].dtype:  # the run's dtype (a tied parameter is one object: cast once)
                tensor.data = torch.empty_like(tensor, dtype=saved[name].dtype)
            tensor.copy_(saved[name])
    model.requires_grad_(False)
    return model.eval()
