"""Tasks as pure functions: d9d's ``TrainTask`` / ``InferenceTask`` with every input and output explicit.

A d9d task mutates a ``PipelineState`` and its own attributes; a d9dfn task receives them and returns new
ones. The method names and their order are d9d's:

``build_forward_inputs`` (once per step, whole local batch) → ``compute_loss`` (once per microbatch) →
``update_metrics`` (once per step, merged state) … ``finalize`` (once, at the end of the run).

Every method here runs inside the compiled step unless its docstring says otherwise, so it must be pure:
no I/O, no ``.item()``, no Python branching on tensor values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from d9dfn._pytree import field, pytree_dataclass
from d9dfn._types import PyTree

if TYPE_CHECKING:
    from d9dfn._pipeline_state import PipelineState
    from d9dfn.metrics import Metric

__all__ = [
    "BuildForwardInputsResult",
    "ComputeLossResult",
    "InferenceTask",
    "PipelineShardingSpec",
    "TrainTask",
]

TBatch = TypeVar("TBatch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineShardingSpec:
    """How ``inputs`` and ``kwargs`` split into microbatches; ``None`` means ``spec_on_dim(x, 0)``.

    Unlike d9d, a spec given here is the spec that is used (d9d's ``PipelineScheduleExecutor.configure_buffers``,
    ``d9d/pipelining/infra/schedule/component/runtime/executor.py``, keeps only the default specs).
    """

    input_data: PyTree = None
    input_kwargs: PyTree = None


@pytree_dataclass
class BuildForwardInputsResult:
    """What the model is called with: ``model(**inputs, **kwargs)``, split per microbatch.

    ``inputs`` go to the first pipeline stage only, ``kwargs`` to every stage (d9d's contract; without
    pipelining both simply become keyword arguments).
    """

    inputs: dict[str, Any]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    pipeline_sharding_spec: PipelineShardingSpec | None = field(static=True, default=None)


@pytree_dataclass
class ComputeLossResult:
    """One microbatch's loss and its weight in the step's weighted mean.

    The gradient of a step is ``∇(Σᵢ wᵢℓᵢ / Σᵢ wᵢ)`` and the logged loss is ``Σᵢ wᵢℓᵢ / Σᵢ wᵢ``: with
    ``ℓᵢ`` a per-token mean and ``wᵢ`` the token count, that is the token mean over the global batch.

    Attributes:
        loss: 0-d tensor.
        loss_weight: 0-d tensor, ``None`` for 1. Treated as data: no gradient flows through it.
        state: the microbatch's pipeline state after this call, ``None`` when unchanged.
        logs: extra 0-d values to report (loss components, Megatron's reduced dicts), averaged over the
            step's microbatches with the same weights as the loss.
    """

    loss: torch.Tensor
    loss_weight: torch.Tensor | None = None
    state: PipelineState | None = None
    logs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class _BaseTask(Generic[TBatch]):
    """What training and inference tasks share: inputs, state, metrics, hparams, finalize."""

    def build_forward_inputs(
        self, batch: TBatch, state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        """Map a collated batch to model inputs; write what later phases need into ``state``.

        Called once per step on the whole local batch (the global view of ``state``).
        """
        raise NotImplementedError(
            f"{type(self).__name__}.build_forward_inputs: every task must implement it; return "
            "(BuildForwardInputsResult(inputs={...}, kwargs={...}), state)"
        )

    def init_state(self) -> PyTree:
        """The task's own state at the start of a run (checkpointed with the train state)."""
        return {}

    def create_metrics(self) -> Metric | None:
        """The metric definition whose state the step carries (``d9dfn.metrics``); ``None`` for none."""
        return None

    def update_metrics(self, metric_state: PyTree, state: PipelineState) -> PyTree:
        """Fold one step's merged pipeline state into the metric state."""
        return metric_state

    def dump_hparams(self) -> dict[str, Any]:
        """Scalars that describe the task, logged once per run. Runs at the edge, not compiled."""
        return {}

    def finalize(self, task_state: PyTree) -> Any:
        """The run's result from the final task state. Runs at the edge, not compiled."""
        return None

    def register_events(self, bus: Any) -> None:
        """Subscribe handlers on the loop's event bus. Runs at the edge, at configure time."""


class TrainTask(_BaseTask[TBatch]):
    """A training task: d9d's ``TrainTask`` as pure functions.

    Subclasses implement ``build_forward_inputs`` and ``compute_loss``; everything else has a default.

    Example (a next-token loss over a model returning ``{"logits": (B, T, V)}``):

    >>> import torch.nn.functional as F
    >>> class NextToken(TrainTask):
    ...     def build_forward_inputs(self, batch, state):
    ...         state = state.set("labels", batch["labels"])
    ...         return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state
    ...
    ...     def compute_loss(self, outputs, state, step):
    ...         labels = state["labels"]
    ...         logits = outputs["logits"].flatten(0, 1)
    ...         num_tokens = (labels != -100).sum()
    ...         loss = F.cross_entropy(logits, labels.flatten(), reduction="sum") / num_tokens.clamp(min=1)
    ...         return ComputeLossResult(loss=loss, loss_weight=num_tokens.float())
    """

    def compute_loss(
        self, outputs: Mapping[str, torch.Tensor], state: PipelineState, step: torch.Tensor
    ) -> ComputeLossResult:
        """One microbatch's loss from the model's outputs and that microbatch's view of ``state``.

        ``step`` is the 0-d optimizer-step tensor (a Python int would recompile the step every step).
        """
        raise NotImplementedError(
            f"{type(self).__name__}.compute_loss: a TrainTask must implement it; return ComputeLossResult(loss=...)"
        )


class InferenceTask(_BaseTask[TBatch]):
    """An inference task: forward only; outputs fold into the task state, one microbatch at a time.

    Unlike d9d's (``InferenceTask`` in ``d9d/loop/control/task.py`` has no ``create_metrics``), an inference task
    may have metrics.
    """

    def process_outputs(self, task_state: PyTree, outputs: Mapping[str, torch.Tensor], state: PipelineState) -> PyTree:
        """Fold one microbatch's model outputs into the task state; return the new task state."""
        raise NotImplementedError(
            f"{type(self).__name__}.process_outputs: an InferenceTask must implement it; return the new task state"
        )
