"""A step's microbatches: the batch cut by the task's spec, their keys, the one loop over them, and what each
microbatch hands back (:class:`MicrobatchOut`).

Every step (train, eval, inference) and every executor starts from :func:`prepare`; every executor that runs
microbatches one after another on one process runs them through :func:`microbatch_loop`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from d9dfn import prng
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._sharding import shard_tree, spec_on_dim
from d9dfn._task import BuildForwardInputsResult, InferenceTask, PipelineShardingSpec, TrainTask
from d9dfn._types import Batch

__all__ = ["Microbatch", "MicrobatchOut", "in_mode", "microbatch_loop", "prepare", "structural_copy", "weighted_logs"]


class Microbatch(NamedTuple):
    """One microbatch as an executor sees it: the model's ``inputs``, its ``kwargs`` (keys included), its state."""

    inputs: dict[str, Any]
    kwargs: dict[str, Any]
    state: Any


class MicrobatchOut(NamedTuple):
    """What a training or evaluation microbatch hands to the tail: its new pipeline state, its logs, the model
    outputs a :class:`~d9dfn.StateUpdate` reads (``stats``, detached; empty without one) and its weight ``wᵢ``
    (detached, float32; last, as the pipeline executors read it)."""

    state: PipelineState
    logs: dict[str, torch.Tensor]
    stats: dict[str, torch.Tensor]
    weight: torch.Tensor


def _split_inputs(
    forward: BuildForwardInputsResult, num_microbatches: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Cut the model inputs into per-microbatch (inputs, kwargs); d9d's default spec is dim 0."""
    spec = forward.pipeline_sharding_spec or PipelineShardingSpec()
    input_spec = spec.input_data if spec.input_data is not None else spec_on_dim(forward.inputs, 0)
    kwargs_spec = spec.input_kwargs if spec.input_kwargs is not None else spec_on_dim(forward.kwargs, 0)
    inputs = shard_tree(forward.inputs, input_spec, num_microbatches, even=True)
    kwargs = shard_tree(forward.kwargs, kwargs_spec, num_microbatches, even=True)
    return list(zip(inputs, kwargs, strict=True))


def prepare(
    task: TrainTask[Any] | InferenceTask[Any],
    batch: Batch,
    num_microbatches: int,
    *,
    rng: torch.Tensor,
    step: torch.Tensor,
    rng_kwarg: str | None,
    first_index: int = 0,
) -> list[Microbatch]:
    """``batch`` → its microbatches; the head of every step (train, eval, inference).

    With ``rng_kwarg`` microbatch ``i`` gets ``prng.fold_in(fold_in(rng, step), first_index + i)`` under that
    keyword: keys are computed here, outside the per-microbatch piece, so the piece never sees a Python index
    (an int would be a guard and recompile it once per microbatch).
    """
    forward, state = task.build_forward_inputs(batch, PipelineState())
    microbatches = _split_inputs(forward, num_microbatches)
    states = state.split(num_microbatches)
    if rng_kwarg is not None:
        step_key = prng.fold_in(rng, step)
        microbatches = [
            (inputs, {**kwargs, rng_kwarg: prng.fold_in(step_key, first_index + index)})
            for index, (inputs, kwargs) in enumerate(microbatches)
        ]
    return [
        Microbatch(inputs, kwargs, mb_state) for (inputs, kwargs), mb_state in zip(microbatches, states, strict=True)
    ]


def microbatch_loop(
    piece: Callable[[Any, Any, Microbatch], tuple[Any, Any]],
    consts: Any,
    carry: Any,
    microbatches: Sequence[Microbatch],
) -> tuple[Any, list[Any]]:
    """The one microbatch loop: ``carry, out = piece(consts, carry, microbatch)`` in microbatch order.

    ``piece`` is the same (compiled) function for every microbatch, so it traces once whatever the count.
    """
    outs = []
    for microbatch in microbatches:
        carry, out = piece(consts, carry, microbatch)
        outs.append(out)
    return carry, outs


def weighted_logs(outs: Sequence[MicrobatchOut], total: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tasks' logs averaged over the microbatches with their weights (``Σwᵢ·logᵢ / total``)."""
    if not outs or not outs[0].logs:
        return {}
    names = outs[0].logs.keys()
    for index, out in enumerate(outs):
        if out.logs.keys() != names:
            raise ValueError(
                f"compute_loss: microbatch {index} logged {sorted(out.logs)} but microbatch 0 logged {sorted(names)}; "
                "return the same ComputeLossResult.logs keys for every microbatch"
            )
    sums = {
        name: cast(torch.Tensor, sum(out.logs[name].detach().float() * out.weight for out in outs)) for name in names
    }
    return {name: safe_divide(value, total) for name, value in sums.items()}


def structural_copy(model: nn.Module) -> nn.Module:
    """New module objects holding the same parameter and buffer tensors (no tensor memory is copied)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


def in_mode(model: nn.Module, training: bool) -> nn.Module:
    """``model`` with every submodule's ``training`` flag equal to ``training``, the caller's module untouched.

    The train step runs its skeleton in train mode, eval and inference steps in eval mode (``nn.Dropout``,
    ``BatchNorm`` and Hugging Face models read the flag), whatever mode the skeleton was left in. When a
    flag differs this is a structural copy: new module objects, the same parameter and buffer tensors (a
    meta skeleton costs nothing, a materialized one no tensor memory).
    """
    if all(module.training == training for module in model.modules()):
        return model
    return structural_copy(model).train(training)


def check_rng_kwarg(owner: str, model: nn.Module, rng_kwarg: str | None) -> None:
    """Refuse a ``rng_kwarg`` the model's ``forward`` does not name: a ``**kwargs`` would swallow it silently."""
    if rng_kwarg is None:
        return
    if getattr(model, "forwards_kwargs", False):  # a wrapper handing every keyword on (compat.MegatronModel)
        return
    parameter = inspect.signature(model.forward).parameters.get(rng_kwarg)
    if parameter is None or parameter.kind not in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD):
        raise ValueError(
            f"{owner}: rng_kwarg={rng_kwarg!r}, but {type(model).__name__}.forward has no parameter named "
            f"{rng_kwarg!r}, so the key would be ignored (or swallowed by **kwargs) and no dropout would follow "
            "it; pass rng_kwarg=None for a model that draws dropout from torch's RNG (Hugging Face models; the "
            "loop reseeds it every step), or give forward that keyword (a wrapper whose **kwargs hand every "
            "keyword on to the wrapped model declares it with a class attribute forwards_kwargs = True)"
        )
