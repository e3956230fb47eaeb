"""timm-style ``TrainingTask`` modules as d9dfn tasks: ``forward(input, target) -> {"loss", "output", ...}``.

A timm training task is an ``nn.Module`` that holds the model, the criterion and anything else the loss
needs (a frozen distillation teacher), and whose ``forward(input, target)`` returns a dict: ``loss``
(required), ``output`` (the logits, recommended) and loss components (``task_loss``, ``kd_loss``, …).
That dict is already d9dfn's model contract, so the module *is* the d9dfn model and :class:`TimmTask` is a
thin ``TrainTask`` around it; no timm package is needed.

=============================================  =========================================================
timm                                           d9dfn
=============================================  =========================================================
the task module                                the model given to ``make_train_step`` / the loop, called
                                               as ``module(input=..., target=...)`` per microbatch
``result["loss"]``                             ``ComputeLossResult.loss``, weighted by the microbatch's
                                               batch size: microbatching gives the batch mean
other 0-d entries (``task_loss``, ``kd_loss``)  ``StepOutput.logs``, averaged like the loss
``result["output"]``                           accuracy metrics (``TimmTask(top_k=(1, 5))``)
frozen teacher (``requires_grad=False``)       frozen params of the state (``TrainState.frozen``): no
                                               gradient, no optimizer state, never updated
``prepare_distributed``, ``.to(device)``       kept for code that calls them; see :class:`TrainingTask`
=============================================  =========================================================

The module runs inside the compiled, differentiated step: ``torch.no_grad()`` blocks (around the
teacher) are fine, in-place updates of *parameters* are not, and BatchNorm statistics come back as new
buffers as with any d9dfn model. Entries that are neither 0-d nor ``output`` are ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from d9dfn import metrics
from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import tree_leaves
from d9dfn._task import BuildForwardInputsResult, ComputeLossResult, TrainTask
from d9dfn._types import Batch, PyTree

__all__ = ["TimmTask", "TrainingTask", "check_task_module"]

_DISTRIBUTED_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


class TrainingTask(nn.Module):
    """A base for timm-style task modules under d9dfn: timm's constructor, ``to`` and ``prepare_distributed``.

    Derive from it instead of timm's ``TrainingTask`` (same arguments, same attributes). Under d9dfn:

    * ``prepare_distributed(device_ids, **ddp_kwargs)`` returns ``self`` and wraps nothing: data
      parallelism is the step's gradient reduction over the mesh, not a ``DistributedDataParallel``
      wrapper (whose ``module.`` prefix and hooks a functional step cannot use).
    * ``.to(device, dtype)`` behaves as ``nn.Module.to`` and keeps ``self.device`` / ``self.dtype`` in
      sync. It moves the module you hold; what trains is the state the loop (or ``init_train_state``)
      copies from it, placed on the loop's device.

    >>> task = TrainingTask().to(torch.float64)
    >>> task.dtype, task.prepare_distributed(device_ids=[0]) is task
    (torch.float64, True)
    """

    def __init__(
        self, device: torch.device | None = None, dtype: torch.dtype | None = None, verbose: bool = True
    ) -> None:
        super().__init__()
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = torch.get_default_dtype() if dtype is None else dtype
        self.verbose = verbose

    def to(self, *args: Any, **kwargs: Any) -> TrainingTask:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            self.device = device
        if dtype is not None:
            self.dtype = dtype
        return super().to(*args, **kwargs)

    def prepare_distributed(self, device_ids: list[int] | None = None, **ddp_kwargs: Any) -> TrainingTask:
        """A no-op under d9dfn (placement and data parallelism belong to the mesh); returns ``self``."""
        return self

    def forward(self, input: Any, target: Any) -> dict[str, torch.Tensor]:
        """``{"loss": 0-d, "output": logits, ...}`` for one batch."""
        raise NotImplementedError(
            f"{type(self).__name__}.forward: a training task implements forward(input, target) and returns a dict "
            "with at least 'loss'"
        )


def check_task_module(module: nn.Module, *, input_name: str = "input", target_name: str = "target") -> nn.Module:
    """Check, at the edge, that ``module`` can run as a d9dfn model; return it unchanged.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``; a submodule is wrapped in ``DistributedDataParallel``
            or ``DataParallel`` (timm's ``prepare_distributed`` was called: derive from
            :class:`TrainingTask` or skip the call); or ``forward`` does not take ``input`` and ``target``.

    >>> class Task(TrainingTask):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model = nn.Linear(2, 3)
    ...
    ...     def forward(self, input, target):
    ...         output = self.model(input)
    ...         return {"loss": nn.functional.cross_entropy(output, target), "output": output}
    >>> check_task_module(Task().prepare_distributed(device_ids=[0])).model
    Linear(in_features=2, out_features=3, bias=True)
    """
    fn = "check_task_module"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{fn}: expected an nn.Module task, got {type(module).__name__}")
    for name, sub in module.named_modules():
        if isinstance(sub, _DISTRIBUTED_WRAPPERS):
            raise TypeError(
                f"{fn}: submodule {name or '<root>'!r} is a {type(sub).__name__}; under d9dfn data parallelism is the "
                "step's business, not a wrapper's: do not call timm's prepare_distributed (derive the task from "
                "d9dfn.compat.timm.TrainingTask, whose prepare_distributed is a no-op), or pass the unwrapped module"
            )
    params = inspect.signature(module.forward).parameters
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    missing = [
        name
        for name in (input_name, target_name)
        if not takes_kwargs and (name not in params or params[name].kind == inspect.Parameter.POSITIONAL_ONLY)
    ]
    if missing:
        raise TypeError(
            f"{fn}: {type(module).__name__}.forward{inspect.signature(module.forward)} cannot take {missing} by "
            f"keyword; d9dfn calls module({input_name}=..., {target_name}=...): rename the parameters or pass "
            "TimmTask(input_name=..., target_name=...)"
        )
    return module


def _leading_size(fn: str, tree: PyTree) -> int:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return leaf.shape[0]
    raise ValueError(f"{fn}: the target holds no tensor with a batch dimension; cannot weight the microbatch")


class TimmTask(TrainTask):
    """The d9dfn ``TrainTask`` for a timm-style task module (the module is the model).

    Args:
        top_k: accuracy metrics to keep from ``output`` and integer targets, e.g. ``(1, 5)`` gives
            ``top1`` and ``top5``; empty for none (soft, mixup-style targets have no accuracy).
        input_name: the keyword the module's ``forward`` takes the input under.
        target_name: the keyword it takes the target under.

    Batches are ``(input, target)`` pairs or mappings with those two keys.

    >>> import d9dfn
    >>> class Task(TrainingTask):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model = nn.Linear(4, 3)
    ...
    ...     def forward(self, input, target):
    ...         output = self.model(input)
    ...         loss = nn.functional.cross_entropy(output, target)
    ...         return {"loss": loss, "output": output, "task_loss": loss}
    >>> module, opt = Task(), d9dfn.optim.sgd(0.1)
    >>> task = TimmTask(top_k=(1,))
    >>> step = d9dfn.make_train_step(module, task, opt, num_microbatches=2, compile=False)
    >>> batch = (torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    >>> state, out = step(d9dfn.init_train_state(module, opt, task=task), batch)
    >>> sorted(out.logs), int(state.metric_state["top1"].total)
    (['task_loss'], 4)
    """

    def __init__(self, *, top_k: Sequence[int] = (), input_name: str = "input", target_name: str = "target") -> None:
        self.top_k = tuple(top_k)
        self.input_name = input_name
        self.target_name = target_name
        self._metrics = metrics.compose({f"top{k}": metrics.accuracy(top_k=k) for k in self.top_k}) if top_k else None

    def build_forward_inputs(
        self, batch: Batch, state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        if isinstance(batch, Mapping) and self.input_name in batch and self.target_name in batch:
            input, target = batch[self.input_name], batch[self.target_name]
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            input, target = batch
        else:
            raise TypeError(
                f"TimmTask.build_forward_inputs: got a batch of type {type(batch).__name__}"
                f"{f' with keys {list(batch)}' if isinstance(batch, Mapping) else ''}; pass (input, target) or "
                f"{{{self.input_name!r}: ..., {self.target_name!r}: ...}}"
            )
        inputs = {self.input_name: input, self.target_name: target}
        return BuildForwardInputsResult(inputs=inputs), state.set("target", target)

    def compute_loss(self, outputs: Mapping[str, Any], state: PipelineState, step: torch.Tensor) -> ComputeLossResult:
        fn = "TimmTask.compute_loss"
        if "loss" not in outputs:
            raise ValueError(
                f"{fn}: the task module returned keys {list(outputs)} without 'loss'; its forward must return "
                "{'loss': 0-d tensor, 'output': logits, ...}"
            )
        loss = outputs["loss"]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"{fn}: outputs['loss'] is {shape}; return the batch's mean loss as a 0-d tensor")
        loss = loss.reshape(())
        # The microbatch's batch size: Σ wℓ / Σ w is then the mean over the whole batch.
        weight = torch.full((), _leading_size(fn, state["target"]), dtype=torch.float32, device=loss.device)
        logs = {
            name: value
            for name, value in outputs.items()
            if name not in ("loss", "output") and isinstance(value, torch.Tensor) and value.ndim == 0
        }
        if self._metrics is not None:
            if "output" not in outputs:
                raise ValueError(
                    f"{fn}: TimmTask(top_k={self.top_k}) needs the module's 'output' (logits), but it returned keys "
                    f"{list(outputs)}; return 'output' or pass top_k=()"
                )
            state = state.set("output", outputs["output"])
        return ComputeLossResult(loss=loss, loss_weight=weight, state=state, logs=logs)

    def create_metrics(self) -> metrics.Metric | None:
        """Top-k accuracies from ``output``, when ``top_k`` asks for them."""
        return self._metrics

    def update_metrics(self, metric_state: PyTree, state: PipelineState) -> PyTree:
        if self._metrics is None:
            return metric_state
        output, target = state["output"], state["target"]
        return self._metrics.update(metric_state, {f"top{k}": (output, target) for k in self.top_k})

    def dump_hparams(self) -> dict[str, Any]:
        return {"task": "timm", "top_k": list(self.top_k)}
