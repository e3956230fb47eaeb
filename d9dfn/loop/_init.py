"""Initializing a module materialized from the meta device, and proving every tensor was initialized.

``to_empty`` leaves each tensor's memory as it was: zeros, old values or NaN by chance. A module's own init
may skip tensors (an HF model's RMSNorm weights have no ``reset_parameters``; its rotary ``inv_freq`` buffer
is computed in ``__init__``, which ran on meta). So the loop *poisons* every floating tensor with NaN (and
every integer tensor with a sentinel) before the init runs, and afterwards refuses a tensor the init did
not write, by name, before step 1 — never a NaN loss that suggests lowering the learning rate.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["check_initialized", "default_initialize", "poison"]

_INT_SENTINEL = -(2**31) + 7  # fits every integer dtype from int32 up; not a value an init writes


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*module.named_parameters(remove_duplicate=True), *module.named_buffers(remove_duplicate=True)]
    return [(name, t) for name, t in named if t.numel() > 0]


@torch.no_grad()
def poison(module: nn.Module) -> None:
    """Fill every floating tensor with NaN and every int32/int64 tensor with a sentinel (in place)."""
    for _, tensor in _tensors(module):
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int32, torch.int64):
            tensor.fill_(_INT_SENTINEL)


def _own_init_weights(module: nn.Module) -> bool:
    """``module.init_weights()`` when the module has one that takes no argument (transformers' models do)."""
    init = getattr(module, "init_weights", None)
    if not callable(init):
        return False
    try:
        inspect.signature(init).bind()
    except (TypeError, ValueError):
        return False
    return True


@torch.no_grad()
def default_initialize(module: nn.Module) -> None:
    """The model's own init scheme: ``init_weights()`` when it has one (Hugging Face's ``PreTrainedModel``
    re-initializes every weight and rebuilds its non-persistent buffers there), else ``reset_parameters()``
    of every submodule that has one, in module order (d9d's ``ModuleLateInit``; a seed fixes the weights)."""
    if _own_init_weights(module):
        module.init_weights()  # type: ignore[operator]
        return
    for submodule in module.modules():
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            reset()


def check_initialized(module: nn.Module, who: str) -> None:
    """Raise unless every parameter and buffer of ``module`` was written by the init and is finite.

    Args:
        module: a module :func:`poison` ed, then initialized.
        who: the provider, named in the message.

    Raises:
        ValueError: the first tensors still holding the poison or a non-finite value, named, with the fix.
    """
    untouched, nonfinite = [], []
    for name, tensor in _tensors(module):
        if tensor.is_floating_point() or tensor.is_complex():
            if torch.isnan(tensor).all():
                untouched.append(name)
            elif not torch.isfinite(tensor).all():
                nonfinite.append(name)
        elif tensor.dtype in (torch.int32, torch.int64) and bool((tensor == _INT_SENTINEL).all()):
            untouched.append(name)
    if untouched:
        raise ValueError(
            f"{who}: {len(untouched)} tensor(s) were never initialized: {untouched[:5]}; "
            "give those modules a reset_parameters(), or override ModelProvider.initialize_weights to fill them "
            "(buffers computed in __init__ must be rebuilt there: the module was built on the meta device)"
        )
    if nonfinite:
        raise ValueError(
            f"{who}: {len(nonfinite)} tensor(s) hold NaN or infinite values after the init: "
            f"{nonfinite[:5]}; fix their init (a NaN here would make the loss NaN at step 1)"
        )
