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
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from d9dfn._pytree import tree_map
from d9dfn._task import TrainTask
from d9dfn._types import PathPredicate, Transform
from d9dfn.loop._pipelining import PipelineLayout
from d9dfn.parallel import MeshAxes, ParallelPlan
from d9dfn.step import TrainState, init_train_state

__all__ = ["Parallelism", "gloo_group", "is_collective_failure"]


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
