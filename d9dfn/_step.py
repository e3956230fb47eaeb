"""The step: one pure function ``step(train_state, batch) -> (train_state, StepOutput)``, compiled whole.

How a training step travels (docs/design/step.md has the reasoning):

``batch`` → ``task.build_forward_inputs`` → ``PipelineState`` → ``split(num_microbatches)`` → per microbatch:
``functional_call(model, params)`` → ``task.compute_loss`` → ``(ℓᵢ, wᵢ)`` → ``grad`` of ``wᵢℓᵢ`` →
accumulate ``Σwᵢ∇ℓᵢ`` and ``Σwᵢ`` → (``reduce_gradients``: sum over the data-parallel group) → scale by
``1/Σw`` → clip → ``optimizer.update`` → ``apply_updates``.

With ``DTensor`` params (data parallelism, ``docs/design/data-parallel.md``) the model runs on the
gathered full params; each gradient is then a ``Partial`` sum over the mesh and is reduced to its
param's placement (all-reduce over replicated axes, reduce-scatter over sharded ones), so clipping,
the optimizer and the new params all work on shards.

The microbatch loop is unrolled at trace time (``num_microbatches`` is static); each microbatch's
activations die before the next one's forward, as with eager gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value

from d9dfn import optim, prng
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import pytree_dataclass, tree_map
from d9dfn._sharding import shard_tree, spec_on_dim
from d9dfn._task import BuildForwardInputsResult, InferenceTask, PipelineShardingSpec, TrainTask
from d9dfn._train_state import TrainState
from d9dfn._types import Batch, Buffers, GradientReduction, Params, PyTree, Transform
from d9dfn.parallel._grads import global_norm as parallel_global_norm
from d9dfn.parallel._grads import reduce_partial_gradients
from d9dfn.parallel._placement import full_tensors, is_distributed_tensor

__all__ = [
    "EvalOutput",
    "InferenceState",
    "StepOutput",
    "make_eval_step",
    "make_inference_step",
    "make_train_step",
]


@pytree_dataclass
class StepOutput:
    """What one training step reports. Every field is a tensor: reading one is a host sync.

    Attributes:
        loss: ``Σwℓ / Σw`` over the step's microbatches (0-d float32).
        loss_weight: ``Σw`` (0-d).
        grad_norm: global L2 norm of the scaled gradient, before clipping (0-d).
        lr: the learning rate the optimizer update used, as its new state records it (``optim.learning_rate``;
            0-d float32, NaN when no transform in the optimizer records a rate).
        nonfinite: ``True`` when the loss or the gradient norm is NaN or infinite (0-d bool).
        skipped: ``True`` when the update was skipped for that reason (``skip_nonfinite=True``).
        logs: the tasks' extra values, averaged over microbatches with the loss weights.
    """

    loss: torch.Tensor
    loss_weight: torch.Tensor
    grad_norm: torch.Tensor
    lr: torch.Tensor
    nonfinite: torch.Tensor
    skipped: torch.Tensor
    logs: dict[str, torch.Tensor]


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


def _weighted_logs(per_mb: list[tuple[dict[str, torch.Tensor], torch.Tensor]], total: torch.Tensor) -> dict:
    if not per_mb or not per_mb[0][0]:
        return {}
    names = per_mb[0][0].keys()
    for index, (logs, _) in enumerate(per_mb):
        if logs.keys() != names:
            raise ValueError(
                f"compute_loss: microbatch {index} logged {sorted(logs)} but microbatch 0 logged {sorted(names)}; "
                "return the same ComputeLossResult.logs keys for every microbatch"
            )
    return {name: safe_divide(sum(logs[name].detach().float() * w for logs, w in per_mb), total) for name in names}


def _compile(fn: Callable, compile: bool, backend: str) -> Callable:
    return torch.compile(fn, fullgraph=True, backend=backend) if compile else fn


def make_train_step(
    model: nn.Module,
    task: TrainTask,
    optimizer: Transform,
    *,
    num_microbatches: int = 1,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    rng_kwarg: str | None = None,
    reduce_gradients: GradientReduction | None = None,
    data_parallel_rank: int = 0,
    compile: bool = True,
    backend: str = "inductor",
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """Build ``step(train_state, batch) -> (train_state, StepOutput)``.

    Args:
        model: the module skeleton; its own tensors are never read (it may live on the meta device).
        task: supplies inputs, per-microbatch losses and metric updates.
        optimizer: a ``d9dfn.optim`` transform over the trainable params.
        num_microbatches: gradient-accumulation count; the local batch must split evenly.
        max_grad_norm: clip the global gradient norm to this value (``None`` or 0: no clipping).
        skip_nonfinite: keep params, buffers and optimizer state unchanged on a non-finite step.
        rng_kwarg: pass each microbatch's key (``d9dfn.prng``) to the model under this keyword
            (e.g. ``"dropout_key"``); keys derive from ``train_state.rng``, the step and the microbatch's
            global index ``data_parallel_rank * num_microbatches + i``.
        reduce_gradients: ``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ) -> (Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ)`` applied to the local sums right
            before the ``1/Σw`` scaling, inside the compiled step. Data parallelism passes
            ``d9dfn.parallel.data_parallel_reduction(group)``, which sums all three over the data-parallel
            group, so the gradient is that of the global weighted mean and ``loss`` / ``loss_weight`` are
            global. It must be traceable and must not mutate its inputs. ``None``: the local sums are used.
            Gradients of ``DTensor`` params reach the hook already reduced to their param's placement;
            ``DTensor`` params without a hook are an error (``Σw`` would stay local).
        data_parallel_rank: this process's index among the data-parallel ranks, which feed consecutive
            slices of the global batch. It numbers the microbatches' keys globally, so a data-parallel run
            draws the same dropout masks as one process on the whole batch, and replicas never share masks.
        compile: ``torch.compile(step, fullgraph=True)``; ``False`` runs the same function eagerly.
        backend: the ``torch.compile`` backend.

    Returns:
        The step function. It never mutates its inputs.

    Raises:
        ValueError: ``num_microbatches``, ``max_grad_norm`` or ``data_parallel_rank`` out of range; at the
            first call, ``DTensor`` params without ``reduce_gradients``.
    """
    if data_parallel_rank < 0:
        raise ValueError(f"make_train_step: data_parallel_rank={data_parallel_rank}; pass this rank's index >= 0")
    if num_microbatches < 1:
        raise ValueError(f"make_train_step: num_microbatches={num_microbatches}; pass a positive count")
    if max_grad_norm is not None and max_grad_norm < 0:
        raise ValueError(f"make_train_step: max_grad_norm={max_grad_norm}; pass a positive norm, or None to not clip")
    mutable = frozenset(name for name, _ in model.named_buffers())
    clip = bool(max_grad_norm)

    def microbatch_loss(
        params: Params,
        buffers: Buffers,
        inputs: dict[str, Any],
        kwargs: dict[str, Any],
        state: PipelineState,
        step: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[PipelineState, dict[str, torch.Tensor], Buffers, torch.Tensor]]:
        outputs, new_buffers = _call_model(model, params, buffers, mutable, inputs, kwargs)
        result = task.compute_loss(outputs, state, step)
        weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight.detach()
        weight = weight.to(torch.float32)
        # torch.func's aux may hold tensors only (no None): hand back the state itself when unchanged.
        new_state = state if result.state is None else result.state
        return result.loss.float() * weight, (new_state, result.logs, new_buffers, weight)

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        forward, state = task.build_forward_inputs(batch, PipelineState())
        microbatches = _split_inputs(forward, num_microbatches)
        states = state.split(num_microbatches)
        step_key = prng.fold_in(train_state.rng, train_state.step)
        params, buffers = train_state.params, train_state.buffers
        distributed = [name for name, p in params.items() if is_distributed_tensor(p)]
        if distributed and reduce_gradients is None:
            raise ValueError(
                f"make_train_step: params[{distributed[0]!r}] is a DTensor but the step has no reduce_gradients; "
                "pass reduce_gradients=d9dfn.parallel.data_parallel_reduction(mesh) so that the loss weight is "
                "summed over the data-parallel ranks"
            )
        full_params = full_tensors(params)  # DTensor → all-gathered plain tensor; plain params as they are

        grad_sum: Params | None = None
        loss_sum = torch.zeros((), dtype=torch.float32, device=train_state.step.device)
        weight_sum = torch.zeros_like(loss_sum)
        new_states, logs = [], []
        for index, ((inputs, kwargs), mb_state) in enumerate(zip(microbatches, states, strict=True)):
            if rng_kwarg is not None:
                global_index = data_parallel_rank * num_microbatches + index
                kwargs = {**kwargs, rng_kwarg: prng.fold_in(step_key, global_index)}
            grads, (weighted_loss, (new_state, mb_logs, new_buffers, weight)) = grad_and_value(
                microbatch_loss, has_aux=True
            )(full_params, {**buffers}, inputs, kwargs, mb_state, train_state.step)
            buffers = {**buffers, **new_buffers}
            grad_sum = grads if grad_sum is None else tree_map(torch.add, grad_sum, grads)
            loss_sum = loss_sum + weighted_loss.detach()
            weight_sum = weight_sum + weight
            new_states.append(new_state)
            logs.append((mb_logs, weight))

        local_weight_sum = weight_sum  # the tasks' logs stay per-rank weighted means
        if distributed:  # partial sums → each param's placement (all-reduce / reduce-scatter), few collectives
            grad_sum = reduce_partial_gradients(grad_sum, params)
        if reduce_gradients is not None:  # e.g. the data-parallel SUM; the 1/Σw below then uses the global Σw
            grad_sum, loss_sum, weight_sum = reduce_gradients(grad_sum, loss_sum, weight_sum)
        # ∇(Σwℓ/Σw) for every parameter (d9d skipped non-replicated ones: bug §11.2).
        inv_weight = safe_divide(torch.ones_like(weight_sum), weight_sum)
        grads = {name: g * inv_weight.to(g.dtype) for name, g in grad_sum.items()}
        loss = loss_sum * inv_weight
        # Over all shards: one collective per sharding pattern for DTensor gradients.
        grad_norm = parallel_global_norm(grads) if distributed else optim.global_norm(grads)
        if clip:
            scale = optim.clip_factor(grad_norm, max_grad_norm)  # the norm over all shards, not this rank's
            grads = {name: g * scale.to(g.dtype) for name, g in grads.items()}
        updates, opt_state = optimizer.update(grads, train_state.opt_state, params)
        lr = optim.learning_rate(opt_state).to(loss.device)  # what this update used, before a skip restores the state
        new_params = optim.apply_updates(params, updates)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if skip_nonfinite:

            def keep(new: Any, old: Any) -> Any:
                return torch.where(nonfinite, old, new) if isinstance(new, torch.Tensor) else new

            new_params = tree_map(keep, new_params, params)
            opt_state = tree_map(keep, opt_state, train_state.opt_state)
            buffers = tree_map(keep, buffers, train_state.buffers)

        metric_state = train_state.metric_state
        if metric_state is not None:  # no metric state, no metrics (init_train_state(task=...) creates it)
            metric_state = task.update_metrics(metric_state, PipelineState.merge(new_states))
            if skip_nonfinite:  # a skipped step leaves no trace, in the metrics either
                metric_state = tree_map(keep, metric_state, train_state.metric_state)
        new_state = train_state.replace(
            params=new_params,
            buffers=buffers,
            opt_state=opt_state,
            step=train_state.step + 1,
            metric_state=metric_state,
        )
        output = StepOutput(
            loss=loss,
            loss_weight=weight_sum,
            grad_norm=grad_norm,
            lr=lr,
            nonfinite=nonfinite,
            skipped=nonfinite & skip_nonfinite,
            logs=_weighted_logs(logs, local_weight_sum),
        )
        return new_state, output

    return _compile(step, compile, backend)


def make_eval_step(
    model: nn.Module,
    task: TrainTask,
    *,
    num_microbatches: int = 1,
    compile: bool = True,
    backend: str = "inductor",
) -> Callable[[TrainState, PyTree, Batch], tuple[PyTree, EvalOutput]]:
    """Build ``eval_step(train_state, metric_state, batch) -> (metric_state, EvalOutput)``: no gradients.

    The model runs with the train state's params and buffers; buffer updates (if the model makes any)
    are discarded. Metrics accumulate in the ``metric_state`` passed in, apart from training metrics.
    """
    mutable = frozenset(name for name, _ in model.named_buffers())

    def eval_step(train_state: TrainState, metric_state: PyTree, batch: Batch) -> tuple[PyTree, EvalOutput]:
        with torch.no_grad():
            forward, state = task.build_forward_inputs(batch, PipelineState())
            microbatches = _split_inputs(forward, num_microbatches)
            loss_sum = torch.zeros((), dtype=torch.float32, device=train_state.step.device)
            weight_sum = torch.zeros_like(loss_sum)
            new_states, logs = [], []
            params = full_tensors(train_state.params)
            for (inputs, kwargs), mb_state in zip(microbatches, state.split(num_microbatches), strict=True):
                outputs, _ = _call_model(model, params, train_state.buffers, mutable, inputs, kwargs)
                result = task.compute_loss(outputs, mb_state, train_state.step)
                weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight
                weight = weight.to(torch.float32)
                loss_sum = loss_sum + result.loss.float() * weight
                weight_sum = weight_sum + weight
                new_states.append(mb_state if result.state is None else result.state)
                logs.append((result.logs, weight))
            metric_state = task.update_metrics(metric_state, PipelineState.merge(new_states))
            output = EvalOutput(
                loss=safe_divide(loss_sum, weight_sum), loss_weight=weight_sum, logs=_weighted_logs(logs, weight_sum)
            )
        return metric_state, output

    return _compile(eval_step, compile, backend)


def make_inference_step(
    model: nn.Module,
    task: InferenceTask,
    *,
    num_microbatches: int = 1,
    rng_kwarg: str | None = None,
    compile: bool = True,
    backend: str = "inductor",
) -> Callable[[InferenceState, Batch], InferenceState]:
    """Build ``infer_step(inference_state, batch) -> inference_state``: forward only, no gradients.

    Per microbatch the task's ``process_outputs`` folds the outputs into ``task_state``; the merged
    pipeline state then updates the metrics.
    """
    mutable = frozenset(name for name, _ in model.named_buffers())

    def infer_step(inference_state: InferenceState, batch: Batch) -> InferenceState:
        with torch.no_grad():
            forward, state = task.build_forward_inputs(batch, PipelineState())
            microbatches = _split_inputs(forward, num_microbatches)
            step_key = prng.fold_in(inference_state.rng, inference_state.step)
            task_state = inference_state.task_state
            params = full_tensors(inference_state.params)
            new_states = []
            for index, ((inputs, kwargs), mb_state) in enumerate(
                zip(microbatches, state.split(num_microbatches), strict=True)
            ):
                if rng_kwarg is not None:
                    kwargs = {**kwargs, rng_kwarg: prng.fold_in(step_key, index)}
                outputs, _ = _call_model(model, params, inference_state.buffers, mutable, inputs, kwargs)
                task_state = task.process_outputs(task_state, outputs, mb_state)
                new_states.append(mb_state)
            metric_state = task.update_metrics(inference_state.metric_state, PipelineState.merge(new_states))
        return inference_state.replace(task_state=task_state, metric_state=metric_state, step=inference_state.step + 1)

    return _compile(infer_step, compile, backend)
