"""The step builders' shared options, resolved once: the microbatch count, the repeated blocks, the backend, and
the combinations that cannot run (refused here, each with its reason, so no builder asks again)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from d9dfn import _torch as torch_patches
from d9dfn._torch import bundled_autograd_cache, compile_piece
from d9dfn._types import DataParallel
from d9dfn.parallel._placement import is_distributed_tensor
from d9dfn.parallel._plan import ParallelPlan, placement_text, plan_data_parallel
from d9dfn.parallel._prefetch import PREFETCH_BACKENDS
from d9dfn.pipeline import Pipeline, PipelineRank
from d9dfn.step._blocks import BlockChoice, resolve_blocks
from d9dfn.step._checkpointing import ActivationCheckpointing
from d9dfn.step._executors import Executor, Sequential, StepParts
from d9dfn.step._precision import Precision

__all__ = [
    "StepOptions",
    "backend_of",
    "block_modules",
    "check_state",
    "resolve_data_parallel",
    "resolve_options",
    "step_device",
    "with_pieces",
]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


Backend = str | Callable[..., Any]
"""A ``torch.compile`` backend: its name (``"inductor"``, ``"aot_eager"``) or a callable backend."""


def backend_of(compile: bool | Backend) -> Backend | None:
    """``compile=`` as a backend: ``True`` → inductor, a name or a callable → that backend, ``False`` → ``None``
    (eager)."""
    if compile is True:
        return "inductor"
    if compile is False:
        return None
    if (isinstance(compile, str) and compile) or callable(compile):
        return compile
    raise ValueError(f"compile={compile!r}; pass True (inductor), False (eager) or a torch.compile backend")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a step builder resolved: the microbatch count, the block classes compiled once, the backend."""

    num_microbatches: int
    blocks: tuple[type[nn.Module], ...]
    backend: Backend | None
    block_names: tuple[str, ...] = ()
    checkpointing: ActivationCheckpointing | None = None
    prefetch: bool = False

    def parts(self, model: nn.Module, precision: Precision | None) -> StepParts:
        return StepParts(
            model, precision, self.blocks, self.backend, self.checkpointing, self.block_names, self.prefetch
        )

    def compiled(self, fn: _Fn) -> _Fn:
        """``fn`` compiled whole (``fullgraph``) with the step's backend, or ``fn`` itself when eager."""
        if self.backend is None:
            return fn
        return compile_piece(fn, self.backend)

    def compiled_head(self, fn: _Fn) -> _Fn:
        """A step's head (the microbatch split: views of the batch, and the task's Python) compiled as
        :meth:`compiled` does, its compile cached whole by AOTAutograd when the backend is inductor.

        A graph of views alone leaves inductor nothing to compile, and torch then caches nothing for it (its compile
        returns the graph's own ``forward``, which AOTAutograd's cache cannot store): every process traced and
        partitioned it again, and the first joint-graph passes of the process set up inductor's pattern matcher for
        it, some 0.4-1 s of every start on a warm cache. With the bundled AOTAutograd cache (read at compile time
        only, so it is set around the call) the head is compiled to an empty module and stored like any graph.
        """
        compiled = self.compiled(fn)
        return bundled_autograd_cache(compiled) if self.backend == "inductor" else compiled


def block_modules(model: nn.Module, executor: Executor) -> tuple[nn.Module, ...]:
    """Where the repeated blocks live, each module named as in the whole model: the model, or every stage's."""
    if isinstance(executor, Sequential):
        return (model,)
    return tuple(stage.module for stage in executor.stages)


def resolve_options(
    owner: str,
    model: nn.Module,
    executor: Executor,
    num_microbatches: int | None,
    repeated_blocks: BlockChoice,
    compile: bool | Backend,
    training: bool,
    checkpointing: ActivationCheckpointing | None = None,
    prefetch: bool = False,
) -> StepOptions:
    """The options of a step builder checked against each other.

    Raises:
        ValueError: a microbatch count below 1 or other than a pipeline program's; ``repeated_blocks`` named
            explicitly with ``Sequential(unroll=True)`` (one traced graph for the whole step: autograd's backward of
            the regions cannot be inside it) or with a program that splits its backward into ``I`` and ``W``
            (``d9dfn.pipeline.SplitBackward`` traces each stage whole to split it); ``"auto"`` skips them there;
            ``checkpointing`` without repeated blocks to act on (or its ``"budget"`` policy in an eager step);
            ``prefetch`` (``prefetch_gathers``) without repeated blocks or with a backend whose graphs it cannot
            rewrite.
    """
    backend = backend_of(compile)
    if backend == "inductor":  # every builder comes here; the rows install once per process (d9dfn/_torch/)
        torch_patches.install(torch_patches.INDUCTOR_ROWS)
        torch_patches.check_vec_isas_early()
    if isinstance(executor, Pipeline | PipelineRank):
        program = executor.program
        if num_microbatches is not None and num_microbatches != program.num_microbatches:
            raise ValueError(
                f"{owner}: the program runs {program.num_microbatches} microbatches but num_microbatches="
                f"{num_microbatches}; build the program with the step's count (or leave num_microbatches out)"
            )
        num_microbatches = program.num_microbatches
    elif not isinstance(executor, Sequential):
        raise TypeError(
            f"{owner}: executor={executor!r}; pass d9dfn.step.Sequential(), d9dfn.pipeline.Pipeline(program, stages) "
            "or a d9dfn.pipeline.PipelineRank"
        )
    num_microbatches = 1 if num_microbatches is None else num_microbatches
    if num_microbatches < 1:
        raise ValueError(f"{owner}: num_microbatches={num_microbatches}; pass a positive count")
    modules = block_modules(model, executor)
    blocks = resolve_blocks(owner, modules, repeated_blocks)
    why_not = _why_not_blocks(executor, training)
    if blocks and why_not is not None:
        if repeated_blocks != "auto":
            raise ValueError(
                f"{owner}: repeated_blocks compiles each block once, but {why_not.reason}; pass repeated_blocks=()"
            )
        blocks = ()
    if checkpointing is not None:
        _check_checkpointing(owner, checkpointing, blocks, why_not, backend)
    if prefetch:
        _check_prefetch(owner, blocks, why_not, backend)
    wanted = frozenset(blocks)
    names = tuple(dict.fromkeys(n for m in modules for n, sub in m.named_modules() if type(sub) in wanted))
    return StepOptions(num_microbatches, blocks, backend, names, checkpointing, prefetch)


def _check_prefetch(
    owner: str, blocks: tuple[type[nn.Module], ...], why_not: _NoBlocks | None, backend: Backend | None
) -> None:
    """Refuse prefetch that would do nothing: no blocks gather per block, or no graph to reorder."""
    if not blocks:
        reason, fix = why_not or _NO_BLOCKS_FOUND
        raise ValueError(
            f"{owner}: prefetch_gathers issues each block's all-gather one block ahead, but {reason}; {fix}, or pass "
            "prefetch_gathers=False"
        )
    if backend not in PREFETCH_BACKENDS:
        raise ValueError(
            f"{owner}: prefetch_gathers reorders the compiled step's collectives, which the backend {backend!r} "
            f"does not let it do; compile with {' or '.join(repr(b) for b in PREFETCH_BACKENDS)}, or pass "
            "prefetch_gathers=False"
        )


def _check_checkpointing(
    owner: str,
    checkpointing: ActivationCheckpointing,
    blocks: tuple[type[nn.Module], ...],
    why_not: _NoBlocks | None,
    backend: Backend | None,
) -> None:
    """Refuse activation checkpointing that would do nothing: no blocks to recompute, or a budget nothing compiles."""
    if not blocks:
        reason, fix = why_not or _NO_BLOCKS_FOUND
        raise ValueError(
            f"{owner}: activation_checkpointing recomputes repeated blocks in the backward, but {reason}; {fix}, or "
            "pass activation_checkpointing=None"
        )
    if checkpointing.policy == "budget" and backend is None:
        raise ValueError(
            f"{owner}: activation_checkpointing policy 'budget' is the compiler's partitioner, but the step runs "
            "eagerly (compile=False); compile the step, or choose policy 'full' or 'selective'"
        )


class _NoBlocks(NamedTuple):
    """Why per-block compilation cannot run with an executor, and what to change so that it can."""

    reason: str
    fix: str


_NO_BLOCKS_FOUND = _NoBlocks(
    "the step has no repeated blocks (repeated_blocks=(), or none found)",
    "name the model's block class in repeated_blocks",
)


def _why_not_blocks(executor: Executor, training: bool) -> _NoBlocks | None:
    """Why per-block compilation cannot run with ``executor`` (and the fix), or ``None`` when it can."""
    if isinstance(executor, Sequential) and executor.unroll:
        return _NoBlocks(
            "Sequential(unroll=True) traces the whole step as one graph, and a region's backward comes from autograd "
            "outside the graph",
            "run the step with Sequential() (unroll=False)",
        )
    splits = isinstance(executor, Pipeline | PipelineRank) and any(
        a.kind == "I" for row in executor.program.ranks for a in row
    )
    if training and splits:
        return _NoBlocks(
            "this program splits each stage's backward into I and W, which traces the stage whole "
            "(d9dfn.pipeline.SplitBackward); with autograd the split would run the activation gradients twice",
            "choose a schedule that runs each backward whole (gpipe, 1f1b without zero_bubble, looped_bfs)",
        )
    return None


def resolve_data_parallel(plan: ParallelPlan | None, data_parallel: DataParallel | None) -> DataParallel | None:
    """The step's :class:`~d9dfn.DataParallel`: ``data_parallel`` when given (plain params replicated over a process
    group, or a reduction of one's own: the tests of the reduction pass wrong ones), else the plan's when it is bound
    to a mesh (the sum over its token axes, this rank's data-parallel index), else none."""
    if data_parallel is not None or plan is None or not plan.distributed:
        return data_parallel
    return plan_data_parallel(plan)


def step_device(plan: ParallelPlan | None, device: torch.device | str | None) -> torch.device:
    """Where the step's params live: ``device`` when given, else the plan's mesh's device type, else CUDA when
    available, else the CPU."""
    if device is not None:
        return torch.device(device)
    if plan is not None and plan.distributed:
        return torch.device(plan.mesh.device_type)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_state(owner: str, params: Mapping[str, Any], plan: ParallelPlan | None) -> None:
    """Whether a state's ``params`` are those the step was built for: the plan's names, each ``DTensor`` stored as
    the plan says; plain params without a plan. Run once, at the first call.

    Raises:
        ValueError: a ``DTensor`` param without a plan, a param the plan lacks or places otherwise, a buffer the plan
            splits (the step keeps buffers replicated); the message names the param or buffer and the fix.
    """
    if plan is not None and (split := plan.split_buffers()):
        name, split_as = next(iter(split.items()))
        raise ValueError(
            f"{owner}: the plan splits buffer {name!r} as {split_as} on {plan.axes.names}, but the step keeps buffers "
            "whole on every rank; drop the rule that splits its logical dimension, or keep the buffer replicated"
        )
    if plan is None or not plan.distributed:
        for name, p in params.items():
            if is_distributed_tensor(p):
                raise ValueError(
                    f"{owner}: params[{name!r}] is a DTensor but the step was built without a plan bound to its mesh; "
                    "pass plan=d9dfn.parallel.plan_for(train_state.params, mesh), so that the step gathers the params "
                    "and sums the loss weight over the data-parallel ranks"
                )
        return
    for name, p in params.items():
        layout = plan.layout(name)
        placed = tuple(placement_text(x) for x in p.placements) if is_distributed_tensor(p) else None
        if placed != layout.storage:
            raise ValueError(
                f"{owner}: params[{name!r}] is {'placed ' + str(placed) if placed else 'a plain tensor'} but the plan "
                f"stores it {layout.storage} on {plan.axes.names}; build the step with the plan of this state "
                "(d9dfn.parallel.plan_for(train_state.params, mesh)) or the state with the plan's placements "
                "(init_train_state(placements=plan.placements))"
            )


def with_pieces(fn: Callable[..., Any], /, pieces: dict[str, Any]) -> Callable[..., Any]:
    """Expose the functions a step calls (each a ``torch.compile`` wrapper when compiled) as ``step.pieces``: a
    read-only view of ``pieces``, which the builder may still change (a piece chosen at the first call)."""
    fn.pieces = types.MappingProxyType(pieces)  # type: ignore[attr-defined]
    return fn
