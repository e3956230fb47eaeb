"""What every step is built from: cutting a batch into microbatches, calling the model functionally, the one
microbatch loop, compiling a piece, and the checks a pipeline argument needs.

``_step.py`` (the train step and its shared tail) and ``_eval_step.py`` (eval and inference steps) use these;
``docs/design/step.md`` has the reasoning.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import torch
from torch import nn
from torch.func import functional_call

from d9dfn import prng
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._precision import Precision
from d9dfn._sharding import shard_tree, spec_on_dim
from d9dfn._task import BuildForwardInputsResult, InferenceTask, PipelineShardingSpec, TrainTask
from d9dfn._types import Batch, Buffers, GradientReduction, Params
from d9dfn.parallel._placement import is_distributed_tensor
from d9dfn.pipeline import PipelineRank, Program, Stage


def _in_mode(model: nn.Module, training: bool) -> nn.Module:
    """``model`` with every submodule's ``training`` flag equal to ``training``, the caller's module untouched.

    The train step runs its skeleton in train mode, eval and inference steps in eval mode (``nn.Dropout``,
    ``BatchNorm`` and Hugging Face models read the flag), whatever mode the skeleton was left in. When a
    flag differs this is a structural copy: new module objects, the same parameter and buffer tensors (a
    meta skeleton costs nothing, a materialized one no tensor memory).
    """
    if all(module.training == training for module in model.modules()):
        return model
    return _structural_copy(model).train(training)


def _structural_copy(model: nn.Module) -> nn.Module:
    """New module objects holding the same parameter and buffer tensors (no tensor memory is copied)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


_OneProcess = tuple[Program, Sequence[Stage]]


@overload
def _pipeline_in_mode(pipeline: _OneProcess | None, training: bool) -> _OneProcess | None: ...
@overload
def _pipeline_in_mode(
    pipeline: _OneProcess | PipelineRank | None, training: bool
) -> _OneProcess | PipelineRank | None: ...
def _pipeline_in_mode(pipeline: _OneProcess | PipelineRank | None, training: bool) -> _OneProcess | PipelineRank | None:
    """``pipeline`` with every stage's skeleton in ``training`` mode (:func:`_in_mode`)."""

    def in_mode(stage: Stage) -> Stage:
        return dataclasses.replace(stage, module=_in_mode(stage.module, training))

    if pipeline is None:
        return None
    if isinstance(pipeline, PipelineRank):
        return dataclasses.replace(pipeline, stages=tuple(in_mode(stage) for stage in pipeline.stages))
    program, stages = pipeline
    return program, [in_mode(stage) for stage in stages]


def _check_rng_kwarg(owner: str, model: nn.Module, rng_kwarg: str | None) -> None:
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
    precision: Precision | None = None,
) -> tuple[Mapping[str, torch.Tensor], Buffers]:
    """``model(**inputs, **kwargs)`` on the given tensors; returns the outputs and the new buffers.

    Module buffers (``mutable``) are cloned first: BatchNorm updates its statistics in place, and the
    step must never write into its inputs. Frozen parameters are read-only and passed as they are. With a
    ``precision`` that casts, floating params and inputs run in its ``compute_dtype`` (the casts are in the
    graph: gradients come back in the params' own dtype).
    """
    if precision is not None and precision.casts:
        params, inputs, kwargs = (
            precision.cast_params(params),
            precision.cast_inputs(inputs),
            precision.cast_inputs(kwargs),
        )
    buffers = {name: (t.clone() if name in mutable else t) for name, t in buffers.items()}
    outputs = functional_call(model, (params, buffers), args=(), kwargs={**inputs, **kwargs}, strict=True)
    return _checked_outputs(model, outputs), {name: buffers[name] for name in mutable}


def _checked_outputs(model: nn.Module, outputs: Any) -> Mapping[str, torch.Tensor]:
    """``outputs`` when ``model.forward`` returned a dict of named outputs; else a ``TypeError`` saying so."""
    if not isinstance(outputs, Mapping):
        raise TypeError(
            f"make_train_step: {type(model).__name__}.forward returned {type(outputs).__name__}; a d9dfn model "
            "returns a dict of named outputs, e.g. {'logits': logits} (wrap the module to adapt it)"
        )
    return outputs


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
    owner: str,
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None,
    num_microbatches: int,
    unroll: bool,
    precision: Precision | None = None,
) -> None:
    if pipeline is None:
        return
    if precision is not None and precision.casts:
        raise ValueError(
            f"{owner}: precision={precision} casts to {precision.compute_dtype}, but pipeline stages do not apply "
            "a precision policy yet; pass precision=None with a pipeline (or cast the stages' params yourself)"
        )
    stages: Sequence[Stage]
    if isinstance(pipeline, PipelineRank):
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
