"""The per-step records of a logging period: the step outputs in one host transfer, and the non-finite policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from d9dfn.step import StepOutput

__all__ = ["NonfiniteSteps", "period_columns"]


def period_columns(outputs: Sequence[StepOutput]) -> dict[str, list[Any]]:
    """The period's scalars by column (``loss``, ``grad_norm``, ``lr``, ``loss_weight``, ``nonfinite``, and the task's
    own logs as ``task/<name>``), one value per step: every scalar is stacked, then ``.tolist()`` once, the period's
    one host sync."""
    columns = {
        "loss": torch.stack([o.loss for o in outputs]),
        "grad_norm": torch.stack([o.grad_norm for o in outputs]),
        "lr": torch.stack([o.lr for o in outputs]),
        "loss_weight": torch.stack([o.loss_weight for o in outputs]),
        "nonfinite": torch.stack([o.nonfinite for o in outputs]).float(),
    }
    for name in outputs[0].logs:  # the task's own values, apart from the loop's columns
        columns[f"task/{name}"] = torch.stack([o.logs[name].float() for o in outputs])
    return {name: column.tolist() for name, column in columns.items()}


class NonfiniteSteps:
    """What a step whose loss or gradient norm is NaN/inf does to the run: stop it (``skip_nonfinite=false``), or
    count it as skipped and stop once more than ``max_consecutive_skipped_steps`` were skipped in a row.

    Args:
        skip: ``trainer.skip_nonfinite``.
        limit: ``trainer.max_consecutive_skipped_steps`` (``None``: never stop).
    """

    def __init__(self, skip: bool, limit: int | None) -> None:
        self.skip = skip
        self.limit = limit
        self.skipped = 0  # skipped steps of this train() call
        self.in_a_row = 0

    def mark(
        self, records: list[dict[str, Any]], on_disk: Callable[[], str]
    ) -> tuple[list[dict[str, Any]], FloatingPointError | None]:
        """Mark each record's ``skipped`` (0 or 1) and count; the records to log, and the error that stops the run
        after they are logged (``None``: it goes on). ``on_disk()`` says what a rerun resumes from.
        """
        bad = [r["step"] for r in records if r["nonfinite"]]
        if bad and not self.skip:
            return [], FloatingPointError(
                f"Trainer: the loss or gradient norm became NaN/inf at step(s) {bad} (loss {records[-1]['loss']}); "
                f"{on_disk()}. Lower the learning rate, set gradient_clipping.max_norm, check the data for "
                "empty batches, or set skip_nonfinite=true to skip such steps"
            )
        for index, record in enumerate(records):
            record["skipped"] = int(bool(record["nonfinite"]))  # with skip_nonfinite, a non-finite step is skipped
            self.in_a_row = self.in_a_row + 1 if record["skipped"] else 0
            self.skipped += record["skipped"]
            if self.limit is not None and self.in_a_row > self.limit:
                return records[: index + 1], FloatingPointError(  # the evidence, up to the step that stopped it
                    f"Trainer: {self.in_a_row} consecutive steps (up to step {record['step']}) had a NaN/inf "
                    f"loss or gradient norm and were skipped (skip_nonfinite=true), more than "
                    f"max_consecutive_skipped_steps={self.limit}: the run is not learning. {on_disk()}. Lower the "
                    "learning rate or set gradient_clipping.max_norm; max_consecutive_skipped_steps=null never stops"
                )
        return records, None
