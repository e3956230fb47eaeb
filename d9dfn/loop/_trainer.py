"""``Trainer``: runs a configured training job around d9dfn's compiled pure step.

``Trainer.train`` feeds batches to the step; everything with side effects — files, logs, progress,
checkpoints, profiling, GC, collective timeouts — stays here. ``TrainingConfigurator`` (``_train.py``)
builds it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from d9dfn import metrics as _metrics
from d9dfn import parallel
from d9dfn._pytree import tree_leaves, tree_map
from d9dfn._task import TrainTask
from d9dfn._types import Transform
from d9dfn.checkpoint import CheckpointCorruptedError, CheckpointStore, export_safetensors
from d9dfn.config import TrainerConfig, should_do_action
from d9dfn.data import BatchLoader, DeviceBatches, StatefulBatchIterator
from d9dfn.loop import _events as ev
from d9dfn.loop._distributed import CollectiveError, set_collective_timeout
from d9dfn.loop._logging import ProgressBar, flatten_scalars, plot_loss
from d9dfn.loop._pipelining import PipelineLayout
from d9dfn.loop._run_dir import RunLock, atomic_write
from d9dfn.loop._runtime import (
    collect_garbage,
    deterministic_algorithms,
    manual_gc,
    profile,
    reseed_torch,
    torch_rng_restored,
)
from d9dfn.loop._trackers import build_tracker
from d9dfn.step import StepOutput, TrainState, init_train_state

__all__ = ["ResumeFrom", "TrainResult", "Trainer"]

ResumeFrom: TypeAlias = int | Literal["latest", "newest-intact"]
"""Which checkpoint a run resumes from: the newest, the newest intact one, or a step number."""


_SAME_AS_DEVICE_MESH: Any = object()
"""``Trainer(data_parallel_mesh=...)``'s default: every rank of ``device_mesh`` is a data-parallel rank."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What ``Trainer.train`` returns: the final state, the task's result and where the run's files are."""

    state: TrainState
    task_result: Any
    run_dir: Path
    steps_run: int
    plot_path: Path | None
    steps_skipped: int = 0
    """Steps of this call whose update was skipped as non-finite (``skip_nonfinite``); logged as ``skipped``."""


class Trainer:
    """Runs a configured job: ``train()`` (resumes from the latest checkpoint) and ``export(path)``."""

    def __init__(
        self,
        *,
        config: TrainerConfig,
        task: TrainTask,
        model: nn.Module,
        skeleton: nn.Module,
        optimizer: Transform,
        step_fn: Any,
        data: StatefulBatchIterator | BatchLoader,
        total_steps: int,
        bus: ev.EventBus,
        run_dir: Path,
        export_mapper: Any,
        hparams: dict[str, Any],
        main_process: bool,
        device_mesh: Any = None,
        placements: Any = None,
        run_lock: RunLock | None = None,
        data_parallel_mesh: Any = _SAME_AS_DEVICE_MESH,
        pipeline: PipelineLayout | None = None,
        pipeline_group: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.model = model
        self.skeleton = skeleton
        self.optimizer = optimizer
        self.step_fn = step_fn
        self.data = data
        self.device = device or torch.device("cpu")  # where batches go (the step's params live there)
        self.total_steps = total_steps
        self.bus = bus
        self.run_dir = run_dir
        self.export_mapper = export_mapper
        self.hparams = hparams
        self.main_process = main_process
        self.device_mesh = device_mesh
        # The mesh of the data-parallel ranks (this pipeline slice's with pp > 1; None when there is only one).
        self.data_parallel_mesh = device_mesh if data_parallel_mesh is _SAME_AS_DEVICE_MESH else data_parallel_mesh
        dp_mesh = self.data_parallel_mesh
        self.data_parallel_size = dp_mesh.size() if dp_mesh is not None else 1
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.placements = placements
        # A pipelined run: this rank's stages, and the pp group over which the last stage's rank shares its
        # metrics and task logs (None on one process).
        self.pipeline = pipeline
        self.pipeline_group = pipeline_group
        # Held from configure() until train() ends (the main process's; None on the other ranks).
        self.run_lock = run_lock
        # Metric states are summed over the data-parallel ranks before they are computed (never WORLD).
        self.dp_group = parallel.data_parallel_group(dp_mesh) if dp_mesh is not None else None
        self.metric = task.create_metrics()
        self.checkpoints = CheckpointStore(
            run_dir / "checkpoints",
            keep=config.checkpointing.num_to_keep,
            async_save=config.checkpointing.async_save,
            group=_checkpoint_group(device_mesh, config.timeout.init_timeout),
        )
        self.log = build_tracker(config.logging.tracker, run_dir, enabled=main_process)
        self.steps_skipped = 0  # this train() call's skipped steps (skip_nonfinite), counted at each flush
        self._skipped_in_a_row = 0

    # --- state ---------------------------------------------------------------------------------------

    def initial_state(self) -> TrainState:
        """The state before step 1: the materialized model's weights, fresh optimizer, metrics and task.

        On several ranks the params (and optimizer state) are ``DTensor``s placed by the model provider's
        ``parallelize_model_stage`` (default: replicated over ``dp_replicate``, sharded over ``dp_shard``).
        """
        if self.pipeline is not None:
            return _pipeline_state(
                self.pipeline, self.optimizer, self.task, self.config.determinism.seed, self.data_parallel_mesh
            )
        return init_train_state(
            self.model,
            self.optimizer,
            task=self.task,
            seed=self.config.determinism.seed,
            mesh=self.data_parallel_mesh,
            placements=self.placements if self.data_parallel_mesh is not None else None,
        )

    def _fingerprint(self) -> dict[str, Any]:
        """The totals a checkpoint must agree with to be resumed (d9d: "step count differs")."""
        batching = self.config.batching
        return {
            "total_steps": self.total_steps,
            "global_batch_size": batching.global_batch_size,
            "microbatch_size": batching.microbatch_size,
        }

    def restore_latest(self, state: TrainState, resume_from: ResumeFrom = "latest") -> TrainState:
        """Load a checkpoint into ``state``'s structure, and the data position and log with it.

        Args:
            state: the initial state (its structure, dtypes, shapes and placements are the template).
            resume_from: ``"latest"`` (the newest step; a corrupted one is an error naming the other
                choices), ``"newest-intact"`` (the newest step that reads back intact) or a step number. Resuming
                from an older step than the newest sets the later steps aside (``checkpoints/.d9dfn-set-aside``),
                announced on the console, so the run saves on from there.

        Raises:
            CheckpointCorruptedError: the chosen step (or, for ``"newest-intact"``, every step) is corrupted.
            FileNotFoundError: ``resume_from`` names a step that is not saved.
            ValueError: the checkpoint was saved with other totals (``total_steps``, batching).
        """
        steps = self.checkpoints.all_steps()
        if not steps:
            if isinstance(resume_from, int):
                raise FileNotFoundError(
                    f"Trainer: resume_from={resume_from}, but {self.checkpoints.directory} holds no checkpoint; drop "
                    "the option to start from scratch"
                )
            self.log.truncate(0)  # a run killed before its first checkpoint starts over, log included
            return state
        if resume_from == "latest":
            try:
                restored, metadata = self.checkpoints.restore(steps[-1], like=state)
            except CheckpointCorruptedError as error:
                raise CheckpointCorruptedError(
                    f"Trainer: {error}. To resume from the newest step that is intact, pass "
                    f"resume_from='newest-intact' (`d9dfn train --resume-from newest-intact`), or a step (saved: "
                    f"{steps}) with `--resume-from STEP`; the later steps are then set aside"
                ) from None
        elif resume_from == "newest-intact":
            restored, metadata = self.checkpoints.restore(None, like=state, fallback=True)
        else:
            restored, metadata = self.checkpoints.restore(resume_from, like=state)
        step = int(restored.step)
        saved = metadata.get("fingerprint", {})
        for key, value in self._fingerprint().items():
            if saved.get(key) != value:
                raise ValueError(
                    f"Trainer: checkpoint {self.checkpoints.directory / str(step)} was saved with "
                    f"{key}={saved.get(key)} but this run has {key}={value}; resume with the same batching and "
                    "total_steps, or point checkpointing.save_dir / run.name at a new directory"
                )
        if resume_from != "latest" and self.main_process:
            print(f"d9dfn: resuming from checkpoint step {step} (resume_from={resume_from!r})")
        if step < steps[-1]:
            moved = self.checkpoints.set_aside_after(step)
            if self.main_process:
                print(f"d9dfn: set aside the later step(s) {[int(p.name.split('-')[0]) for p in moved]}: {moved}")
        self.data.restore(metadata["data"])
        self.log.truncate(metadata["log_lines"])
        return restored

    def _save(self, state: TrainState, step: int, data_state: dict[str, Any]) -> None:
        state = self._share_metric_state(state)  # rank 0 writes the metric state: the last stage's, mid-period too
        metadata = {"fingerprint": self._fingerprint(), "data": data_state, "log_lines": self.log.position()}
        self.checkpoints.save(step, state, metadata)

    # --- the loop -------------------------------------------------------------------------------------

    def train(self, resume_from: ResumeFrom = "latest") -> TrainResult:
        """Train to ``total_steps`` from a checkpoint (see :meth:`restore_latest`); finalize, fire ``train.finished``.

        The main process holds the run directory's lock (taken by ``configure``) until this returns or raises.

        Raises:
            RunDirectoryError: the lock was released and another process has taken it since.
        """
        if self.run_lock is not None:
            self.run_lock.acquire()  # a no-op when configure's lock is still held
        try:
            return self._train(resume_from)
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self, resume_from: ResumeFrom) -> TrainResult:
        config = self.config
        state = self.restore_latest(self.initial_state(), resume_from)
        start = int(state.step)
        self.steps_skipped = self._skipped_in_a_row = 0
        if self.main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.run_dir / "hparams.json", json.dumps(self.hparams, indent=2, default=str))
        tokens_per_step = 0
        bar = ProgressBar(self.total_steps, initial=start, enabled=self.main_process)
        pending: list[tuple[int, StepOutput]] = []
        last_loss: float | None = None
        batches = DeviceBatches(self.data, self.device, self.total_steps - start)
        try:
            with (
                deterministic_algorithms(config.determinism.deterministic_algorithms),
                torch_rng_restored(),  # reseeded every step below; the caller's state comes back
                manual_gc(),
                profile(config.profiling) as profiler,
            ):
                self.bus.trigger(
                    ev.EVENT_TRAIN_READY,
                    ev.EventTrainReadyContext(run=self.log, step=start, total_steps=self.total_steps),
                )
                for position in range(start + 1, self.total_steps + 1):
                    context = ev.EventStepContext(step=position, total_steps=self.total_steps, state=state)
                    self.bus.trigger(ev.EVENT_TRAIN_STEP_PRE, context)
                    batch = next(batches)
                    tokens_per_step = tokens_per_step or _tokens_in(batch) * self.data_parallel_size
                    # The compiled step fuses forward, backward and the optimizer update, so the four
                    # inner events fire around it in d9d's order (docs/design/events.md).
                    self.bus.trigger(ev.EVENT_TRAIN_FORWARD_BACKWARD_PRE, context)
                    state, output = self._step(state, batch, position, first=position == start + 1)
                    batches.prefetch()  # the next batch loads, and copies on a side stream, while the step runs
                    done = dataclasses.replace(context, state=state, output=output)
                    self.bus.trigger(ev.EVENT_TRAIN_FORWARD_BACKWARD_POST, done)
                    self.bus.trigger(ev.EVENT_TRAIN_OPTIMIZER_STEP_PRE, done)
                    self.bus.trigger(ev.EVENT_TRAIN_OPTIMIZER_STEP_POST, done)
                    pending.append((position, output))
                    if should_do_action(
                        config.logging.period_steps, step=position, total_steps=self.total_steps, on_last_step=True
                    ):
                        last_loss = self._flush(pending, position)
                        state = self._log_metrics(state, position)
                    collect_garbage(config.gc.period_steps, step=position, total_steps=self.total_steps)
                    if profiler is not None:
                        profiler.step()
                    self.bus.trigger(ev.EVENT_TRAIN_STEP_POST, done)
                    if should_do_action(
                        config.checkpointing.period_steps,
                        step=position,
                        total_steps=self.total_steps,
                        on_last_step=True,
                    ):
                        last_loss = self._flush(pending, position) or last_loss
                        self._save(state, position, batches.state())  # not counting the batch taken ahead
                    bar.update(position, tokens=tokens_per_step, loss=last_loss, skipped=self.steps_skipped)
            self.checkpoints.wait()
        finally:
            bar.close()
            self.data.close()  # stops data_loading's worker processes, if any
            self.log.close()
            self.checkpoints.close()
        task_result = self.task.finalize(state.task_state)
        self.bus.trigger(ev.EVENT_TRAIN_FINISHED, ev.EventTrainFinishedContext(state=state))
        plot = self._plot() if self.main_process else None
        return TrainResult(
            state=state,
            task_result=task_result,
            run_dir=self.run_dir,
            steps_run=self.total_steps - start,
            plot_path=plot,
            steps_skipped=self.steps_skipped,
        )

    def _plot(self) -> Path | None:
        """``loss.png`` from the tracker's records; none (with a notice) when the tracker keeps none."""
        records = self.log.records()
        if records is None:
            print(f"d9dfn: the {type(self.log).__name__} keeps no records; skipping the loss plot")
            return None
        return plot_loss(records, self.run_dir / "loss.png")

    def _step(self, state: TrainState, batch: Any, position: int, *, first: bool) -> tuple[TrainState, StepOutput]:
        """One compiled step; on several ranks a failed collective becomes a ``CollectiveError`` naming the fix.

        The first step (compilation included) runs under ``timeout.init_timeout``; afterwards the process
        group's timeout drops to ``timeout.step_timeout``, so a dead or stalled rank fails the others fast.
        """
        # torch's RNG as a function of the step: models that draw from it (HF dropout) resume bitwise.
        reseed_torch(self.config.determinism.seed, position, self.rank)
        if self.device_mesh is None:
            return self.step_fn(state, batch)
        try:
            out = self.step_fn(state, batch)
            if first:
                torch.distributed.barrier()  # every rank compiled and stepped before the short timeout applies
        except RuntimeError as error:
            if not _is_collective_failure(error):  # a bug in the model or task: its own error, unwrapped
                raise
            raise CollectiveError(
                f"Trainer: rank {self.rank} of {torch.distributed.get_world_size()}: step "
                f"{position} failed in a collective ({type(error).__name__}: {str(error).splitlines()[0]}). Another "
                f"rank most likely died or stalled for longer than timeout."
                f"{'init_timeout' if first else 'step_timeout'}; check its log. The last committed checkpoint is "
                "intact: rerun the same command to resume"
            ) from error
        if first:
            set_collective_timeout(self.config.timeout.step_timeout, self._step_groups())
        return out

    def _step_groups(self) -> list[Any]:
        """The process groups the step waits on besides WORLD: the mesh's per-axis groups, the flattened
        data-parallel group and the ``pp`` group (the checkpoint group keeps its long timeout)."""
        groups = list(self.device_mesh.get_all_groups()) if self.device_mesh is not None else []
        groups += [g for g in (self.dp_group, self.pipeline_group) if g is not None]
        return list({id(g): g for g in groups}.values())

    def _flush(self, pending: list[tuple[int, StepOutput]], position: int) -> float | None:
        """Write the period's per-step records: the one host sync of the period."""
        if not pending:
            return None
        steps = [s for s, _ in pending]
        # One transfer for the whole period: stack every scalar, then .tolist() once.
        outputs = [o for _, o in pending]
        columns = {
            "loss": torch.stack([o.loss for o in outputs]),
            "grad_norm": torch.stack([o.grad_norm for o in outputs]),
            "lr": torch.stack([o.lr for o in outputs]),
            "loss_weight": torch.stack([o.loss_weight for o in outputs]),
            "nonfinite": torch.stack([o.nonfinite for o in outputs]).float(),
        }
        for name in outputs[0].logs:  # the task's own values, apart from the loop's columns
            columns[f"task/{name}"] = torch.stack([o.logs[name].float() for o in outputs])
        values = {name: column.tolist() for name, column in columns.items()}
        if self.pipeline_group is not None:  # only the last stage's rank has the task's logs: it shares them
            values = {**values, **self._from_last_stage({k: v for k, v in values.items() if k.startswith("task/")})}
        pending.clear()
        records = [{"step": s, **{name: values[name][i] for name in values}} for i, s in enumerate(steps)]
        bad = [r["step"] for r in records if r["nonfinite"]]
        if bad and not self.config.skip_nonfinite:
            raise FloatingPointError(
                f"Trainer: the loss or gradient norm became NaN/inf at step(s) {bad} (loss {records[-1]['loss']}); "
                f"{self._on_disk()}. Lower the learning rate, set gradient_clipping.max_norm, check the data for "
                "empty batches, or set skip_nonfinite=true to skip such steps"
            )
        limit = self.config.max_consecutive_skipped_steps
        for record in records:
            record["skipped"] = int(bool(record["nonfinite"]))  # with skip_nonfinite, a non-finite step is skipped
            self._skipped_in_a_row = self._skipped_in_a_row + 1 if record["skipped"] else 0
            self.steps_skipped += record["skipped"]
            if limit is not None and self._skipped_in_a_row > limit:
                self.log.log(records[: records.index(record) + 1])  # the evidence, up to the step that stopped it
                raise FloatingPointError(
                    f"Trainer: {self._skipped_in_a_row} consecutive steps (up to step {record['step']}) had a NaN/inf "
                    f"loss or gradient norm and were skipped (skip_nonfinite=true), more than "
                    f"max_consecutive_skipped_steps={limit}: the run is not learning. {self._on_disk()}. Lower the "
                    "learning rate or set gradient_clipping.max_norm; max_consecutive_skipped_steps=null never stops"
                )
        self.log.log(records)
        return records[-1]["loss"]

    def _on_disk(self) -> str:
        """What a failed run leaves to resume from, as the error messages state it (only what is true)."""
        step = self.checkpoints.latest_step()
        if step is None:
            return (
                f"no checkpoint has been saved yet in {self.checkpoints.directory} (checkpointing.period_steps="
                f"{self.config.checkpointing.period_steps}): a rerun starts from scratch"
            )
        return (
            f"the newest committed checkpoint is step {step} in {self.checkpoints.directory}: rerun the same command "
            "to resume from it"
        )

    def _log_metrics(self, state: TrainState, position: int) -> TrainState:
        """Compute, write and reset the task's metrics (they accumulate over one logging period)."""
        if self.metric is None:
            return state
        state = self._share_metric_state(state)
        metric_state = state.metric_state
        if self.dp_group is not None:
            metric_state = _metrics.reduce(metric_state, self.dp_group)
        values = flatten_scalars(self.metric.compute(metric_state), prefix="metrics")
        self.log.log([{"step": position, **values}])
        return state.replace(metric_state=self.metric.init(state.step.device))

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` (a picklable object) as the last stage's pipeline rank has it, on every rank of the pp group."""
        assert self.pipeline is not None
        assert self.pipeline_group is not None
        box = [value]
        source = torch.distributed.get_global_rank(self.pipeline_group, self.pipeline.last_stage_rank)
        torch.distributed.broadcast_object_list(box, src=source, group=self.pipeline_group)
        return box[0]

    def _share_metric_state(self, state: TrainState) -> TrainState:
        """On pipeline ranks: the last stage's metric state everywhere (only its rank updates it; the others
        would log and checkpoint their initial one). A no-op without a pp group."""
        if self.pipeline_group is None or state.metric_state is None:
            return state
        assert self.pipeline is not None
        source = torch.distributed.get_global_rank(self.pipeline_group, self.pipeline.last_stage_rank)

        def share(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            leaf = leaf.detach().clone()
            torch.distributed.broadcast(leaf, src=source, group=self.pipeline_group)
            return leaf

        return state.replace(metric_state=tree_map(share, state.metric_state))

    # --- export ---------------------------------------------------------------------------------------

    def export(self, path: Path, *, load_checkpoint: bool = True) -> Path:
        """Write the model as ``model.safetensors`` under ``path`` (works on one process: d9d bug §11.4).

        On several ranks every rank calls it (the shards are gathered) and rank 0 writes the file.
        """
        if self.pipeline_group is not None:
            raise NotImplementedError(
                "Trainer.export: this run's ranks each hold only their pipeline stages; export from the checkpoint "
                f"on one process instead: `d9dfn export {self.run_dir} OUT_DIR` (a checkpoint restores onto any layout)"
            )
        state = self.initial_state()
        if load_checkpoint:
            state = self.restore_latest(state)
        params = parallel.full_tensors(state.params)  # a collective on several ranks
        file = Path(path) / "model.safetensors"
        if self.main_process:
            file = export_safetensors(self.skeleton, params, state.buffers, Path(path), self.export_mapper)
        return file


def _pipeline_state(layout: PipelineLayout, optimizer: Transform, task: TrainTask, seed: int, mesh: Any) -> TrainState:
    """The initial state of a pipeline rank: its stages' params and buffers (full names), the optimizer over them.

    With a data-parallel ``mesh`` (this pipeline slice's) the params are ``DTensor``s on it, placed per stage by
    the model provider's ``parallelize_model_stage`` (default: replicated over ``dp_replicate``, sharded along
    dim 0 over ``dp_shard``).
    """
    states = [
        init_train_state(module, optimizer, task=task, seed=seed, mesh=mesh, placements=placements)
        for module, placements in zip(layout.modules, layout.placements or [None] * len(layout.modules), strict=True)
    ]
    params = {name: p for s in states for name, p in s.params.items()}
    buffers = {name: b for s in states for name, b in s.buffers.items()}
    return states[0].replace(params=params, buffers=buffers, opt_state=optimizer.init(params))


def _is_collective_failure(error: RuntimeError) -> bool:
    """A dead or stalled peer: NCCL raises ``DistError``s, gloo plain ``RuntimeError``s naming its transport."""
    text = str(error)
    pipeline_p2p = text.startswith("run_rank_program: pipeline rank")  # a send/receive of the pipeline's
    return isinstance(error, torch.distributed.DistError) or pipeline_p2p or "gloo" in text or "Timed out" in text


def _checkpoint_group(device_mesh: Any, timeout_s: float) -> Any:
    """The group that saves checkpoints together: a gloo group with the long start-up timeout.

    Checkpoint collectives move small Python objects (manifests, status) and may wait for a slow disk, so
    they get their own CPU group: NCCL would need CUDA tensors for them, and ``step_timeout`` is too short
    for a big save. ``None`` on one process.
    """
    if device_mesh is None:
        return None
    import datetime

    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _tokens_in(batch: Any) -> int:
    """Tokens in a batch, for the progress bar: ``input_ids`` or ``tokens``, else the leading batch size."""
    for key in ("input_ids", "tokens"):  # d9d / HF and Megatron names
        if isinstance(batch, dict) and isinstance(batch.get(key), torch.Tensor):
            return batch[key].numel()
    leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim > 0]
    return leaves[0].shape[0] if leaves else 1
