"""How one rank takes part in a training run of several processes, and the loop's collectives over it.

:class:`Parallelism` groups the distributed pieces ``TrainingConfigurator`` builds (the device mesh, this pipeline
slice's data-parallel mesh, the model's placements, this rank's pipeline stages and the ``pp`` group);
``Parallelism()`` is one process. Its methods are what the ``Trainer`` does across ranks outside the step: build
this rank's initial state, and hand the last pipeline stage's task and metric values to every rank of the ``pp``
group (only that stage's rank computes the loss and the metrics).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9dfn._pytree import tree_map
from d9dfn._task import TrainTask
from d9dfn._types import PathPredicate, Transform
from d9dfn.loop._pipelining import PipelineLayout
from d9dfn.parallel import MeshAxes, ParallelPlan, data_parallel_position, split_context
from d9dfn.step import TrainState, init_train_state

__all__ = ["Parallelism", "context_position", "context_split", "gloo_group", "is_collective_failure"]


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The distributed pieces of one rank of a run; every field ``None`` (the default) on one process.

    Attributes:
        device_mesh: the whole mesh: ``(dp_replicate, dp_shard)``, or ``(pp, dp_replicate, dp_shard)``.
        data_parallel_mesh: the data-parallel ranks of this rank's pipeline slice (the whole mesh without a
            pipeline); ``None`` when there is only one.
        plan: this rank's params' parallel plan on ``data_parallel_mesh`` (the model provider's
            ``parallelize_model_stage`` choice, else the default placements); ``None`` without a mesh.
        pipeline: this rank's pipeline program and stages (with ``trainer.pipelining``, also on one process).
        pipeline_group: the ``pp`` group (``None`` on one process).
        data_parallel_group: the process group of ``data_parallel_mesh``'s ranks, over which metric states and
            validation sums are reduced (never WORLD): the plan's token axes, ``parallel.token_group(plan)``.
    """

    device_mesh: DeviceMesh | None = None
    data_parallel_mesh: DeviceMesh | None = None
    plan: ParallelPlan | None = None
    pipeline: PipelineLayout | None = None
    pipeline_group: ProcessGroup | None = None
    data_parallel_group: ProcessGroup | None = None

    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that see different rows of each batch."""
        if self.data_parallel_mesh is None:
            return 1
        return MeshAxes.of_mesh(self.data_parallel_mesh).data_parallel_size  # tensor-parallel peers see the same rows

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the :attr:`data_parallel_size` ranks: the part of every global batch it reads
        (its context- and tensor-parallel peers read the same part)."""
        if self.data_parallel_mesh is None:
            return 0
        return data_parallel_position(self.data_parallel_mesh)[0]

    @property
    def context_parallel_size(self) -> int:
        """The number of ranks each sequence is split over (``mesh.context_parallel_shard``; 1 without a ``cp``
        axis)."""
        return context_position(self.data_parallel_mesh)[1]

    @property
    def token_ranks(self) -> tuple[int, int]:
        """``(index, count)`` of this rank in :attr:`data_parallel_group` (the token axes: data × context ranks):
        the ranks whose metric states differ, one row each in a checkpoint (``_metric_ranks.py``)."""
        group = self.data_parallel_group
        if group is None:
            return 0, 1
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    def groups(self) -> list[ProcessGroup]:
        """The process groups the step waits on besides WORLD, each once: the mesh's per-axis groups, the flattened
        data-parallel group and the ``pp`` group."""
        groups = list(self.device_mesh.get_all_groups()) if self.device_mesh is not None else []
        groups += [g for g in (self.data_parallel_group, self.pipeline_group) if g is not None]
        return list({id(g): g for g in groups}.values())

    def initial_state(
        self, model: nn.Module, optimizer: Transform, task: TrainTask, seed: int, trainable: PathPredicate | None = None
    ) -> TrainState:
        """This rank's state before step 1: ``model``'s weights (or, pipelined, this rank's stages'), a fresh
        optimizer state over them, the task's and the metrics' initial states.

        On a data-parallel mesh the params (and optimizer state) are ``DTensor``s placed as the plan stores them
        (the model provider's ``parallelize_model_stage``, default: replicated over ``dp_replicate``, sharded along
        dim 0 over ``dp_shard``), per stage when pipelined; the frozen ones (``trainable``, as
        ``init_train_state``'s) too.
        """
        mesh = self.data_parallel_mesh
        placements = self.plan.placements if mesh is not None and self.plan is not None else None
        if self.pipeline is None:
            return init_train_state(
                model, optimizer, task=task, seed=seed, mesh=mesh, placements=placements, trainable=trainable
            )
        layout = self.pipeline
        states = [
            init_train_state(
                module, optimizer, task=task, seed=seed, mesh=mesh, placements=placements, trainable=trainable
            )
            for module in layout.modules
        ]
        params = {name: p for s in states for name, p in s.params.items()}
        buffers = {name: b for s in states for name, b in s.buffers.items()}
        frozen = tuple(name for s in states for name in s.frozen)
        trained = {name: p for name, p in params.items() if name not in frozen}
        return states[0].replace(params=params, buffers=buffers, opt_state=optimizer.init(trained), frozen=frozen)

    def from_last_stage(self, value: Any) -> Any:
        """``value`` (a picklable object) as the last stage's pipeline rank has it, on every rank of the pp group."""
        box = [value]
        torch.distributed.broadcast_object_list(box, src=self._last_stage_rank(), group=self.pipeline_group)
        return box[0]

    def tree_from_last_stage(self, tree: Any) -> Any:
        """``tree``'s tensors as the last stage's pipeline rank has them, on every rank of the pp group."""
        source = self._last_stage_rank()

        def share(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            leaf = leaf.detach().clone()
            torch.distributed.broadcast(leaf, src=source, group=self.pipeline_group)
            return leaf

        return tree_map(share, tree)

    def share_metric_state(self, state: TrainState) -> TrainState:
        """On pipeline ranks: the last stage's metric state everywhere (only its rank updates it; the others
        would log and checkpoint their initial one). A no-op without a pp group."""
        if self.pipeline_group is None or state.metric_state is None:
            return state
        return state.replace(metric_state=self.tree_from_last_stage(state.metric_state))

    def _last_stage_rank(self) -> int:
        """The global rank of the pipeline rank that holds the last stage."""
        assert self.pipeline is not None
        assert self.pipeline_group is not None
        return torch.distributed.get_global_rank(self.pipeline_group, self.pipeline.last_stage_rank)


def context_position(mesh: DeviceMesh | None) -> tuple[int, int]:
    """``(index, count)``: this rank's coordinate on ``mesh``'s context axis (``cp``) and its size; ``(0, 1)``
    without one."""
    if mesh is None:
        return 0, 1
    axes = MeshAxes.of_mesh(mesh)
    name = axes.name_of("context")
    if name is None:
        return 0, 1
    return int(mesh.get_local_rank(name)), axes.size_of("context")


def _split_collated(collate: Callable[[Any], Any], size: int, rank: int, items: Any) -> Any:
    return split_context(collate(items), size, rank)


def context_split(collate: Callable[[Any], Any], mesh: DeviceMesh | None) -> Callable[[Any], Any]:
    """``collate`` followed by this rank's part of every sequence (``d9dfn.parallel.split_context`` at its ``cp``
    coordinate), or ``collate`` itself without a context axis. Every context rank of a data-parallel rank reads the
    same rows and keeps its 2 of the ``2·cp`` chunks of each; a partial of a module-level function, so a
    ``DataLoader`` worker can take it (``data_loading.num_workers``)."""
    rank, size = context_position(mesh)
    return collate if size == 1 else functools.partial(_split_collated, collate, size, rank)


def is_collective_failure(error: RuntimeError) -> bool:
    """A dead or stalled peer: NCCL raises ``DistError``s, gloo plain ``RuntimeError``s naming its transport."""
    text = str(error)
    pipeline_p2p = text.startswith("run_rank_program: pipeline rank")  # a send/receive of the pipeline's
    return isinstance(error, torch.distributed.DistError) or pipeline_p2p or "gloo" in text or "Timed out" in text


def gloo_group(device_mesh: DeviceMesh | None, timeout_s: float) -> ProcessGroup | None:
    """A CPU (gloo) group of every rank with the long start-up timeout; ``None`` on one process.

    Checkpoint collectives move small Python objects (manifests, status) and may wait for a slow disk, so
    they get their own CPU group: NCCL would need CUDA tensors for them, and ``step_timeout`` is too short
    for a big save. The stop agreement (one int per step) gets another, whose timeout drops to
    ``step_timeout`` after the first step (``Trainer._step``).
    """
    if device_mesh is None:
        return None
    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
