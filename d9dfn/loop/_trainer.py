"""``Trainer``: runs a configured training job around d9dfn's compiled pure step.

``Trainer.train`` feeds batches to the step; everything with side effects — files, logs, progress,
checkpoints, profiling, GC, collective timeouts — stays here. ``TrainingConfigurator`` (``_train.py``)
builds it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9dfn import metrics as _metrics
from d9dfn import parallel
from d9dfn._pytree import tree_leaves
from d9dfn._task import TrainTask
from d9dfn._types import Batch, PathPredicate, Schedule, Transform
from d9dfn.checkpoint import BASE_KEY, CheckpointStore, base_record, export_safetensors, left_out
from d9dfn.config import TrainerConfig, should_do_action
from d9dfn.data import BatchLoader, DeviceBatches, StatefulBatchIterator
from d9dfn.loop import _events as ev
from d9dfn.loop._clock import TIMINGS_FILE, Clock
from d9dfn.loop._compile_cache import publish_compile_cache
from d9dfn.loop._distributed import CollectiveError, set_collective_timeout
from d9dfn.loop._logging import ProgressBar, flatten_scalars, plot_loss, tokens_in
from d9dfn.loop._metric_ranks import METADATA_KEY, as_saved, gather_rank_states, merge_notice, rank_state
from d9dfn.loop._parallelism import Parallelism, gloo_group, is_collective_failure
from d9dfn.loop._records import NonfiniteSteps, period_columns
from d9dfn.loop._result import TrainResult
from d9dfn.loop._resume import (
    ResumeFrom,
    check_fingerprint,
    check_frozen,
    extension_problem,
    fingerprint,
    frozen_fingerprint,
    on_disk,
    read_checkpoint,
    resume_notice,
    with_base,
    without_base,
)
from d9dfn.loop._run_dir import RunLock, append_jsonl, atomic_write
from d9dfn.loop._runtime import (
    collect_garbage,
    deterministic_algorithms,
    manual_gc,
    profile,
    reseed_torch,
    torch_rng_restored,
)
from d9dfn.loop._signals import StopAgreement, StopDuring, StopSignals, TrainingStopped, committed_steps
from d9dfn.loop._sleep import DEFAULT_SLEEP_TAGS, Offloaded, SleepTag, offload, onload
from d9dfn.loop._trackers import build_tracker
from d9dfn.loop._validation import Validation
from d9dfn.step import StepOutput, TrainState

__all__ = ["TIMINGS_FILE", "ResumeFrom", "TrainResult", "Trainer", "Validation"]

StepFn = Callable[[TrainState, Batch], tuple[TrainState, StepOutput]]
"""The compiled train step (``make_train_step``'s): ``(train_state, batch) -> (train_state, StepOutput)``."""

ExportMapper = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""The model provider's export renaming (``PrepareExportModelStageResult.state_mapper``)."""


class Trainer:
    """Runs a configured job: ``train()`` (resumes from the latest checkpoint) and ``export(path)``.

    ``TrainingConfigurator.configure`` builds it.

    Args:
        config: the job's config; the run's files go to ``config.run_dir``.
        task: the training task (metrics, ``finalize``).
        model: the materialized model whose weights start the run (with a pipeline, ``parallelism.pipeline``
            holds this rank's stages instead).
        skeleton: the whole model on the meta device (``export``'s names).
        optimizer: the optimizer transform; its state is initialized over the params.
        step_fn: the compiled train step.
        data: this rank's batches, resumable.
        total_steps: the optimizer steps of the run.
        bus: the event bus the loop fires on.
        hparams: what ``hparams.json`` records.
        device: where batches go (the step's params live there).
        parallelism: this rank's distributed pieces (``Parallelism()`` on one process).
        main_process: whether this process writes the run's files, logs and prints.
        run_lock: the run directory's lock (the main process's), held until ``train()`` ends.
        export_mapper: renames the exported tensors (the model provider's).
        validation: validation during training, or ``None``.
        lr_schedule_for: the LR multiplier the job would have with another ``total_steps``: a finished run extends
            only when the steps it already ran had the same learning rate (``restore_latest``); ``None``: never.
        trainable: which params train (``ModelProvider.parameters_to_train``; ``None``: those with
            ``requires_grad``); the rest are frozen params of the state (``init_train_state(trainable=...)``).
    """

    def __init__(
        self,
        *,
        config: TrainerConfig,
        task: TrainTask,
        model: nn.Module,
        skeleton: nn.Module,
        optimizer: Transform,
        step_fn: StepFn,
        data: StatefulBatchIterator | BatchLoader,
        total_steps: int,
        bus: ev.EventBus,
        hparams: dict[str, Any],
        device: torch.device,
        parallelism: Parallelism,
        main_process: bool = True,
        run_lock: RunLock | None = None,
        export_mapper: ExportMapper | None = None,
        validation: Validation | None = None,
        lr_schedule_for: Callable[[int], Schedule] | None = None,
        trainable: PathPredicate | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.model = model
        self.skeleton = skeleton
        self.optimizer = optimizer
        self.step_fn = step_fn
        self.data = data
        self.device = device
        self.total_steps = total_steps
        self.bus = bus
        self.run_dir = Path(config.run_dir)
        self.export_mapper = export_mapper
        self.hparams = hparams
        self.main_process = main_process
        self.parallelism = parallelism
        self.device_mesh = parallelism.device_mesh
        self.data_parallel_mesh = parallelism.data_parallel_mesh
        self.data_parallel_size = parallelism.data_parallel_size
        self.context_size = parallelism.context_parallel_size
        self.pipeline = parallelism.pipeline
        self.pipeline_group = parallelism.pipeline_group
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # Held from configure() until train() ends (the main process's; None on the other ranks).
        self.run_lock = run_lock
        self.dp_group = parallelism.data_parallel_group
        # The part of every global batch this rank reads (its context- and tensor-parallel peers read the same).
        self.data_parallel_rank = parallelism.data_parallel_rank
        # This rank's row of the metric states a checkpoint holds (_metric_ranks.py) and their number: its place in
        # dp_group (the token axes: with a cp axis, data × context ranks, each with a partial state of its own).
        self.metric_rank, self.metric_ranks = parallelism.token_ranks
        self.metric = task.create_metrics()
        self.checkpoints = CheckpointStore(
            self.run_dir / "checkpoints",
            keep=config.checkpointing.num_to_keep,
            async_save=config.checkpointing.async_save,
            group=gloo_group(self.device_mesh, config.timeout.init_timeout),
        )
        # Where the ranks agree, after every step, whether a SIGTERM/SIGINT stops the run (``_signals.py``).
        self.stop_group = gloo_group(self.device_mesh, config.timeout.init_timeout)
        self.log = build_tracker(config.logging.tracker, self.run_dir, enabled=main_process)
        self.nonfinite = NonfiniteSteps(config.skip_nonfinite, config.max_consecutive_skipped_steps)
        self.validation = validation
        self._validated = False  # whether this process has run (and so compiled) the validation step
        self.lr_schedule_for = lr_schedule_for
        self.trainable = trainable
        self._clock = Clock()
        self._frozen_prints: dict[str, str] | None = None  # frozen_fingerprint of the initial state, once
        self.base_source: Path | None = config.model_stage_factory.source_checkpoint
        """The folder the frozen params are read from at the start (``None``: the model's own initialization);
        with one, checkpoints leave them out and record it (``d9dfn/checkpoint/_base.py``)."""
        self._state: TrainState | None = None
        """The run's state as of the last point between steps (what ``sleep`` moves); ``None`` before ``train``."""
        self._in_step: int | None = None
        """The step in flight, from ``train.step.pre`` until ``train.step.post``: ``sleep`` is refused then."""
        self._asleep: Offloaded | None = None

    # --- state ---------------------------------------------------------------------------------------

    def initial_state(self) -> TrainState:
        """The state before step 1: the materialized model's weights, fresh optimizer, metrics and task.

        On several ranks the params (and optimizer state) are ``DTensor``s placed by the model provider's
        ``parallelize_model_stage`` (default: replicated over ``dp_replicate``, sharded over ``dp_shard``).
        """
        return self.parallelism.initial_state(
            self.model, self.optimizer, self.task, self.config.determinism.seed, self.trainable
        )

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
        # The metric state comes back as saved: one row per data-parallel rank of the run that saved it.
        template = state.replace(metric_state=as_saved(state.metric_state)) if self.metric is not None else state
        self._frozen_prints = frozen_fingerprint(state)  # the frozen params this run starts from (its base)
        # A checkpoint that left its base out holds the rest: its base is this run's own start, checked below.
        _, base = left_out(self.checkpoints.peek_metadata(resume_from if isinstance(resume_from, int) else None))
        found = read_checkpoint(self.checkpoints, without_base(template, base), resume_from)
        if found is None:
            self.log.truncate(0)  # a run killed before its first checkpoint starts over, log included
            return state
        restored, metadata, steps = found
        restored = with_base(restored, state)
        step = int(restored.step)
        extended_from = check_fingerprint(
            metadata.get("fingerprint", {}),
            fingerprint(self.config, self.total_steps),
            where=self.checkpoints.directory / str(step),
            run_dir=self.run_dir,
            problem_extending=lambda saved: extension_problem(saved, step, self.total_steps, self.lr_schedule_for),
        )
        check_frozen(
            metadata.get(BASE_KEY),
            self._frozen_prints,
            where=self.checkpoints.directory / str(step),
            run_dir=self.run_dir,
            source=self.base_source,
        )
        notice = None
        if self.metric is not None:  # this rank's row (or, on another rank count, rank 0 gets their merge)
            num_rows, size = metadata.get(METADATA_KEY), self.metric_ranks
            metric_state, merged = rank_state(
                restored.metric_state, num_rows, state.metric_state, self.metric_rank, size, self.metric.merge
            )
            restored = restored.replace(metric_state=metric_state)
            notice = merge_notice(step, num_rows, size) if merged else None
        if self.main_process and announce:
            for line in resume_notice(self.run_dir, step, resume_from, notice, extended_from, self.total_steps):
                print(line)
        if step < steps[-1]:
            moved = self.checkpoints.set_aside_after(step)
            if self.main_process:
                print(
                    f"d9dfn: set aside the later step(s) {[int(p.name.split('-')[0]) for p in moved]}: "
                    f"{', '.join(map(str, moved))}"
                )
        self.data.restore(metadata["data"])
        self.log.truncate(metadata["log_lines"])
        return restored

    def _save(self, state: TrainState, step: int, data_state: dict[str, Any]) -> None:
        fingerprinted = fingerprint(self.config, self.total_steps)
        metadata = {"fingerprint": fingerprinted, "data": data_state, "log_lines": self.log.position()}
        if self._frozen_prints is None:  # saved before any restore: the frozen params are still the initial ones
            self._frozen_prints = frozen_fingerprint(state)
        if self._frozen_prints:
            # A base read from files is left out (checkpoint/_base.py): a LoRA checkpoint is its adapters' state.
            metadata[BASE_KEY] = base_record(self.base_source, self._frozen_prints)
            if self.base_source is not None:
                state = without_base(state, state.frozen)
        if self.metric is not None:
            # Every data-parallel rank's partial metric state, as rows (the period may be half-way): a resume logs
            # the same metrics/* as an uninterrupted run. On pipeline ranks, the last stage's (only it updates them).
            state = self.parallelism.share_metric_state(state)
            state = state.replace(metric_state=gather_rank_states(state.metric_state, self.dp_group))
            metadata[METADATA_KEY] = self.metric_ranks
        self.checkpoints.save(step, state, metadata)

    # --- sleep and wake (d9d's DEP-0006) --------------------------------------------------------------

    def is_sleeping(self, tag: SleepTag | str = SleepTag.TENSOR_STATES) -> bool:
        """Whether ``tag`` (``tensor_states``) is asleep: the run's tensors are in host memory."""
        return SleepTag(tag) == SleepTag.TENSOR_STATES and self._asleep is not None

    def _check_tags(self, tags: frozenset[SleepTag | str] | set[SleepTag | str], method: str) -> frozenset[SleepTag]:
        try:
            checked = frozenset(SleepTag(tag) for tag in tags)
        except ValueError:
            raise ValueError(
                f"Trainer.{method}: tags={sorted(map(str, tags))}; pass d9dfn.loop.SleepTag values "
                f"({', '.join(tag.value for tag in SleepTag)})"
            ) from None
        if SleepTag.COMMS in checked:
            raise ValueError(
                f"Trainer.{method}: tag 'comms' (tearing down the process groups' communicators) is not implemented, "
                "as in d9d; pass tags={'tensor_states'} (the default)"
            )
        return checked

    def sleep(self, tags: frozenset[SleepTag | str] | set[SleepTag | str] = DEFAULT_SLEEP_TAGS) -> None:
        """Move the run's tensors to host memory: params, buffers, optimizer, metric and task state, and the model's
        own weights (d9d's ``Trainer.sleep``, for colocated RL). Fires ``train.sleep.pre`` / ``train.sleep.post``.

        Call it between steps: from a ``train.step.post`` (or ``train.ready``) handler, or after ``train()``
        returned. A step does not run asleep: ``wake()`` first (in the same handler, or in the next
        ``train.step.pre`` handler). Gradients are not held between steps (the step computes and applies them
        inside itself), so there are none to move. Tensors keep their identity and are rebound to host copies
        (``d9dfn/loop/_sleep.py``): the compiled step runs again after ``wake()`` without a recompile. On a GPU the
        copies are pinned and the device memory goes back to the driver; on a CPU the "host" is the same memory,
        so a sleep only copies every storage and releases the old one. On a data-parallel mesh each rank moves its own
        tensors (a ``DTensor``'s local shard); call it on every rank. Asleep already: nothing happens.

        Raises:
            RuntimeError: called during a step (from ``train.step.pre`` until ``train.step.post``), or before the
                run has a state (``train()`` not started).
            ValueError: an unknown tag, or ``comms`` (not implemented); a pipelined run.
        """
        checked = self._check_tags(tags, "sleep")
        if self._in_step is not None:
            raise RuntimeError(
                f"Trainer.sleep: called during step {self._in_step} (a train.step.pre, forward_backward or "
                "optimizer_step handler), while the step holds the state; sleep between steps: from a "
                "train.step.post handler, or after train() returned"
            )
        if self._asleep is not None:
            return
        if self._state is None:
            raise RuntimeError(
                "Trainer.sleep: the run has no state yet (train() has not started); sleep from a train.ready or "
                "train.step.post handler, or after train() returned"
            )
        if self.pipeline_group is not None or self.pipeline is not None:
            raise ValueError(
                "Trainer.sleep: this run is pipelined; sleep and wake support one process and data-parallel meshes "
                "(sharded params move their local shards) for now, not pipeline stages' modules"
            )
        step = int(self._state.step)
        self.bus.trigger(ev.EVENT_TRAIN_SLEEP_PRE, ev.EventSleepContext(tags=checked, step=step))
        tensors = [leaf for leaf in tree_leaves(self._state) if isinstance(leaf, torch.Tensor)]
        tensors += [*self.model.parameters(), *self.model.buffers()]
        self._asleep = offload(tensors, self.device, pin_memory=self.device.type == "cuda")
        self.bus.trigger(
            ev.EVENT_TRAIN_SLEEP_POST, ev.EventSleepContext(tags=checked, step=step, num_bytes=self._asleep.num_bytes)
        )

    def wake(self, tags: frozenset[SleepTag | str] | set[SleepTag | str] = DEFAULT_SLEEP_TAGS) -> None:
        """Bring back what :meth:`sleep` moved, onto the run's device (fresh device memory, every tensor rebound in
        place). Fires ``train.wake.pre`` / ``train.wake.post``. Awake already: nothing happens.

        Raises:
            ValueError: an unknown tag, or ``comms``.
        """
        checked = self._check_tags(tags, "wake")
        if self._asleep is None:
            return
        step = None if self._state is None else int(self._state.step)
        self.bus.trigger(ev.EVENT_TRAIN_WAKE_PRE, ev.EventSleepContext(tags=checked, step=step))
        record, self._asleep = self._asleep, None
        onload(record)
        self.bus.trigger(
            ev.EVENT_TRAIN_WAKE_POST, ev.EventSleepContext(tags=checked, step=step, num_bytes=record.num_bytes)
        )

    # --- the loop -------------------------------------------------------------------------------------

    def train(self, resume_from: ResumeFrom = "latest") -> TrainResult:
        """Train to ``total_steps`` from a checkpoint (see :meth:`restore_latest`); finalize, fire ``train.finished``.

        The main process holds the run directory's lock (taken by ``configure``) until this returns or raises.

        SIGTERM and SIGINT (Ctrl-C) stop the run cleanly while this runs (called from the main thread; from
        another thread signals keep their usual effect): the step in flight finishes, every rank stops after
        the same step, its checkpoint is saved and committed, and ``TrainingStopped`` is raised instead of a
        result (no ``train.finished``). The first step (its compile) is cut short instead, at once: nothing of it is
        written, the checkpoints stay as they were, and ``TrainingStopped.during`` says so. A second signal ends the
        process at once with exit code 128 + its number, leaving the newest committed checkpoint as it was. The
        previous handlers come back on return.

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
        self._state = state
        start = position = int(state.step)
        self.nonfinite = NonfiniteSteps(config.skip_nonfinite, config.max_consecutive_skipped_steps)
        if self.main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.run_dir / "hparams.json", json.dumps(self.hparams, indent=2, default=str))
        tokens_per_step = 0
        bar = ProgressBar(self.total_steps, initial=start, enabled=self.main_process)
        self._clock = clock = Clock(start_step=start)
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
                    self._in_step = position
                    self.bus.trigger(ev.EVENT_TRAIN_STEP_PRE, context)
                    if self._asleep is not None:
                        raise RuntimeError(
                            f"Trainer: step {position} would run while the trainer sleeps (Trainer.sleep); call "
                            "Trainer.wake() before it: in the train.step.post handler that slept, or in a "
                            "train.step.pre handler"
                        )
                    batch = next(batches)
                    # Each rank's batch holds 1/cp of each of its rows' tokens (the context axis splits them).
                    tokens_per_step = tokens_per_step or tokens_in(batch) * self.data_parallel_size * self.context_size
                    # The compiled step fuses forward, backward and the optimizer update, so the four
                    # inner events fire around it in d9d's order (docs/design/events.md).
                    self.bus.trigger(ev.EVENT_TRAIN_FORWARD_BACKWARD_PRE, context)
                    if position == start + 1:
                        state, output = self._first_step(state, batch, position, bar, stop_signal.signals)
                    else:
                        state, output = self._step(state, batch, position, first=False)
                    batches.prefetch()  # the next batch loads, and copies on a side stream, while the step runs
                    done = dataclasses.replace(context, state=state, output=output)
                    self.bus.trigger(ev.EVENT_TRAIN_FORWARD_BACKWARD_POST, done)
                    self.bus.trigger(ev.EVENT_TRAIN_OPTIMIZER_STEP_PRE, done)
                    self.bus.trigger(ev.EVENT_TRAIN_OPTIMIZER_STEP_POST, done)
                    pending.append((position, output))
                    state, last_loss = self._periodic(state, position, pending, last_loss)
                    if profiler is not None:
                        profiler.step()
                    self._state, self._in_step = state, None  # between steps: sleep may move this state
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
                    bar.update(position, tokens=tokens_per_step, loss=last_loss, skipped=self.nonfinite.skipped)
                    if stopped_by:
                        break
            self.checkpoints.wait()
            publish_compile_cache()  # the evaluation's graphs too
            stopped_by = stopped_by or stop_signal()  # during the last save (or its commit): the run is done, stop
            saved = self.checkpoints.latest_step() if stopped_by else None
        finally:
            failing = sys.exc_info()[1]  # the run's own error, if one is on its way out
            self._in_step = None
            bar.close()
            self.data.close()  # stops data_loading's worker processes, if any
            self.log.close()
            self.checkpoints.close()
            if self.main_process and clock.first_step_s is not None:
                record = {"command": "train", **clock.record(), "compile": config.compile}
                try:
                    append_jsonl(self.run_dir / TIMINGS_FILE, record)
                except OSError:
                    # The run's error (a full disk, most often) is what its user needs, not this line's on top of it.
                    if failing is None:
                        raise
        if stopped_by:
            raise TrainingStopped(
                stopped_by,
                step=position,
                total_steps=self.total_steps,
                checkpoint_step=saved,
                checkpoint_dir=self.checkpoints.directory,
                saved=position > start,
            )
        return self._finished(state, steps_run=self.total_steps - start)

    def _first_step(
        self, state: TrainState, batch: Any, position: int, bar: ProgressBar, signals: StopSignals
    ) -> tuple[TrainState, StepOutput]:
        """The process's first step, which compiles: a ticking status line instead of a bar at 0%; its time goes to
        the clock, and its graphs to the host's compile cache for the next job of this model.

        A SIGTERM/SIGINT while it runs stops it at once (``StopSignals.abrupt``: nothing of this run is written yet, so
        nothing needs to finish) and raises ``TrainingStopped`` saying so; the run's checkpoints stay as they are.
        """
        during = "the first step's compile" if self.config.compile else "the first step"
        try:
            with (
                bar.first_step("compiling (first step)" if self.config.compile else "first step"),
                signals.abrupt(during),
            ):
                out = self._step(state, batch, position, first=True)
        except StopDuring as stop:
            steps = committed_steps(self.checkpoints.directory)  # a listing: no collective (a peer may have left)
            raise TrainingStopped(
                stop.signal_number,
                step=position - 1,
                total_steps=self.total_steps,
                checkpoint_step=steps[-1] if steps else None,
                checkpoint_dir=self.checkpoints.directory,
                saved=False,
                during=during,
            ) from None
        self._clock.first_step_done(bar.first_step_s)
        publish_compile_cache()
        return out

    def _periodic(
        self, state: TrainState, position: int, pending: list[tuple[int, StepOutput]], last_loss: float | None
    ) -> tuple[TrainState, float | None]:
        """What is due after step ``position``, in order: the logging period's records and the task's metrics, the
        validation, a garbage collection. Returns the state (metrics reset) and the last loss written."""
        config = self.config
        if should_do_action(
            config.logging.period_steps, step=position, total_steps=self.total_steps, on_last_step=True
        ):
            last_loss = self._flush(pending, position)
            state = self._log_metrics(state, position)
        if self.validation is not None and should_do_action(
            self.validation.period, step=position, total_steps=self.total_steps, on_last_step=True
        ):
            last_loss = self._flush(pending, position) or last_loss  # the log stays in step order
            with self._clock.excluded("validation_s"):
                self._validate(state, position)
        collect_garbage(config.gc.period_steps, step=position, total_steps=self.total_steps)
        return state, last_loss

    def _finished(self, state: TrainState, steps_run: int) -> TrainResult:
        """The task's result, ``train.finished``, the loss plot (main process): the run's result."""
        task_result = self.task.finalize(state.task_state)
        self.bus.trigger(ev.EVENT_TRAIN_FINISHED, ev.EventTrainFinishedContext(state=state))
        plot = self._plot() if self.main_process else None
        return TrainResult(
            state=state,
            task_result=task_result,
            run_dir=self.run_dir,
            steps_run=steps_run,
            plot_path=plot,
            steps_skipped=self.nonfinite.skipped,
            first_step_s=self._clock.first_step_s,
            step_s=self._clock.step_s(),
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
            if not is_collective_failure(error):  # a bug in the model or task: its own error, unwrapped
                raise
            world_size = torch.distributed.get_world_size()
            raise CollectiveError.at_step(
                error, rank=self.rank, world_size=world_size, step=position, first=first
            ) from error
        if first:  # every group the step waits on (the checkpoint group keeps its long timeout)
            stop = [self.stop_group] if self.stop_group is not None else []
            set_collective_timeout(self.config.timeout.step_timeout, [*self.parallelism.groups(), *stop])
        return out

    def _flush(self, pending: list[tuple[int, StepOutput]], position: int) -> float | None:
        """Write the period's per-step records: the one host sync of the period."""
        if not pending:
            return None
        values = period_columns([o for _, o in pending])
        if self.pipeline_group is not None:  # only the last stage's rank has the task's logs: it shares them
            task_logs = {k: v for k, v in values.items() if k.startswith("task/")}
            values = {**values, **self.parallelism.from_last_stage(task_logs)}
        records = [{"step": s, **{name: values[name][i] for name in values}} for i, (s, _) in enumerate(pending)]
        pending.clear()
        records, error = self.nonfinite.mark(records, self._on_disk)
        if records:
            self.log.log(records)
        if error is not None:
            raise error
        self._clock.flushed(position)  # the .tolist() above waited for every step of the period
        return records[-1]["loss"]

    def _on_disk(self) -> str:
        """What a failed run leaves to resume from (``_resume.on_disk``); the signal watcher thread calls it too."""
        return on_disk(self.checkpoints.directory, self.config.checkpointing.period_steps)

    def _validate(self, state: TrainState, position: int) -> None:
        """Run ``validation`` with ``state``'s weights and log its record (``val/*``) at ``position``."""
        assert self.validation is not None
        record = self.validation.run(
            state,
            position,
            task=self.task,
            device=self.device,
            parallelism=self.parallelism,
            show=self.main_process,
            compiling=self.config.compile and not self._validated,  # the process's first validation compiles
        )
        self._validated = True
        self.log.log([record])

    def _log_metrics(self, state: TrainState, position: int) -> TrainState:
        """Compute, write and reset the task's metrics (they accumulate over one logging period)."""
        if self.metric is None:
            return state
        state = self.parallelism.share_metric_state(state)
        metric_state = state.metric_state
        if self.dp_group is not None:
            metric_state = _metrics.reduce(metric_state, self.dp_group)
        values = flatten_scalars(self.metric.compute(metric_state), prefix="metrics")
        self.log.log([{"step": position, **values}])
        return state.replace(metric_state=self.metric.init(state.step.device))

    # --- export ---------------------------------------------------------------------------------------

    def export(self, path: Path, *, load_checkpoint: bool = True) -> Path:
        """Write the model as ``model.safetensors`` under ``path``; on one process too (d9d's exporter,
        ``d9d/loop/component/model_stage_exporter.py``, asks for the distributed mesh, which one process lacks).

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
