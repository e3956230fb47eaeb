"""Sharded parameters gathered one block at a time, inside the step (FSDP2's per-block all-gather, SimpleFSDP's
"inside the traced graph").

A block's params are ``Shard(0)`` ``DTensor`` s over the ``dp_shard`` axis. Each rank packs its local shards into one
flat bucket (:meth:`BlockLayout.bucket`: the shards one after another, zero-padded to the longest rank's bucket), and
the block's forward all-gathers the buckets with one collective and cuts every full param out of the gathered rows
(:meth:`BlockLayout.gather`). The gather is an autograd function whose backward reduce-scatters the full params'
gradients into each rank's bucket gradient, one collective per block, as soon as the block's backward is done; the
bucket's gradient then splits back into each local shard's (the bucket's ``cat``). With a precision policy the
buckets travel in the compute dtype and the gradients are reduce-scattered in the reduce dtype (FSDP2's
``MixedPrecisionPolicy``). Gradients at rest stay sharded; with hybrid sharding they are still partial over the
replicas, which the step's tail all-reduces (:func:`d9dfn.parallel.reduce_partial_gradients`, ``local=``).

Traceable by ``torch.compile`` (functional collectives), and inside a ``nested_compile_region``: every block of a class
reuses one compiled gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = ["BlockLayout", "block_layout"]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How one block's sharded params travel: their order, full shapes, each rank's rows, the bucket length.

    Attributes:
        names: the params' names inside the block (``self_attn.q_proj.weight``), in bucket order.
        shapes: their full shapes.
        rows: per param, the dim-0 rows each shard rank holds (``torch.chunk``'s split: the last ranks may hold
            fewer, or none).
        row_len: the bucket's length on every rank (the longest rank's elements).
        group: the shard group's registered name (the functional collectives take it).
        compute_dtype: the dtype the buckets travel and the block computes in (``None``: the params' own).
        reduce_dtype: the dtype the gradients are reduce-scattered in (``None``: the params' own).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[int, ...], ...]
    row_len: int
    group: str
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @property
    def world(self) -> int:
        return len(self.rows[0])

    def _inner(self, index: int) -> int:
        return math.prod(self.shapes[index][1:])

    def bucket(self, local: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This rank's bucket from its local shards (keyed by ``names``): flattened, concatenated, zero-padded."""
        parts = [local[name].reshape(-1) for name in self.names]
        used = sum(part.numel() for part in parts)
        # Always a padding part, empty on the longest rank: its length differs by rank, so no branch on it.
        return torch.cat([*parts, parts[0].new_zeros(self.row_len - used)])

    def gather(self, bucket: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every rank's bucket all-gathered into the block's full params (in the compute dtype): one collective,
        whose backward reduce-scatters the params' gradients into this rank's bucket gradient."""
        flat: torch.Tensor = _GatherBuckets.apply(  # type: ignore[no-untyped-call]
            bucket, self.group, self.world, self.compute_dtype, self.reduce_dtype
        )
        gathered = flat.view(self.world, self.row_len)  # (world, row_len)
        params = {}
        offsets = [0] * self.world
        for index, name in enumerate(self.names):
            inner, tail = self._inner(index), self.shapes[index][1:]
            pieces = []
            for rank, count in enumerate(self.rows[index]):
                pieces.append(gathered[rank, offsets[rank] : offsets[rank] + count * inner].view(count, *tail))
                offsets[rank] += count * inner
            params[name] = torch.cat(pieces)
        return params


class _GatherBuckets(torch.autograd.Function):
    """All-gather the buckets (cast to the compute dtype first); backward: reduce-scatter the gradient (in the reduce
    dtype) back to this rank's bucket, in the bucket's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        bucket: torch.Tensor,
        group: str,
        world: int,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        ctx.group, ctx.dtype, ctx.reduce_dtype = group, bucket.dtype, reduce_dtype
        sent = bucket if compute_dtype is None else bucket.to(compute_dtype)
        gathered = funcol.all_gather_single(sent, 0, cast("GroupName", group))
        return cast(torch.Tensor, funcol.wait_tensor(gathered))  # type: ignore[no-untyped-call]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        import torch.distributed._functional_collectives as funcol

        grad = grad.contiguous() if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype).contiguous()
        scattered = funcol.reduce_scatter_single(grad, "sum", 0, cast("GroupName", ctx.group))
        reduced = cast(torch.Tensor, funcol.wait_tensor(scattered))  # type: ignore[no-untyped-call]
        return reduced.to(ctx.dtype), None, None, None, None


def _rows(size: int, world: int) -> tuple[int, ...]:
    """``torch.chunk``'s split of ``size`` rows over ``world`` ranks (DTensor's ``Shard``), zeros for empty ranks."""
    counts = [len(chunk) for chunk in torch.arange(size).chunk(world)] if size else []
    return tuple(counts + [0] * (world - len(counts)))


def block_layout(
    params: Mapping[str, Any],
    names: Sequence[str],
    group: str,
    world: int,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> BlockLayout:
    """The layout of a block's params ``names`` (shapes read from ``params``; they split over ``world`` ranks)."""
    shapes = tuple(tuple(params[name].shape) for name in names)
    rows = tuple(_rows(shape[0], world) for shape in shapes)
    per_rank = [sum(r[rank] * math.prod(s[1:]) for r, s in zip(rows, shapes, strict=True)) for rank in range(world)]
    return BlockLayout(tuple(names), shapes, rows, max(per_rank), group, compute_dtype, reduce_dtype)
