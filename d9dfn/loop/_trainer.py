"""``Trainer``: runs a configured training job around d9dfn's compiled pure step.

``Trainer.train`` feeds batches to the step; everything with side effects — files, logs, progress,
checkpoints, profiling, GC, collective timeouts — stays here. ``TrainingConfigurator`` (``_train.py``)
builds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from d9dfn import metrics as _metrics
from d9dfn import parallel
from d9dfn._pytree import tree_leaves, tree_map
from d9dfn._step import StepOutput
from d9dfn._task import TrainTask
from d9dfn._train_state import TrainState, init_train_state
from d9dfn._types import Batch, Schedule, Transform
from d9dfn.checkpoint import CheckpointCorruptedError, CheckpointStore, export_safetensors
from d9dfn.config import TrainerConfig, should_do_action
from d9dfn.data import BatchLoader, DeviceBatches, StatefulBatchIterator, to_device
from d9dfn.loop import _events as ev
from d9dfn.loop._distributed import CollectiveError, set_collective_timeout
from d9dfn.loop._logging import ProgressBar, flatten_scalars, plot_loss
from d9dfn.loop._metric_ranks import METADATA_KEY, as_saved, gather_rank_states, rank_state
from d9dfn.loop._pipelining import PipelineLayout
from d9dfn.loop._run_dir import RunLock, append_jsonl, atomic_write
from d9dfn.loop._runtime import (
    collect_garbage,
    deterministic_algorithms,
    manual_gc,
    profile,
    reseed_torch,
    torch_rng_restored,
)
from d9dfn.loop._signals import StopAgreement, StopSignals, TrainingStopped, committed_steps
from d9dfn.loop._trackers import build_tracker

__all__ = ["ResumeFrom", "TrainResult", "Trainer", "Validation"]

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
    first_step_s: float | None = None
    """Seconds this call's first step took, compilation included (``None`` when no step ran)."""
    step_s: float | None = None
    """Seconds per warm step after the first, checkpoint saves and validation excluded (``None``: fewer than 2
    steps ran, or none after the first before the last logged record)."""


@dataclasses.dataclass(frozen=True)
class Validation:
    """Validation during training (``evaluation``): the forward-only step and a fresh pass over the validation data.

    ``batches()`` returns this rank's validation batches from the start, in order (a new iterator each time, so
    the training data's position is never touched); ``step_fn`` is ``make_eval_step``'s
    ``(train_state, metric_state, batch) -> (metric_state, EvalOutput)``.
    """

    step_fn: Callable[..., Any]
    batches: Callable[[], Iterable[Batch]]
    num_batches: int
    period: Any
    """``evaluation.period_steps``: when it runs (``should_do_action``, also on the last step)."""


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
        validation: Validation | None = None,
        lr_schedule_for: Callable[[int], Schedule] | None = None,
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
        # This rank's row of the metric states a checkpoint holds (_metric_ranks.py): its place in dp_group, which
        # is also the part of every global batch it reads (rank order of the flattened data-parallel mesh).
        self.data_parallel_rank = torch.distributed.get_rank(self.dp_group) if self.dp_group is not None else 0
        self.metric = task.create_metrics()
        self.checkpoints = CheckpointStore(
            run_dir / "checkpoints",
            keep=config.checkpointing.num_to_keep,
            async_save=config.checkpointing.async_save,
            group=_gloo_group(device_mesh, config.timeout.init_timeout),
        )
        # Where the ranks agree, after every step, whether a SIGTERM/SIGINT stops the run (``_signals.py``).
        self.stop_group = _gloo_group(device_mesh, config.timeout.init_timeout)
        self.log = build_tracker(config.logging.tracker, run_dir, enabled=main_process)
        self.steps_skipped = 0  # this train() call's skipped steps (skip_nonfinite), counted at each flush
        self._skipped_in_a_row = 0
        self.validation = validation
        self._validated = False  # whether this process has run (and so compiled) the validation step
        # The LR multiplier the job would have with another total_steps: a finished run extends only when the
        # steps it already ran had the same learning rate (restore_latest). None: it never extends.
        self.lr_schedule_for = lr_schedule_for
        self._clock = _Clock()

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

    def restore_latest(
        self, state: TrainState, resume_from: ResumeFrom = "latest", *, announce: bool = True
    ) -> TrainState:
        """Load a checkpoint into ``state``'s structure, and the data position and log with it.

        Args:
            state: the initial state (its structure, dtypes, shapes and placements are the template).
            resume_from: ``"latest"`` (the newest step; a corrupted one is an error naming the other
                choices), ``"newest-intact"`` (the newest step that reads back intact) or a step number. Resuming
                from an older step than the newest sets the later steps aside (``checkpoints/.d9dfn-set-aside``),
                announced on the console, so the run saves on from there.
            announce: print ``d9dfn: resuming RUN_DIR from step N`` (and an extension of ``total_steps``) on the
                main process.

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
        # The metric state comes back as saved: one row per data-parallel rank of the run that saved it.
        template = state.replace(metric_state=as_saved(state.metric_state)) if self.metric is not None else state
        if resume_from == "newest-intact":
            restored, metadata = self.checkpoints.restore(None, like=template, fallback=True)
        else:
            try:
                restored, metadata = self.checkpoints.restore(
                    steps[-1] if resume_from == "latest" else resume_from, like=template
                )
            except CheckpointCorruptedError as error:
                error.fix = (
                    f"resume the Trainer from the newest intact step with resume_from='newest-intact', or from another "
                    f"saved step ({error.steps}) with resume_from=STEP; the later steps are then set aside"
                )
                raise
        step = int(restored.step)
        extended_from = self._check_fingerprint(metadata.get("fingerprint", {}), step)
        notice = None
        if self.metric is not None:
            restored, notice = self._restore_metric_state(
                restored, metadata.get(METADATA_KEY), state.metric_state, step
            )
        if self.main_process and announce:
            how = "" if resume_from == "latest" else f" (resume_from={resume_from!r})"
            print(f"d9dfn: resuming {self.run_dir} from step {step}{how}")
            if notice is not None:
                print(notice)
            if extended_from is not None:
                print(
                    f"d9dfn: extending {self.run_dir} from total_steps={extended_from} to {self.total_steps} (the "
                    f"learning rate of steps 1-{step} is the same under both)"
                )
        if step < steps[-1]:
            moved = self.checkpoints.set_aside_after(step)
            if self.main_process:
                print(f"d9dfn: set aside the later step(s) {[int(p.name.split('-')[0]) for p in moved]}: {moved}")
        self.data.restore(metadata["data"])
        self.log.truncate(metadata["log_lines"])
        return restored

    def _restore_metric_state(
        self, restored: TrainState, num_rows: int | None, like: Any, step: int
    ) -> tuple[TrainState, str | None]:
        """``restored`` with this rank's metric state out of the checkpoint's rows (``_metric_ranks.rank_state``):
        its own row, or on a resume with another number of data-parallel ranks the merge of all rows on rank 0;
        then the line that says so (``None`` when each rank got its own row)."""
        assert self.metric is not None
        size = self.data_parallel_size
        metric_state, merged = rank_state(
            restored.metric_state, num_rows, like, rank=self.data_parallel_rank, size=size, merge=self.metric.merge
        )
        notice = None
        if merged and num_rows is None:
            notice = (
                f"d9dfn: checkpoint step {step} holds rank 0's metric state only (saved by a d9dfn from before "
                f"per-rank metric states) and this run has {size} data-parallel ranks: rank 0 continues with it, so "
                "the metrics/* of the logging period in progress miss the other ranks' part of it"
            )
        elif merged:
            notice = (
                f"d9dfn: checkpoint step {step} holds the metric states of {num_rows} data-parallel ranks and this run "
                f"has {size}: rank 0 continues with their merge, so the metrics/* of the logging period in progress "
                "equal an uninterrupted run's up to float rounding"
            )
        return restored.replace(metric_state=metric_state), notice

    def _check_fingerprint(self, saved: dict[str, Any], step: int) -> int | None:
        """Raise unless the checkpoint's totals fit this run; the saved ``total_steps`` when the run extends.

        A different ``total_steps`` is accepted when the checkpoint's step is within it and the learning rate of
        every step already run is the same under both (``lr_schedule_for``): a constant rate, or phases that do not
        depend on ``total_steps`` up to ``step``. Batching must match.
        """
        where = self.checkpoints.directory / str(step)
        new_run = f"--set trainer.run.name={self.run_dir.name}-new (run.name in a TrainerConfig)"
        extended_from = None
        for key, value in self._fingerprint().items():
            if saved.get(key) == value:
                continue
            if key == "total_steps" and isinstance(saved.get(key), int):
                problem = self._extension_problem(saved[key], step)
                if problem is None:
                    extended_from = saved[key]
                    continue
                raise ValueError(
                    f"Trainer: checkpoint {where} was saved with total_steps={saved[key]} but this run has "
                    f"total_steps={value}, and {problem}. To resume that run, keep --set "
                    f"trainer.total_steps={saved[key]}; to train {value} steps, start a new run: {new_run}"
                )
            setting = "trainer.batching." + key
            raise ValueError(
                f"Trainer: checkpoint {where} was saved with {key}={saved.get(key)} but this run has {key}={value}; "
                f"to resume that run, keep --set {setting}={saved.get(key)}; to use {key}={value}, start a new run: "
                f"{new_run}"
            )
        return extended_from

    def _extension_problem(self, saved_total: int, step: int) -> str | None:
        """Why the run at ``step`` (saved with ``saved_total`` steps) cannot go on to ``total_steps``; None: it can."""
        if step > self.total_steps:
            return f"the checkpoint is already at step {step}"
        if self.lr_schedule_for is None:
            return "this trainer cannot compare learning-rate schedules (no lr_schedule_for)"
        before = _multipliers(self.lr_schedule_for(saved_total), step)
        after = _multipliers(self.lr_schedule_for(self.total_steps), step)
        changed = (before != after).nonzero()
        if len(changed):
            past = int(changed[0, 0])
            return (
                f"the learning-rate schedule depends on total_steps: step {past} had multiplier "
                f"{float(before[past]):.6g}, which total_steps={self.total_steps} would make {float(after[past]):.6g}"
            )
        return None

    def _save(self, state: TrainState, step: int, data_state: dict[str, Any]) -> None:
        metadata = {"fingerprint": self._fingerprint(), "data": data_state, "log_lines": self.log.position()}
        if self.metric is not None:
            # Every data-parallel rank's partial metric state, as rows (the period may be half-way): a resume logs
            # the same metrics/* as an uninterrupted run. On pipeline ranks, the last stage's (only it updates them).
            state = self._share_metric_state(state)
            state = state.replace(metric_state=gather_rank_states(state.metric_state, self.dp_group))
            metadata[METADATA_KEY] = self.data_parallel_size
        self.checkpoints.save(step, state, metadata)

    # --- the loop -------------------------------------------------------------------------------------

    def train(self, resume_from: ResumeFrom = "latest") -> TrainResult:
        """Train to ``total_steps`` from a checkpoint (see :meth:`restore_latest`); finalize, fire ``train.finished``.

        The main process holds the run directory's lock (taken by ``configure``) until this returns or raises.

        SIGTERM and SIGINT (Ctrl-C) stop the run cleanly while this runs (called from the main thread; from
        another thread signals keep their usual effect): the step in flight finishes, every rank stops after
        the same step, its checkpoint is saved and committed, and ``TrainingStopped`` is raised instead of a
        result (no ``train.finished``). A second signal ends the process at once with exit code 128 + its
        number, leaving the newest committed checkpoint as it was. The previous handlers come back on return.

        Raises:
            TrainingStopped: a SIGTERM or SIGINT stopped the run; it names the step and the checkpoint.
            RunDirectoryError: the lock was released and another process has taken it since.
        """
        if self.run_lock is not None:
            self.run_lock.acquire()  # a no-op when configure's lock is still held
        try:
            with StopSignals(self._on_disk) as signals:
                return self._train(resume_from, StopAgreement(signals, self.stop_group))
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self, resume_from: ResumeFrom, stop_signal: StopAgreement) -> TrainResult:
        config = self.config
        state = self.restore_latest(self.initial_state(), resume_from)
        start = position = int(state.step)
        self.steps_skipped = self._skipped_in_a_row = 0
        if self.main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.run_dir / "hparams.json", json.dumps(self.hparams, indent=2, default=str))
        tokens_per_step = 0
        bar = ProgressBar(self.total_steps, initial=start, enabled=self.main_process)
        self._clock = clock = _Clock(start_step=start)
        pending: list[tuple[int, StepOutput]] = []
        last_loss: float | None = None
        batches = DeviceBatches(self.data, self.device, self.total_steps - start)
        stopped_by = stop_signal()  # a signal during set-up or the restore: stop before the first step
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
                for position in range(start + 1, self.total_steps + 1) if not stopped_by else ():
                    context = ev.EventStepContext(step=position, total_steps=self.total_steps, state=state)
                    self.bus.trigger(ev.EVENT_TRAIN_STEP_PRE, context)
                    batch = next(batches)
                    tokens_per_step = tokens_per_step or _tokens_in(batch) * self.data_parallel_size
                    # The compiled step fuses forward, backward and the optimizer update, so the four
                    # inner events fire around it in d9d's order (docs/design/events.md).
                    self.bus.trigger(ev.EVENT_TRAIN_FORWARD_BACKWARD_PRE, context)
                    if position == start + 1:  # compiles: a ticking status line instead of a bar at 0%
                        with bar.first_step("compiling (first step)" if config.compile else "first step"):
                            state, output = self._step(state, batch, position, first=True)
                        clock.first_step_done(bar.first_step_s)
                    else:
                        state, output = self._step(state, batch, position, first=False)
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
                    if self.validation is not None and should_do_action(
                        self.validation.period, step=position, total_steps=self.total_steps, on_last_step=True
                    ):
                        last_loss = self._flush(pending, position) or last_loss  # the log stays in step order
                        with clock.excluded("validation_s"):
                            self._validate(state, position)
                    collect_garbage(config.gc.period_steps, step=position, total_steps=self.total_steps)
                    if profiler is not None:
                        profiler.step()
                    self.bus.trigger(ev.EVENT_TRAIN_STEP_POST, done)
                    stopped_by = stop_signal()  # every rank, after every step: the same answer everywhere
                    if stopped_by or should_do_action(
                        config.checkpointing.period_steps,
                        step=position,
                        total_steps=self.total_steps,
                        on_last_step=True,
                    ):
                        last_loss = self._flush(pending, position) or last_loss
                        with clock.excluded("checkpoint_s"):
                            self._save(state, position, batches.state())  # not counting the batch taken ahead
                        stopped_by = stopped_by or stop_signal()  # a signal during the save: it is done, stop here
                    bar.update(position, tokens=tokens_per_step, loss=last_loss, skipped=self.steps_skipped)
                    if stopped_by:
                        break
            self.checkpoints.wait()
            stopped_by = stopped_by or stop_signal()  # during the last save (or its commit): the run is done, stop
            saved = self.checkpoints.latest_step() if stopped_by else None
        finally:
            bar.close()
            self.data.close()  # stops data_loading's worker processes, if any
            self.log.close()
            self.checkpoints.close()
            if self.main_process and clock.first_step_s is not None:
                record = {"command": "train", **clock.record(), "compile": config.compile}
                append_jsonl(self.run_dir / TIMINGS_FILE, record)
        if stopped_by:
            raise TrainingStopped(
                stopped_by,
                step=position,
                total_steps=self.total_steps,
                checkpoint_step=saved,
                checkpoint_dir=self.checkpoints.directory,
                saved=position > start,
            )
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
            first_step_s=clock.first_step_s,
            step_s=clock.step_s(),
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
        data-parallel group, the ``pp`` group and the stop group (the checkpoint group keeps its long timeout)."""
        groups = list(self.device_mesh.get_all_groups()) if self.device_mesh is not None else []
        groups += [g for g in (self.dp_group, self.pipeline_group, self.stop_group) if g is not None]
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
        self._clock.flushed(position)  # the .tolist() above waited for every step of the period
        return records[-1]["loss"]

    def _on_disk(self) -> str:
        """What a failed run leaves to resume from, as the error messages state it (only what is true).

        A listing of ``checkpoints/`` (no orbax): the signal watcher thread calls it too.
        """
        steps = committed_steps(self.checkpoints.directory)
        if not steps:
            return (
                f"no checkpoint has been saved yet in {self.checkpoints.directory} (checkpointing.period_steps="
                f"{self.config.checkpointing.period_steps}): a rerun starts from scratch"
            )
        return (
            f"the newest committed checkpoint is step {steps[-1]} in {self.checkpoints.directory}: rerun the same "
            "command to resume from it"
        )

    def _validate(self, state: TrainState, position: int) -> None:
        """Run ``validation`` over its batches with ``state``'s weights and log ``val/*`` at ``position``.

        Logs ``val/loss`` (the weighted mean of the task's loss over every validation batch: Σw·ℓ / Σw),
        ``val/loss_weight`` (Σw) and the task's metrics as ``val/metrics/...``, all summed over the data-parallel
        ranks (each evaluates its rows of every batch). Nothing of the training state changes, so a resumed run
        logs the same records.
        """
        validation = self.validation
        assert validation is not None
        metric = self.task.create_metrics()
        metric_state = metric.init(state.step.device) if metric is not None else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=state.step.device)
        weight_sum = torch.zeros_like(loss_sum)
        bar = ProgressBar(
            validation.num_batches,
            enabled=self.main_process,
            desc=f"validation at step {position}",
            unit="batch",
            leave=False,
        )
        try:
            for index, batch in enumerate(validation.batches(), start=1):
                batch = to_device(batch, self.device)
                if index == 1:  # the first validation of the process compiles the forward
                    compiling = self.config.compile and not self._validated
                    with bar.first_step("compiling (first batch)" if compiling else "first batch"):
                        metric_state, out = validation.step_fn(state, metric_state, batch)
                    self._validated = True
                else:
                    metric_state, out = validation.step_fn(state, metric_state, batch)
                loss_sum = loss_sum + out.loss.double() * out.loss_weight.double()
                weight_sum = weight_sum + out.loss_weight.double()
                bar.update(index)
        finally:
            bar.close()
        sums = torch.stack([loss_sum, weight_sum])
        if self.dp_group is not None:  # each data-parallel rank evaluated its rows of every batch
            torch.distributed.all_reduce(sums, group=self.dp_group)
        total_loss, total_weight = sums.tolist()  # the validation's one host sync
        record: dict[str, Any] = {
            "step": position,
            "val/loss": total_loss / total_weight if total_weight else math.nan,
            "val/loss_weight": total_weight,
        }
        if metric is not None:
            if self.pipeline_group is not None:  # only the last stage's rank updated it
                metric_state = self._tree_from_last_stage(metric_state)
            if self.dp_group is not None:
                metric_state = _metrics.reduce(metric_state, self.dp_group)
            record.update(flatten_scalars(metric.compute(metric_state), prefix="val/metrics"))
        self.log.log([record])

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
        return state.replace(metric_state=self._tree_from_last_stage(state.metric_state))

    def _tree_from_last_stage(self, tree: Any) -> Any:
        """``tree``'s tensors as the last stage's pipeline rank has them, on every rank of the pp group."""
        assert self.pipeline is not None
        source = torch.distributed.get_global_rank(self.pipeline_group, self.pipeline.last_stage_rank)

        def share(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            leaf = leaf.detach().clone()
            torch.distributed.broadcast(leaf, src=source, group=self.pipeline_group)
            return leaf

        return tree_map(share, tree)

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
            state = self.restore_latest(state, announce=False)
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


TIMINGS_FILE = "timings.jsonl"
"""Wall-clock figures of every ``train()`` call, one JSON line each, in the run directory (kept out of the
tracker's records so that ``metrics.jsonl`` stays byte-identical across kills and resumes)."""


class _Clock:
    """Wall-clock timing of one ``train()`` call: the first step (compilation included) and the warm steps after
    it, measured at the flushes (each waits for the steps of its period; no sync is added), with checkpoint saves
    and validation timed apart."""

    def __init__(self, start_step: int = 0) -> None:
        self.start_step = start_step
        self.first_step_s: float | None = None
        self.apart = {"checkpoint_s": 0.0, "validation_s": 0.0}
        self._warm_from = 0.0  # when the first step returned
        self._warm = (0.0, 0)  # (seconds of warm steps, warm steps) at the last flush

    def first_step_done(self, seconds: float | None) -> None:
        self.first_step_s = seconds
        self._warm_from = time.perf_counter()

    @contextlib.contextmanager
    def excluded(self, what: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.apart[what] += time.perf_counter() - started

    def flushed(self, position: int) -> None:
        if self.first_step_s is None:
            return
        seconds = time.perf_counter() - self._warm_from - sum(self.apart.values())
        self._warm = (seconds, position - self.start_step - 1)

    def step_s(self) -> float | None:
        seconds, steps = self._warm
        return seconds / steps if steps > 0 else None

    def record(self) -> dict[str, Any]:
        """The ``timings.jsonl`` line: the steps timed (to the last flush), first and warm steps' seconds, the rest."""
        seconds, steps = self._warm
        return {
            "start_step": self.start_step,
            "end_step": self.start_step + 1 + steps,
            "first_step_s": round(self.first_step_s or 0.0, 3),
            "step_s": None if steps <= 0 else round(seconds / steps, 6),
            **{name: round(value, 3) for name, value in self.apart.items()},
        }


def _multipliers(schedule: Schedule, last: int) -> torch.Tensor:
    """``schedule`` at steps ``0..last`` as a 1-d float64 tensor: one call on a vector of steps when the schedule
    takes one (the built-in piecewise schedules do), else one call per step."""
    steps = torch.arange(last + 1)
    try:
        values = schedule(steps)
        if isinstance(values, torch.Tensor) and values.shape == steps.shape:
            return values.detach().cpu().double()
    except (RuntimeError, TypeError, ValueError):
        pass  # a schedule written for 0-d steps only
    return torch.tensor([float(schedule(step)) for step in steps], dtype=torch.float64)


def _is_collective_failure(error: RuntimeError) -> bool:
    """A dead or stalled peer: NCCL raises ``DistError``s, gloo plain ``RuntimeError``s naming its transport."""
    text = str(error)
    pipeline_p2p = text.startswith("run_rank_program: pipeline rank")  # a send/receive of the pipeline's
    return isinstance(error, torch.distributed.DistError) or pipeline_p2p or "gloo" in text or "Timed out" in text


def _gloo_group(device_mesh: Any, timeout_s: float) -> Any:
    """A CPU (gloo) group of every rank with the long start-up timeout; ``None`` on one process.

    Checkpoint collectives move small Python objects (manifests, status) and may wait for a slow disk, so
    they get their own CPU group: NCCL would need CUDA tensors for them, and ``step_timeout`` is too short
    for a big save. The stop agreement (one int per step) gets another, whose timeout drops to
    ``step_timeout`` after the first step (``_step_groups``).
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
