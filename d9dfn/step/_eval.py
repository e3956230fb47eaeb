"""The forward-only steps: ``make_eval_step`` (loss and metrics, no gradients) and ``make_inference_step`` (the task
folds every microbatch's outputs into its state), on the train step's head and executors
(:func:`d9dfn.step._executors.forward_run`).

Across pipeline ranks every rank runs the head on the same batch (the first stage takes the inputs, every stage the
kwargs); only the last stage's ranks see outputs, so only they run ``compute_loss`` / ``process_outputs`` and update
metrics. The eval loss and ``Σw`` are then summed over ``pp`` (zeros from the other ranks, exact), so every rank
returns the same ``loss`` and ``loss_weight``; ``logs``, the metric state and the inference task state are the last
stage's and come back unchanged (``logs`` empty) elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._task import InferenceTask, TrainTask
from d9dfn._types import Batch, Params, PyTree
from d9dfn.parallel._pipeline import pipeline_reduction
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.pipeline import PipelineRank
from d9dfn.step._blocks import BlockChoice
from d9dfn.step._executors import Executor, Sequential, forward_run
from d9dfn.step._microbatches import Microbatch, MicrobatchOut, in_mode, prepare, weighted_logs
from d9dfn.step._options import Backend, check_state, resolve_options, with_pieces
from d9dfn.step._precision import Precision
from d9dfn.step._state import EvalOutput, InferenceState, TrainState, check_live

__all__ = ["make_eval_step", "make_inference_step"]


def make_eval_step(
    model: nn.Module,
    task: TrainTask[Any],
    *,
    num_microbatches: int | None = None,
    executor: Executor | None = None,
    repeated_blocks: BlockChoice = (),
    precision: Precision | None = None,
    plan: ParallelPlan | None = None,
    compile: bool | Backend = True,
) -> Callable[[TrainState, PyTree, Batch], tuple[PyTree, EvalOutput]]:
    """Build ``eval_step(train_state, metric_state, batch) -> (metric_state, EvalOutput)``: no gradients.

    The model runs with the train state's params and buffers; buffer updates (if the model makes any) are
    discarded. Metrics accumulate in the ``metric_state`` passed in, apart from training metrics. The options are
    ``make_train_step``'s: the same executors (a pipeline runs its program's forwards; a
    :class:`~d9dfn.pipeline.PipelineRank` this rank's, where ``compute_loss`` and the metrics run on the last stage's
    rank and the loss and its weight are summed over the ``pp`` group, so every rank returns the same ``loss`` /
    ``loss_weight``), the same per-block compilation and precision, the same parallel ``plan`` (the head gathers
    what it says; the loss and ``Σw`` stay this rank's: the caller sums them over the data-parallel ranks).
    """
    executor = Sequential() if executor is None else executor
    options = resolve_options("make_eval_step", model, executor, num_microbatches, repeated_blocks, compile, False)
    model, m = in_mode(model, training=False), options.num_microbatches
    reduce_pipeline = (
        pipeline_reduction(executor.group, executor.param_names) if isinstance(executor, PipelineRank) else None
    )

    def head(train_state: TrainState, batch: Batch) -> tuple[Params | None, list[Microbatch], tuple[torch.Tensor, ...]]:
        microbatches = prepare(task, batch, m, rng=train_state.rng, step=train_state.step, rng_kwarg=None)
        loss_sum = torch.zeros((), dtype=torch.float32, device=train_state.step.device)
        # Plain params are not returned: a compiled graph returning its inputs pays a per-output alias check a call.
        return gathered(train_state.params), microbatches, (loss_sum, torch.zeros_like(loss_sum))

    def consume(
        step: torch.Tensor, carry: tuple[torch.Tensor, ...], outputs: Mapping[str, Any], state: PipelineState
    ) -> tuple[tuple[torch.Tensor, ...], MicrobatchOut]:
        loss_sum, weight_sum = carry
        result = task.compute_loss(outputs, state, step)
        weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight
        weight = weight.to(torch.float32)
        carry = (loss_sum + result.loss.float() * weight, weight_sum + weight)
        return carry, MicrobatchOut(state if result.state is None else result.state, result.logs, {}, weight)

    def tail(
        metric_state: PyTree, carry: tuple[torch.Tensor, ...], outs: list[MicrobatchOut]
    ) -> tuple[PyTree, EvalOutput]:
        loss_sum, weight_sum = carry
        logs = weighted_logs(outs, weight_sum)  # this rank's
        if outs:  # no outputs: a pipeline rank without the last stage (its metrics are the last stage's)
            metric_state = task.update_metrics(metric_state, PipelineState.merge([out.state for out in outs]))
        if reduce_pipeline is not None:  # zeros from the ranks without the last stage
            loss_sum, weight_sum = reduce_pipeline.sums(loss_sum, weight_sum)
        return metric_state, EvalOutput(loss=safe_divide(loss_sum, weight_sum), loss_weight=weight_sum, logs=logs)

    run = forward_run(executor, options.parts(model, precision), consume)
    gathered = _gathering(plan, run.prepare(plan))
    head_fn, tail_fn = options.compiled_head(head), options.compiled(tail)
    checked: list[bool] = []

    def eval_step(train_state: TrainState, metric_state: PyTree, batch: Batch) -> tuple[PyTree, EvalOutput]:
        check_live(train_state)  # a state a donating train step took: its error, not one from inside a piece
        if not checked:  # once: the state is the one the step was built for
            check_state("make_eval_step", train_state.params, plan)
            checked.append(True)
        with torch.no_grad():
            full_params, microbatches, carry = head_fn(train_state, batch)
            params = train_state.params if full_params is None else full_params
            carry, outs = run.run(params, train_state.buffers, microbatches, train_state.step, carry)
            return tail_fn(metric_state, carry, outs)

    return with_pieces(eval_step, {"head": head_fn, **run.pieces, "tail": tail_fn})


def make_inference_step(
    model: nn.Module,
    task: InferenceTask[Any],
    *,
    num_microbatches: int | None = None,
    executor: Executor | None = None,
    repeated_blocks: BlockChoice = (),
    precision: Precision | None = None,
    rng_kwarg: str | None = None,
    plan: ParallelPlan | None = None,
    compile: bool | Backend = True,
) -> Callable[[InferenceState, Batch], InferenceState]:
    """Build ``infer_step(inference_state, batch) -> inference_state``: forward only, no gradients.

    Per microbatch the task's ``process_outputs`` folds the outputs into ``task_state``; the merged pipeline state
    then updates the metrics. The options are ``make_eval_step``'s (``d9dfn.pipeline.inference`` is the natural
    program of a pipeline): across ranks the outputs exist on the last stage's rank only, so ``task_state`` and
    ``metric_state`` are updated there and come back unchanged on the other ranks (every rank advances ``step``).
    """
    executor = Sequential() if executor is None else executor
    options = resolve_options("make_inference_step", model, executor, num_microbatches, repeated_blocks, compile, False)
    model, m = in_mode(model, training=False), options.num_microbatches

    def head(inference_state: InferenceState, batch: Batch) -> tuple[Params | None, list[Microbatch]]:
        microbatches = prepare(task, batch, m, rng=inference_state.rng, step=inference_state.step, rng_kwarg=rng_kwarg)
        return gathered(inference_state.params), microbatches

    def consume(
        step: torch.Tensor, task_state: PyTree, outputs: Mapping[str, Any], state: PipelineState
    ) -> tuple[PyTree, PipelineState]:
        return task.process_outputs(task_state, outputs, state), state

    def tail(inference_state: InferenceState, task_state: PyTree, states: list[Any]) -> InferenceState:
        metric_state = inference_state.metric_state
        if states:  # no outputs: a pipeline rank without the last stage
            metric_state = task.update_metrics(metric_state, PipelineState.merge(states))
        return inference_state.replace(task_state=task_state, metric_state=metric_state, step=inference_state.step + 1)

    run = forward_run(executor, options.parts(model, precision), consume)
    gathered = _gathering(plan, run.prepare(plan))
    head_fn, tail_fn = options.compiled_head(head), options.compiled(tail)
    checked: list[bool] = []

    def infer_step(inference_state: InferenceState, batch: Batch) -> InferenceState:
        if not checked:  # once: the state is the one the step was built for
            check_state("make_inference_step", inference_state.params, plan)
            checked.append(True)
        with torch.no_grad():
            full_params, microbatches = head_fn(inference_state, batch)
            params = inference_state.params if full_params is None else full_params
            task_state, states = run.run(
                params, inference_state.buffers, microbatches, inference_state.step, inference_state.task_state
            )
            return tail_fn(inference_state, task_state, states)

    return with_pieces(infer_step, {"head": head_fn, **run.pieces, "tail": tail_fn})


def _gathering(plan: ParallelPlan | None, local: frozenset[str]) -> Callable[[Params], Params | None]:
    """The head's gather: the params in the plan's compute layout (``local``: this rank's shards, which the executor
    gathers per block), or ``None`` for plain params (the head then returns none: see ``make_train_step``)."""
    if plan is None or not plan.distributed:
        return lambda params: None
    return lambda params: plan.compute_params(params, local)
