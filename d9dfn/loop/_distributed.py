"""The edge of a multi-process job: the process group, its timeouts, and who writes files.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed`
creates the default process group from them (gloo on CPU, NCCL on CUDA) with the configured timeout and
returns the data-parallel mesh. Every function here has side effects and runs once, at start-up or
between steps, never inside the compiled step.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from d9dfn.config import DeviceMeshParameters
from d9dfn.parallel import MeshAxes

__all__ = [
    "CollectiveError",
    "default_device_type",
    "init_data_parallel_mesh",
    "init_distributed",
    "init_mesh",
    "init_pipeline_mesh",
    "is_main_process",
    "launched_world_size",
    "mesh_axes",
    "resolve_device",
    "set_collective_timeout",
]


_NOT_YET = ("context_parallel_replicate",)


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, or did not arrive within the process group's timeout."""

    @classmethod
    def at_step(cls, error: BaseException, *, rank: int, world_size: int, step: int, first: bool) -> CollectiveError:
        """The error for ``error`` raised by a collective of training step ``step`` (``first``: the step that
        compiles, under ``timeout.init_timeout``; later ones under ``timeout.step_timeout``)."""
        return cls(
            f"Trainer: rank {rank} of {world_size}: step {step} failed in a collective ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}). Another rank most likely died or stalled for longer than timeout."
            f"{'init_timeout' if first else 'step_timeout'}; check its log. The last committed checkpoint is "
            "intact: rerun the same command to resume"
        )


def launched_world_size() -> int:
    """The number of processes ``torchrun`` started (``WORLD_SIZE``), 1 outside ``torchrun``.

    >>> launched_world_size() >= 1
    True
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(int(value), 1)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an int; launch with torchrun, or unset it") from None


def is_main_process() -> bool:
    """Rank 0 of the job, or the only process: the one that writes logs, plots and progress."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def init_distributed(mesh: DeviceMeshParameters, *, timeout_s: float, device_type: str | None = None) -> Any:
    """Create the default process group (if needed) with ``timeout_s``, then the data-parallel mesh.

    Args:
        mesh: the job's degrees; only the pipeline, the two data-parallel, the expert-, the tensor- and the
            sharded context-parallel ones may exceed 1 so far.
        timeout_s: how long a collective waits for the other ranks before it fails (``TimeoutConfig.
            init_timeout`` at start-up; :func:`set_collective_timeout` lowers it after the first step).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); default: ``"cuda"`` when available.

    Returns:
        The ``(dp_replicate, dp_shard)`` ``DeviceMesh``; with ``mesh.pipeline_parallel > 1`` the
        ``(pp, dp_replicate, dp_shard)`` one (:func:`init_pipeline_mesh`); with ``mesh.expert_parallel > 1`` an
        ``ep`` axis carved out of the data-parallel ones (:func:`mesh_axes`).

    Raises:
        ValueError: the degrees do not multiply to the number of processes, or an unimplemented degree.
    """
    import torch.distributed as dist

    for name in _NOT_YET:
        value = getattr(mesh, name)
        if value != 1:
            raise ValueError(
                f"init_distributed: mesh.{name}={value} is not implemented (d9dfn has pipeline, data, expert, "
                f"tensor and one context axis only); set mesh.{name}=1 and spread the processes over "
                "mesh.context_parallel_shard, mesh.data_parallel_replicate (DDP) and mesh.data_parallel_shard (FSDP)"
            )
    axes = mesh_axes(mesh)  # refused here, before any process group
    device_type = device_type or default_device_type()
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ValueError(
                "init_distributed: the mesh asks for several processes but this one was not started by torchrun "
                f"(MASTER_ADDR is unset); launch it with `torchrun --nproc-per-node {mesh.world_size} -m d9dfn "
                "train ...` (or `infer ...`: the same command and flags after -m d9dfn)"
            )
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return init_mesh(axes, device_type=device_type)


def mesh_axes(mesh: DeviceMeshParameters) -> MeshAxes:
    """The job's mesh as axes with roles (``d9dfn.parallel.MeshAxes``): the two data-parallel axes always, the
    pipeline axis (outermost) when its degree is above 1, and the expert axis when ``mesh.expert_parallel`` is above
    1, carved out of ``data_parallel_shard`` when it divides it (innermost), else out of ``data_parallel_replicate``
    (right after it): the data-parallel ranks keep their order and number, and params other than the experts are
    placed as that data parallelism places them; the tensor axis (innermost) when ``mesh.tensor_parallel`` is above 1;
    the context axis ``cp`` (role ``context``, a token axis: its ranks take the same rows, each its part of every
    sequence) right inside ``dp_shard`` when ``mesh.context_parallel_shard`` is above 1.

    >>> mesh_axes(DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2)).names
    ('pp', 'dp_replicate', 'dp_shard')
    >>> axes = mesh_axes(DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=2))
    >>> axes.names, axes.sizes
    (('dp_replicate', 'dp_shard', 'ep'), (2, 1, 2))
    >>> axes = mesh_axes(DeviceMeshParameters(data_parallel_shard=2, context_parallel_shard=2))
    >>> axes.names, axes.token_axes, axes.data_parallel_size
    (('dp_replicate', 'dp_shard', 'cp'), ('dp_replicate', 'dp_shard', 'cp'), 2)
    >>> mesh_axes(DeviceMeshParameters(context_parallel_shard=2, tensor_parallel=2)).names  # tp innermost, cp outside
    ('dp_replicate', 'dp_shard', 'cp', 'tp')

    Raises:
        ValueError: ``mesh.expert_parallel`` divides neither data-parallel degree.
    """
    replicate, shard, experts = mesh.data_parallel_replicate, mesh.data_parallel_shard, mesh.expert_parallel
    degrees: dict[str, Any] = {"data_replicate": replicate, "data_shard": shard}
    if mesh.pipeline_parallel > 1:
        degrees["pipeline"] = mesh.pipeline_parallel
    if mesh.context_parallel_shard > 1:  # a token axis: the same rows, each rank its part of every sequence
        degrees["context"] = mesh.context_parallel_shard
    if mesh.tensor_parallel > 1:  # innermost: the tensor group's all-reduces stay between neighbours
        degrees["tensor"] = mesh.tensor_parallel
    if experts == 1:
        return MeshAxes.of(**degrees)
    if shard % experts == 0:
        carved = {**degrees, "data_shard": shard // experts, "expert": experts}
        return MeshAxes.of(**carved)  # innermost: carved from dp_shard
    if replicate % experts == 0:
        carved = {**degrees, "data_replicate": replicate // experts, "expert": experts}
        return MeshAxes.of(**carved, expert_from="data_replicate")
    raise ValueError(
        f"mesh.expert_parallel={experts} divides neither mesh.data_parallel_shard={shard} nor "
        f"mesh.data_parallel_replicate={replicate}: the expert ranks are carved out of one of them; set --set "
        f"mesh.expert_parallel to a divisor of {shard if shard > 1 else replicate}"
    )


def init_mesh(axes: MeshAxes, *, device_type: str | None = None) -> Any:
    """Create the ``DeviceMesh`` of ``axes`` over every process (their names and sizes, outermost first).

    Raises:
        ValueError: the sizes do not multiply to the number of processes.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    size = math.prod(axes.sizes)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != size:
        shape = " x ".join(f"{a.name}={a.size}" for a in axes.axes)
        raise ValueError(
            f"init_mesh: {shape} = {size} processes, but the job has {dist.get_world_size()}; launch {size} "
            f"(torchrun --nproc-per-node {size}) or change the degrees so that their product is "
            f"{dist.get_world_size()}"
        )
    return init_device_mesh(device_type or default_device_type(), axes.sizes, mesh_dim_names=axes.names)


def set_collective_timeout(timeout_s: float, groups: Sequence[Any] = ()) -> None:
    """Set the collective timeout of the default process group and of ``groups`` (d9d: ``step_timeout`` after
    the first step).

    Each process group keeps the timeout it was created with: a mesh's subgroups (the ``pp`` group whose sends
    and receives the pipeline waits on, the data-parallel groups) must be passed here, or a stalled peer keeps
    them waiting for the start-up timeout.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        for group in (dist.group.WORLD, *groups):
            _set_pg_timeout(timeout, group)


def resolve_device(name: str, field: str = "run.device") -> torch.device:
    """The device a config's ``device`` names: ``"auto"`` is CUDA when available, else the CPU; ``"cuda"`` is
    the ``LOCAL_RANK`` GPU under ``torchrun`` (0 without it).

    Raises:
        ValueError: CUDA is named but no GPU is visible, naming ``field`` and the fix.
    """
    if name == "auto":
        name = default_device_type()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"{field}={name!r} but torch sees no CUDA device (torch {torch.__version__}); set {field}='cpu', "
                f"or 'auto' to use a GPU only when there is one"
            )
        if name == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def default_device_type() -> str:
    """``"cuda"`` (NCCL) when a GPU is visible, else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_data_parallel_mesh(replicate: int = 1, shard: int = 1, *, device_type: str | None = None) -> Any:
    """Create the 2-D data-parallel ``DeviceMesh`` ``(dp_replicate, dp_shard)`` over every process.

    If the default process group does not exist yet, ``init_device_mesh`` creates it from the
    ``torchrun`` environment (gloo on CPU, NCCL on CUDA). Ranks are laid out shard-major: ranks
    ``0..shard-1`` form the first shard group, so with HSDP the reduce-scatter stays between neighbours.

    Args:
        replicate: replicas that each hold whole params (DDP).
        shard: ranks that split params, gradients and optimizer state along dim 0 (FSDP).
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when available, else ``"cpu"``.

    Returns:
        A ``DeviceMesh`` of shape ``(replicate, shard)`` with axes ``d9dfn.parallel.DATA_PARALLEL_AXES``.

    Raises:
        ValueError: a degree below 1, or a world size that differs from ``replicate * shard``.
    """
    import torch.distributed as dist

    for name, value in (("replicate", replicate), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_data_parallel_mesh: {name}={value!r}; pass a positive int")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != replicate * shard:
        raise ValueError(
            f"init_data_parallel_mesh: replicate={replicate} x shard={shard} = {replicate * shard} processes, but "
            f"the job has {dist.get_world_size()}; launch {replicate * shard} (torchrun --nproc-per-node "
            f"{replicate * shard}) or change the degrees so that their product is {dist.get_world_size()}"
        )
    return init_mesh(MeshAxes.of(data_replicate=replicate, data_shard=shard), device_type=device_type)


def init_pipeline_mesh(pipeline: int, replicate: int = 1, shard: int = 1, *, device_type: str | None = None) -> Any:
    """Create the 3-D ``DeviceMesh`` ``(pp, dp_replicate, dp_shard)`` over every process, ``pp`` outermost.

    Global rank ``g`` is pipeline rank ``g // (replicate * shard)``: the data-parallel peers of one stage are
    neighbours (intra-node in production) and the pipeline hops are the long ones, as in torchtitan. Read it
    with ``d9dfn.parallel.pipeline_group``, ``pipeline_rank`` and ``data_parallel_submesh``.

    Args:
        pipeline: pipeline ranks (each runs one row of a program).
        replicate: data-parallel replicas of each pipeline slice (DDP).
        shard: ranks that shard each pipeline slice's params along dim 0 (FSDP).
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` when available, else ``"cpu"``.

    Raises:
        ValueError: a degree below 1, or a world size that differs from ``pipeline * replicate * shard``.
    """
    import torch.distributed as dist

    degrees = (("pipeline", pipeline), ("replicate", replicate), ("shard", shard))
    for name, value in degrees:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_pipeline_mesh: {name}={value!r}; pass a positive int")
    size = pipeline * replicate * shard
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != size:
        raise ValueError(
            f"init_pipeline_mesh: pipeline={pipeline} x replicate={replicate} x shard={shard} = {size} processes, "
            f"but the job has {dist.get_world_size()}; launch {size} (torchrun --nproc-per-node {size}) or change "
            f"the degrees so that their product is {dist.get_world_size()}"
        )
    return init_mesh(
        MeshAxes.of(pipeline=pipeline, data_replicate=replicate, data_shard=shard), device_type=device_type
    )
