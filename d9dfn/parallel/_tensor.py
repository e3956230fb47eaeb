"""Tensor parallelism inside a decoder block: the two collectives around a column- then row-parallel pair.

The tensor axis (role ``tensor``, ``d9dfn.parallel.MeshAxes``) splits each block's attention heads and MLP width
over its ``n`` ranks (the plan's :data:`~d9dfn.parallel.TENSOR_PARALLEL_RULES`): q/k/v and gate/up are split by
output rows (``Shard(0)`` of the Linear weight: column-parallel), o and down by input columns (``Shard(1)``:
row-parallel). A block then computes, on every rank of the group, on the same tokens:

    y = x + g(o_local(attention_local(f(norm(x)))))

* ``f`` (:func:`enter_tensor_parallel`): the identity forward; its adjoint sums the input gradient over the group
  (each rank's local heads contribute a part of ``∂L/∂norm(x)``);
* ``g`` (:func:`leave_tensor_parallel`): sums the row-parallel outputs over the group (each rank's part of
  ``o(attention)``); its adjoint is the identity (the output gradient is already whole on every rank).

Megatron's ``f`` and ``g`` (Shoeybi et al. 2019, §3, figure 3), written as ``autograd.Function`` s over
``torch.distributed._functional_collectives.all_reduce``, so they are differentiable under ``torch.func`` (the
step's ``vjp``) and a compiled graph holds them: one all-reduce forward and one backward per attention and per MLP,
4 per block per microbatch. No module hooks: the decoder's attention and MLP call them when bound to a group
(:func:`tensor_parallel_of`, set by the loop or a test).

What follows for the gradients (the plan's ``partial``): a split param's gradient is this rank's shard, complete
(every token, every rank's contribution to its rows flows back through ``g`` 's identity adjoint and the local
matmul); a param computed whole on every rank and applied to the residual stream (the norms, the embedding, the LM
head, o's bias) gets the same, complete gradient on every rank (``f`` summed the gradient before it); a param applied
to each head (Qwen3's per-head q/k norms) sees only this rank's heads: its gradient is partial over the tensor axis
(the family plan's ``sums_over``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["TensorParallel", "enter_tensor_parallel", "leave_tensor_parallel", "tensor_parallel_of"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor group a decoder block splits its heads and MLP over: a plain value the compiled step holds as a
    constant.

    Attributes:
        group: the registered name of the tensor axis's process group (what the functional collectives take).
        size: its number of ranks ``n``; each holds ``1/n`` of the heads, kv-heads and MLP width.
    """

    group: str
    size: int


def tensor_parallel_of(plan: Any) -> TensorParallel | None:
    """The tensor group of a plan bound to a mesh with a tensor axis of more than one rank over which some param is
    computed split (the plan's rules: :data:`~d9dfn.parallel.TENSOR_PARALLEL_RULES`), else ``None`` (the blocks then
    compute whole). Resolves the group's name: call it when the step is built."""
    from d9dfn.parallel._reduce import group_name

    if plan is None or plan.mesh is None:
        return None
    name = plan.axes.name_of("tensor")
    if name is None or plan.axes.size_of("tensor") == 1:
        return None
    index = plan.axes.names.index(name)
    if not any(layout.compute[index] != "R" for layout in plan.params.values()):
        return None  # a tensor axis, but nothing computed split over it
    return TensorParallel(group_name(plan.mesh.get_group(name), "tensor_parallel_of"), plan.axes.size_of("tensor"))


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    out: torch.Tensor = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", cast("GroupName", group)))  # type: ignore[no-untyped-call]
    return out


class _Enter(torch.autograd.Function):
    """``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(x: torch.Tensor, group: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Leave.apply(grad, ctx.group), None  # type: ignore[no-untyped-call]


class _Leave(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(x: torch.Tensor, group: str) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Enter.apply(grad, ctx.group), None  # type: ignore[no-untyped-call]


def enter_tensor_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``x`` (whole on every rank of the group) as the input of column-parallel layers: the identity; its gradient is
    summed over the group (the module docstring's ``f``)."""
    out: torch.Tensor = _Enter.apply(x, tp.group)  # type: ignore[no-untyped-call]
    return out


def leave_tensor_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of a row-parallel output, summed over the group (the module docstring's ``g``): whole on every
    rank; its gradient passes as it is."""
    out: torch.Tensor = _Leave.apply(x, tp.group)  # type: ignore[no-untyped-call]
    return out
