"""Sequence classification: cross-entropy over one label per sequence, with accuracy, macro F1 and AUROC.

Reads batches ``{"input_ids": (B, T), "labels": (B,)}`` (class indices) and a model that returns
``{"logits": (B, num_labels)}`` (``d9dfn.models.SequenceClassifier``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from d9dfn import metrics
from d9dfn._pipeline_state import PipelineState
from d9dfn._task import BuildForwardInputsResult, ComputeLossResult, TrainTask
from d9dfn._types import PyTree

__all__ = ["ClassificationTask"]


class ClassificationTask(TrainTask[Mapping[str, torch.Tensor]]):
    """Sequence-mean cross-entropy over the global batch; metrics over the logging period: ``loss``, ``accuracy``,
    ``f1`` (macro over the classes, ``d9dfn.metrics.confusion_matrix``) and ``auroc`` (``binary_auroc`` of the
    positive class's probability for two labels, else the macro one-vs-rest ``multiclass_auroc``).

    Each microbatch's loss is its per-sequence mean and its weight its number of sequences, so the step's gradient
    is that of the mean over the global batch however it is cut into microbatches.

    Args:
        num_labels: the classes (>= 2); labels are indices in ``[0, num_labels)``.
        auroc_bins: the AUROC's score bins (its resolution).

    Raises:
        ValueError: ``num_labels < 2``.

    >>> task = ClassificationTask(3)
    >>> sorted(task.create_metrics().init())
    ['accuracy', 'auroc', 'f1', 'loss']
    """

    def __init__(self, num_labels: int, *, auroc_bins: int = 1000) -> None:
        if not isinstance(num_labels, int) or num_labels < 2:
            raise ValueError(f"ClassificationTask: num_labels={num_labels!r}; a classification has at least 2 labels")
        self.num_labels = num_labels
        f1 = metrics.confusion_matrix(num_labels, metrics=("f1",), average="macro")
        auroc = (
            metrics.binary_auroc(auroc_bins) if num_labels == 2 else metrics.multiclass_auroc(num_labels, auroc_bins)
        )
        self._metrics = metrics.compose(
            {
                "loss": metrics.weighted_mean(),
                "accuracy": metrics.accuracy(),
                "f1": f1._replace(compute=lambda state: metrics.f1_score(state, "macro")),
                "auroc": auroc,
            }
        )

    def build_forward_inputs(
        self, batch: Mapping[str, torch.Tensor], state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state.set("labels", batch["labels"])

    def compute_loss(
        self, outputs: Mapping[str, torch.Tensor], state: PipelineState, step: torch.Tensor
    ) -> ComputeLossResult:
        logits = outputs["logits"].float()  # (b, C), float32 whatever the compute dtype
        labels = state["labels"]  # (b,)
        nll = F.cross_entropy(logits, labels, reduction="sum")
        count = torch.tensor(float(labels.shape[0]), device=logits.device)
        state = state.set("nll", nll.detach()).set("count", count).set("logits", logits.detach())
        return ComputeLossResult(loss=nll / count, loss_weight=count, state=state)

    def create_metrics(self) -> metrics.Metric:
        """Loss, accuracy, macro F1 and AUROC over the logging period."""
        return self._metrics

    def update_metrics(self, metric_state: PyTree, state: PipelineState) -> PyTree:
        # Per-microbatch writes merged: nll and count (M,) vectors, logits (B, C) concatenated; labels (B,).
        count = state["count"].sum()
        logits, labels = state["logits"], state["labels"]
        probs = torch.softmax(logits, dim=-1)
        scores = (probs[:, 1], labels) if self.num_labels == 2 else (probs, labels)
        return self._metrics.update(
            metric_state,
            {
                "loss": (state["nll"].sum() / count.clamp(min=1.0), count),
                "accuracy": (logits, labels),
                "f1": (logits, labels),
                "auroc": scores,
            },
        )

    def dump_hparams(self) -> dict[str, Any]:
        return {"task": "classification", "num_labels": self.num_labels}
