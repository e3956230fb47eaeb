"""The train step: ``step(train_state, batch) -> (train_state, StepOutput)``, a program of compiled pieces.

How a training step travels (``docs/design/step.md`` has the reasoning):

``batch`` → ``task.build_forward_inputs`` → ``PipelineState`` → ``split(num_microbatches)`` (the compiled head)
→ per microbatch, one compiled piece: ``functional_call(model, params)`` → ``task.compute_loss`` → ``(ℓᵢ, wᵢ)`` →
``grad`` of ``wᵢℓᵢ`` → ``Σwᵢ∇ℓᵢ + ...`` (the accumulation inside the piece's graph) → the compiled tail:
(``reduce_gradients``: sum over the data-parallel group) → scale by ``1/Σw`` → clip → ``optimizer.update`` →
``apply_updates``. Each piece traces once, so graph count and compile time do not grow with the microbatch
count; ``unroll=True`` compiles the whole step as one graph instead, and ``pipeline=`` replaces the microbatch
loop by a pipeline program's executor (``d9dfn.pipeline``) with the same head and tail.

With ``DTensor`` params (data parallelism, ``docs/design/data-parallel.md``) the model runs on the
gathered full params; each gradient is then a ``Partial`` sum over the mesh and is reduced to its
param's placement (all-reduce over replicated axes, reduce-scatter over sharded ones), so clipping,
the optimizer and the new params all work on shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import grad_and_value

from d9dfn._blocks import regional_train_step, with_block_regions
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._precision import Precision
from d9dfn._pytree import pytree_dataclass
from d9dfn._step_parts import (
    Microbatch,
    _call_model,
    _check_pipeline,
    _check_reduction,
    _check_rng_kwarg,
    _compile,
    _in_mode,
    _pipeline_in_mode,
    _prepare,
    _weighted_logs,
    _with_pieces,
)
from d9dfn._tail import BlockwiseTail, kept, update_whole
from d9dfn._task import TrainTask
from d9dfn._train_state import TrainState
from d9dfn._types import Batch, Buffers, GradientReduction, Params, Transform
from d9dfn.parallel._grads import reduce_partial_gradients
from d9dfn.parallel._pipeline import PipelineReduction, pipeline_reduction
from d9dfn.parallel._placement import full_tensors
from d9dfn.pipeline import PipelineRank, Program, Stage, run_program, run_rank_program
from d9dfn.pipeline._split_backward import SplitBackward

__all__ = ["StepOutput", "make_train_step"]


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
    precision: Precision | None = None,
    blockwise: BlockwiseTail | None = None,
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
        blockwise: with ``repeated_blocks`` and a ``leafwise`` optimizer, the per-leaf work of each block's
            leaves through one shared region (:class:`d9dfn._tail.BlockwiseTail`); plain-tensor params only
            (``DTensor`` params update the whole tree).

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
    reduces = distributed or reduce_gradients is not None
    if reduces and precision is not None:  # gradients cross the group in precision.reduce_dtype
        grad_sum = precision.reduce(grad_sum)
    if distributed:  # partial sums → each param's placement (all-reduce / reduce-scatter), few collectives
        grad_sum = reduce_partial_gradients(grad_sum, params)
    if reduce_gradients is not None:  # e.g. the data-parallel SUM; the 1/Σw below then uses the global Σw
        grad_sum, loss_sum, weight_sum = reduce_gradients(grad_sum, loss_sum, weight_sum)
    if reduces and precision is not None:
        grad_sum = precision.unreduce(grad_sum, params)
    if reduce_pipeline is not None:  # then over pp: zeros from ranks without the last stage
        loss_sum, weight_sum = reduce_pipeline.sums(loss_sum, weight_sum)
    # ∇(Σwℓ/Σw) for every parameter (d9d skipped non-replicated ones: bug §11.2).
    inv_weight = safe_divide(torch.ones_like(weight_sum), weight_sum)
    loss = loss_sum * inv_weight
    if blockwise is not None and not distributed and reduce_pipeline is None and blockwise.applies(params):
        done = blockwise(params, grad_sum, train_state.opt_state, inv_weight, loss, max_grad_norm, skip_nonfinite)
    else:
        done = update_whole(
            train_state,
            grad_sum,
            inv_weight,
            loss,
            optimizer,
            max_grad_norm,
            skip_nonfinite,
            distributed,
            reduce_pipeline,
        )
    new_params, opt_state, grad_norm, nonfinite = done.params, done.opt_state, done.grad_norm, done.nonfinite
    lr = done.lr.to(loss.device)

    if skip_nonfinite:
        buffers = kept(nonfinite, train_state.buffers, buffers)
    metric_state = train_state.metric_state
    if metric_state is not None and outs:  # no metric state, no metrics (init_train_state(task=...) creates it)
        metric_state = task.update_metrics(metric_state, PipelineState.merge(new_states))
        if skip_nonfinite:  # a skipped step leaves no trace, in the metrics either
            metric_state = kept(nonfinite, train_state.metric_state, metric_state)
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


def _add_sums(
    sums: tuple[Params, torch.Tensor, torch.Tensor], grads: Params, weighted_loss: torch.Tensor, weight: torch.Tensor
) -> tuple[Params, torch.Tensor, torch.Tensor]:
    """``sums + (grads, wℓ, w)``, out of place.

    In place (``add_`` into the head's zeros) measured 1.5% faster on CPU but summed a replicated 0-d DTensor
    param's gradient wrongly over simulated ranks (``tests/test_parallel_properties.py``, mesh 2x1, 2
    microbatches); the out-of-place sum is what every test checks.
    """
    grad_sum, loss_sum, weight_sum = sums
    return (
        {name: grad_sum[name] + g for name, g in grads.items()},
        loss_sum + weighted_loss.detach(),
        weight_sum + weight,
    )


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
    precision: Precision | None = None,
    compile: bool = True,
    unroll: bool = False,
    backend: str = "inductor",
    repeated_blocks: Sequence[type[nn.Module]] = (),
    blockwise_optimizer: bool = False,
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
            unused, and ``program.num_microbatches`` must equal ``num_microbatches``). The executor interprets
            the program in Python; with ``compile`` the head and the tail are compiled, and every stage runs as
            its traced ``fw``/``dI``/``dW`` pieces (a plain ``B`` as ``dI`` then ``dW``), each compiled once
            (``compile=False``: ``vjp``, bitwise equal to the one-stage step). A
            :class:`d9dfn.pipeline.PipelineRank` runs this rank's row with sends and receives instead
            (:func:`d9dfn.pipeline.run_rank_program`; the train state holds this rank's params only) and sums
            the loss, its weight and the gradient norm over the ``pp`` group in the tail.
        precision: a :class:`d9dfn.Precision` policy: the state's floating params must be in its
            ``param_dtype``; the model runs in ``compute_dtype`` (params and floating inputs cast inside the
            step), gradients and the optimizer stay in ``param_dtype``, the loss, ``Σw`` and the norms in
            float32, and data-parallel reductions run in ``reduce_dtype``. ``None``: no casts.
        compile: compile the pieces (``torch.compile(fullgraph=True)``): the head, the per-microbatch piece
            and the tail, or with ``pipeline`` the head, each stage's pieces and the tail; ``False`` runs the
            same functions eagerly.
        unroll: compile the whole step as one graph with the microbatch loop unrolled (the pre-0.x step;
            compile time grows with ``num_microbatches``). See ``docs/design/step.md`` for when it is faster.
        backend: the ``torch.compile`` backend.
        repeated_blocks: classes of the model's repeated blocks (e.g. its decoder layer): each is compiled once
            for all its instances, so the layers add little to cold compile time (``d9dfn._blocks``). The
            per-microbatch piece then becomes a compiled forward and loss with the params swapped in, and the
            gradients come from autograd (accumulated over microbatches in ``.grad``, outside the graph);
            results equal the default piece to rounding. Not with ``pipeline`` or ``unroll``.
        blockwise_optimizer: with ``repeated_blocks``, the tail's per-leaf work (``1/Σw``, norm, clip, the
            optimizer, the skip) runs each block's leaves through one region too, so the tail stops growing with
            depth as well (:class:`d9dfn._tail.BlockwiseTail`; results equal the whole-tree tail bitwise in
            eager). Needs a ``leafwise`` optimizer (``adamw``, ``adam``, ``sgd`` without a
            ``weight_decay_mask``; :class:`d9dfn.Transform`). Measured on CPU: a flat cold compile with depth
            (−71% at 28 layers with ``repeated_blocks``) and a warm step within 5% of the default step's
            (``docs/design/step.md``); not measured on a GPU. Plain-tensor params
            only: ``DTensor`` params update the whole tree.

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
    _check_pipeline("make_train_step", pipeline, num_microbatches, unroll, precision)
    if repeated_blocks and (pipeline is not None or unroll):
        raise ValueError(
            "make_train_step: repeated_blocks compiles the one-stage program's forward per block; pass "
            "repeated_blocks=() with pipeline= or unroll=True"
        )
    if pipeline is None:
        _check_rng_kwarg("make_train_step", model, rng_kwarg)
    model, pipeline = _in_mode(model, training=True), _pipeline_in_mode(pipeline, training=True)
    mutable = frozenset(name for name, _ in model.named_buffers())
    reduce_pipeline = (
        pipeline_reduction(pipeline.group, pipeline.param_names) if isinstance(pipeline, PipelineRank) else None
    )
    if blockwise_optimizer and not (repeated_blocks and optimizer.leafwise):
        raise ValueError(
            "make_train_step: blockwise_optimizer=True updates each repeated block's leaves through one region; "
            + (
                "it needs repeated_blocks (pass the block's class)"
                if not repeated_blocks
                else "the optimizer is not leafwise (a name mask, a global norm or a per-leaf random stream), so a "
                "block's update would differ from the whole tree's; pass blockwise_optimizer=False"
            )
        )
    blockwise = BlockwiseTail(model, repeated_blocks, optimizer) if blockwise_optimizer else None

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
        outputs, new_buffers = _call_model(model, params, buffers, mutable, inputs, kwargs, precision)
        weighted_loss, out = microbatch_loss(outputs, state, step)
        return weighted_loss, (out, new_buffers)

    def head(
        train_state: TrainState, batch: Batch
    ) -> tuple[Params | None, list[Microbatch], tuple[Params, torch.Tensor, torch.Tensor] | None]:
        distributed = _check_reduction(train_state.params, reduce_gradients)
        if precision is not None:
            precision.check_params("make_train_step", train_state.params)
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
        # One microbatch starts from its own gradients. Several accumulate onto these zeros (0 + g is g,
        # bitwise), so every microbatch runs the same piece. With repeated blocks autograd accumulates.
        zeros = num_microbatches > 1 and not repeated_blocks
        sums = _zeros_like_sums(params, train_state.step.device) if zeros else None
        return full_params, microbatches, sums

    def piece(
        consts: tuple[Params, torch.Tensor], carry: tuple[Buffers, tuple[Any, ...] | None], microbatch: Microbatch
    ) -> tuple[tuple[Buffers, tuple[Any, ...] | None], tuple[Any, ...]]:
        """Forward, backward and ``sums += (w∇ℓ, wℓ, w)`` of one microbatch: one graph, called m times.

        Returns only the new mutable buffers (outputs that alias inputs cost a check per call) and the new sums.
        """
        params, step = consts
        buffers, sums = carry
        grads, (weighted_loss, (out, new_buffers)) = grad_and_value(model_loss, has_aux=True)(
            params, {**buffers}, microbatch, step
        )
        if sums is None:
            return (new_buffers, (grads, weighted_loss.detach(), out[2])), out
        return (new_buffers, _add_sums(sums, grads, weighted_loss, out[2])), out

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
            precision=precision,
            blockwise=blockwise,
        )

    if pipeline is not None:
        return _pipeline_train_step(pipeline, head, microbatch_loss, tail, compile, backend)
    if repeated_blocks:
        return regional_train_step(
            with_block_regions("make_train_step", model, repeated_blocks),
            mutable,
            precision,
            microbatch_loss,
            _compile(head, compile, backend),
            _compile(tail, compile, backend),
            compile,
            backend,
        )

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        full_params, microbatches, sums = head_fn(train_state, batch)
        consts = (train_state.params if full_params is None else full_params, train_state.step)
        buffers, outs = train_state.buffers, []
        for microbatch in microbatches:  # the piece traces once: every microbatch has the same shapes
            (new_buffers, sums), out = piece_fn(consts, (buffers, sums), microbatch)
            buffers = {**buffers, **new_buffers} if new_buffers else buffers
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


def _pipeline_train_step(
    pipeline: tuple[Program, Sequence[Stage]] | PipelineRank,
    head: Callable[..., Any],
    microbatch_loss: Callable[..., Any],
    tail: Callable[..., tuple[TrainState, StepOutput]],
    compile: bool,
    backend: str,
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """The train step over a pipeline program: compiled head, the executor (the single-process reference, or
    this rank's row with P2P for a ``PipelineRank``) interpreting the program in Python, compiled tail.

    Eager (``compile=False``) the stages run under ``vjp`` (``I``/``W`` through the traced split). Compiled, every
    stage runs as its traced ``fw``/``dI``/``dW`` pieces (``B`` = ``dI`` then ``dW``), each compiled once.
    """
    head_fn, tail_fn = _compile(head, compile, backend), _compile(tail, compile, backend)

    # Each stage traced into fw/dI/dW once, for every step (zero-bubble programs; every program when compiled).
    split = SplitBackward(compile=_piece_compiler(backend) if compile else None)

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

    piped = _with_pieces(step, head=head_fn, tail=tail_fn)
    piped.stage_pieces = split  # type: ignore[attr-defined]  # the stages' traced (and compiled) fw/dI/dW graphs
    return piped


def _piece_compiler(backend: str) -> Callable[[torch.fx.GraphModule], Callable[..., Any]]:
    """How a pipeline stage's traced piece is compiled: ``torch.compile(fullgraph=True)`` with the step's backend."""

    def compile_piece(graph: torch.fx.GraphModule) -> Callable[..., Any]:
        return torch.compile(graph, fullgraph=True, backend=backend)

    return compile_piece
