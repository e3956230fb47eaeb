"""Whether a checkpoint fits the run that resumes it: the totals it was saved with, and an extended run's schedule.

A checkpoint records its run's *fingerprint* (``total_steps`` and the batch sizes). A run resumes it only with the
same batching; a different ``total_steps`` is accepted when the checkpoint's step is within it and the learning
rate of every step already run is the same under both totals (a constant rate, or phases that do not depend on
``total_steps`` up to that step), so a finished run can be extended (``docs/design/run-directory.md``).

It records its frozen params' base too (``d9dfn.checkpoint.base_record``: a LoRA run's pretrained weights): the folder
they are read from, whose params the checkpoint then leaves out (:func:`without_base`; the resume takes them from the
run's own start, :func:`with_base`), and a fingerprint of each. A run whose frozen params differ (another
``model.source``, another ``source_checkpoint``, the folder's files changed) does not resume it (:func:`check_frozen`):
it would train the checkpoint's adapters on another base, or bring back the old base under the new one's name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch

from d9dfn._types import Schedule
from d9dfn.checkpoint import CheckpointCorruptedError, CheckpointMismatchError, CheckpointStore, check_base
from d9dfn.checkpoint import fingerprint as checkpoint_fingerprint
from d9dfn.config import TrainerConfig
from d9dfn.loop._signals import committed_steps
from d9dfn.step import TrainState

__all__ = [
    "ResumeFrom",
    "check_fingerprint",
    "check_frozen",
    "extension_problem",
    "fingerprint",
    "frozen_fingerprint",
    "read_checkpoint",
    "resume_notice",
    "with_base",
    "without_base",
]

ResumeFrom: TypeAlias = int | Literal["latest", "newest-intact"]
"""Which checkpoint a run resumes from: the newest, the newest intact one, or a step number."""


def read_checkpoint(
    checkpoints: CheckpointStore, like: TrainState, resume_from: ResumeFrom
) -> tuple[TrainState, dict[str, Any], list[int]] | None:
    """The checkpoint ``resume_from`` picks, in ``like``'s structure, with its metadata and every saved step; ``None``
    when nothing is saved (and ``resume_from`` is not a step number).

    Raises:
        FileNotFoundError: ``resume_from`` is a step number and nothing is saved, or not that step.
        CheckpointCorruptedError: the chosen step (for ``"newest-intact"``: every step) is corrupted; with
            ``"latest"`` or a step, its ``fix`` names the ``resume_from`` that goes on past the damage.
        ValueError: the checkpoint holds another model than ``like`` (other parameters, dtypes or shapes).
    """
    try:
        return _read_checkpoint(checkpoints, like, resume_from)
    except CheckpointMismatchError as error:  # the API's terms ("pass like=") would not help: say what differs
        raise ValueError(
            f"Trainer: checkpoint {error.which} in {checkpoints.directory} holds another model than this run "
            f"builds: {error.difference()}; to resume it, build the model it was trained with; to train this model, "
            "start a new run under another run.name (--set trainer.run.name=NAME in a job)"
        ) from None


def _read_checkpoint(
    checkpoints: CheckpointStore, like: TrainState, resume_from: ResumeFrom
) -> tuple[TrainState, dict[str, Any], list[int]] | None:
    steps = checkpoints.all_steps()
    if not steps:
        if isinstance(resume_from, int):
            raise FileNotFoundError(
                f"Trainer: resume_from={resume_from}, but {checkpoints.directory} holds no checkpoint; drop "
                "the option to start from scratch"
            )
        return None
    if resume_from == "newest-intact":
        restored, metadata = checkpoints.restore(None, like=like, fallback=True)
        return restored, metadata, steps
    try:
        restored, metadata = checkpoints.restore(steps[-1] if resume_from == "latest" else resume_from, like=like)
    except CheckpointCorruptedError as error:
        error.fix = (
            f"resume the Trainer from the newest intact step with resume_from='newest-intact', or from another "
            f"saved step ({error.steps}) with resume_from=STEP; the later steps are then set aside"
        )
        raise
    return restored, metadata, steps


def resume_notice(
    run_dir: Path,
    step: int,
    resume_from: ResumeFrom,
    merged: str | None,
    extended_from: int | None,
    total_steps: int,
) -> list[str]:
    """The console lines of a resume: from which step (and ``resume_from`` when not the latest), the metric rows'
    merge notice, and an extension of ``total_steps``.

    >>> resume_notice(Path("runs/lm"), 200, "latest", None, 300, 600)  # doctest: +NORMALIZE_WHITESPACE
    ['d9dfn: resuming runs/lm from step 200', 'd9dfn: extending runs/lm from total_steps=300 to 600 (the learning
    rate of steps 1-200 is the same under both)']
    """
    how = "" if resume_from == "latest" else f" (resume_from={resume_from!r})"
    lines = [f"d9dfn: resuming {run_dir} from step {step}{how}"]
    if merged is not None:
        lines.append(merged)
    if extended_from is not None:
        lines.append(
            f"d9dfn: extending {run_dir} from total_steps={extended_from} to {total_steps} (the learning rate of "
            f"steps 1-{step} is the same under both)"
        )
    return lines


def fingerprint(config: TrainerConfig, total_steps: int) -> dict[str, Any]:
    """The totals a checkpoint must agree with to be resumed (d9d: "step count differs")."""
    return {
        "total_steps": total_steps,
        "global_batch_size": config.batching.global_batch_size,
        "microbatch_size": config.batching.microbatch_size,
    }


def check_fingerprint(
    saved: dict[str, Any],
    ours: dict[str, Any],
    *,
    where: Path,
    run_dir: Path,
    problem_extending: Callable[[int], str | None],
) -> int | None:
    """Raise unless the checkpoint ``where`` (saved with ``saved``) fits this run (``ours``); the saved
    ``total_steps`` when the run extends it.

    ``problem_extending(saved_total_steps)`` says why the run cannot go on to its own ``total_steps`` (``None``: it
    can; :func:`extension_problem`).

    Raises:
        ValueError: other batch sizes, or another ``total_steps`` that the run cannot extend to; the message gives
            the ``--set`` that resumes and the one that starts a new run.
    """
    new_run = f"--set trainer.run.name={run_dir.name}-new (run.name in a TrainerConfig)"
    extended_from = None
    for key, value in ours.items():
        if saved.get(key) == value:
            continue
        if key == "total_steps" and isinstance(saved.get(key), int):
            problem = problem_extending(saved[key])
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


def extension_problem(
    saved_total: int, step: int, total_steps: int, lr_schedule_for: Callable[[int], Schedule] | None
) -> str | None:
    """Why the run at ``step`` (saved with ``saved_total`` steps) cannot go on to ``total_steps``; None: it can.

    ``lr_schedule_for(total_steps)`` is the LR multiplier the job would have with that many steps (``None``: the
    schedules cannot be compared, so the run never extends).
    """
    if step > total_steps:
        return f"the checkpoint is already at step {step}"
    if lr_schedule_for is None:
        return "this trainer cannot compare learning-rate schedules (no lr_schedule_for)"
    before = _multipliers(lr_schedule_for(saved_total), step)
    after = _multipliers(lr_schedule_for(total_steps), step)
    changed = (before != after).nonzero()
    if len(changed):
        past = int(changed[0, 0])
        return (
            f"the learning-rate schedule depends on total_steps: step {past} had multiplier "
            f"{float(before[past]):.6g}, which total_steps={total_steps} would make {float(after[past]):.6g}"
        )
    return None


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


def on_disk(checkpoints: Path, period_steps: object) -> str:
    """What a failed run leaves to resume from, as the error messages state it (only what is true).

    A listing of ``checkpoints`` (no orbax), so a signal watcher thread may call it.
    """
    steps = committed_steps(checkpoints)
    if not steps:
        return (
            f"no checkpoint has been saved yet in {checkpoints} (checkpointing.period_steps={period_steps}): a rerun "
            "starts from scratch"
        )
    return (
        f"the newest committed checkpoint is step {steps[-1]} in {checkpoints}: rerun the same command to resume "
        "from it"
    )


def frozen_fingerprint(state: TrainState) -> dict[str, str]:
    """The fingerprint of each frozen param of ``state`` (``d9dfn.checkpoint.fingerprint``: a collective on several
    ranks, every rank calls it).

    >>> from torch import nn
    >>> import d9dfn.optim as optim
    >>> from d9dfn.step import init_train_state
    >>> state = init_train_state(nn.Linear(2, 1), optim.sgd(0.1), trainable=lambda name, tensor: name == "bias")
    >>> list(frozen_fingerprint(state))
    ['weight']
    """
    return checkpoint_fingerprint(state.params, state.frozen)


def without_base(state: TrainState, base: Collection[str]) -> TrainState:
    """``state`` without the params ``base`` names: what a checkpoint that leaves its base out holds (and the
    template such a checkpoint restores into)."""
    if not base:
        return state
    return state.replace(params={name: p for name, p in state.params.items() if name not in base})


def with_base(restored: TrainState, start: TrainState) -> TrainState:
    """``restored`` with the params it lacks taken from ``start`` (the base the run read from its files), in
    ``start``'s order (the step's compiled pieces see the same tree)."""
    params = {name: restored.params.get(name, param) for name, param in start.params.items()}
    return restored.replace(params=params)


def check_frozen(
    saved: Mapping[str, Any] | None, ours: Mapping[str, str], *, where: Path, run_dir: Path, source: Path | None
) -> None:
    """Raise unless the frozen params this run starts from (``ours``, read from ``source``) are those the checkpoint
    ``where`` was trained on (``saved``: its base record, ``d9dfn.checkpoint.base_record``).

    Only the names both hold are compared (a pipeline rank holds its stages' params; a checkpoint saved before
    fingerprints were recorded holds none).

    Raises:
        ValueError: one line naming the base the checkpoint was trained on, the first params that differ and both
            ways out.
    """
    check_base(
        saved,
        ours,
        where=where,
        source=source,
        fix=(
            "resume it with the base it was trained on (model.source, model_stage_factory.source_checkpoint), or "
            f"start a new run on this one: --set trainer.run.name={run_dir.name}-new"
        ),
    )
