"""The train step's tail, the same for every executor: the executor's :class:`~d9dfn.pipeline.ProgramResult` →
reduce over the data-parallel (and pipeline) group → ``× 1/Σw`` → global norm → clip → ``optimizer.update`` →
``apply_updates`` → the model's state update (:class:`~d9dfn.StateUpdate`: an MoE layer's balancing bias, from the
step's statistics summed over microbatches and data-parallel ranks) → the skip of a non-finite step → metrics.

The per-leaf part runs in one of three forms: over the whole tree (:func:`~d9dfn.step._tail_parts.update_whole`);
with repeated blocks and a ``leafwise`` optimizer, each block's leaves through one shared compiled region
(:class:`~d9dfn.step._blockwise_tail.BlockwiseTail`: the optimizer's graph stops growing with depth); or, when the
step runs the optimizer's fused kernel (``Transform.fused``), as that kernel, eagerly
(:func:`~d9dfn.step._fused_tail.update_fused`; the whole tail is then not compiled). All take their norm from the same
per-leaf norms (``d9dfn.parallel.leaf_norms``), combined over the pipeline when there is one; ``docs/design/step.md``
has the reasoning.
"""

from __future__ import annotations

from typing import Any

import torch

from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._task import TrainTask
from d9dfn._types import FusedUpdate, GradientReduction, Params, StateUpdate, Sums, Transform
from d9dfn.parallel._grads import reduce_partial_gradients
from d9dfn.parallel._pipeline import PipelineReduction
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.pipeline import ProgramResult
from d9dfn.step._blockwise_tail import BlockwiseTail
from d9dfn.step._fused_tail import update_fused
from d9dfn.step._microbatches import MicrobatchOut, weighted_logs
from d9dfn.step._precision import Precision
from d9dfn.step._state import StepOutput, TrainState, trainable_params, with_trainable
from d9dfn.step._state_slots import StateSlots
from d9dfn.step._tail_parts import donated_update, kept, update_whole

__all__ = ["Tail"]

_STAT = "\0stat:"
"""The prefix of a state update's statistic among the gradients the data-parallel hook sums (no param name has it)."""


class Tail:
    """Everything a training step does after its executor, for every executor (one stage, a pipeline program, or
    one pipeline rank's row); built once per step function.

    Args:
        task: its ``update_metrics`` folds the microbatches' states into the metric state.
        optimizer: the update.
        max_grad_norm: clip to this global norm (``None`` or 0: no clipping).
        skip_nonfinite: keep params, buffers, optimizer and metric state on a non-finite step.
        reduce_gradients: the data-parallel hook (sums over the group; ``None``: local sums).
        pipeline: on a pipeline rank, the ``pp`` reductions (``d9dfn.parallel.pipeline_reduction``).
        precision: gradients cross the data-parallel group in its ``reduce_dtype``.
        blockwise: the per-block form of the per-leaf part (:class:`BlockwiseTail`), or ``None``.
        plan: the parallel plan the params follow (``None``: plain params): over which axes each gradient is partial.
        local: the params whose gradients arrive as local shards (gathered per block by the executor).
        fused: the optimizer's fused kernel when the step runs it (:meth:`fused_for`), else ``None``.
        donate: update the state's params and optimizer moments in place (a donating step): the fused kernel writes
            into them, a compiled form copies its new values into them (``_tail_parts.write_into``); the tail then
            returns the new state without them (``params`` empty, ``opt_state`` the tuple of its other leaves), for
            :meth:`rebuilt` to put the updated tensors back outside the compiled code (a graph that returns its
            inputs pays an alias check per output per call).
        state_update: the model's :class:`~d9dfn.StateUpdate`, applied to the buffers after the optimizer from its
            ``outputs`` summed over the microbatches and (with the gradients, in the same all-reduce) the
            data-parallel group; ``None``: the buffers as the executor returned them.
    """

    def __init__(
        self,
        task: TrainTask[Any],
        optimizer: Transform,
        *,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        reduce_gradients: GradientReduction | None,
        pipeline: PipelineReduction | None,
        precision: Precision | None,
        blockwise: BlockwiseTail | None,
        plan: ParallelPlan | None = None,
        local: frozenset[str] = frozenset(),
        fused: FusedUpdate | None = None,
        donate: bool = False,
        state_update: StateUpdate | None = None,
    ) -> None:
        self.task, self.optimizer = task, optimizer
        self.max_grad_norm, self.skip_nonfinite = max_grad_norm, skip_nonfinite
        self.reduce_gradients, self.pipeline, self.precision = reduce_gradients, pipeline, precision
        self.blockwise = blockwise
        self.plan, self.local, self.fused = plan, local, fused
        self.donate, self.state_update = donate, state_update
        self.distributed = plan is not None and plan.distributed  # DTensor params: reduced to their placements

    @staticmethod
    def fused_for(optimizer: Transform, device: torch.device) -> FusedUpdate | None:
        """The optimizer's fused kernel if the step runs it for params on ``device`` (it then runs the tail eagerly,
        :mod:`d9dfn.step._fused_tail`), else ``None`` (the tail is compiled)."""
        fused = optimizer.fused
        return fused if fused is not None and fused.wanted(device) else None

    def prepare(self, train_state: TrainState) -> None:
        """Before every call, outside the trace: the per-block tail's layout for this state's names and structure."""
        if self.blockwise is not None and self.fused is None:
            self.blockwise.prepare(trainable_params(train_state), train_state.opt_state)

    def reduce(
        self, sums: Sums, params: Params, stats: dict[str, torch.Tensor] | None = None
    ) -> tuple[Sums, dict[str, torch.Tensor]]:
        """The local sums → global ones: each ``DTensor`` param's partial gradient to its placement (in the
        policy's ``reduce_dtype``), then the data-parallel hook, then ``Σwℓ``/``Σw`` over the pipeline. ``stats``
        (a state update's sums, in their own dtype) ride through the data-parallel hook beside the plain gradients."""
        grads, loss_sum, weight_sum = sums
        stats = stats or {}
        distributed = self.distributed
        reduces = distributed or self.reduce_gradients is not None
        precision = self.precision if reduces else None
        if precision is not None:
            grads = precision.reduce(grads)
        if distributed:  # partial sums → each param's placement (all-reduce / reduce-scatter), few collectives
            assert self.plan is not None
            # In the eager (fused) tail the sums are reduced into themselves, a bucket at a time: no flat copy of all.
            in_place = self.fused is not None
            grads = reduce_partial_gradients(grads, params, self.local, self.plan.partial_placements, in_place=in_place)
        if self.reduce_gradients is not None:  # e.g. the data-parallel SUM: the 1/Σw below uses the global Σw
            # The stats under names no param has: summed with the plain gradients, one collective for both.
            tagged = {**grads, **{_STAT + name: value for name, value in stats.items()}}
            tagged, loss_sum, weight_sum = self.reduce_gradients(tagged, loss_sum, weight_sum)
            grads = {name: tagged[name] for name in grads}
            stats = {name: tagged[_STAT + name] for name in stats}
        if precision is not None:
            grads = precision.unreduce(grads, params)
        if self.pipeline is not None:  # then over pp: zeros from ranks without the last stage
            if stats:  # every stage's rank updates its own layers' state from the last stage's outputs
                loss_sum, weight_sum, stats = self.pipeline.sums(loss_sum, weight_sum, stats)
            else:
                loss_sum, weight_sum = self.pipeline.sums(loss_sum, weight_sum)
        return Sums(grads, loss_sum, weight_sum), stats

    def __call__(self, train_state: TrainState, result: ProgramResult) -> tuple[TrainState, StepOutput]:
        """The new train state and the step's :class:`StepOutput` from the executor's ``result``.

        Everything per leaf (reduction, norm, clipping, the optimizer, donation) sees the trainable params only
        (a state without the frozen ones); the frozen params come back as they were."""
        full_state, distributed = train_state, self.distributed
        params = trainable_params(train_state)
        if train_state.frozen:
            train_state = train_state.replace(params=params, frozen=())
        outs: list[MicrobatchOut] = result.outs
        local_weight_sum = result.sums.weight  # the tasks' logs stay per-rank weighted means
        stats = self._stats(outs, result.sums.loss)
        (grads, loss_sum, weight_sum), stats = self.reduce(result.sums, params, stats)
        # ∇(Σwℓ/Σw) for every parameter (d9d skipped non-replicated ones: bug §11.2).
        inv_weight = safe_divide(torch.ones_like(weight_sum), weight_sum)
        loss = loss_sum * inv_weight
        per_leaf = (self.max_grad_norm, self.skip_nonfinite, self.pipeline)
        if self.fused is not None:
            done = update_fused(train_state, grads, inv_weight, loss, self.fused, *per_leaf, distributed, self.donate)
        elif self.blockwise is not None and self.blockwise.layout.rest:  # the rest carries the state's shared scalars
            done = self.blockwise(params, grads, train_state.opt_state, inv_weight, loss, *per_leaf, distributed)
        else:
            done = update_whole(train_state, grads, inv_weight, loss, self.optimizer, *per_leaf)
        params_out, opt_state_out = with_trainable(full_state, done.params), done.opt_state
        if self.donate:  # the updated tensors are the state's own: rebuilt() puts them back, outside compiled code
            params_out, opt_state_out = {}, donated_update(train_state, done, written=self.fused is not None)
        buffers = result.buffers
        if self.state_update is not None:  # after the optimizer, from this step's global statistics
            buffers = self.state_update.update(buffers, stats)
        if self.skip_nonfinite:
            buffers = kept(done.nonfinite, train_state.buffers, buffers)
        metric_state = train_state.metric_state
        if metric_state is not None and outs:  # no metric state, no metrics (init_train_state(task=...) creates it)
            metric_state = self.task.update_metrics(metric_state, PipelineState.merge([out.state for out in outs]))
            if self.skip_nonfinite:  # a skipped step leaves no trace, in the metrics either
                metric_state = kept(done.nonfinite, train_state.metric_state, metric_state)
        new_state = full_state.replace(
            params=params_out,
            buffers=buffers,
            opt_state=opt_state_out,
            step=train_state.step + 1,
            metric_state=metric_state,
        )
        output = StepOutput(
            loss=loss,
            loss_weight=weight_sum,
            grad_norm=done.grad_norm,
            lr=done.lr.to(loss.device),
            nonfinite=done.nonfinite,
            skipped=done.nonfinite & self.skip_nonfinite,
            logs=weighted_logs(outs, local_weight_sum),
        )
        return new_state, output

    def _stats(self, outs: list[MicrobatchOut], like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state update's statistics summed over this rank's microbatches (none without an update); on a pipeline
        rank without the last stage (no loss, so no outputs), zeros of their shapes, to be summed over ``pp``."""
        update = self.state_update
        if update is None:
            return {}
        if not outs:
            if self.pipeline is None or update.shapes is None:
                return {}
            return {name: like.new_zeros(update.shapes[name], dtype=torch.float32) for name in update.outputs}
        return {name: torch.stack([out.stats[name] for out in outs]).sum(0) for name in update.outputs}

    @staticmethod
    def rebuilt(train_state: TrainState, new_state: TrainState) -> TrainState:
        """A donating tail's ``new_state`` made whole: ``train_state``'s params and per-param optimizer state (updated
        in place by the tail) back in it, beside the new scalars (``count``, ``lr``) it returned."""
        state = StateSlots.of(train_state.opt_state, trainable_params(train_state).keys())
        scalars = iter(new_state.opt_state)
        leaves = [dict(leaf) if i in state.slots else next(scalars) for i, leaf in enumerate(state.leaves)]
        return new_state.replace(params=dict(train_state.params), opt_state=state.spec.unflatten(leaves))
