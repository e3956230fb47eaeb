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
from d9dfn.parallel import VocabParallelLogits, vocab_parallel_correct, vocab_parallel_nll

__all__ = ["IGNORE_INDEX", "CausalLMTask", "PerplexityTask", "expert_load", "token_correct", "token_nll"]

IGNORE_INDEX = -100
"""Label value that contributes no loss (as in torch's ``cross_entropy`` and d9d's ``LM_IGNORE_INDEX``)."""


def token_nll(logits: torch.Tensor | VocabParallelLogits, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token negative log-likelihood and the number of counted tokens.

    Args:
        logits: (B, T, V) scores, or this rank's columns of them under vocabulary parallelism (a
            :class:`~d9dfn.parallel.VocabParallelLogits`: the cross-entropy then runs on the shards,
            ``d9dfn.parallel.vocab_parallel_nll``).
        labels: (B, T) target ids, ``IGNORE_INDEX`` where no loss is taken.

    Returns:
        ``(nll_sum, num_tokens)``, both 0-d float32.

    >>> nll, n = token_nll(torch.zeros(1, 2, 4), torch.tensor([[1, IGNORE_INDEX]]))
    >>> round(float(nll), 4), float(n)
    (1.3863, 1.0)
    """
    if isinstance(logits, VocabParallelLogits):
        return vocab_parallel_nll(logits, labels), (labels != IGNORE_INDEX).sum().to(torch.float32)
    # (B, T, V) -> (B·T, V); the loss is accumulated in float32 whatever the logits' dtype.
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, (labels != IGNORE_INDEX).sum().to(torch.float32)


def token_correct(logits: torch.Tensor | VocabParallelLogits, labels: torch.Tensor) -> torch.Tensor:
    """The number of counted tokens whose argmax over the vocabulary is the label, 0-d float32 (under vocabulary
    parallelism from the shards, ``d9dfn.parallel.vocab_parallel_correct``: the logits are not gathered).

    >>> float(token_correct(torch.tensor([[[0.0, 1.0], [2.0, 0.0]]]), torch.tensor([[1, IGNORE_INDEX]])))
    1.0
    """
    if isinstance(logits, VocabParallelLogits):
        hits = vocab_parallel_correct(logits, labels)
    else:
        hits = logits.argmax(-1) == labels
    return (hits & (labels != IGNORE_INDEX)).sum().to(torch.float32)


def _lm_inputs(
    batch: Mapping[str, torch.Tensor], state: PipelineState
) -> tuple[BuildForwardInputsResult, PipelineState]:
    """The model's inputs (``input_ids``, optional ``position_ids`` and ``document_ids`` of packed rows); ``labels``
    kept for the loss."""
    state = state.set("labels", batch["labels"])
    kwargs = {name: batch[name] for name in ("position_ids", "document_ids") if name in batch}
    return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}, kwargs=kwargs), state


def expert_load(num_experts: int) -> metrics.Metric:
    """Token copies per expert summed over a logging period, and its load imbalance (the busiest expert's count over
    the mean count: 1.0 is perfectly balanced, ``num_experts`` all on one expert).

    ``update(state, counts)`` adds ``counts`` (..., E) summed over its leading dimensions; ``compute`` returns
    ``{"tokens_per_expert": (E,), "load_imbalance": 0-d}``.

    >>> m = expert_load(4)
    >>> out = m.compute(m.update(m.init(), torch.tensor([[3.0, 1.0, 0.0, 0.0]])))
    >>> out["tokens_per_expert"].tolist(), float(out["load_imbalance"])
    ([3.0, 1.0, 0.0, 0.0], 3.0)
    """

    def init(device: torch.device | str | None = None) -> torch.Tensor:
        return torch.zeros(num_experts, dtype=torch.float32, device=device)

    def update(state: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return state + counts.float().reshape(-1, num_experts).sum(0)

    def compute(state: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"tokens_per_expert": state, "load_imbalance": state.max() / state.mean().clamp(min=1e-12)}

    def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    return metrics.Metric(init=init, update=update, compute=compute, merge=merge)


class CausalLMTask(TrainTask[Mapping[str, torch.Tensor]]):
    """Token-mean cross-entropy over the global batch, with a token-accuracy and loss metric.

    Each microbatch's loss is its per-token mean and its weight the token count, so the step's gradient
    is that of the mean over every counted token of the batch, however they fall into microbatches.

    A mixture-of-experts model (``d9dfn.models.qwen3_moe.Qwen3MoeLM``) also returns ``aux_loss`` (its load-balancing
    loss) and ``expert_counts`` (MoE layers, E): the loss is then ``cross_entropy + aux_loss_weight * aux_loss``
    (Hugging Face's ``router_aux_loss_coef``), ``aux_loss`` and ``load_imbalance`` (the worst MoE layer's busiest
    expert over its mean, this step) are the step's logs (``metrics.jsonl``'s ``task/…``; with a capacity factor also
    ``dropped_fraction``, the token copies dropped over those routed), and with ``num_experts``
    the metrics add ``experts/tokens_per_expert`` (E,) and ``experts/load_imbalance`` over each logging period.

    Args:
        aux_loss_weight: the weight of the model's ``aux_loss`` in the loss (the LM job passes the model's
            ``router_aux_loss_coef``); a model without one ignores it.
        num_experts: the experts per MoE layer, for the per-expert metrics; ``None``: none.
    """

    def __init__(self, aux_loss_weight: float = 0.0, num_experts: int | None = None) -> None:
        self.aux_loss_weight = float(aux_loss_weight)
        self.num_experts = num_experts
        named: dict[str, metrics.Metric] = {"loss": metrics.weighted_mean(), "accuracy": metrics.weighted_mean()}
        if num_experts is not None:
            named["experts"] = expert_load(num_experts)
        self._metrics = metrics.compose(named)

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
        correct = token_correct(outputs["logits"], labels)
        state = state.set("nll", nll).set("num_tokens", num_tokens).set("correct", correct)
        if "aux_loss" not in outputs:
            return ComputeLossResult(loss=loss, loss_weight=num_tokens, state=state)
        counts = outputs["expert_counts"].detach()  # (MoE layers, E)
        imbalance = (counts.amax(-1) / counts.mean(-1).clamp(min=1e-12)).amax()
        logs = {"aux_loss": outputs["aux_loss"].detach(), "load_imbalance": imbalance}
        if "expert_dropped" in outputs:  # a capacity factor: the share of token copies dropped, all MoE layers
            logs["dropped_fraction"] = outputs["expert_dropped"].detach().sum() / counts.sum().clamp(min=1.0)
        if self.num_experts is not None:  # (1, E): the microbatches' rows concatenate to (M, E)
            state = state.set("expert_counts", counts.sum(0, keepdim=True))
        loss = loss + self.aux_loss_weight * outputs["aux_loss"]
        return ComputeLossResult(loss=loss, loss_weight=num_tokens, state=state, logs=logs)

    def create_metrics(self) -> metrics.Metric:
        """Token-mean loss and next-token accuracy, as weighted means over the logging period."""
        return self._metrics

    def update_metrics(self, metric_state: PyTree, state: PipelineState) -> PyTree:
        # Per-microbatch writes merged into (num_microbatches,) vectors.
        num_tokens = state["num_tokens"].sum()
        safe = num_tokens.clamp(min=1.0)
        inputs: dict[str, tuple[Any, ...]] = {
            "loss": (state["nll"].sum() / safe, num_tokens),
            "accuracy": (state["correct"].sum() / safe, num_tokens),
        }
        if self.num_experts is not None:
            inputs["experts"] = (state["expert_counts"],)
        return self._metrics.update(metric_state, inputs)

    def dump_hparams(self) -> dict[str, Any]:
        moe = {"aux_loss_weight": self.aux_loss_weight, "num_experts": self.num_experts} if self.num_experts else {}
        return {"task": "causal_lm", "ignore_index": IGNORE_INDEX, **moe}


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
