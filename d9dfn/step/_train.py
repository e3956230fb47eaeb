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
from d9dfn._types import Batch, DataParallel, Params, Sums, Transform
from d9dfn.parallel._pipeline import pipeline_reduction
from d9dfn.parallel._placement import is_distributed_tensor, step_params
from d9dfn.pipeline import PipelineRank, ProgramResult
from d9dfn.step._blocks import BlockChoice, region_compiled
from d9dfn.step._blockwise_tail import BlockwiseTail
from d9dfn.step._checkpointing import ActivationCheckpointing
from d9dfn.step._executors import Executor, Sequential, train_run
from d9dfn.step._microbatches import Microbatch, MicrobatchOut, check_rng_kwarg, in_mode, prepare
from d9dfn.step._options import Backend, block_modules, resolve_options, with_pieces
from d9dfn.step._precision import Precision
from d9dfn.step._state import StepOutput, TrainState
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
    data_parallel: DataParallel | None = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    rng_kwarg: str | None = None,
    compile: bool | Backend = True,
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
        data_parallel: a :class:`d9dfn.DataParallel` (``d9dfn.parallel.data_parallel(group, rank)``): the local
            sums are summed over the data-parallel group inside the compiled step, and microbatch keys are numbered
            globally. Needed when params are ``DTensor`` s.
        max_grad_norm: clip the global gradient norm to this value (``None`` or 0: no clipping).
        skip_nonfinite: keep params, buffers and optimizer state unchanged on a non-finite step.
        rng_kwarg: pass each microbatch's key (``d9dfn.prng``) to the model under this keyword (e.g.
            ``"dropout_key"``); keys derive from ``train_state.rng``, the step and the microbatch's global index
            ``data_parallel.rank * num_microbatches + i``.
        compile: ``True`` compiles the pieces with inductor (``torch.compile(fullgraph=True)``), a string with that
            backend (``"aot_eager"``), ``False`` runs the same functions eagerly.

    Returns:
        The step function. It never mutates its inputs. ``step.pieces`` holds what it calls, by name.

    Raises:
        ValueError: a count or norm out of range, a pipeline whose program counts other microbatches, a combination
            that cannot run (each message says why and what to pass instead); at the first call, ``DTensor`` params
            without ``data_parallel``.
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
    model = in_mode(model, training=True)
    m = options.num_microbatches
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
        return result.loss.float() * weight, MicrobatchOut(new_state, result.logs, weight)

    run = train_run(executor, options.parts(model, precision), microbatch_loss)
    blockwise = None
    if options.blocks and optimizer.leafwise:  # each block's update through one region too
        blockwise = BlockwiseTail(block_modules(model, executor), options.blocks, optimizer)
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
    )

    local: frozenset[str] = frozenset()  # DTensor params the executor gathers per block (set at the first call)

    def head(
        train_state: TrainState, batch: Batch, distributed: bool
    ) -> tuple[Params | None, list[Microbatch], Sums | None]:
        if precision is not None:
            precision.check_params("make_train_step", train_state.params)
        microbatches = prepare(
            task, batch, m, rng=train_state.rng, step=train_state.step, rng_kwarg=rng_kwarg, first_index=first_index
        )
        # DTensor params → all-gathered plain tensors, or this rank's shards for the ones gathered per block. Plain
        # params are not returned: a compiled graph that returns its inputs pays a per-output alias check per call.
        full_params = step_params(train_state.params, local) if distributed else None
        params = train_state.params if full_params is None else full_params
        return full_params, microbatches, run.init(params, m)

    def step(train_state: TrainState, batch: Batch, distributed: bool) -> tuple[TrainState, StepOutput]:
        full_params, microbatches, sums = head_fn(train_state, batch, distributed)
        params = train_state.params if full_params is None else full_params
        result = run.run(params, train_state.buffers, microbatches, train_state.step, sums)
        return tail_fn(train_state, result, distributed)

    pieces: dict[str, Any]
    tail_fn: Callable[[TrainState, ProgramResult, bool], tuple[TrainState, StepOutput]]
    if run.whole:  # the whole step, microbatch loop unrolled, as one graph
        head_fn, tail_fn = head, tail
        ready = options.compiled(step)
        pieces = {"step": ready}
    else:
        head_fn = options.compiled_head(head)
        tail_fn = options.compiled(tail) if blockwise is None else region_compiled(tail, options.backend)
        ready, pieces = step, {"head": head_fn, **run.pieces, "tail": tail_fn}
    prepared: list[bool] = []

    def choose_tail(params: Params) -> None:
        """At the first call: the optimizer's fused kernel, run eagerly, in place of the compiled tail where the
        optimizer offers one and wants it for these params' device (``Transform.fused``)."""
        nonlocal tail_fn
        if not run.whole and tail.fused_for(params) is not None:
            tail_fn = pieces["tail"] = tail

    def train_step(train_state: TrainState, batch: Batch) -> tuple[TrainState, StepOutput]:
        nonlocal local
        if not prepared:  # before the first compile: which params the executor gathers itself (their placements)
            local = tail.local = run.prepare(train_state.params)
            if prefetch_gathers and not local:
                raise ValueError(
                    "make_train_step: prefetch_gathers issues the per-block all-gathers early, but no param is "
                    "gathered per block (none of the repeated blocks' params is a DTensor sharded Shard(0) over one "
                    "mesh axis); shard them (mesh.data_parallel_shard > 1), or pass prefetch_gathers=False"
                )
            choose_tail(train_state.params)
            prepared.append(True)
        # Decided here, outside the trace, and passed on as a constant: a check of every param traced in the head
        # and the tail is paid again at every start (dynamo traces them anew).
        distributed = _check_distributed(train_state.params, data_parallel)
        tail.prepare(train_state)
        with backward_compiled_early():  # a graph's C++ build behind the compile of its backward
            return ready(train_state, batch, distributed)

    return with_pieces(train_step, pieces)


def _check_distributed(params: Params, data_parallel: DataParallel | None) -> bool:
    """True when some param is a ``DTensor``; raises when such params have no ``data_parallel``."""
    distributed = [name for name, p in params.items() if is_distributed_tensor(p)]
    if distributed and data_parallel is None:
        raise ValueError(
            f"make_train_step: params[{distributed[0]!r}] is a DTensor but the step has no data_parallel; pass "
            "data_parallel=d9dfn.parallel.data_parallel(mesh, rank) so that the loss weight is summed over the "
            "data-parallel ranks"
        )
    return bool(distributed)
