"""What every step is built from: cutting a batch into microbatches, calling the model functionally, the one
microbatch loop, compiling a piece, and the checks a pipeline argument needs.

``_step.py`` (the train step and its shared tail) and ``_eval_step.py`` (eval and inference steps) use these;
``docs/design/step.md`` has the reasoning.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.func import functional_call

from d9dfn import prng
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._sharding import shard_tree, spec_on_dim
from d9dfn._task import BuildForwardInputsResult, InferenceTask, PipelineShardingSpec, TrainTask
from d9dfn._types import Batch, Buffers, GradientReduction, Params
from d9dfn.parallel._placement import is_distributed_tensor
from d9dfn.pipeline import PipelineRank, Program, Stage


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


def _call_model(
    model: nn.Module,
    params: Params,
    buffers: Buffers,
    mutable: frozenset[str],
    inputs: dict[str, Any],
    kwargs: dict[str, Any],
) -> tuple[Mapping[str, torch.Tensor], Buffers]:
    """``model(**inputs, **kwargs)`` on the given tensors; returns the outputs and the new buffers.

    Module buffers (``mutable``) are cloned first: BatchNorm updates its statistics in place, and the
    step must never write into its inputs. Frozen parameters are read-only and passed as they are.
    """
    buffers = {name: (t.clone() if name in mutable else t) for name, t in buffers.items()}
    outputs = functional_call(model, (params, buffers), args=(), kwargs={**inputs, **kwargs}, strict=True)
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"make_train_step: {type(model).__name__}.forward returned {type(outputs).__name__}; a d9dfn model "
            "returns a dict of named outputs, e.g. {'logits': logits} (wrap the module to adapt it)"
        )
    return outputs, {name: buffers[name] for name in mutable}


def _weighted_logs(
    per_mb: list[tuple[dict[str, torch.Tensor], torch.Tensor]], total: torch.Tensor
) -> dict[str, torch.Tensor]:
    if not per_mb or not per_mb[0][0]:
        return {}
    names = per_mb[0][0].keys()
    for index, (logs, _) in enumerate(per_mb):
        if logs.keys() != names:
            raise ValueError(
                f"compute_loss: microbatch {index} logged {sorted(logs)} but microbatch 0 logged {sorted(names)}; "
                "return the same ComputeLossResult.logs keys for every microbatch"
            )
    sums = {name: cast(torch.Tensor, sum(logs[name].detach().float() * w for logs, w in per_mb)) for name in names}
    return {name: safe_divide(value, total) for name, value in sums.items()}


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _compile(fn: _Fn, compile: bool, backend: str) -> _Fn:
    return cast(_Fn, torch.compile(fn, fullgraph=True, backend=backend)) if compile else fn


def _with_pieces(fn: Callable[..., Any], /, **pieces: Callable[..., Any]) -> Callable[..., Any]:
    """Expose the functions a step calls (each a ``torch.compile`` wrapper when compiled) as ``step.pieces``."""
    fn.pieces = types.MappingProxyType(pieces)  # type: ignore[attr-defined]
    return fn


Microbatch = tuple[dict[str, Any], dict[str, Any], PipelineState]
"""One microbatch as the loop sees it: the model's ``inputs``, its ``kwargs`` (rng key included) and its state."""


def _prepare(
    task: TrainTask[Any] | InferenceTask[Any],
    batch: Batch,
    num_microbatches: int,
    *,
    rng: torch.Tensor,
    step: torch.Tensor,
    rng_kwarg: str | None,
    first_index: int = 0,
) -> list[Microbatch]:
    """``batch`` → per-microbatch ``(inputs, kwargs, state)``; the head every step (train, eval, inference) runs.

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
    return [(inputs, kwargs, mb_state) for (inputs, kwargs), mb_state in zip(microbatches, states, strict=True)]


def _microbatch_loop(
    piece: Callable[..., Any], consts: Any, carry: Any, microbatches: list[Microbatch]
) -> tuple[Any, list[Any]]:
    """The one microbatch loop: ``carry, out = piece(consts, carry, microbatch)`` in microbatch order.

    ``piece`` is the same (compiled) function for every microbatch, so it traces once whatever the count.
    """
    outs = []
    for microbatch in microbatches:
        carry, out = piece(consts, carry, microbatch)
        outs.append(out)
    return carry, outs


def _check_reduction(params: Params, reduce_gradients: GradientReduction | None) -> bool:
    """True when some param is a ``DTensor``; raises when such params have no ``reduce_gradients``."""
    distributed = [name for name, p in params.items() if is_distributed_tensor(p)]
    if distributed and reduce_gradients is None:
        raise ValueError(
            f"make_train_step: params[{distributed[0]!r}] is a DTensor but the step has no reduce_gradients; "
            "pass reduce_gradients=d9dfn.parallel.data_parallel_reduction(mesh) so that the loss weight is "
            "summed over the data-parallel ranks"
        )
    return bool(distributed)


def _check_pipeline(
    owner: str, pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None, num_microbatches: int, unroll: bool
) -> None:
    if pipeline is None:
        return
    stages: Sequence[Stage]
    if isinstance(pipeline, PipelineRank):
        if owner != "make_train_step":  # issue 13 item 4: eval and inference across processes come with the loop
            raise ValueError(
                f"{owner}: a PipelineRank (multi-process pipeline) runs training programs only so far; pass "
                "(program, stages) to run the program in one process"
            )
        program, stages = pipeline.program, pipeline.stages
    else:
        program, stages = pipeline
    if unroll:
        raise ValueError(f"{owner}: unroll=True compiles the one-stage step whole; pass pipeline=None or unroll=False")
    if program.num_microbatches != num_microbatches:
        raise ValueError(
            f"{owner}: the program runs {program.num_microbatches} microbatches but num_microbatches="
            f"{num_microbatches}; build the program with the step's count"
        )
    if len(stages) != program.num_stages:
        raise ValueError(
            f"{owner}: the program has {program.num_stages} stages but {len(stages)} were given; pass one Stage "
            "per program stage, in stage order"
        )
