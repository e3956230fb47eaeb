"""Next-token language modelling: the training task and the perplexity inference task.

Both read batches ``{"input_ids": (B, T), "labels": (B, T)}`` where ``labels`` are the next tokens and
``-100`` marks positions that carry no loss (padding, prompts), and a model that returns
``{"logits": (B, T, V)}``. Packed rows (``d9dfn.data.PackedDataset``) add ``position_ids`` and ``document_ids``
(B, T), handed to the model as kwargs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from d9dfn import metrics
from d9dfn._pipeline_state import PipelineState
from d9dfn._task import BuildForwardInputsResult, ComputeLossResult, InferenceTask, TrainTask
from d9dfn._types import PyTree

__all__ = ["IGNORE_INDEX", "CausalLMTask", "PerplexityTask", "token_nll"]

IGNORE_INDEX = -100
"""Label value that contributes no loss (as in torch's ``cross_entropy`` and d9d's ``LM_IGNORE_INDEX``)."""


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token negative log-likelihood and the number of counted tokens.

    Args:
        logits: (B, T, V) scores.
        labels: (B, T) target ids, ``IGNORE_INDEX`` where no loss is taken.

    Returns:
        ``(nll_sum, num_tokens)``, both 0-d float32.

    >>> nll, n = token_nll(torch.zeros(1, 2, 4), torch.tensor([[1, IGNORE_INDEX]]))
    >>> round(float(nll), 4), float(n)
    (1.3863, 1.0)
    """
    # (B, T, V) -> (B·T, V); the loss is accumulated in float32 whatever the logits' dtype.
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, (labels != IGNORE_INDEX).sum().to(torch.float32)


def _lm_inputs(
    batch: Mapping[str, torch.Tensor], state: PipelineState
) -> tuple[BuildForwardInputsResult, PipelineState]:
    """The model's inputs (``input_ids``, optional ``position_ids`` and ``document_ids`` of packed rows); ``labels``
    kept for the loss."""
    state = state.set("labels", batch["labels"])
    kwargs = {name: batch[name] for name in ("position_ids", "document_ids") if name in batch}
    return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}, kwargs=kwargs), state


class CausalLMTask(TrainTask[Mapping[str, torch.Tensor]]):
    """Token-mean cross-entropy over the global batch, with a token-accuracy and loss metric.

    Each microbatch's loss is its per-token mean and its weight the token count, so the step's gradient
    is that of the mean over every counted token of the batch, however they fall into microbatches.
    """

    def __init__(self) -> None:
        self._metrics = metrics.compose({"loss": metrics.weighted_mean(), "accuracy": metrics.weighted_mean()})

    def build_forward_inputs(
        self, batch: Mapping[str, torch.Tensor], state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return _lm_inputs(batch, state)

    def compute_loss(
        self, outputs: Mapping[str, torch.Tensor], state: PipelineState, step: torch.Tensor
    ) -> ComputeLossResult:
        labels = state["labels"]
        nll, num_tokens = token_nll(outputs["logits"], labels)
        loss = nll / num_tokens.clamp(min=1.0)
        correct = ((outputs["logits"].argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
        state = state.set("nll", nll).set("num_tokens", num_tokens).set("correct", correct.to(torch.float32))
        return ComputeLossResult(loss=loss, loss_weight=num_tokens, state=state)

    def create_metrics(self) -> metrics.Metric:
        """Token-mean loss and next-token accuracy, as weighted means over the logging period."""
        return self._metrics

    def update_metrics(self, metric_state: PyTree, state: PipelineState) -> PyTree:
        # Per-microbatch writes merged into (num_microbatches,) vectors.
        num_tokens = state["num_tokens"].sum()
        safe = num_tokens.clamp(min=1.0)
        return self._metrics.update(
            metric_state,
            {"loss": (state["nll"].sum() / safe, num_tokens), "accuracy": (state["correct"].sum() / safe, num_tokens)},
        )

    def dump_hparams(self) -> dict[str, Any]:
        return {"task": "causal_lm", "ignore_index": IGNORE_INDEX}


class PerplexityTask(InferenceTask[Mapping[str, torch.Tensor]]):
    """Validation perplexity: sums token NLL and counts over the whole run; ``finalize`` returns ``exp``.

    The task state is ``{"nll": 0-d, "num_tokens": 0-d}``; it is checkpointed like any other state, so an
    interrupted evaluation resumes where it stopped (d9d's ``calculate_perplexity`` example, made pure).
    """

    def init_state(self) -> PyTree:
        return {"nll": torch.zeros((), dtype=torch.float64), "num_tokens": torch.zeros((), dtype=torch.float64)}

    def build_forward_inputs(
        self, batch: Mapping[str, torch.Tensor], state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return _lm_inputs(batch, state)  # same inputs, same labels as training

    def process_outputs(self, task_state: PyTree, outputs: Mapping[str, torch.Tensor], state: PipelineState) -> PyTree:
        nll, num_tokens = token_nll(outputs["logits"], state["labels"])
        return {
            "nll": task_state["nll"] + nll.to(torch.float64),
            "num_tokens": task_state["num_tokens"] + num_tokens.to(torch.float64),
        }

    def finalize(self, task_state: PyTree) -> dict[str, float]:
        num_tokens = float(task_state["num_tokens"])
        mean_nll = float(task_state["nll"]) / max(num_tokens, 1.0)
        return {"perplexity": float(torch.tensor(mean_nll).exp()), "nll": mean_nll, "num_tokens": num_tokens}
