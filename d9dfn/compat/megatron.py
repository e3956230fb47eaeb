"""Megatron Bridge forward steps as d9dfn tasks: the user's ``forward_step`` runs unchanged in the pure step.

Megatron Bridge trains with ``forward_step(state, data_iterator, model) -> (output_tensor, loss_func)``
(any of its four signatures, or a functor). d9dfn runs such a function inside its compiled, pure
``step(train_state, batch)``; no Megatron package is needed. The pieces:

* :class:`MegatronModel` wraps the user's module. It has the module's parameter names (no ``module.``
  prefix) and is what d9dfn's step calls through ``functional_call`` and differentiates. Its ``forward``
  computes nothing: it returns ``{"model": fn}``, where ``fn`` runs the user's module on the tensors the
  step handed in — the current, traced params and buffers.
* :class:`MegatronTask` is the ``TrainTask``. ``build_forward_inputs`` puts the raw batch into the
  pipeline state (so the step splits it per microbatch) and gives the model no inputs. ``compute_loss``
  then calls the user's ``forward_step`` with a :class:`GlobalState`, a one-item iterator over the
  microbatch and ``fn`` as ``model``, applies the returned ``loss_func`` to the output, and translates its
  return value (below).

The forward step runs in ``compute_loss`` rather than in the model's ``forward`` because only
``compute_loss`` sees the 0-d step tensor that :class:`GlobalState` carries, and because ``loss_func`` is a
closure made per call: it must be applied where it is made.

``loss_func(output_tensor)`` may return

=========================================  ==============================================================
Megatron Bridge                            d9dfn
=========================================  ==============================================================
``(loss, reduced)``                        ``ComputeLossResult(loss, loss_weight=1, logs=reduced)``: the
                                           step's loss is the mean of the microbatch losses (Megatron
                                           divides each by the number of microbatches)
``(loss_sum, num_tokens, reduced)``        ``loss = loss_sum / num_tokens``, ``loss_weight = num_tokens``:
                                           the step's gradient is ``∇ Σ loss_sum / Σ num_tokens``, the
                                           global token-weighted mean (``calculate_per_token_loss=True``)
anything else (inference data)             an error in :class:`MegatronTask`; fold it with
                                           :class:`MegatronInferenceTask` (forward only)
=========================================  ==============================================================

Values of ``reduced`` become ``StepOutput.logs`` under their own names: a 0-d or one-element tensor as
it is, a two-element ``[sum, count]`` tensor (Megatron's reporting pair) as ``sum / count``. The step
averages logs over microbatches with the loss weights, so a pair that counts the same tokens as
``num_tokens`` logs exactly ``Σ sum / Σ count``.

What differs from Megatron Bridge, because the step is one pure compiled function:

* The forward step is *traced*: under ``torch.compile`` its Python runs once per compilation, not once
  per microbatch. Python state it keeps (a functor's ``self.step_count += 1``) does not advance per step;
  read ``state.step`` (a 0-d tensor) instead, and never branch in Python on tensor values.
* ``state.timers(name).start()/stop()`` are no-ops (timing inside a compiled graph is the profiler's
  job: ``TrainerConfig.profiling``); :attr:`Timers.names` lists the timers eager calls asked for.
* ``return_schedule_plan`` is always ``False``: d9dfn's step has no combined 1F1B overlap schedule.
* The iterator holds the microbatch already on the step's device: drop ``.cuda()`` calls, placement is
  the loop's business.
* Single process for now: the data-parallel reduction of ``Σ loss_sum`` and ``Σ num_tokens`` comes with
  d9dfn's distributed step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call

from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import tree_map
from d9dfn._task import BuildForwardInputsResult, ComputeLossResult, InferenceTask, TrainTask
from d9dfn._types import Batch, PyTree
from d9dfn.compat._megatron_api import (
    ForwardStepSignature,
    GlobalState,
    Timer,
    Timers,
    TrainStateView,
    call_forward_step,
    inspect_forward_step,
    loss_func_result,
)

if TYPE_CHECKING:
    from d9dfn.config import TrainerConfig
    from d9dfn.loop import TrainResult

__all__ = [
    "BATCH_KEY",
    "ForwardStepSignature",
    "GlobalState",
    "MegatronInferenceTask",
    "MegatronModel",
    "MegatronTask",
    "Timer",
    "Timers",
    "TrainStateView",
    "inspect_forward_step",
    "loss_func_result",
    "pretrain",
]

BATCH_KEY = "batch"
"""The pipeline-state key under which :class:`MegatronTask` carries the raw batch to ``compute_loss``."""

# --- the model ---------------------------------------------------------------------------------------------


class _BoundModel:
    """``model(...)`` for the forward step: the user's module run on the step's current tensors."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], extra_kwargs: dict[str, Any]) -> None:
        self._module = module
        self._tensors = tensors
        self._extra_kwargs = extra_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return functional_call(self._module, self._tensors, args, {**kwargs, **self._extra_kwargs}, strict=True)

    def __getattr__(self, name: str) -> Any:
        # model.config and other plain attributes read by forward steps come from the user's module.
        module = self.__dict__.get("_module")
        if module is None:
            raise AttributeError(name)
        return getattr(module, name)


class MegatronModel(nn.Module):
    """The user's module, seen by d9dfn's step under its own parameter names; ``forward`` returns ``{"model"}``.

    The wrapper shares the module's parameter, buffer and submodule tables, so ``named_parameters()``,
    ``state_dict()``, ``to_empty()`` and ``functional_call`` see exactly the module's names and tensors.
    ``forward(**kwargs)`` returns ``{"model": fn}``: ``fn(*args, **kw)`` runs the module on the tensors the
    step's ``functional_call`` handed this wrapper (so gradients reach the params), adding ``kwargs`` (e.g. a
    dropout key from ``make_train_step(rng_kwarg=...)``) to every call.

    >>> wrapped = MegatronModel(nn.Linear(2, 1))
    >>> sorted(name for name, _ in wrapped.named_parameters())
    ['bias', 'weight']
    """

    forwards_kwargs = True
    """``forward(**kwargs)`` hands every keyword (the step's ``rng_kwarg`` key included) to the forward step."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"MegatronModel: expected an nn.Module, got {type(module).__name__}")
        super().__init__()
        # Share the tables instead of registering ``module`` as a child: no "module." prefix, and whatever
        # the loop does to the wrapper (to_empty, functional_call's swaps) happens to the module too.
        self.__dict__["_wrapped"] = module
        self.__dict__["_parameters"] = module._parameters
        self.__dict__["_buffers"] = module._buffers
        self.__dict__["_non_persistent_buffers_set"] = module._non_persistent_buffers_set
        self.__dict__["_modules"] = module._modules

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self.__dict__["_wrapped"]

    def reset_parameters(self) -> None:
        """The module's own top-level ``reset_parameters``, if it has one (its submodules reset themselves)."""
        reset = getattr(self.module, "reset_parameters", None)
        if callable(reset):
            reset()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_wrapped")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def forward(self, **kwargs: Any) -> dict[str, Any]:
        tensors: dict[str, torch.Tensor] = dict(self.named_parameters(remove_duplicate=False))
        tensors.update(self.named_buffers(remove_duplicate=False))
        return {"model": _BoundModel(self.module, tensors, kwargs)}


def _bound_model(fn: str, outputs: Mapping[str, Any]) -> Callable[..., Any]:
    model = outputs.get("model") if isinstance(outputs, Mapping) else None
    if not isinstance(model, _BoundModel):
        found = list(outputs) if isinstance(outputs, Mapping) else type(outputs).__name__
        raise TypeError(
            f"{fn}: the model's outputs have no bound model (got {found}); "
            "build the step with MegatronModel(your_module), e.g. make_train_step(MegatronModel(gpt), task, opt)"
        )
    return model


# --- the tasks ---------------------------------------------------------------------------------------------


class MegatronTask(TrainTask):
    """A Megatron Bridge forward step as a d9dfn ``TrainTask`` (use it with :class:`MegatronModel`).

    Args:
        forward_step: a function or functor with one of the signatures of :func:`inspect_forward_step`.
        config: what ``state.cfg`` shows the forward step.
        batch_spec: how the batch splits into microbatches (a ``PipelineState`` spec); ``None`` splits every
            tensor on dim 0, so a shared ``(1, 1, T, T)`` attention mask needs e.g.
            ``{"tokens": SpecShard(0), "attention_mask": SpecReplicate(), ...}``.

    Raises:
        TypeError: the forward step's signature is not one Megatron Bridge accepts.

    >>> import torch.nn.functional as F
    >>> from functools import partial
    >>> def loss_func(labels, logits):
    ...     loss = F.cross_entropy(logits, labels)
    ...     return loss, {"lm loss": loss.detach()}
    >>> def forward_step(data_iterator, model):
    ...     batch = next(data_iterator)
    ...     return model(batch["x"]), partial(loss_func, batch["y"])
    >>> import d9dfn
    >>> model, opt = MegatronModel(nn.Linear(4, 3)), d9dfn.optim.sgd(0.1)
    >>> step = d9dfn.make_train_step(model, MegatronTask(forward_step), opt, num_microbatches=2, compile=False)
    >>> state, out = step(d9dfn.init_train_state(model, opt), {"x": torch.randn(4, 4), "y": torch.tensor([0, 1, 2, 0])})
    >>> sorted(out.logs)
    ['lm loss']
    """

    def __init__(self, forward_step: Callable[..., Any], *, config: Any = None, batch_spec: PyTree = None) -> None:
        self.forward_step = forward_step
        self.signature = inspect_forward_step(forward_step)
        self.config = config
        self.batch_spec = batch_spec
        self.timers = Timers()

    def build_forward_inputs(
        self, batch: Batch, state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        # The model takes no inputs: the forward step reads the microbatch from its iterator in compute_loss.
        return BuildForwardInputsResult(inputs={}), state.set(BATCH_KEY, batch, spec=self.batch_spec)

    def compute_loss(self, outputs: Mapping[str, Any], state: PipelineState, step: torch.Tensor) -> ComputeLossResult:
        fn = "MegatronTask.compute_loss"
        model = _bound_model(fn, outputs)
        global_state = GlobalState(cfg=self.config, timers=self.timers, train_state=TrainStateView(step), step=step)
        output, loss_func = call_forward_step(
            fn, self.forward_step, self.signature, global_state, state[BATCH_KEY], model
        )
        return loss_func_result(loss_func(output), fn=fn)

    def dump_hparams(self) -> dict[str, Any]:
        return {
            "forward_step": getattr(self.forward_step, "__qualname__", type(self.forward_step).__qualname__),
            **self.signature._asdict(),
        }


def _sum_fold(task_state: PyTree, data: PyTree) -> PyTree:
    data = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, data)
    if isinstance(task_state, dict) and not task_state:
        return data
    return tree_map(torch.add, task_state, data)


class MegatronInferenceTask(InferenceTask):
    """Forward-only use of a forward step whose ``loss_func`` returns inference data (any pytree).

    Each microbatch's data is folded into the task state with ``fold(task_state, data)``; the default
    adds tensor leaves, starting from ``init_state`` (``{}`` means "the first microbatch's data": give a
    tree of zeros instead to avoid the one recompilation the changing structure causes). ``state.step``
    is ``None`` here: an inference task does not see the step. ``finalize`` returns the final task state.

    >>> import d9dfn
    >>> def forward_step(data_iterator, model):
    ...     batch = next(data_iterator)
    ...     return model(batch["x"]), lambda logits: {"count": (logits.argmax(-1) == batch["y"]).sum()}
    >>> model = MegatronModel(nn.Linear(4, 3))
    >>> task = MegatronInferenceTask(forward_step, init_state={"count": torch.zeros((), dtype=torch.int64)})
    >>> params, buffers = d9dfn.split_module_state(model)
    >>> start = d9dfn.InferenceState(
    ...     params=params, buffers=buffers, step=torch.zeros((), dtype=torch.int64), rng=d9dfn.prng.key(0),
    ...     task_state=task.init_state(),
    ... )
    >>> infer = d9dfn.make_inference_step(model, task, num_microbatches=2, compile=False)
    >>> batch = {"x": torch.randn(4, 4), "y": torch.tensor([0, 1, 2, 0])}
    >>> int(infer(start, batch).task_state["count"]) in range(5)
    True
    """

    def __init__(
        self,
        forward_step: Callable[..., Any],
        *,
        config: Any = None,
        batch_spec: PyTree = None,
        init_state: PyTree = None,
        fold: Callable[[PyTree, PyTree], PyTree] | None = None,
    ) -> None:
        self.forward_step = forward_step
        self.signature = inspect_forward_step(forward_step)
        self.config = config
        self.batch_spec = batch_spec
        self.timers = Timers()
        self._init_state = init_state
        self.fold = fold or _sum_fold

    def init_state(self) -> PyTree:
        return {} if self._init_state is None else self._init_state

    def build_forward_inputs(
        self, batch: Batch, state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return BuildForwardInputsResult(inputs={}), state.set(BATCH_KEY, batch, spec=self.batch_spec)

    def process_outputs(self, task_state: PyTree, outputs: Mapping[str, Any], state: PipelineState) -> PyTree:
        fn = "MegatronInferenceTask.process_outputs"
        model = _bound_model(fn, outputs)
        global_state = GlobalState(cfg=self.config, timers=self.timers, train_state=TrainStateView(None), step=None)
        output, loss_func = call_forward_step(
            fn, self.forward_step, self.signature, global_state, state[BATCH_KEY], model
        )
        return self.fold(task_state, loss_func(output))

    def finalize(self, task_state: PyTree) -> PyTree:
        return task_state


# --- pretrain ----------------------------------------------------------------------------------------------


def _model_provider(model: Any) -> Any:
    from d9dfn.loop import InitializeModelStageResult, ModelProvider

    class _MegatronModelProvider(ModelProvider):
        def initialize_model_stage(self, context: Any) -> InitializeModelStageResult:
            inner = model.initialize_model_stage(context).model if isinstance(model, ModelProvider) else model()
            if not isinstance(inner, nn.Module):
                raise TypeError(f"pretrain: model() returned {type(inner).__name__}; it must build an nn.Module")
            return InitializeModelStageResult(model=MegatronModel(inner))

        def dump_hparams(self) -> dict[str, Any]:
            return model.dump_hparams() if isinstance(model, ModelProvider) else {}

    if not (isinstance(model, ModelProvider) or callable(model)) or isinstance(model, nn.Module):
        raise TypeError(
            f"pretrain: model is a {type(model).__name__}; pass a function that builds the module (the loop calls "
            "it on the meta device, then initializes the weights with reset_parameters) or a d9dfn ModelProvider"
        )
    return _MegatronModelProvider()


def _data_provider(dataset: Any, collate_fn: Callable[[Sequence[Any]], Any] | None) -> Any:
    from torch.utils.data import default_collate

    from d9dfn.loop import InitializeDatasetResult

    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        # torch types default_collate's argument as a list; it reads any sequence of items.
        collator: Callable[[Sequence[Any]], Any] = collate_fn or default_collate  # type: ignore[assignment]
        return lambda context: InitializeDatasetResult(dataset=dataset, collator=collator)
    if callable(dataset):
        return dataset
    raise TypeError(
        f"pretrain: dataset is a {type(dataset).__name__}; pass a map-style dataset (__len__ and __getitem__; the "
        "loop checkpoints its position) or a d9dfn DatasetProvider"
    )


def pretrain(
    config: TrainerConfig,
    forward_step: Callable[..., Any],
    *,
    model: Any,
    dataset: Any,
    collate_fn: Callable[[Sequence[Any]], Any] | None = None,
    megatron_config: Any = None,
    batch_spec: PyTree = None,
    optimizer_provider: Any = None,
    lr_scheduler_provider: Any = None,
    device: torch.device | str | None = None,
) -> TrainResult:
    """Build and run a d9dfn training job from a Megatron Bridge forward step: Megatron's ``pretrain``.

    The job is d9dfn's loop (``TrainingConfigurator(...).configure().train()``): compiled step (unless
    ``config.compile`` is off), checkpoints and exact resume, events, ``metrics.jsonl`` with the reduced
    dicts' values beside the loss.

    Args:
        config: the d9dfn ``TrainerConfig`` (batching, optimizer, schedule, checkpoints, total steps).
        forward_step: the Megatron forward step (any signature of :func:`inspect_forward_step`).
        model: a zero-argument function that builds the module (Megatron's ``model_provider``; called on
            the meta device, then materialized and initialized with ``reset_parameters``), or a d9dfn
            ``ModelProvider``.
        dataset: a map-style dataset whose items ``collate_fn`` stacks into the batch the forward step reads
            (default: ``torch.utils.data.default_collate``), or a d9dfn ``DatasetProvider``.
        collate_fn: how items become a batch.
        megatron_config: what ``state.cfg`` shows the forward step (default: ``config``).
        batch_spec: how a batch splits into microbatches (see :class:`MegatronTask`).
        optimizer_provider: a d9dfn ``OptimizerProvider`` (default: from ``config.optimizer``).
        lr_scheduler_provider: a d9dfn ``LRSchedulerProvider`` (default: from ``config.lr_scheduler``).
        device: where the weights live (Megatron's ``.cuda()``); ``None``: ``config.run.device`` (``"auto"``:
            CUDA when available, else the CPU).

    Returns:
        The loop's ``TrainResult`` (final state, run directory, steps run).

    Raises:
        TypeError: a wrong kind of ``config``, ``model``, ``dataset`` or forward step.
    """
    from d9dfn.config import DeviceMeshParameters, TrainerConfig
    from d9dfn.loop import TrainingConfigurator

    if not isinstance(config, TrainerConfig):
        raise TypeError(
            f"pretrain: config is a {type(config).__name__}; pass a d9dfn.loop.TrainerConfig (Megatron's own config "
            "can ride along as megatron_config=..., which the forward step sees as state.cfg)"
        )
    inspect_forward_step(forward_step)  # fail here, before any model is built
    cfg = config if megatron_config is None else megatron_config
    if device is not None:  # the config owns the device; this argument sets it there
        config = config.model_copy(update={"run": config.run.model_copy(update={"device": str(device)})})
    trainer = TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=config,
        task_provider=lambda: MegatronTask(forward_step, config=cfg, batch_spec=batch_spec),
        model_provider=_model_provider(model),
        data_provider=_data_provider(dataset, collate_fn),
        optimizer_provider=optimizer_provider,
        lr_scheduler_provider=lr_scheduler_provider,
    ).configure()
    return trainer.train()
