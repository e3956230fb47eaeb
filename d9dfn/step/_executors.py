"""Executors: how a step runs its microbatches and stages, as values.

An executor is one of :class:`Sequential` (the microbatches one after another on this process, the default),
:class:`~d9dfn.pipeline.Pipeline` (a pipeline program whose stages this process all holds) or
:class:`~d9dfn.pipeline.PipelineRank` (this rank's row of a program, with sends and receives). The step builders
turn it, once, into a :class:`TrainRun` or a :class:`ForwardRun`; every train run returns the same named result
(:class:`~d9dfn.pipeline.ProgramResult`) to the one tail, and the forward runs hand the last stage's outputs to
the step's ``consume``.

How each stage (or the whole model, the one stage of :class:`Sequential`) runs is a runner: traced
(``torch.func``: one compiled graph per microbatch piece, or a pipeline stage's ``fw``/``dI``/``dW``) or, with
repeated blocks compiled once, regional (:class:`d9dfn.step._blocks.RegionalStages`, autograd). The choice is made
here, once; nothing later asks which path it is on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import grad_and_value

from d9dfn._torch import compile_piece
from d9dfn._types import Buffers, Params, Sums
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.pipeline import (
    Pipeline,
    PipelineRank,
    ProgramResult,
    SplitBackward,
    Stage,
    StageConsts,
    StageRunner,
    TracedStages,
    run_forward,
    run_program,
    run_rank_forward,
    run_rank_program,
    stage_args,
)
from d9dfn.step._blocks import RegionalStages
from d9dfn.step._call import call_module, stage_call
from d9dfn.step._checkpointing import ActivationCheckpointing
from d9dfn.step._microbatches import Microbatch, in_mode, microbatch_loop
from d9dfn.step._precision import Precision

__all__ = ["Executor", "ForwardRun", "Sequential", "StepParts", "TrainRun", "forward_run", "train_run"]


@dataclasses.dataclass(frozen=True)
class Sequential:
    """The step's microbatches one after another on this process (gradient accumulation); the default executor.

    Attributes:
        unroll: compile the whole step as one graph with the microbatch loop unrolled (compile time grows with the
            microbatch count; ``docs/design/step.md`` says when it is faster). Traced steps only: per-block
            compilation needs autograd's backward outside the graph.
    """

    unroll: bool = False


Executor = Sequential | Pipeline | PipelineRank
"""How a step runs its microbatches and stages."""

Loss = Callable[[Mapping[str, torch.Tensor], Any, torch.Tensor], tuple[torch.Tensor, Any]]
"""``loss(outputs, microbatch_state, step) -> (w·ℓ, aux)``: the train step's per-microbatch loss (``aux[-1]`` is w)."""

Consume = Callable[[torch.Tensor, Any, Mapping[str, Any], Any], tuple[Any, Any]]
"""``consume(step, carry, outputs, microbatch_state) -> (carry, out)``: what a forward-only step does with each
microbatch's outputs (the eval loss and metrics, or the inference task's ``process_outputs``)."""


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What every executor needs, resolved once by a step builder.

    Attributes:
        model: the skeleton (in the step's train/eval mode); unused by pipeline executors (their stages are).
        precision: the policy the model call casts for (``None``: no casts).
        blocks: the repeated block classes compiled once (empty: the traced runner).
        backend: the ``torch.compile`` backend, ``None`` to run eagerly.
        checkpointing: the blocks' activation checkpointing (train steps), or ``None``.
        block_names: every block's full name in the whole model's order.
        prefetch: issue each gathered block's all-gather one block ahead (:mod:`d9dfn.parallel._prefetch`).
    """

    model: nn.Module
    precision: Precision | None
    blocks: tuple[type[nn.Module], ...]
    backend: str | Callable[..., Any] | None
    checkpointing: ActivationCheckpointing | None = None
    block_names: tuple[str, ...] = ()
    prefetch: bool = False

    @property
    def mutable(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.model.named_buffers())

    def compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled whole (``fullgraph``) with the step's backend, or ``fn`` itself when eager."""
        return fn if self.backend is None else compile_piece(fn, self.backend)

    def runner(self) -> StageRunner:
        """The stage runner: regional with repeated blocks, else traced (compiled pieces when compiling)."""
        if self.blocks:
            return RegionalStages(
                self.blocks, self.precision, self.backend, self.checkpointing, self.block_names, self.prefetch
            )
        backend = self.backend
        split = SplitBackward(compile=None if backend is None else functools.partial(_compile_graph, backend=backend))
        forward = None if backend is None else functools.partial(_compile_fn, backend=backend)
        return TracedStages(split, stage_call(self.precision), forward)


def _compile_graph(graph: torch.fx.GraphModule, backend: str | Callable[..., Any]) -> Callable[..., Any]:
    return compile_piece(graph, backend)


def _compile_fn(fn: Callable[..., Any], backend: str | Callable[..., Any]) -> Callable[..., Any]:
    return compile_piece(fn, backend)


class TrainRun(NamedTuple):
    """A built train executor.

    Attributes:
        init: ``init(params, num_microbatches) -> Sums | None``: where the accumulation starts, traced into the
            step's head (zeros for a compiled piece that adds every microbatch alike; ``None``: the first
            microbatch's own sums).
        run: ``run(params, buffers, microbatches, step, sums) -> ProgramResult``.
        pieces: the compiled (or eager) functions it calls, by name, for inspection (``step.pieces``).
        whole: the executor wants the whole step compiled as one graph (``Sequential(unroll=True)``).
        prepare: ``prepare(plan) -> names``, called once when the step is built, with its parallel plan: the names of
            the ``DTensor`` params the executor gathers itself, per block (the head then hands them over as local
            shards, and their gradients come back as local shards).
    """

    init: Callable[[Params, int], Sums | None]
    run: Callable[[Params, Buffers, list[Microbatch], torch.Tensor, Sums | None], ProgramResult]
    pieces: Mapping[str, Any]
    whole: bool = False
    prepare: Callable[[ParallelPlan | None], frozenset[str]] = lambda plan: frozenset()


class ForwardRun(NamedTuple):
    """A built forward-only executor: ``run(params, buffers, microbatches, step, carry) -> (carry, outs)``, the
    step's ``consume`` applied to each microbatch's outputs in microbatch order (``outs`` is empty on a pipeline
    rank without the last stage); ``prepare`` as :class:`TrainRun`'s."""

    run: Callable[[Params, Buffers, list[Microbatch], torch.Tensor, Any], tuple[Any, list[Any]]]
    pieces: Mapping[str, Any]
    prepare: Callable[[ParallelPlan | None], frozenset[str]] = lambda plan: frozenset()


def _zeros(params: Params, num_microbatches: int) -> Sums | None:
    """Zeroed sums for several microbatches (``0 + g`` is ``g``, bitwise, so every microbatch runs one piece)."""
    if num_microbatches == 1 or not params:
        return None
    device = next(iter(params.values())).device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return Sums({name: torch.zeros_like(p) for name, p in params.items()}, zero, torch.zeros_like(zero))


def _no_init(params: Params, num_microbatches: int) -> None:
    return None


def _add(sums: Sums | None, grads: Params, weighted_loss: torch.Tensor, weight: torch.Tensor) -> Sums:
    """``sums + (grads, wℓ, w)``, out of place (the first microbatch's own values when ``sums`` is ``None``); one
    ``_foreach_add`` for the gradients.

    In place (``add_`` into the head's zeros) measured 1.5% faster on CPU but summed a replicated 0-d DTensor
    param's gradient wrongly over simulated ranks (``tests/test_parallel_properties.py``); out of place is exact.
    """
    if sums is None:
        return Sums(grads, weighted_loss.detach(), weight)
    names = list(grads)
    added = torch._foreach_add([sums.grads[name] for name in names], [grads[name] for name in names])
    return Sums(dict(zip(names, added, strict=True)), sums.loss + weighted_loss.detach(), sums.weight + weight)


def _step_loss(loss: Loss) -> Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]:
    """The pipeline executors' ``loss(outputs, state)``: the step tensor travels with the microbatch's state, not in
    a closure (a traced graph would keep a closure's tensor as a constant: the first step's value)."""

    def stage_loss(outputs: Mapping[str, torch.Tensor], state_and_step: tuple[Any, torch.Tensor]) -> Any:
        state, step = state_and_step
        return loss(outputs, state, step)

    return stage_loss


def _with_step(microbatches: Sequence[Microbatch], step: torch.Tensor) -> list[tuple[Any, Any, Any]]:
    return [(mb.inputs, mb.kwargs, (mb.state, step)) for mb in microbatches]


def train_run(executor: Executor, parts: StepParts, loss: Loss) -> TrainRun:
    """The train executor ``executor`` built over ``parts`` with the step's per-microbatch ``loss``."""
    if isinstance(executor, Sequential):
        if parts.blocks:
            return _regional_sequential(parts, loss)
        return _traced_sequential(parts, loss, executor.unroll)
    runner = parts.runner()
    stage_loss = _step_loss(loss)
    pieces = {"stages": runner}
    prepare = _prepare_of(runner, tuple(stage.module for stage in executor.stages))

    if isinstance(executor, PipelineRank):
        pipeline = dataclasses.replace(executor, stages=_in_mode(executor.stages, training=True))

        def run_rank(
            params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, sums: Sums | None
        ) -> ProgramResult:
            mbs = _with_step(microbatches, step)
            return run_rank_program(pipeline, params, buffers, mbs, stage_loss, sums=sums, step=step, runner=runner)

        return TrainRun(_zeros if not parts.blocks else _no_init, run_rank, pieces, prepare=prepare)
    program, stages = executor.program, _in_mode(executor.stages, training=True)

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, sums: Sums | None
    ) -> ProgramResult:
        return run_program(
            program, stages, params, buffers, _with_step(microbatches, step), stage_loss, sums=sums, runner=runner
        )

    return TrainRun(_zeros if not parts.blocks else _no_init, run, pieces, prepare=prepare)


def _prepare_of(runner: StageRunner, modules: tuple[nn.Module, ...]) -> Callable[[ParallelPlan | None], frozenset[str]]:
    """The per-block runner plans its gathering from the step's plan; a traced runner gathers nothing itself."""
    if not isinstance(runner, RegionalStages):
        return lambda plan: frozenset()
    return functools.partial(runner.prepare, modules=modules)


def _in_mode(stages: Sequence[Stage], training: bool) -> tuple[Stage, ...]:
    return tuple(dataclasses.replace(stage, module=in_mode(stage.module, training)) for stage in stages)


def _traced_sequential(parts: StepParts, loss: Loss, unroll: bool) -> TrainRun:
    """The default: per microbatch one graph — forward, ``grad_and_value`` of ``wℓ`` and ``sums += (w∇ℓ, wℓ, w)``
    — compiled once and called for every microbatch (or inlined into the whole step's graph with ``unroll``)."""
    model, mutable, precision = parts.model, parts.mutable, parts.precision

    def model_loss(
        params: Params, buffers: Buffers, microbatch: Microbatch, step: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Any, Buffers]]:
        outputs, new_buffers = call_module(model, params, buffers, mutable, *microbatch[:2], precision)
        weighted_loss, out = loss(outputs, microbatch.state, step)
        return weighted_loss, (out, new_buffers)

    def piece(
        consts: tuple[Params, torch.Tensor], carry: tuple[Buffers, Sums | None], microbatch: Microbatch
    ) -> tuple[tuple[Buffers, Sums], Any]:
        """Forward, backward and the sums of one microbatch: one graph, called m times. Returns only the new
        mutable buffers (outputs that alias inputs cost a check per call)."""
        params, step = consts
        buffers, sums = carry
        grads, (weighted_loss, (out, new_buffers)) = grad_and_value(model_loss, has_aux=True)(
            params, {**buffers}, microbatch, step
        )
        return (new_buffers, _add(sums, grads, weighted_loss, out[-1])), out

    piece_fn = piece if unroll else parts.compiled(piece)

    def merged(consts: Any, carry: tuple[Buffers, Sums | None], microbatch: Microbatch) -> tuple[Any, Any]:
        buffers, _ = carry
        (new_buffers, sums), out = piece_fn(consts, carry, microbatch)
        return ({**buffers, **new_buffers} if new_buffers else buffers, sums), out

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, sums: Sums | None
    ) -> ProgramResult:
        (buffers, sums), outs = microbatch_loop(merged, (params, step), (buffers, sums), microbatches)
        assert sums is not None  # the head's zeros, or the one microbatch's own sums
        return ProgramResult(sums, buffers, outs)

    return TrainRun(_zeros, run, {} if unroll else {"microbatch": piece_fn}, whole=unroll)


def _whole_stage(model: nn.Module) -> Stage:
    return Stage.from_module(0, model)


def _regional_sequential(parts: StepParts, loss: Loss) -> TrainRun:
    """With repeated blocks: per microbatch the whole model as one regional stage (its forward and loss compiled
    once, each block class one region), its gradients from autograd, added in microbatch order."""
    runner = parts.runner()
    stage = _whole_stage(parts.model)

    def post(outputs: dict[str, Any], consts: StageConsts) -> tuple[Any, Any]:
        state, step = consts.state
        return loss(outputs, state, step)

    def piece(
        consts: tuple[Params, torch.Tensor], carry: tuple[Buffers, Sums | None], microbatch: Microbatch
    ) -> tuple[tuple[Buffers, Sums], Any]:
        params, step = consts
        buffers, sums = carry
        trainable, frozen, stage_buffers = stage_args(stage, params, buffers)
        stage_consts = StageConsts(
            frozen, stage_buffers, microbatch.inputs, microbatch.kwargs, (microbatch.state, step)
        )
        weighted_loss, closure, out, new_buffers = runner.vjp(stage, post, trainable, {}, stage_consts)
        grads, _ = closure(torch.ones_like(weighted_loss))
        return ({**buffers, **new_buffers}, _add(sums, grads, weighted_loss, out[-1])), out

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, sums: Sums | None
    ) -> ProgramResult:
        (buffers, sums), outs = microbatch_loop(piece, (params, step), (buffers, sums), microbatches)
        assert sums is not None
        return ProgramResult(sums, buffers, outs)

    return TrainRun(_no_init, run, {"stages": runner}, prepare=_prepare_of(runner, (parts.model,)))


def forward_run(executor: Executor, parts: StepParts, consume: Consume) -> ForwardRun:
    """The forward-only executor ``executor`` built over ``parts``, handing each microbatch's outputs to ``consume``."""
    if isinstance(executor, Sequential):
        return _sequential_forward(parts, consume)
    runner = parts.runner()

    def forwards(params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor) -> list[Any]:
        if isinstance(executor, PipelineRank):
            pipeline = dataclasses.replace(executor, stages=_in_mode(executor.stages, training=False))
            return run_rank_forward(pipeline, params, buffers, microbatches, step=step, runner=runner)
        outputs = run_forward(
            executor.program, _in_mode(executor.stages, training=False), params, buffers, microbatches, runner=runner
        )
        if len(outputs) != len(microbatches):
            raise AssertionError(f"run_forward returned {len(outputs)} outputs for {len(microbatches)} microbatches")
        return outputs

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, carry: Any
    ) -> tuple[Any, list[Any]]:
        outs = []  # stays empty on a pipeline rank without the last stage
        for out, microbatch in zip(forwards(params, buffers, microbatches, step), microbatches, strict=False):
            carry, mb_out = consume(step, carry, out, microbatch.state)
            outs.append(mb_out)
        return carry, outs

    return ForwardRun(run, {"stages": runner}, _prepare_of(runner, tuple(stage.module for stage in executor.stages)))


def _sequential_forward(parts: StepParts, consume: Consume) -> ForwardRun:
    """Per microbatch one compiled piece: the model's forward and ``consume`` (with repeated blocks, the model's
    region copy with the params swapped in around the compiled piece)."""
    model, mutable, precision = parts.model, parts.mutable, parts.precision
    if parts.blocks:
        runner = parts.runner()
        assert isinstance(runner, RegionalStages)
        return _regional_forward(runner, _whole_stage(model), consume)._replace(prepare=_prepare_of(runner, (model,)))

    def piece(consts: tuple[Params, Buffers, torch.Tensor], carry: Any, microbatch: Microbatch) -> tuple[Any, Any]:
        params, buffers, step = consts
        outputs, _ = call_module(model, params, buffers, mutable, microbatch.inputs, microbatch.kwargs, precision)
        return consume(step, carry, outputs, microbatch.state)

    piece_fn = parts.compiled(piece)

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, carry: Any
    ) -> tuple[Any, list[Any]]:
        return microbatch_loop(piece_fn, (params, buffers, step), carry, microbatches)

    return ForwardRun(run, {"microbatch": piece_fn})


def _regional_forward(runner: RegionalStages, stage: Stage, consume: Consume) -> ForwardRun:
    piece_fn = runner.forward_piece(stage, consume)

    def run(
        params: Params, buffers: Buffers, microbatches: list[Microbatch], step: torch.Tensor, carry: Any
    ) -> tuple[Any, list[Any]]:
        return microbatch_loop(piece_fn, (params, buffers, step), carry, microbatches)

    return ForwardRun(run, {"microbatch": piece_fn})
