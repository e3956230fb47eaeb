"""Validation during training (``trainer.evaluation``): the forward-only step over the validation split, one record."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from d9dfn import metrics as _metrics
from d9dfn._task import TrainTask
from d9dfn._types import Batch, PyTree
from d9dfn.config import StepActionPeriod
from d9dfn.data import to_device
from d9dfn.loop._logging import ProgressBar, flatten_scalars
from d9dfn.loop._parallelism import Parallelism
from d9dfn.step import EvalOutput, TrainState

__all__ = ["Validation"]


@dataclasses.dataclass(frozen=True)
class Validation:
    """Validation during training (``evaluation``): the forward-only step and a fresh pass over the validation data.

    ``batches()`` returns this rank's validation batches from the start, in order (a new iterator each time, so
    the training data's position is never touched); ``step_fn`` is ``make_eval_step``'s
    ``(train_state, metric_state, batch) -> (metric_state, EvalOutput)``.
    """

    step_fn: Callable[[TrainState, PyTree, Batch], tuple[PyTree, EvalOutput]]
    batches: Callable[[], Iterable[Batch]]
    num_batches: int
    period: StepActionPeriod
    """``evaluation.period_steps``: when it runs (``should_do_action``, also on the last step)."""

    def run(
        self,
        state: TrainState,
        position: int,
        *,
        task: TrainTask,
        device: torch.device,
        parallelism: Parallelism,
        show: bool,
        compiling: bool,
    ) -> dict[str, Any]:
        """Run over the batches with ``state``'s weights; the record to log at ``position``.

        The record holds ``val/loss`` (the weighted mean of the task's loss over every validation batch: Σw·ℓ / Σw),
        ``val/loss_weight`` (Σw) and the task's metrics as ``val/metrics/...``, all summed over the data-parallel
        ranks (``parallelism.data_parallel_group``; each evaluates its rows of every batch). Nothing of the training
        state changes, so a resumed run logs the same records. ``show``: draw the progress bar (the main process);
        ``compiling``: the first batch compiles (its status line says so).
        """
        metric = task.create_metrics()
        metric_state = metric.init(state.step.device) if metric is not None else None
        loss_sum = torch.zeros((), dtype=torch.float64, device=state.step.device)
        weight_sum = torch.zeros_like(loss_sum)
        bar = ProgressBar(
            self.num_batches, enabled=show, desc=f"validation at step {position}", unit="batch", leave=False
        )
        try:
            for index, batch in enumerate(self.batches(), start=1):
                batch = to_device(batch, device)
                if index == 1:
                    with bar.first_step("compiling (first batch)" if compiling else "first batch"):
                        metric_state, out = self.step_fn(state, metric_state, batch)
                else:
                    metric_state, out = self.step_fn(state, metric_state, batch)
                loss_sum = loss_sum + out.loss.double() * out.loss_weight.double()
                weight_sum = weight_sum + out.loss_weight.double()
                bar.update(index)
        finally:
            bar.close()
        sums = torch.stack([loss_sum, weight_sum])
        dp_group = parallelism.data_parallel_group
        if dp_group is not None:  # each data-parallel rank evaluated its rows of every batch
            torch.distributed.all_reduce(sums, group=dp_group)
        total_loss, total_weight = sums.tolist()  # the validation's one host sync
        record: dict[str, Any] = {
            "step": position,
            "val/loss": total_loss / total_weight if total_weight else math.nan,
            "val/loss_weight": total_weight,
        }
        if metric is not None:
            if parallelism.pipeline_group is not None:  # only the last stage's rank updated it
                metric_state = parallelism.tree_from_last_stage(metric_state)
            if dp_group is not None:
                metric_state = _metrics.reduce(metric_state, dp_group)
            record.update(flatten_scalars(metric.compute(metric_state), prefix="val/metrics"))
        return record
