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

import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

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
from d9dfn.parallel._pipeline import PipelineReduction, pipeline_reduction
from d9dfn.parallel._placement import full_tensors, is_distributed_tensor
from d9dfn.pipeline import PipelineRank, Program, Stage, run_forward, run_program, run_rank_program
from d9dfn.pipeline._split_backward import SplitBackward

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

    if TYPE_CHECKING:  # added by ``pytree_dataclass``; declared here so that type checkers know it

        def replace(self, **changes: Any) -> Self:
            """Return a copy with ``changes`` applied; the original is unchanged."""
            ...


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


def train_tail(
    train_state: TrainState,
    buffers: Buffers,
    sums: tuple[Params, torch.Tensor, torch.Tensor],
    outs: list[tuple[PipelineState, dict[str, torch.Tensor], torch.Tensor]],
    *,
    task: TrainTask[Any],
    optimizer: Transform,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    reduce_gradients: GradientReduction | None,
    reduce_pipeline: PipelineReduction | None = None,
) -> tuple[TrainState, StepOutput]:
    """Everything a training step does after its microbatches, for every executor (one stage or a program).

    Args:
        train_state: the state the step started from.
        buffers: the buffers after every microbatch's forward, in forward order.
        sums: ``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ)`` over this rank's microbatches; gradients of the full (gathered) params.
        outs: per microbatch, in order: ``(new pipeline state, logs, wᵢ)``; empty on a pipeline rank without
            the last stage (its metrics and logs stay as they are: the last stage's rank owns them).
        reduce_pipeline: on a pipeline rank, the ``pp`` hooks: ``Σwℓ``/``Σw`` summed over ``pp`` after the
            data-parallel reduction, and the gradient norm over every stage, so that every rank scales, clips
            and skips alike (``d9dfn.parallel.pipeline_reduction``).

    Returns:
        The new train state and the step's :class:`StepOutput`: reduce over the data-parallel group → scale by
        ``1/Σw`` → global norm → clip → ``optimizer.update`` → ``apply_updates`` → skip if non-finite → metrics.
    """
    params = train_state.params
    distributed = _check_reduction(params, reduce_gradients)
    grad_sum, loss_sum, weight_sum = sums
    new_states = [new_state for new_state, _, _ in outs]
    logs = [(mb_logs, weight) for _, mb_logs, weight in outs]
    local_weight_sum = weight_sum  # the tasks' logs stay per-rank weighted means
    if distributed:  # partial sums → each param's placement (all-reduce / reduce-scatter), few collectives
        grad_sum = reduce_partial_gradients(grad_sum, params)
    if reduce_gradients is not None:  # e.g. the data-parallel SUM; the 1/Σw below then uses the global Σw
        grad_sum, loss_sum, weight_sum = reduce_gradients(grad_sum, loss_sum, weight_sum)
    if reduce_pipeline is not None:  # then over pp: zeros from ranks without the last stage
        loss_sum, weight_sum = reduce_pipeline.sums(loss_sum, weight_sum)
    # ∇(Σwℓ/Σw) for every parameter (d9d skipped non-replicated ones: bug §11.2).
    inv_weight = safe_divide(torch.ones_like(weight_sum), weight_sum)
    grads = {name: g * inv_weight.to(g.dtype) for name, g in grad_sum.items()}
    loss = loss_sum * inv_weight
    # Over all shards: one collective per sharding pattern for DTensor gradients.
    if reduce_pipeline is not None:  # over every stage: torchtitan#596 clipped with the local norm
        grad_norm = reduce_pipeline.global_norm(grads)
    else:
        grad_norm = parallel_global_norm(grads) if distributed else optim.global_norm(grads)
    if max_grad_norm:
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
    if metric_state is not None and outs:  # no metric state, no metrics (init_train_state(task=...) creates it)
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


def _zeros_like_sums(params: Params, device: torch.device) -> tuple[Params, torch.Tensor, torch.Tensor]:
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    return {name: torch.zeros_like(p) for name, p in params.items()}, loss_sum, torch.zeros_like(loss_sum)


def _add_sums_(
    sums: tuple[Params, torch.Tensor, torch.Tensor], grads: Params, weighted_loss: torch.Tensor, weight: torch.Tensor
) -> None:
    """``sums += (grads, wℓ, w)`` in place: the step's own accumulators, created by its head each step."""
    grad_sum, loss_sum, weight_sum = sums
    for name, g in grads.items():
        grad_sum[name].add_(g)
    loss_sum.add_(weighted_loss.detach())
    weight_sum.add_(weight)


def make_train_step(
    model: nn.Module,
    task: TrainTask[Any],
    optimizer: Transform,
    *,
    num_microbatches: int = 1,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    rng_kwarg: str | None = None,
    reduce_gradients: GradientReduction | None = None,
    data_parallel_rank: int = 0,
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank | None = None,
    compile: bool = True,
    unroll: bool = False,
    backend: str = "inductor",
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """Build ``step(train_state, batch) -> (train_state, StepOutput)``.

    The step is a program of pieces, each compiled once (``docs/design/step.md``): a head (inputs, split,
    keys), a per-microbatch piece — forward, backward and the gradient accumulation in one graph — called
    ``num_microbatches`` times, and a tail (reduction, ``1/Σw``, clipping, the optimizer). Graph count and cold
    compile time do not grow with ``num_microbatches``.

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
        pipeline: ``(program, stages)``: run a pipeline program (``d9dfn.pipeline``) over these stages with
            the single-process reference executor (:func:`d9dfn.pipeline.run_program`; ``model`` is then
            unused, and ``program.num_microbatches`` must equal ``num_microbatches``). The executor runs
            eagerly; with ``compile`` the head and the tail are compiled. A
            :class:`d9dfn.pipeline.PipelineRank` runs this rank's row with sends and receives instead
            (:func:`d9dfn.pipeline.run_rank_program`; the train state holds this rank's params only) and sums
            the loss, its weight and the gradient norm over the ``pp`` group in the tail.
        compile: compile the pieces (``torch.compile(fullgraph=True)``); ``False`` runs the same functions
            eagerly.
        unroll: compile the whole step as one graph with the microbatch loop unrolled (the pre-0.x step;
            compile time grows with ``num_microbatches``). See ``docs/design/step.md`` for when it is faster.
        backend: the ``torch.compile`` backend.

    Returns:
        The step function. It never mutates its inputs.

    Raises:
        ValueError: ``num_microbatches``, ``max_grad_norm`` or ``data_parallel_rank`` out of range, a pipeline
            program whose microbatch count differs, or ``unroll`` with a pipeline; at the first call,
            ``DTensor`` params without ``reduce_gradients``.
    """
    if data_parallel_rank < 0:
        raise ValueError(f"make_train_step: data_parallel_rank={data_parallel_rank}; pass this rank's index >= 0")
    if num_microbatches < 1:
        raise ValueError(f"make_train_step: num_microbatches={num_microbatches}; pass a positive count")
    if max_grad_norm is not None and max_grad_norm < 0:
        raise ValueError(f"make_train_step: max_grad_norm={max_grad_norm}; pass a positive norm, or None to not clip")
    _check_pipeline("make_train_step", pipeline, num_microbatches, unroll)
    mutable = frozenset(name for name, _ in model.named_buffers())
    reduce_pipeline = (
        pipeline_reduction(pipeline.group, pipeline.param_names) if isinstance(pipeline, PipelineRank) else None
    )

    def microbatch_loss(
        outputs: Mapping[str, torch.Tensor], state: PipelineState, step: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[PipelineState, dict[str, torch.Tensor], torch.Tensor]]:
        """``(wℓ, (new state, logs, w))``: ``w`` detached and float32; the loss the backward seeds."""
        result = task.compute_loss(outputs, state, step)
        weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight.detach()
        weight = weight.to(torch.float32)
        # torch.func's aux may hold tensors only (no None): hand back the state itself when unchanged.
        new_state = state if result.state is None else result.state
        return result.loss.float() * weight, (new_state, result.logs, weight)

    def model_loss(
        params: Params, buffers: Buffers, microbatch: Microbatch, step: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[tuple[Any, ...], Buffers]]:
        inputs, kwargs, state = microbatch
        outputs, new_buffers = _call_model(model, params, buffers, mutable, inputs, kwargs)
        weighted_loss, out = microbatch_loss(outputs, state, step)
        return weighted_loss, (out, new_buffers)

    def head(
        train_state: TrainState, batch: Batch
    ) -> tuple[Params | None, list[Microbatch], tuple[Params, torch.Tensor, torch.Tensor] | None]:
        distributed = _check_reduction(train_state.params, reduce_gradients)
        microbatches = _prepare(
            task,
            batch,
            num_microbatches,
            rng=train_state.rng,
            step=train_state.step,
            rng_kwarg=rng_kwarg,
            first_index=data_parallel_rank * num_microbatches,
        )
        # DTensor params → all-gathered plain tensors. Plain params are not returned: a compiled graph that
        # returns its inputs pays a per-output alias check on every call.
        full_params = full_tensors(train_state.params) if distributed else None
        params = train_state.params if full_params is None else full_params
        # One microbatch starts from its own gradients. Several accumulate in place into these zeros, which
        # belong to this step alone (0 + g is g, bitwise), so every microbatch runs the same piece.
        sums = None if num_microbatches == 1 else _zeros_like_sums(params, train_state.step.device)
        return full_params, microbatches, sums

    def piece(
        consts: tuple[Params, torch.Tensor], carry: tuple[Buffers, tuple[Any, ...] | None], microbatch: Microbatch
    ) -> tuple[tuple[Buffers, tuple[Any, ...] | None], tuple[Any, ...]]:
        """Forward, backward and ``sums += (w∇ℓ, wℓ, w)`` of one microbatch: one graph, called m times.

        The sums are the step's own buffers, accumulated in place (inductor writes the adds into them): no
        fresh gradient-sized allocation per microbatch. Returns only the new mutable buffers, and the sums
        only when it was given none (one microbatch): outputs that alias inputs cost a check per call.
        """
        params, step = consts
        buffers, sums = carry
        grads, (weighted_loss, (out, new_buffers)) = grad_and_value(model_loss, has_aux=True)(
            params, {**buffers}, microbatch, step
        )
        if sums is None:
            return (new_buffers, (grads, weighted_loss.detach(), out[2])), out
        _add_sums_(sums, grads, weighted_loss, out[2])
        return (new_buffers, None), out

    def tail(
        train_state: TrainState, buffers: Buffers, sums: tuple[Any, ...], outs: list[Any]
    ) -> tuple[TrainState, StepOutput]:
        return train_tail(
            train_state,
            buffers,
            sums,
            outs,
            task=task,
            optimizer=optimizer,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=skip_nonfinite,
            reduce_gradients=reduce_gradients,
            reduce_pipeline=reduce_pipeline,
        )

    if pipeline is not None:
        return _pipeline_train_step(pipeline, head, microbatch_loss, tail, compile, backend)

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        full_params, microbatches, sums = head_fn(train_state, batch)
        consts = (train_state.params if full_params is None else full_params, train_state.step)
        buffers, outs = train_state.buffers, []
        for microbatch in microbatches:  # the piece traces once: every microbatch has the same shapes
            (new_buffers, own_sums), out = piece_fn(consts, (buffers, sums), microbatch)
            buffers = {**buffers, **new_buffers} if new_buffers else buffers
            sums = own_sums if sums is None else sums
            outs.append(out)
        assert sums is not None  # the head's zeros, or the one microbatch's own sums
        return tail_fn(train_state, buffers, sums, outs)

    if unroll:  # the whole step, loop unrolled, as one graph
        head_fn, piece_fn, tail_fn = head, piece, tail
        compiled = _compile(step, compile, backend)
        return _with_pieces(compiled, step=compiled)
    head_fn, piece_fn, tail_fn = (
        _compile(head, compile, backend),
        _compile(piece, compile, backend),
        _compile(tail, compile, backend),
    )
    return _with_pieces(step, head=head_fn, microbatch=piece_fn, tail=tail_fn)


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


def _pipeline_train_step(
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank,
    head: Callable[..., Any],
    microbatch_loss: Callable[..., Any],
    tail: Callable[..., tuple[TrainState, StepOutput]],
    compile: bool,
    backend: str,
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """The train step over a pipeline program: compiled head, an eager executor (the single-process reference, or
    this rank's row with P2P for a ``PipelineRank``), compiled tail."""
    head_fn, tail_fn = _compile(head, compile, backend), _compile(tail, compile, backend)

    split = SplitBackward()  # zero-bubble programs: each stage traced into fw/dI/dW once, for every step

    def loss(outputs: Mapping[str, torch.Tensor], state_and_step: tuple[Any, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        # The step tensor travels with the microbatch state, not in a closure: a traced I/W graph would keep a
        # closure's tensor as a constant (the first step's value) for every later step.
        state, step = state_and_step
        return microbatch_loss(outputs, state, step)  # type: ignore[no-any-return]

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        full_params, microbatches, sums = head_fn(train_state, batch)
        params = train_state.params if full_params is None else full_params
        microbatches = [(inputs, kwargs, (state, train_state.step)) for inputs, kwargs, state in microbatches]
        if isinstance(pipeline, PipelineRank):
            result = run_rank_program(
                pipeline, params, train_state.buffers, microbatches, loss, sums=sums, step=train_state.step, split=split
            )
        else:
            result = run_program(*pipeline, params, train_state.buffers, microbatches, loss, sums=sums, split=split)
        return tail_fn(train_state, result.buffers, result.sums, result.outs)

    return _with_pieces(step, head=head_fn, tail=tail_fn)


def make_eval_step(
    model: nn.Module,
    task: TrainTask[Any],
    *,
    num_microbatches: int = 1,
    pipeline: tuple[Program, Sequence[Stage]] | None = None,
    compile: bool = True,
    backend: str = "inductor",
) -> Callable[[TrainState, PyTree, Batch], tuple[PyTree, EvalOutput]]:
    """Build ``eval_step(train_state, metric_state, batch) -> (metric_state, EvalOutput)``: no gradients.

    The model runs with the train state's params and buffers; buffer updates (if the model makes any)
    are discarded. Metrics accumulate in the ``metric_state`` passed in, apart from training metrics.
    The same pieces as the train step: head, one per-microbatch piece, tail; ``pipeline=(program, stages)``
    runs the program's forwards over the stages instead (reference executor, eager).
    """
    _check_pipeline("make_eval_step", pipeline, num_microbatches, False)
    mutable = frozenset(name for name, _ in model.named_buffers())

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

    def piece(
        consts: tuple[Any, ...], carry: tuple[Any, ...], microbatch: Microbatch
    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        params, buffers, step = consts
        inputs, kwargs, state = microbatch
        outputs, _ = _call_model(model, params, buffers, mutable, inputs, kwargs)
        return consume(step, carry, outputs, state)

    def tail(metric_state: PyTree, carry: tuple[Any, ...], outs: list[Any]) -> tuple[PyTree, EvalOutput]:
        loss_sum, weight_sum = carry
        metric_state = task.update_metrics(metric_state, PipelineState.merge([state for state, _, _ in outs]))
        logs = _weighted_logs([(mb_logs, weight) for _, mb_logs, weight in outs], weight_sum)
        return metric_state, EvalOutput(loss=safe_divide(loss_sum, weight_sum), loss_weight=weight_sum, logs=logs)

    head_fn, piece_fn, tail_fn = (
        _compile(head, compile, backend),
        _compile(piece, compile, backend),
        _compile(tail, compile, backend),
    )

    def eval_step(train_state: TrainState, metric_state: PyTree, batch: Batch) -> tuple[PyTree, EvalOutput]:
        with torch.no_grad():
            params, microbatches, carry = head_fn(train_state, batch)
            if pipeline is None:
                carry, outs = _microbatch_loop(
                    piece_fn, (params, train_state.buffers, train_state.step), carry, microbatches
                )
            else:
                outputs = run_forward(*pipeline, params, train_state.buffers, microbatches)
                outs = []
                for out, (_, _, state) in zip(outputs, microbatches, strict=True):
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
    pipeline: tuple[Program, Sequence[Stage]] | None = None,
    compile: bool = True,
    backend: str = "inductor",
) -> Callable[[InferenceState, Batch], InferenceState]:
    """Build ``infer_step(inference_state, batch) -> inference_state``: forward only, no gradients.

    Per microbatch the task's ``process_outputs`` folds the outputs into ``task_state``; the merged
    pipeline state then updates the metrics. ``pipeline=(program, stages)`` runs the program's forwards over
    the stages instead (reference executor, eager; ``d9dfn.pipeline.inference`` is the natural program).
    """
    _check_pipeline("make_inference_step", pipeline, num_microbatches, False)
    mutable = frozenset(name for name, _ in model.named_buffers())

    def head(inference_state: InferenceState, batch: Batch) -> tuple[Params, list[Microbatch]]:
        microbatches = _prepare(
            task, batch, num_microbatches, rng=inference_state.rng, step=inference_state.step, rng_kwarg=rng_kwarg
        )
        return full_tensors(inference_state.params), microbatches

    def piece(consts: tuple[Any, ...], task_state: PyTree, microbatch: Microbatch) -> tuple[PyTree, PipelineState]:
        params, buffers = consts
        inputs, kwargs, state = microbatch
        outputs, _ = _call_model(model, params, buffers, mutable, inputs, kwargs)
        return task.process_outputs(task_state, outputs, state), state

    def tail(inference_state: InferenceState, task_state: PyTree, states: list[Any]) -> InferenceState:
        metric_state = task.update_metrics(inference_state.metric_state, PipelineState.merge(states))
        return inference_state.replace(task_state=task_state, metric_state=metric_state, step=inference_state.step + 1)

    head_fn, piece_fn, tail_fn = (
        _compile(head, compile, backend),
        _compile(piece, compile, backend),
        _compile(tail, compile, backend),
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
                outputs = run_forward(*pipeline, params, inference_state.buffers, microbatches)
                states = []
                for out, (_, _, state) in zip(outputs, microbatches, strict=True):
                    task_state = task.process_outputs(task_state, out, state)
                    states.append(state)
            return tail_fn(inference_state, task_state, states)

    return _with_pieces(infer_step, head=head_fn, microbatch=piece_fn, tail=tail_fn)
