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

__all__ = [
    "TensorParallel",
    "enter_tensor_parallel",
    "gather_sequence",
    "leave_tensor_parallel",
    "scatter_sequence",
    "sequence_rank",
    "split_sequence",
    "tensor_parallel_of",
    "unsplit_sequence",
]


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
    sequence: bool = False
    """Sequence parallelism: between the blocks' column/row pairs (the norms, the residual stream) each rank holds
    ``1/n`` of the sequence; the pair's entry all-gathers it and its exit reduce-scatters onto it
    (:func:`gather_sequence`, :func:`scatter_sequence`), in place of the two all-reduces."""
    vocab: bool = False
    """Vocabulary parallelism: the embedding and the LM head hold ``1/n`` of the vocabulary rows; the embedding's
    parts are summed over the group and the logits stay split (``d9dfn.parallel.vocab_parallel_embedding``,
    :class:`~d9dfn.parallel.VocabParallelLogits`)."""


def tensor_parallel_of(plan: Any, rules: Any = ()) -> TensorParallel | None:
    """The tensor group of a plan bound to a mesh with a tensor axis of more than one rank over which some param is
    computed split (the plan's rules: :data:`~d9dfn.parallel.TENSOR_PARALLEL_RULES`), else ``None`` (the blocks then
    compute whole); with sequence parallelism when ``rules`` (those the plan was made with) split the ``sequence``
    dimension over the tensor axis (:data:`~d9dfn.parallel.SEQUENCE_PARALLEL_RULES`), with vocabulary parallelism
    when they split ``vocab`` over it (:data:`~d9dfn.parallel.VOCAB_PARALLEL_RULES`). Resolves the group's name: call
    it when the step is built."""
    from d9dfn.parallel._reduce import group_name

    if plan is None or plan.mesh is None:
        return None
    name = plan.axes.name_of("tensor")
    if name is None or plan.axes.size_of("tensor") == 1:
        return None
    index = plan.axes.names.index(name)
    if not any(layout.compute[index] != "R" for layout in plan.params.values()):
        return None  # a tensor axis, but nothing computed split over it
    sequence = any(dim == "sequence" and "tensor" in roles for dim, roles in rules)
    vocab = any(dim == "vocab" and "tensor" in roles for dim, roles in rules)
    group = group_name(plan.mesh.get_group(name), "tensor_parallel_of")
    return TensorParallel(group, plan.axes.size_of("tensor"), sequence, vocab)


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


# Sequence parallelism: the residual stream (B, T, D) split along T (dim 1) over the tensor group between the pairs.


def _gather(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """(B, T', ...) -> (B, n·T', ...): every rank's ``x`` concatenated along dim 1, in rank order."""
    import torch.distributed._functional_collectives as funcol

    # The raw op (dim 0), not funcol's *_single, and without autograd: torch's own autograd formulas of these ops are
    # autograd Functions that torch.func cannot run (no setup_context); the Functions below give the gradients.
    with torch.no_grad():
        stacked = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group)
        out: torch.Tensor = funcol.wait_tensor(stacked)  # type: ignore[no-untyped-call]  # (n·B, T', ...)
    return out.reshape(size, -1, *out.shape[1:]).movedim(0, 1).flatten(1, 2)


def _reduce_scatter(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    """(B, n·T', ...) -> (B, T', ...): the sum over the ranks of this rank's part along dim 1."""
    import torch.distributed._functional_collectives as funcol

    parts = _parts(x, size).movedim(1, 0).flatten(0, 1).contiguous()  # (n·B, T', ...), part r first
    with torch.no_grad():  # as in _gather
        summed = torch.ops._c10d_functional.reduce_scatter_tensor(parts, "sum", size, group)
        out: torch.Tensor = funcol.wait_tensor(summed)  # type: ignore[no-untyped-call]
    return out


def _take(x: torch.Tensor, size: int, rank: torch.Tensor) -> torch.Tensor:
    # (B, n·T', ...) -> (B, T', ...): this rank's chunk, the rank a tensor (simulated ranks differ per rank).
    return _parts(x, size).index_select(1, rank.reshape(1)).squeeze(1)


def _parts(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, n·T', ...) -> (B, n, T', ...)."""
    return x.reshape(x.shape[0], size, -1, *x.shape[2:])


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        return _gather(x, group, size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ScatterSequence.apply(grad, ctx.group, ctx.size), None, None  # type: ignore[no-untyped-call]


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
        return _reduce_scatter(x, group, size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _GatherSequence.apply(grad, ctx.group, ctx.size), None, None  # type: ignore[no-untyped-call]


class _SplitSequence(torch.autograd.Function):
    """This rank's chunk of a tensor whole on every rank forward, all-gather of the gradient backward (every rank's
    chunk's gradient, so the gradient of the whole is complete on every rank)."""

    @staticmethod
    def forward(x: torch.Tensor, group: str, size: int, rank: torch.Tensor) -> torch.Tensor:
        return _take(x, size, rank).contiguous()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.group, ctx.size), None, None, None


class _UnsplitSequence(torch.autograd.Function):
    """All-gather along the sequence forward; backward, this rank's chunk of the gradient (every rank computes the
    same thing from the whole, so the gradient of the whole is the same on every rank)."""

    @staticmethod
    def forward(x: torch.Tensor, group: str, size: int, rank: torch.Tensor) -> torch.Tensor:
        return _gather(x, group, size)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group, ctx.size, ctx.rank = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _take(grad, ctx.size, ctx.rank).contiguous(), None, None, None


def sequence_rank(tp: TensorParallel, device: torch.device) -> torch.Tensor:
    """This rank's index in the tensor group as a 0-d int64 tensor, from one tiny reduce-scatter (every rank
    contributes ``0, 1, …, n-1``: rank ``r`` receives ``n·r``), so that it needs no Python int per rank: the same code
    runs on real ranks, on simulated ones (``LocalTensorMode``) and in a compiled graph."""
    return group_rank(tp.group, tp.size, device)


def group_rank(group: str, size: int, device: torch.device) -> torch.Tensor:
    """This rank's index in the process group ``group`` of ``size`` ranks as a 0-d int64 tensor (:func:`sequence_rank`;
    context parallelism's ``d9dfn.parallel.context_rank``)."""
    import torch.distributed._functional_collectives as funcol

    ranks = torch.arange(size, dtype=torch.float32, device=device)
    summed = funcol.wait_tensor(  # type: ignore[no-untyped-call]
        torch.ops._c10d_functional.reduce_scatter_tensor(ranks, "sum", size, group)
    )
    rank: torch.Tensor = (summed[0] / size).round().to(torch.int64)
    return rank


def gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(B, T/n, D) this rank's part of the sequence -> (B, T, D) whole, as the input of column-parallel layers
    (sequence parallelism's ``f``); its gradient is reduce-scattered back onto the sequence."""
    out: torch.Tensor = _GatherSequence.apply(x, tp.group, tp.size)  # type: ignore[no-untyped-call]
    return out


def scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(B, T, D) this rank's part of a row-parallel output -> (B, T/n, D) the sum over the group of this rank's part
    of the sequence (sequence parallelism's ``g``); its gradient is all-gathered."""
    out: torch.Tensor = _ScatterSequence.apply(x, tp.group, tp.size)  # type: ignore[no-untyped-call]
    return out


def split_sequence(x: torch.Tensor, tp: TensorParallel, rank: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) whole on every rank -> (B, T/n, ...) this rank's part (``rank``: its index in the group, a 0-d
    int64 tensor on ``x`` 's device); its gradient is all-gathered."""
    out: torch.Tensor = _SplitSequence.apply(x, tp.group, tp.size, rank)  # type: ignore[no-untyped-call]
    return out


def unsplit_sequence(x: torch.Tensor, tp: TensorParallel, rank: torch.Tensor) -> torch.Tensor:
    """(B, T/n, ...) this rank's part -> (B, T, ...) whole on every rank (all-gathered); the inverse of
    :func:`split_sequence`: its gradient is this rank's part of the (same on every rank) gradient."""
    out: torch.Tensor = _UnsplitSequence.apply(x, tp.group, tp.size, rank)  # type: ignore[no-untyped-call]
    return out
