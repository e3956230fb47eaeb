"""Initial weights from a safetensors directory (``model_stage_factory.source_checkpoint``).

The directory is what ``d9dfn export`` writes, or a Hugging Face-style model directory: one or more
``*.safetensors`` files whose tensor names are the model's ``state_dict`` names (after an optional
mapping, e.g. stripping a ``model.`` prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_initial_weights"]


def load_initial_weights(
    model: nn.Module,
    directory: str | Path,
    mapper: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Copy the tensors of every ``*.safetensors`` file under ``directory`` into ``model`` (in place).

    Loading is strict: every persistent tensor of the model must be in the files, with its shape, and no
    file tensor may be left over. Dtypes are converted to the model's.

    Args:
        model: a materialized module (the loop calls this right after ``reset_parameters``).
        directory: the safetensors directory.
        mapper: renames the file's tensors to the model's names before loading.

    Raises:
        FileNotFoundError: the directory is missing or holds no ``*.safetensors`` file.
        ValueError: names or shapes do not match; the message lists them and says how to fix it.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"load_initial_weights: no *.safetensors file in {directory}; point "
            "model_stage_factory.source_checkpoint at a directory written by `d9dfn export` (or an HF model dir)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    if mapper is not None:
        tensors = mapper(tensors)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name}: file {tuple(tensors[name].shape)} vs model {tuple(expected[name].shape)}"
        for name in expected
        if name in tensors and tensors[name].shape != expected[name].shape
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"load_initial_weights: {directory} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, wrong shapes {wrong_shape[:5]}; export from the same model config, or give the "
            "model provider a state mapper that renames the file's tensors"
        )
    with torch.no_grad():
        model.load_state_dict({name: tensors[name] for name in expected}, strict=True)
