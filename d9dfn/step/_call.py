"""How the step calls a model or a pipeline stage, and the one place where a precision policy casts.

Every path of the step — the traced per-microbatch piece, the per-block runner, pipeline stages, eval and
inference — gets its compute-dtype params and inputs from :func:`for_compute`, and calls a whole model through
:func:`call_module` or a stage through :func:`stage_call`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from d9dfn._types import Buffers, Params
from d9dfn.pipeline import Stage, StageCall
from d9dfn.step._precision import Precision

__all__ = ["call_module", "checked_outputs", "for_compute", "stage_call"]


def for_compute(
    precision: Precision | None, params: Mapping[str, torch.Tensor], inputs: Any, kwargs: Any
) -> tuple[Any, Any, Any]:
    """``(params, inputs, kwargs)`` as the model computes with them: with a casting ``precision``, every floating
    param (frozen ones too) and floating input tensor in its ``compute_dtype``; the identity otherwise.

    Inside a traced function the casts are part of the graph, so gradients come back in the params' own dtype.
    """
    if precision is None or not precision.casts:
        return params, inputs, kwargs
    return precision.cast_params(params), precision.cast_inputs(inputs), precision.cast_inputs(kwargs)


def checked_outputs(module: nn.Module, outputs: Any) -> dict[str, Any]:
    """``outputs`` when ``module.forward`` returned a mapping of named outputs (``None`` ones dropped, d9d's
    contract); else a ``TypeError`` saying so."""
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"make_train_step: {type(module).__name__}.forward returned {type(outputs).__name__}; a d9dfn model "
            "returns a dict of named outputs, e.g. {'logits': logits} (wrap the module to adapt it)"
        )
    return {name: value for name, value in outputs.items() if value is not None}


def call_module(
    module: nn.Module,
    params: Params,
    buffers: Buffers,
    mutable: frozenset[str],
    inputs: Mapping[str, Any],
    kwargs: Mapping[str, Any],
    precision: Precision | None,
) -> tuple[dict[str, Any], Buffers]:
    """``module(**inputs, **kwargs)`` on the given tensors; returns the outputs and the new ``mutable`` buffers.

    ``buffers`` holds the module buffers and the frozen params; ``mutable`` (the module buffers) are cloned first:
    BatchNorm updates its statistics in place, and the step must never write into its inputs.
    """
    frozen = {name: t for name, t in buffers.items() if name not in mutable}
    params, inputs, kwargs = for_compute(precision, {**params, **frozen}, inputs, kwargs)
    current = {name: buffers[name].clone() for name in mutable}
    outputs = functional_call(module, (params, current), args=(), kwargs={**inputs, **kwargs}, strict=True)
    return checked_outputs(module, outputs), current


def stage_call(precision: Precision | None) -> StageCall:
    """``call(stage, params, buffers, inputs, kwargs)``: the stage as a pure function, cast for ``precision``
    (its frozen params arrive among ``params``); the pipeline executors' :class:`~d9dfn.pipeline.StageCall`."""

    def call(
        stage: Stage, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Buffers]:
        params, inputs, kwargs = for_compute(precision, params, inputs, kwargs)
        return stage(params, buffers, inputs, kwargs)

    return call
