"""Sharded params gathered where they are used: each repeated block's ``Shard(0)`` params all-gathered right before
its forward, given back after it, gathered again for its backward, and their gradients reduce-scattered as soon as
its backward is done (FSDP2's per-block schedule, written into the step: ``docs/design/data-parallel.md``).

The per-block runner (:class:`d9dfn.step._blocks.RegionalStages`) replaces each such block, in its copy of the
module, by a :class:`GatheredBlock`: it holds one parameter, ``bucket`` (this rank's shards of the block's params,
flat: :class:`d9dfn.parallel.BlockLayout`), and its forward, one compiled region per block class, all-gathers the
bucket into the block's full params and calls the block on them (``functional_call``). The gather runs under a
checkpoint that recomputes it: a compiled step keeps only the bucket for the backward and gathers again there, so
the full params of one block at a time are alive (an eager step keeps them until the block's backward). The model,
the task, the checkpoints and their layout do not change: placement decides (``Shard(0)`` over ``dp_shard``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from d9dfn._types import Params
from d9dfn.parallel._gather import BlockLayout, block_layout
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.parallel._reduce import group_name
from d9dfn.step._checkpointing import ActivationCheckpointing, checkpointed_forward
from d9dfn.step._precision import Precision

__all__ = ["GatheredBlock", "Gathering", "gathered_class", "plan_gathering"]

BUCKET = "bucket"
"""The name of a :class:`GatheredBlock`'s one parameter."""


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


class GatheredBlock(nn.Module):
    """A repeated block whose params arrive as this rank's flat bucket of shards, gathered at each forward.

    ``inner`` (the block itself, holding no tensors the step reads) is an attribute, not a submodule: the copy's
    only parameter for the block is ``bucket``.
    """

    inner: nn.Module

    def __init__(self, inner: nn.Module, layout: BlockLayout) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.layout = layout
        self.bucket = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)  # swapped in every call

    def gathered_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward on its gathered params; the gather is recomputed, not kept, for the backward."""
        context = functools.partial(create_selective_checkpoint_contexts, _recompute_everything)
        params = checkpoint(self.layout.gather, self.bucket, use_reentrant=False, context_fn=context)
        return functional_call(self.inner, params, args, kwargs, strict=True)


def gathered_class(
    cls: type[nn.Module],
    checkpointing: ActivationCheckpointing | None,
    classes: dict[tuple[type[nn.Module], ActivationCheckpointing | None, bool], type[nn.Module]],
    region: bool = True,
) -> type[GatheredBlock]:
    """The :class:`GatheredBlock` for blocks of ``cls``: its forward one nested compile region per block class (and
    policy) in the step's ``classes`` (inlined into the caller's graph without ``region``), run under
    ``checkpointing``'s activation checkpoint inside it when given (the recompute gathers again)."""
    key = (cls, checkpointing, True)
    if key not in classes:
        forward = GatheredBlock.gathered_forward
        if checkpointing is not None:
            forward = checkpointed_forward(forward, checkpointing)
        names = {
            "forward": torch.compiler.nested_compile_region(forward) if region else forward,
            "__module__": __name__,
            "__qualname__": f"Gathered{cls.__qualname__}",
        }
        classes[key] = type(f"Gathered{cls.__name__}", (GatheredBlock,), names)
    return classes[key]  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Gathering:
    """Which blocks gather their sharded params, and how: block name → its :class:`~d9dfn.parallel.BlockLayout`."""

    layouts: Mapping[str, BlockLayout] = dataclasses.field(default_factory=dict)

    def names(self) -> frozenset[str]:
        """The full names of every param gathered per block."""
        return frozenset(f"{block}.{inner}" for block, layout in self.layouts.items() for inner in layout.names)

    def buckets(self, params: Params) -> tuple[Params, dict[str, torch.Tensor]]:
        """``params`` without the gathered ones, and the buckets of the blocks whose params they hold (keyed
        ``<block>.bucket``, as the copy's :class:`GatheredBlock` names its parameter)."""
        gathered = self.names()
        rest = {name: p for name, p in params.items() if name not in gathered}
        buckets = {
            f"{block}.{BUCKET}": layout.bucket({inner: params[f"{block}.{inner}"] for inner in layout.names})
            for block, layout in self.layouts.items()
            if f"{block}.{layout.names[0]}" in params
        }
        return rest, buckets


def plan_gathering(
    plan: ParallelPlan | None, blocks: Mapping[str, nn.Module], precision: Precision | None
) -> Gathering:
    """The blocks (name → a module holding it, for its param names and full shapes) whose params the plan stores
    ``Shard(0)`` over one mesh axis and computes whole (:meth:`~d9dfn.parallel.ParallelPlan.gathers_per_block`): these
    gather per block. Blocks of one class share one layout object (one compiled region serves them all). Nothing
    without a plan bound to a mesh."""
    layouts: dict[str, BlockLayout] = {}
    if plan is None or not plan.distributed:
        return Gathering(layouts)
    shared: dict[BlockLayout, BlockLayout] = {}
    for block, module in blocks.items():
        full = dict(module.named_parameters())
        inner = list(full)
        names = [f"{block}.{name}" for name in inner]
        if not inner or any(name not in plan.params for name in names):
            continue  # a block holding a param the plan does not describe
        axis = plan.gathers_per_block(names)
        if axis is None:
            continue
        compute = None if precision is None or not precision.casts else precision.compute_dtype
        reduce = None if precision is None else precision.reduce_dtype
        group = group_name(plan.mesh.get_group(axis), "plan_gathering")
        layout = block_layout(full, inner, group, plan.axes.sizes[axis], compute, reduce)
        layouts[block] = shared.setdefault(layout, layout)
    return Gathering(layouts)
