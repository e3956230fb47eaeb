"""The forward-only steps: ``make_eval_step`` (loss and metrics, no gradients) and ``make_inference_step``
(the task folds every microbatch's outputs into its state), built from the same head / microbatch loop / tail
as the train step (``_step_parts.py``), or over a pipeline program: in one process (``(program, stages)``,
``run_forward``) or across the ``pp`` ranks (a ``PipelineRank``, ``run_rank_forward``).

Across ranks every rank runs the head on the same batch (the first stage takes the inputs, every stage the
kwargs); only the last stage's ranks see outputs, so only they run ``compute_loss`` / ``process_outputs`` and
update metrics. The eval loss and ``Σw`` are then summed over ``pp`` (zeros from the other ranks, exact), so
every rank returns the same ``loss`` and ``loss_weight``; ``logs``, the metric state and the inference task
state are the last stage's and come back unchanged (``logs`` empty) elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from d9dfn._blocks import ModelCall, forward_piece
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._precision import Precision
from d9dfn._pytree import pytree_dataclass
from d9dfn._step_parts import (
    Microbatch,
    _check_pipeline,
    _compile,
    _in_mode,
    _microbatch_loop,
    _pipeline_in_mode,
    _prepare,
    _weighted_logs,
    _with_pieces,
)
from d9dfn._task import InferenceTask, TrainTask
from d9dfn._train_state import TrainState
from d9dfn._types import Batch, Buffers, Params, PyTree
from d9dfn.parallel._pipeline import pipeline_reduction
from d9dfn.parallel._placement import full_tensors
from d9dfn.pipeline import PipelineRank, Program, Stage, run_forward, run_rank_forward

__all__ = ["EvalOutput", "InferenceState", "make_eval_step", "make_inference_step"]


@pytree_dataclass
class EvalOutput:
    """What one evaluation step reports: the weighted loss, its weight, and the tasks' extra values."""

    loss: torch.Tensor
    loss_weight: torch.Tensor
    logs: dict[str, torch.Tensor]


@pytree_dataclass
class InferenceState:
    """The state an inference run carries: weights, the task's accumulating state, metrics, step, key."""

    params: Params
    buffers: Buffers
    step: torch.Tensor
    rng: torch.Tensor
    task_state: PyTree = None
    metric_state: PyTree = None

    if TYPE_CHECKING:  # added by ``pytree_dataclass``; declared here so that type checkers know it

        def replace(self, **changes: Any) -> Self:
            """Return a copy with ``changes`` applied; the original is unchanged."""
            ...


def make_eval_step(
    model: nn.Module,
    task: TrainTask[Any],
    *,
    num_microbatches: int = 1,
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None = None,
    precision: Precision | None = None,
    compile: bool = True,
    backend: str = "inductor",
    repeated_blocks: Sequence[type[nn.Module]] = (),
) -> Callable[[TrainState, PyTree, Batch], tuple[PyTree, EvalOutput]]:
    """Build ``eval_step(train_state, metric_state, batch) -> (metric_state, EvalOutput)``: no gradients.

    The model runs with the train state's params and buffers; buffer updates (if the model makes any)
    are discarded. Metrics accumulate in the ``metric_state`` passed in, apart from training metrics.
    The same pieces as the train step: head, one per-microbatch piece, tail; ``pipeline=(program, stages)``
    runs the program's forwards over the stages instead (reference executor, eager).

    A :class:`d9dfn.pipeline.PipelineRank` runs this rank's forwards with sends and receives (any program:
    ``d9dfn.pipeline.inference``, or a training program's forwards; the train state holds this rank's params).
    ``compute_loss`` and the metrics run on the last stage's rank; the loss and its weight are summed over the
    ``pp`` group, so every rank returns the same ``loss`` / ``loss_weight``. The other ranks return the
    ``metric_state`` they were given, unchanged, and empty ``logs``. ``precision`` runs the model in its
    ``compute_dtype`` and ``repeated_blocks`` compiles each named block class once for all its instances (both as
    ``make_train_step``; not with ``pipeline``).
    """
    _check_forward_options("make_eval_step", pipeline, num_microbatches, precision, repeated_blocks)
    model, pipeline = _in_mode(model, training=False), _pipeline_in_mode(pipeline, training=False)
    mutable = frozenset(name for name, _ in model.named_buffers())
    reduce_pipeline = (
        pipeline_reduction(pipeline.group, pipeline.param_names) if isinstance(pipeline, PipelineRank) else None
    )

    def head(train_state: TrainState, batch: Batch) -> tuple[Params, list[Microbatch], tuple[Any, ...]]:
        microbatches = _prepare(
            task, batch, num_microbatches, rng=train_state.rng, step=train_state.step, rng_kwarg=None
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=train_state.step.device)
        return full_tensors(train_state.params), microbatches, (loss_sum, torch.zeros_like(loss_sum))

    def consume(
        step: torch.Tensor, carry: tuple[Any, ...], outputs: Mapping[str, Any], state: PipelineState
    ) -> tuple[Any, ...]:
        loss_sum, weight_sum = carry
        result = task.compute_loss(outputs, state, step)
        weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight
        weight = weight.to(torch.float32)
        carry = (loss_sum + result.loss.float() * weight, weight_sum + weight)
        return carry, (state if result.state is None else result.state, result.logs, weight)

    def piece_of(call: ModelCall) -> Callable[..., tuple[tuple[Any, ...], tuple[Any, ...]]]:
        def piece(
            consts: tuple[Any, ...], carry: tuple[Any, ...], microbatch: Microbatch
        ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            params, buffers, step = consts
            inputs, kwargs, state = microbatch
            return consume(step, carry, call(params, buffers, inputs, kwargs), state)

        return piece

    def tail(metric_state: PyTree, carry: tuple[Any, ...], outs: list[Any]) -> tuple[PyTree, EvalOutput]:
        loss_sum, weight_sum = carry
        logs = _weighted_logs([(mb_logs, weight) for _, mb_logs, weight in outs], weight_sum)  # this rank's
        if outs:  # no outputs: a pipeline rank without the last stage (its metrics are the last stage's)
            metric_state = task.update_metrics(metric_state, PipelineState.merge([state for state, _, _ in outs]))
        if reduce_pipeline is not None:  # zeros from the ranks without the last stage
            loss_sum, weight_sum = reduce_pipeline.sums(loss_sum, weight_sum)
        return metric_state, EvalOutput(loss=safe_divide(loss_sum, weight_sum), loss_weight=weight_sum, logs=logs)

    head_fn, tail_fn = _compile(head, compile, backend), _compile(tail, compile, backend)
    piece_fn = forward_piece("make_eval_step", model, repeated_blocks, mutable, precision, piece_of, compile, backend)

    def eval_step(train_state: TrainState, metric_state: PyTree, batch: Batch) -> tuple[PyTree, EvalOutput]:
        with torch.no_grad():
            params, microbatches, carry = head_fn(train_state, batch)
            if pipeline is None:
                carry, outs = _microbatch_loop(
                    piece_fn, (params, train_state.buffers, train_state.step), carry, microbatches
                )
            else:
                outs = []  # stays empty on a pipeline rank without the last stage
                outputs = _forwards(pipeline, params, train_state, microbatches)
                for out, (_, _, state) in zip(outputs, microbatches[: len(outputs)], strict=True):
                    carry, mb_out = consume(train_state.step, carry, out, state)
                    outs.append(mb_out)
            return tail_fn(metric_state, carry, outs)

    return _with_pieces(eval_step, head=head_fn, microbatch=piece_fn, tail=tail_fn)


def make_inference_step(
    model: nn.Module,
    task: InferenceTask[Any],
    *,
    num_microbatches: int = 1,
    rng_kwarg: str | None = None,
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None = None,
    precision: Precision | None = None,
    compile: bool = True,
    backend: str = "inductor",
    repeated_blocks: Sequence[type[nn.Module]] = (),
) -> Callable[[InferenceState, Batch], InferenceState]:
    """Build ``infer_step(inference_state, batch) -> inference_state``: forward only, no gradients.

    Per microbatch the task's ``process_outputs`` folds the outputs into ``task_state``; the merged
    pipeline state then updates the metrics. ``pipeline=(program, stages)`` runs the program's forwards over
    the stages instead (reference executor, eager; ``d9dfn.pipeline.inference`` is the natural program).

    A :class:`d9dfn.pipeline.PipelineRank` runs this rank's forwards with sends and receives; the outputs
    exist on the last stage's rank only, so ``task_state`` and ``metric_state`` are updated there and come back
    unchanged on the other ranks (every rank advances ``step``).
    ``precision`` runs the model in its ``compute_dtype`` and ``repeated_blocks`` compiles each named block class
    once for all its instances (both as ``make_train_step``; not with ``pipeline``).
    """
    _check_forward_options("make_inference_step", pipeline, num_microbatches, precision, repeated_blocks)
    model, pipeline = _in_mode(model, training=False), _pipeline_in_mode(pipeline, training=False)
    mutable = frozenset(name for name, _ in model.named_buffers())

    def head(inference_state: InferenceState, batch: Batch) -> tuple[Params, list[Microbatch]]:
        microbatches = _prepare(
            task, batch, num_microbatches, rng=inference_state.rng, step=inference_state.step, rng_kwarg=rng_kwarg
        )
        return full_tensors(inference_state.params), microbatches

    def piece_of(call: ModelCall) -> Callable[..., tuple[PyTree, PipelineState]]:
        def piece(consts: tuple[Any, ...], task_state: PyTree, microbatch: Microbatch) -> tuple[PyTree, PipelineState]:
            params, buffers = consts
            inputs, kwargs, state = microbatch
            return task.process_outputs(task_state, call(params, buffers, inputs, kwargs), state), state

        return piece

    def tail(inference_state: InferenceState, task_state: PyTree, states: list[Any]) -> InferenceState:
        metric_state = inference_state.metric_state
        if states:  # no outputs: a pipeline rank without the last stage
            metric_state = task.update_metrics(metric_state, PipelineState.merge(states))
        return inference_state.replace(task_state=task_state, metric_state=metric_state, step=inference_state.step + 1)

    head_fn, tail_fn = _compile(head, compile, backend), _compile(tail, compile, backend)
    piece_fn = forward_piece(
        "make_inference_step", model, repeated_blocks, mutable, precision, piece_of, compile, backend
    )

    def infer_step(inference_state: InferenceState, batch: Batch) -> InferenceState:
        with torch.no_grad():
            params, microbatches = head_fn(inference_state, batch)
            task_state = inference_state.task_state
            if pipeline is None:
                task_state, states = _microbatch_loop(
                    piece_fn, (params, inference_state.buffers), task_state, microbatches
                )
            else:
                states = []  # stays empty on a pipeline rank without the last stage
                outputs = _forwards(pipeline, params, inference_state, microbatches)
                for out, (_, _, state) in zip(outputs, microbatches[: len(outputs)], strict=True):
                    task_state = task.process_outputs(task_state, out, state)
                    states.append(state)
            return tail_fn(inference_state, task_state, states)

    return _with_pieces(infer_step, head=head_fn, microbatch=piece_fn, tail=tail_fn)


def _check_forward_options(
    owner: str,
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None,
    num_microbatches: int,
    precision: Precision | None,
    repeated_blocks: Sequence[type[nn.Module]],
) -> None:
    _check_pipeline(owner, pipeline, num_microbatches, False, precision)
    if repeated_blocks and pipeline is not None:
        raise ValueError(
            f"{owner}: repeated_blocks compiles the one-stage forward per block, but a pipeline runs its stages "
            "eagerly; pass repeated_blocks=() with pipeline="
        )


def _forwards(
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank,
    params: Params,
    state: TrainState | InferenceState,
    microbatches: list[Microbatch],
) -> list[dict[str, Any]]:
    """The last stage's outputs per microbatch: every microbatch's in one process; across ranks, on the last
    stage's rank only (``[]`` elsewhere)."""
    if isinstance(pipeline, PipelineRank):
        return run_rank_forward(pipeline, params, state.buffers, microbatches, step=state.step)
    outputs = run_forward(*pipeline, params, state.buffers, microbatches)
    if len(outputs) != len(microbatches):
        raise AssertionError(f"run_forward returned {len(outputs)} outputs for {len(microbatches)} microbatches")
    return outputs
