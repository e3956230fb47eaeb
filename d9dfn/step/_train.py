"""The train step: ``step(train_state, batch) -> (train_state, StepOutput)``, a program of compiled pieces.

``batch`` → the head (``task.build_forward_inputs``, the microbatches and their keys, the gathered params, where
the sums start) → the executor (:mod:`d9dfn.step._executors`: the microbatches one after another, or a pipeline
program) → its :class:`~d9dfn.pipeline.ProgramResult` → the tail (:class:`d9dfn.step._tail.Tail`: reduction,
``1/Σw``, clipping, the optimizer, metrics). ``docs/design/step.md`` has the reasoning, ``docs/architecture.md``
which module owns which feature.

With ``DTensor`` params (data parallelism, ``docs/design/data-parallel.md``) the model runs on the gathered full
params; each gradient is then a ``Partial`` sum over the mesh and is reduced to its param's placement (all-reduce
over replicated axes, reduce-scatter over sharded ones), so clipping, the optimizer and the new params all work on
shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from d9dfn._pipeline_state import PipelineState
from d9dfn._task import TrainTask
from d9dfn._torch import backward_compiled_early
from d9dfn._types import Batch, DataParallel, Params, StateUpdate, Sums, Transform
from d9dfn.parallel._pipeline import pipeline_reduction
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.pipeline import PipelineRank, ProgramResult
from d9dfn.step._blocks import BlockChoice, region_compiled
from d9dfn.step._blockwise_tail import BlockwiseTail
from d9dfn.step._checkpointing import ActivationCheckpointing
from d9dfn.step._executors import Executor, Sequential, train_run
from d9dfn.step._microbatches import Microbatch, MicrobatchOut, check_rng_kwarg, in_mode, prepare
from d9dfn.step._options import (
    Backend,
    block_modules,
    check_state,
    resolve_data_parallel,
    resolve_options,
    step_device,
    with_pieces,
)
from d9dfn.step._precision import Precision
from d9dfn.step._state import StepOutput, TrainState, check_live, consume, trainable_params
from d9dfn.step._tail import Tail

__all__ = ["make_train_step"]


def make_train_step(
    model: nn.Module,
    task: TrainTask[Any],
    optimizer: Transform,
    *,
    num_microbatches: int | None = None,
    executor: Executor | None = None,
    repeated_blocks: BlockChoice = (),
    activation_checkpointing: ActivationCheckpointing | None = None,
    prefetch_gathers: bool = False,
    precision: Precision | None = None,
    plan: ParallelPlan | None = None,
    data_parallel: DataParallel | None = None,
    device: torch.device | str | None = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    rng_kwarg: str | None = None,
    compile: bool | Backend = True,
    donate: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]:
    """Build ``step(train_state, batch) -> (train_state, StepOutput)``.

    The step is a program of pieces, each compiled once (``docs/design/step.md``): a head (inputs, split, keys),
    the executor's pieces, called for every microbatch, and a tail (reduction, ``1/Σw``, clipping, the optimizer).
    Graph count and cold compile time do not grow with the microbatch count. Every option composes with every
    other; the few combinations that cannot run are refused here, each with its reason.

    Args:
        model: the module skeleton; its own tensors are never read (it may live on the meta device).
        task: supplies inputs, per-microbatch losses and metric updates.
        optimizer: a ``d9dfn.optim`` transform over the trainable params.
        num_microbatches: gradient-accumulation count; the local batch must split evenly. Default: the pipeline
            program's count, else 1.
        executor: how the microbatches run: :class:`~d9dfn.step.Sequential` (the default),
            :class:`~d9dfn.pipeline.Pipeline` (a program over stages this process holds, the reference executor)
            or :class:`~d9dfn.pipeline.PipelineRank` (this rank's row, with sends and receives; the train state
            holds this rank's params, and the loss, its weight and the gradient norm are summed over the ``pp``
            group in the tail).
        repeated_blocks: the classes of the model's repeated blocks (its decoder layer), or ``"auto"`` to find them
            (``d9dfn.step.find_repeated_blocks``): each is compiled once for all its instances, in one process and
            inside pipeline stages, so cold compile time stops growing with depth; the tail then updates each
            block's leaves through one region too when the optimizer is ``leafwise``. Gradients then come from
            autograd; results equal the traced step's to rounding. ``()``: the whole model traced per microbatch.
        activation_checkpointing: recompute the repeated blocks' forward in the backward instead of keeping their
            activations (:class:`d9dfn.step.ActivationCheckpointing`: every block or every k-th, all of it or all
            but the matmuls, or a budget for the compiler); results equal the step without it (bitwise in eager).
        prefetch_gathers: with params gathered per block (``Shard(0)`` ``DTensor`` s and repeated blocks), issue each
            block's all-gather one block ahead, forward and backward, so that it travels while the block before
            computes (two blocks' full params alive instead of one). The gathered blocks are then compiled inline
            with the stage, not once per class: cold compile time grows with depth again. Needs ``compile=True``
            or ``"aot_eager"``; the first call refuses it when no param is gathered per block.
        precision: a :class:`d9dfn.Precision` policy: the state's floating params must be in its ``param_dtype``;
            the model (every stage) runs in ``compute_dtype`` (params and floating inputs cast at the call, the only
            cast site), gradients and the optimizer stay in ``param_dtype``, the loss, ``Σw`` and the norms in
            float32, pipeline activations travel in ``compute_dtype`` and data-parallel reductions run in
            ``reduce_dtype``. ``None``: no casts.
        plan: the :class:`~d9dfn.parallel.ParallelPlan` the train state's params follow (``d9dfn.parallel.plan_for``):
            where each param is stored and computed, what the step gathers (in the head, or per block) and over which
            mesh axes each gradient is a partial sum; ``Σw`` and the loss are summed over its token axes and the
            microbatch keys numbered by this rank's data-parallel index. Needed when params are ``DTensor`` s.
        data_parallel: a :class:`d9dfn.DataParallel` (``d9dfn.parallel.data_parallel(group, rank)``) for plain
            params replicated by hand over a process group: the local sums are summed over it inside the compiled
            step, and microbatch keys are numbered globally. Default: the plan's (``parallel.plan_data_parallel``);
            given with a plan, it replaces the plan's reduction and rank.
        device: where the params live, which decides the optimizer tail's form (its fused kernel, run eagerly, where
            the optimizer wants it for that device: ``Transform.fused``); default: the plan's mesh's device type,
            else CUDA when available, else the CPU.
        max_grad_norm: clip the global gradient norm to this value (``None`` or 0: no clipping).
        skip_nonfinite: keep params, buffers and optimizer state unchanged on a non-finite step.

    A model with a method ``state_update()`` that returns a :class:`~d9dfn.StateUpdate` (an MoE model's balancing
    bias: ``Qwen3MoeLM.state_update``) has its buffers updated by it after the optimizer, from the model outputs it
    names summed over the microbatches and the data-parallel ranks (``docs/design/step.md``, "Block state").
        rng_kwarg: pass each microbatch's key (``d9dfn.prng``) to the model under this keyword (e.g.
            ``"dropout_key"``); keys derive from ``train_state.rng``, the step and the microbatch's global index
            ``data_parallel.rank * num_microbatches + i``.
        compile: ``True`` compiles the pieces with inductor (``torch.compile(fullgraph=True)``), a string with that
            backend (``"aot_eager"``), ``False`` runs the same functions eagerly.
        donate: the step takes over the train state it is given, as ``jax.jit(donate_argnums=0)`` does: it updates
            the params and the optimizer's per-param state in place (the fused kernel without its copies; a compiled
            tail writes its new values into them) and returns them in the new state, so a step holds one train state
            instead of two. The given state is consumed: reading its ``params`` or ``opt_state`` afterwards raises
            (its other fields stay readable); a tensor taken out of it before the call sees the update. Results are
            bitwise those of the pure step. The loop donates; the default keeps the step pure, for tests and
            notebooks that call it twice with one state (``docs/design/step.md``, "Donation").

    Returns:
        The step function. Without ``donate`` it never mutates its inputs. ``step.pieces`` holds what it calls, by
        name.

    Raises:
        ValueError: a count or norm out of range, a pipeline whose program counts other microbatches, a combination
            that cannot run (each message says why and what to pass instead); a model's state update without its
            outputs' shapes under pipeline ranks; at the first call, a train state whose params the plan does not
            describe (``DTensor`` params without a plan among them), or model outputs without a statistic the state
            update reads.
    """
    if max_grad_norm is not None and max_grad_norm < 0:
        raise ValueError(f"make_train_step: max_grad_norm={max_grad_norm}; pass a positive norm, or None to not clip")
    executor = Sequential() if executor is None else executor
    options = resolve_options(
        "make_train_step",
        model,
        executor,
        num_microbatches,
        repeated_blocks,
        compile,
        True,
        activation_checkpointing,
        prefetch_gathers,
    )
    if isinstance(executor, Sequential):
        check_rng_kwarg("make_train_step", model, rng_kwarg)
    state_update = model_state_update("make_train_step", model, executor)
    stat_names = () if state_update is None else state_update.outputs
    model = in_mode(model, training=True)
    m = options.num_microbatches
    data_parallel = resolve_data_parallel(plan, data_parallel)
    first_index = (0 if data_parallel is None else data_parallel.rank) * m

    def microbatch_loss(
        outputs: Mapping[str, torch.Tensor], state: PipelineState, step: torch.Tensor
    ) -> tuple[torch.Tensor, MicrobatchOut]:
        """``(wℓ, MicrobatchOut)``: ``w`` detached and float32; the loss the backward seeds."""
        result = task.compute_loss(outputs, state, step)
        weight = torch.ones_like(result.loss) if result.loss_weight is None else result.loss_weight.detach()
        weight = weight.to(torch.float32)
        # torch.func's aux may hold tensors only (no None): hand back the state itself when unchanged.
        new_state = state if result.state is None else result.state
        stats = {name: _stat(outputs, name) for name in stat_names}  # what the state update reads, summed in the tail
        return result.loss.float() * weight, MicrobatchOut(new_state, result.logs, stats, weight)

    run = train_run(executor, options.parts(model, precision), microbatch_loss)
    local = run.prepare(plan)  # the DTensor params the executor gathers per block; the head hands it their shards
    if prefetch_gathers and not local:
        raise ValueError(
            "make_train_step: prefetch_gathers issues the per-block all-gathers early, but no param is gathered per "
            "block (the plan stores none of the repeated blocks' params Shard(0) over one mesh axis); shard them "
            "(mesh.data_parallel_shard > 1), or pass prefetch_gathers=False"
        )
    fused = None if run.whole else Tail.fused_for(optimizer, step_device(plan, device))
    blockwise = None
    if options.blocks and optimizer.leafwise and fused is None:  # each block's update through one region too
        blockwise = BlockwiseTail(block_modules(model, executor), options.blocks, optimizer)
    distributed = plan is not None and plan.distributed
    tail = Tail(
        task,
        optimizer,
        max_grad_norm=max_grad_norm,
        skip_nonfinite=skip_nonfinite,
        reduce_gradients=None if data_parallel is None else data_parallel.reduce,
        pipeline=(
            pipeline_reduction(executor.group, executor.param_names) if isinstance(executor, PipelineRank) else None
        ),
        precision=precision,
        blockwise=blockwise,
        plan=plan,
        local=local,
        fused=fused,
        donate=donate,
        state_update=state_update,
    )

    def head(train_state: TrainState, batch: Batch) -> tuple[Params | None, list[Microbatch], Sums | None]:
        if precision is not None:
            precision.check_params("make_train_step", trainable_params(train_state))
        microbatches = prepare(
            task, batch, m, rng=train_state.rng, step=train_state.step, rng_kwarg=rng_kwarg, first_index=first_index
        )
        # The params as the model computes with them (the plan's gathers; this rank's shards for the ones gathered
        # per block), frozen ones too. Plain params are not returned: a compiled graph that returns its inputs pays a
        # per-output alias check per call.
        full_params = plan.compute_params(train_state.params, local) if plan is not None and distributed else None
        params = train_state.params if full_params is None else full_params
        return full_params, microbatches, run.init(_trainable(params, train_state.frozen), m)

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        full_params, microbatches, sums = head_fn(train_state, batch)
        params = train_state.params if full_params is None else full_params
        # The executor differentiates the trainable params; the frozen ones (as the model computes with them) travel
        # with the buffers as constants, the executors' ``StageConsts.frozen``, and are dropped from its new buffers.
        trainable, consts = _trainable(params, train_state.frozen), _constants(params, train_state)
        result = run.run(trainable, consts, microbatches, train_state.step, sums)
        if train_state.frozen:
            result = result._replace(buffers={name: result.buffers[name] for name in train_state.buffers})
        return tail_fn(train_state, result)

    pieces: dict[str, Any]
    tail_fn: Callable[[TrainState, ProgramResult], tuple[TrainState, StepOutput]]
    if run.whole:  # the whole step, microbatch loop unrolled, as one graph
        head_fn, tail_fn = head, tail
        ready = options.compiled(step)
        pieces = {"step": ready}
    else:
        head_fn = options.compiled_head(head)
        if fused is not None:  # the optimizer's fused kernel: the tail runs eagerly, nothing of it compiled
            tail_fn = tail
        else:
            tail_fn = options.compiled(tail) if blockwise is None else region_compiled(tail, options.backend)
        ready, pieces = step, {"head": head_fn, **run.pieces, "tail": tail_fn}
    checked: list[bool] = []

    def train_step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        check_live(train_state)  # a state donated before: a clear error here, not inside a compiled piece
        if donate:  # the caller's state object is marked consumed; the step runs on a copy of its fields
            train_state = consume(train_state)
        if not checked:  # once: the state is the one the step was built for (its params as the plan says)
            check_state("make_train_step", train_state.params, plan)
            checked.append(True)
        tail.prepare(train_state)
        with backward_compiled_early():  # a graph's C++ build behind the compile of its backward
            new_state, output = ready(train_state, batch)
        return (Tail.rebuilt(train_state, new_state) if donate else new_state), output

    return with_pieces(train_step, pieces)


def model_state_update(owner: str, model: nn.Module, executor: Executor) -> StateUpdate | None:
    """The model's :class:`~d9dfn.StateUpdate` (its ``state_update()``), or ``None`` when it has none.

    Raises:
        ValueError: a state update without its outputs' ``shapes`` under pipeline ranks (a rank without the last
            stage could not take part in summing them over the pipeline).
    """
    offer = getattr(model, "state_update", None)
    update = offer() if callable(offer) else None
    if update is not None and not isinstance(update, StateUpdate):
        raise TypeError(
            f"{owner}: {type(model).__name__}.state_update() returned a {type(update).__name__}; return a "
            "d9dfn.StateUpdate(outputs=..., update=...) or None"
        )
    if update is not None and update.shapes is None and isinstance(executor, PipelineRank):
        raise ValueError(
            f"{owner}: {type(model).__name__} updates its state from its outputs {list(update.outputs)} "
            "(state_update()) without their shapes, which pipeline ranks without the last stage need to sum them over "
            "the pipeline; return StateUpdate(..., shapes={name: shape}), or run it without pipelining"
        )
    return update


def _stat(outputs: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """The model output ``name`` a state update reads, detached."""
    if name not in outputs:
        raise ValueError(
            f"make_train_step: the model's state update reads its output {name!r}, but the model returned "
            f"{sorted(outputs)}; return {name!r} from forward, or change StateUpdate.outputs"
        )
    return outputs[name].detach()


def _trainable(params: Params, frozen: tuple[str, ...]) -> Params:
    """``params`` without the ``frozen`` ones (``params`` itself when none is)."""
    if not frozen:
        return params
    names = frozenset(frozen)
    return {name: p for name, p in params.items() if name not in names}


def _constants(params: Params, train_state: TrainState) -> Params:
    """What the executor holds constant: the frozen params (as the model computes with them), then the buffers."""
    if not train_state.frozen:
        return train_state.buffers
    return {**{name: params[name] for name in train_state.frozen}, **train_state.buffers}
