"""Where each parameter lives on the data-parallel mesh: ``Replicate`` over ``dp_replicate``, ``Shard(0)``
over ``dp_shard`` (FSDP-style), both at once for hybrid sharding. Pure apart from the collectives that
``distribute_tensor`` and ``full_tensor`` run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from d9dfn._pytree import tree_flatten, tree_unflatten
from d9dfn._types import Params, PyTree

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "PlacementFn",
    "data_parallel_placements",
    "distribute_params",
    "full_tensors",
    "is_distributed_tensor",
    "local_of",
    "placed_like",
    "shard_offset",
]

PlacementFn = Callable[[str, torch.Tensor, Any], Sequence[Any]]
"""``(name, tensor, mesh) -> placements``: one ``torch.distributed.tensor.Placement`` per mesh axis."""


def is_distributed_tensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a ``DTensor`` (without importing ``torch.distributed.tensor`` when unused)."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def data_parallel_placements(name: str, tensor: torch.Tensor, mesh: Any) -> tuple[Any, ...]:
    """The default placements: ``Shard(0)`` on the storage-sharding axis (role ``data_shard``: ``dp_shard``),
    ``Replicate`` on every other axis (data parallelism's plan: ``d9dfn.parallel.make_plan``).

    A 0-d tensor cannot be split and is replicated everywhere. Dim 0 need not divide evenly: shards
    follow ``torch.chunk`` (the last ones may be smaller, or empty). An unnamed mesh replicates everywhere.
    """
    from torch.distributed.tensor import Replicate, Shard

    from d9dfn.parallel._axes import MeshAxes

    if not mesh.mesh_dim_names:
        return tuple(Replicate() for _ in range(mesh.ndim))
    sharded = MeshAxes.of_mesh(mesh).storage_shard_axes
    return tuple(Shard(0) if axis in sharded and tensor.ndim > 0 else Replicate() for axis in mesh.mesh_dim_names)


def distribute_params(params: Params, mesh: Any, placements: PlacementFn | None = None) -> Params:
    """Turn every rank's full copy of ``params`` into ``DTensor``s on ``mesh``.

    Replicated axes take their values from the first rank of each axis (``distribute_tensor`` broadcasts),
    so every replica starts from the same weights even if the ranks initialized differently; sharded axes
    keep this rank's slice. A collective: every rank of ``mesh`` calls it with the same names and shapes.

    Args:
        params: a flat ``{name: tensor}`` of full tensors (plain, not yet distributed).
        mesh: the data-parallel ``DeviceMesh`` (:func:`d9dfn.loop.init_data_parallel_mesh`).
        placements: ``(name, tensor, mesh) -> placements``; default :func:`data_parallel_placements`.
            ``ModelProvider.parallelize_model_stage`` can return one to choose per parameter.

    Raises:
        ValueError: a placement list whose length is not the mesh's number of axes, or a ``Shard(d)`` on a
            dim the tensor does not have; the message names the parameter.
    """
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    choose = placements or data_parallel_placements
    out: Params = {}
    for name, tensor in params.items():
        chosen = tuple(choose(name, tensor, mesh))
        if len(chosen) != mesh.ndim:
            raise ValueError(
                f"distribute_params: params[{name!r}] got placements {chosen} for a {mesh.ndim}-axis mesh "
                f"{mesh.mesh_dim_names}; return one placement per mesh axis"
            )
        for placement in chosen:
            if isinstance(placement, Partial):
                raise ValueError(
                    f"distribute_params: params[{name!r}] got placement {placement!r}; a parameter is Replicate() or "
                    "Shard(dim), never Partial"
                )
            if isinstance(placement, Shard) and not -tensor.ndim <= placement.dim < max(tensor.ndim, 1):
                raise ValueError(
                    f"distribute_params: params[{name!r}] has shape {tuple(tensor.shape)} but got {placement!r}; "
                    "shard a dimension it has, or Replicate() it"
                )
        out[name] = distribute_tensor(tensor.detach(), mesh, chosen)
    return out


def full_tensors(tree: PyTree) -> PyTree:
    """Every ``DTensor`` leaf of ``tree`` gathered into a plain full tensor; other leaves as they are.

    A collective for sharded leaves (all-gather); replicated leaves cost nothing. Used by the step to
    run the model on whole params, and by the loop's edge (export, logging).
    """
    leaves, spec = tree_flatten(tree)
    gathered = []
    for leaf in leaves:
        gathered.append(leaf.full_tensor() if is_distributed_tensor(leaf) else leaf)
    return tree_unflatten(spec, gathered)


def shard_offset(tensor: DTensor) -> tuple[Any, ...]:
    """Where this rank's local shard of ``tensor`` starts in the whole tensor, per dim.

    ``Shard(d)`` on a mesh axis splits dim ``d`` as ``torch.chunk`` does; several ``Shard(d)`` of one dim split it
    again in mesh-axis order (what ``DTensor`` stores); ``Replicate`` adds nothing. On simulated ranks
    (``LocalTensorMode``) the entries are per-rank symbolic ints, which tensor arithmetic accepts.

    Raises:
        TypeError: a placement other than ``Shard(dim)`` or ``Replicate()`` (``Partial``, ``_StridedShard``).
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, ndim = tensor.device_mesh, tensor.ndim
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"shard_offset: this rank is not on the tensor's mesh {mesh}; call it on the mesh's ranks")
    size, offset = list(tensor.shape), [0] * ndim
    for axis, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise TypeError(
                f"shard_offset: a DTensor of shape {tuple(tensor.shape)} has placement {placement!r} on mesh axis "
                f"{axis} ({mesh}); only Shard(dim) and Replicate() have a global offset; redistribute it first"
            )
        dim = placement.dim % ndim
        size[dim], start = Shard.local_shard_size_and_offset(size[dim], mesh.size(axis), coordinate[axis])
        offset[dim] = offset[dim] + start
    return tuple(offset)


def local_of(tensor: Any) -> Any:
    """A ``DTensor``'s local shard, else ``tensor`` itself (:func:`placed_like` puts it back)."""
    return tensor.to_local() if is_distributed_tensor(tensor) else tensor


def placed_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` placed like ``param`` (a ``DTensor`` shard back into its ``DTensor``), else itself."""
    if not is_distributed_tensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
