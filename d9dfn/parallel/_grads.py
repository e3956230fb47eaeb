"""Gradients of gathered ``DTensor`` params: reduced to each param's placement with few collectives.

Inside the step the model runs on full (gathered) params, so each rank's gradient is a partial sum
(``Partial`` on every mesh axis). Reducing it to the param's placement costs, per rank, one all-reduce for
a replicated param and one reduce-scatter for a sharded one; done param by param that is one round trip
per param (and per axis), which on gloo costs more than the bytes. So:

* params whole on every rank (replicated, or "sharded" over a 1-rank axis) share **one bucket**: their
  gradients are concatenated and all-reduced together (one collective per mesh axis), then split back;
* a sharded param is reduce-scattered over its sharded axes first and only then all-reduced over the
  replicated ones, so with hybrid sharding the replicas exchange a shard, not the whole gradient;
* the global norm of the reduced gradients is one scalar per sharding pattern, summed over the sharded
  axes only (:func:`global_norm`), instead of one collective per param.

Pure functions of their inputs, apart from the collectives (traceable by ``torch.compile``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from d9dfn._types import Grads, Params
from d9dfn.parallel._bucket import bucketed
from d9dfn.parallel._placement import is_distributed_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

__all__ = ["global_norm", "leaf_norms", "reduce_partial_gradients", "shard_norms"]


def _is_shard(placement: object) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard)


def _split_axes(tensor: DTensor) -> tuple[bool, ...]:
    """Per mesh axis: does the placement really split the tensor (``Shard`` on an axis of more than 1 rank)?"""
    mesh = tensor.device_mesh
    return tuple(_is_shard(p) and mesh.size(axis) > 1 for axis, p in enumerate(tensor.placements))


def _stored_as_computed(stored: Sequence[Any], partial: Sequence[Any], sizes: Sequence[int]) -> bool:
    """Whether a gradient of placements ``partial`` (the plan's) is this rank's stored shard already, to be summed over
    its ``Partial`` axes only: split on some axis, and on each axis either split as stored or stored whole (a tensor-
    parallel param stored as it computes). A ``Shard`` over a 1-rank axis stores the whole (a row-parallel weight's
    FSDP ``S(0)`` at ``dp_shard = 1``): so with context parallelism beside, its gradient joins the bucket over ``cp``
    instead of an all-reduce of its own."""
    from torch.distributed.tensor import Partial, Replicate

    split = False
    for s, p, size in zip(stored, partial, sizes, strict=True):
        if _is_shard(s) and size == 1 and s != p:
            continue  # whole on this axis; the gradient there is whole too (Partial over one rank is the value)
        if _is_shard(s):
            if s != p:
                return False
            split = True
        elif not isinstance(s, Replicate) or not isinstance(p, Partial | Replicate):
            return False
    return split


def reduce_partial_gradients(
    grads: Grads,
    params: Params,
    local: Collection[str] = (),
    partial: Callable[[str], Sequence[Any]] | None = None,
    *,
    in_place: bool = False,
) -> Grads:
    """Reduce each rank's partial gradient w.r.t. a ``DTensor`` param to that param's placement.

    Args:
        grads: this rank's partial sums: plain tensors of the params' full shapes (the params the step gathered
            whole), or for the names in ``local`` of the param's local shape (gathered per block: already
            reduce-scattered over the axes that split the param, still partial over the others).
        params: the params; plain ones leave their gradient as it is.
        local: the names whose gradients are local shards (``d9dfn.parallel.BlockLayout``); a param computed split
            as it is stored (tensor parallelism: ``partial`` says so) is one too.
        partial: name → the placements of this rank's gradient of a whole-computed param (the plan's
            ``ParallelPlan.partial_placements``); default ``Partial`` on every mesh axis (data parallelism).
        in_place: ``grads`` are the caller's own (the step's sums, in its eager tail): the all-reduced buckets are
            reduced in place and copied back into them, one bucket of at most ``CAP_BYTES`` at a time
            (``d9dfn.parallel._bucket.bucketed(into_inputs=True)``), instead of into views of one flat copy of them
            all. Eager only (the in-place collective is not traced); the values are the same.

    Returns:
        ``DTensor`` gradients placed like their params (plain gradients for plain params).
    """
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def partial_of(name: str, mesh: DeviceMesh) -> Sequence[Any]:
        return [Partial()] * mesh.ndim if partial is None else partial(name)

    out = dict(grads)
    whole: dict[str, DTensor] = {}  # params whose gradients are all-reduced together, one bucket per (mesh, dtype)
    shards: dict[str, DTensor] = {}  # local shards all-reduced over the axes that do not split them
    for name, grad in grads.items():
        param = params[name]
        if not is_distributed_tensor(param):
            continue
        if name in local or _stored_as_computed(
            param.placements, partial_of(name, param.device_mesh), param.device_mesh.shape
        ):
            shards[name] = param  # a local shard (a tensor-parallel param's): all-reduced over its partial axes only
            continue
        if not any(_split_axes(param)):  # whole on every rank (Shard on a 1-rank axis is whole too)
            whole[name] = param
            continue
        # Reduce-scatter over the sharded axes first, all-reduce the (smaller) shard over the rest.
        mesh, placements = param.device_mesh, tuple(param.placements)
        # Partial over a 1-rank axis is the value itself: Replicate there, so no collective runs over it (an expert
        # param's gradient at EP = every data-parallel rank is complete once the all-to-all's backward ran).
        over = [
            Replicate() if isinstance(p, Partial) and mesh.size(i) == 1 else p
            for i, p in enumerate(partial_of(name, mesh))
        ]
        partial_grad = DTensor.from_local(grad, mesh, over, run_check=False)
        first = [p if _is_shard(p) else o for p, o in zip(placements, over, strict=True)]
        out[name] = partial_grad.redistribute(mesh, first).redistribute(mesh, placements)

    # Buckets are keyed by position in a list of (mesh, split axes, summed axes), not by the mesh: a DeviceMesh that
    # dynamo takes back out of a dict key reaches DTensor.from_local as an opaque object, which the compiled step cannot
    # trace. Summed: the axes over which the gradient is partial (every axis for data parallelism).
    patterns: list[tuple[DeviceMesh, tuple[bool, ...], tuple[bool, ...]]] = []

    def key_of(name: str, param: DTensor, split: tuple[bool, ...]) -> int:
        summed = tuple(isinstance(p, Partial) for p in partial_of(name, param.device_mesh))
        for index, (mesh, pattern, over) in enumerate(patterns):
            if mesh is param.device_mesh and pattern == split and over == summed:
                return index
        patterns.append((param.device_mesh, split, summed))
        return len(patterns) - 1

    def all_reduce(flat: torch.Tensor, key: Hashable) -> torch.Tensor:
        mesh, split, summed = patterns[cast(int, key)]  # over the partial axes that do not split the tensor
        if in_place:  # the bucket's own buffer, reduced where it is: no output copy
            for axis in [axis for axis, s in enumerate(split) if not s and summed[axis] and mesh.size(axis) > 1]:
                name = mesh.get_group(axis).group_name
                torch.ops._c10d_functional.all_reduce_(flat, "sum", name)  # funcol has no in-place all-reduce
                funcol.wait_tensor(flat)  # type: ignore[no-untyped-call]
            return flat
        if not any(split):
            where = [Partial() if s else Replicate() for s in summed]
            reduced = DTensor.from_local(flat, mesh, where, run_check=False)
            return reduced.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        for axis in [axis for axis, s in enumerate(split) if not s and summed[axis] and mesh.size(axis) > 1]:
            # local shards (their length may differ by rank): a plain all-reduce over each other partial axis
            flat = funcol.wait_tensor(funcol.all_reduce(flat, "sum", (mesh, axis)))  # type: ignore[no-untyped-call]
        return flat

    def sums_something(key: int) -> bool:  # a partial axis of more than one rank that does not split the tensor
        mesh, split, summed = patterns[key]
        return any(summed[axis] and not split[axis] and mesh.size(axis) > 1 for axis in range(mesh.ndim))

    every = {**whole, **shards}
    keys = [key_of(n, p, (False,) * p.device_mesh.ndim if n in whole else _split_axes(p)) for n, p in every.items()]
    # A bucket whose sum is over one rank (a mesh of one; local shards on a 1-rank replicate axis) is the identity:
    # its gradients pass as they are, without the flat copy a bucket makes.
    reduced = [grads[name] for name in every]
    summing = [i for i, key in enumerate(keys) if sums_something(key)]
    summed = bucketed(
        [reduced[i] for i in summing], all_reduce, group_by=[keys[i] for i in summing], into_inputs=in_place
    )
    for i, grad in zip(summing, summed, strict=True):
        reduced[i] = grad
    for (name, param), grad in zip(every.items(), reduced, strict=True):
        mesh = param.device_mesh
        out[name] = DTensor.from_local(
            grad, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return out


def leaf_norms(grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Each gradient's L2 norm (0-d float32, plain), for plain and ``DTensor`` leaves (``None`` leaves skipped).

    ``torch._foreach_norm`` of every leaf's local values (a plain tensor, a ``DTensor``'s shard); leaves split over
    mesh axes then combine their shards' norms (:func:`shard_norms`). The one definition of a gradient's norm:
    :func:`global_norm`, the pipeline's norm and the blockwise tail combine these.
    """
    names = [name for name, g in grads.items() if g is not None]
    if not names:
        return {}
    norms = torch._foreach_norm([_local(grads[n]) for n in names], 2.0, dtype=torch.float32)
    local = dict(zip(names, norms, strict=True))
    return shard_norms(local, grads)


def shard_norms(local: Mapping[str, torch.Tensor], grads: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Whole-tensor norms from the norms of each rank's local values (``local``, keyed like ``grads``).

    A leaf no mesh axis splits (a plain tensor, a replicated ``DTensor``) is whole on every rank: its local norm is
    its norm. The squares of the split leaves' local norms are stacked per sharding pattern and summed over exactly
    the axes that split them (one collective per pattern), then rooted: replicated values count once, shards once
    each.
    """
    split = [n for n in local if is_distributed_tensor(grads[n]) and any(_split_axes(grads[n]))]
    if not split:
        return dict(local)
    from torch.distributed.tensor import DTensor, Partial, Replicate

    # Keyed by position, with the meshes in a list: a mesh taken back out of a dict key is opaque to dynamo.
    patterns: list[tuple[DeviceMesh, tuple[bool, ...]]] = []
    members: list[list[str]] = []
    for name in split:
        mesh, sharded = grads[name].device_mesh, _split_axes(grads[name])
        index = next((i for i, (m, s) in enumerate(patterns) if m is mesh and s == sharded), None)
        if index is None:
            patterns.append((mesh, sharded))
            members.append([name])
        else:
            members[index].append(name)
    combined: dict[str, torch.Tensor] = {}
    for (mesh, sharded), group in zip(patterns, members, strict=True):
        squares = torch.stack([local[n].square() for n in group])
        placements = [Partial() if s else Replicate() for s in sharded]
        full = DTensor.from_local(squares, mesh, placements, run_check=False).full_tensor()
        combined.update(zip(group, full.sqrt().unbind(), strict=True))
    return {name: combined.get(name, norm) for name, norm in local.items()}


def _local(grad: torch.Tensor | None) -> torch.Tensor:
    assert grad is not None
    return grad.to_local() if is_distributed_tensor(grad) else grad.detach()


def global_norm(grads: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    """The L2 norm of all gradients together (a plain 0-d float32 tensor), for ``DTensor`` and plain leaves:
    the norm of their :func:`leaf_norms`, as ``optim.global_norm`` and ``torch.nn.utils.clip_grad_norm_`` compute
    it (bitwise ``optim.global_norm`` for plain leaves).
    """
    norms = list(leaf_norms(grads).values())
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    device = norms[0].device
    norm: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    return norm
