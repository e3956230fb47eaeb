"""Providers: where user code plugs into the loop (d9d's names and roles, returning values, not mutating).

* ``ModelProvider`` builds the model skeleton on the meta device; the loop materializes it.
* ``DatasetProvider`` returns a dataset and its collator for this process's data-parallel rank.
* ``LRSchedulerProvider`` returns a learning-rate *multiplier* schedule (d9d's piecewise semantics).
* ``OptimizerProvider`` returns a ``d9dfn.optim`` transform, given that multiplier.
* Task providers return the ``TrainTask`` / ``InferenceTask``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from d9dfn._task import InferenceTask, TrainTask
from d9dfn._types import Params, PathPredicate, Schedule, Transform
from d9dfn.loop._init import default_initialize
from d9dfn.parallel import PlacementFn

__all__ = [
    "AutoLRSchedulerProvider",
    "AutoOptimizerProvider",
    "DatasetProvider",
    "InferenceTaskProvider",
    "InitializeDatasetContext",
    "InitializeDatasetResult",
    "InitializeLRSchedulerContext",
    "InitializeModelStageContext",
    "InitializeModelStageResult",
    "InitializeOptimizerStageContext",
    "LRSchedulerProvider",
    "ModelProvider",
    "OptimizerProvider",
    "PrepareExportModelStageResult",
    "TrainTaskProvider",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeModelStageContext:
    """Where the stage lives: its index among ``num_stages`` (1 without pipelining) and the mesh.

    With ``trainer.pipelining`` the loop calls the provider once per stage (``stage_index`` in
    ``range(num_stages)``, ``num_stages = pp × stages per rank``) and once with the defaults for the whole
    model's skeleton (meta only: export names). ``mesh`` is the job's ``DeviceMeshParameters``; ``device_mesh``
    the data-parallel ``DeviceMesh`` ``(dp_replicate, dp_shard)`` of this rank (its pipeline slice's) when there
    are several data-parallel ranks, else ``None``.
    """

    stage_index: int = 0
    num_stages: int = 1
    mesh: Any = None
    device_mesh: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeModelStageResult:
    """The stage's module, built on the meta device; ``reset_parameters()`` initializes it later."""

    model: nn.Module


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareExportModelStageResult:
    """How exported tensor names map from d9dfn's to the target format's (identity by default)."""

    state_mapper: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareLoadModelStageResult:
    """How ``model_stage_factory.source_checkpoint`` is read into the stage (the export side's mirror).

    Attributes:
        state_mapper: renames the files' tensors to the model's ``state_dict`` names (e.g. strips HF's
            ``model.`` prefix); identity by default.
        check_config: called with the directory's ``config.json`` (parsed) when it has one, before any tensor
            is loaded; raises ``ValueError`` naming the field when the checkpoint describes another model
            (names and shapes cannot catch a wrong ``rope_theta`` or norm epsilon). ``None``: no check.
        not_in_source: the model's tensors the checkpoint need not hold, by name: those it lacks keep the
            initialization (LoRA adapters on a pretrained base; d9d's mapper leaves them out too). ``None``: every
            tensor must be there.
    """

    state_mapper: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state
    check_config: Callable[[dict[str, Any]], None] | None = None
    not_in_source: Callable[[str], bool] | None = None


class ModelProvider(abc.ABC):
    """Builds the model. Only ``initialize_model_stage`` is required."""

    @abc.abstractmethod
    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        """Build the stage's module; the loop calls this under ``torch.device("meta")``.

        A stage of several (``context.num_stages > 1``) must name its tensors as the whole model does
        (``Qwen3LM(config, stage=PipelineStageInfo(i, n))``), and every module that owns tensors needs a
        ``reset_parameters``: the loop seeds each by its full name, so weights do not depend on the layout.
        """

    def initialize_weights(self, context: InitializeModelStageContext, model: nn.Module) -> None:
        """Initialize the materialized stage in place (it comes from ``to_empty``: its memory is garbage).

        The default is the model's own scheme (``d9dfn.loop.default_initialize``): ``init_weights()`` when
        the module has one (Hugging Face models, which also rebuild their rotary buffers there), else every
        submodule's ``reset_parameters()``. Afterwards the loop checks that every parameter and buffer was
        written and is finite, and names the ones that were not.
        """
        default_initialize(model)

    def parallelize_model_stage(self, context: InitializeModelStageContext, model: nn.Module) -> PlacementFn | None:
        """Choose the parameters' placements on ``context.device_mesh`` (called only on several data-parallel
        processes; with pipelining once per local stage, on the stage's data-parallel mesh).

        Return ``(name, tensor, mesh) -> placements`` (one ``Replicate()`` or ``Shard(dim)`` per mesh axis)
        to place some parameters yourself, or ``None`` (the default) for
        ``d9dfn.parallel.data_parallel_placements``: replicated over ``dp_replicate``, ``Shard(0)`` over
        ``dp_shard``. Unlike d9d's hook it returns a choice instead of wrapping the module in place.
        """
        return None

    def logical_dims(
        self, context: InitializeModelStageContext, model: nn.Module
    ) -> Mapping[str, Sequence[str]] | None:
        """The logical dimensions of ``model``'s params (name → one name per tensor dimension: ``d9dfn.models.
        logical_dims`` of a family's plan), which the parallel plan's rules read (called only on several
        data-parallel processes, with the model on the meta device); ``None`` (the default): none named, every param
        computed whole. Expert parallelism (``mesh.expert_parallel``) splits the dimension named ``experts``
        (``d9dfn.parallel.EXPERT_PARALLEL_RULES``), tensor parallelism (``mesh.tensor_parallel``) ``heads``,
        ``kv_heads`` and ``mlp`` (``d9dfn.parallel.TENSOR_PARALLEL_RULES``)."""
        return None

    def summed_dims(self, context: InitializeModelStageContext, model: nn.Module) -> Mapping[str, Sequence[str]] | None:
        """The logical dimensions each param is applied across without having them (``d9dfn.models.summed_dims`` of a
        family's ``sums_over``: a per-head norm over ``heads``): where the rules split one, the param's gradient is
        partial over that axis. ``None`` (the default): none."""
        return None

    def parameters_to_train(self, context: InitializeModelStageContext) -> PathPredicate | None:
        """Which parameters train: ``(name, tensor) -> bool`` (e.g. only the LoRA adapters of a frozen base), or
        ``None`` (the default): every parameter with ``requires_grad``.

        The loop passes it to ``init_train_state(trainable=...)`` and builds the optimizer over the parameters it
        keeps (d9d's ``PeftInjectionResult.parameters_to_train``, as a predicate). The others are frozen: they stay
        params, stored and sharded as the plan places them (``parallelize_model_stage``), checkpointed and exported
        with the rest, with no gradient and no optimizer state. A parameter without ``requires_grad`` is frozen
        whatever this says.
        """
        return None

    def prepare_export_model_stage(self, context: InitializeModelStageContext) -> PrepareExportModelStageResult:
        """The name mapping ``Trainer.export`` applies before writing safetensors."""
        return PrepareExportModelStageResult()

    def prepare_load_model_stage(self, context: InitializeModelStageContext) -> PrepareLoadModelStageResult:
        """The name mapping and config check applied to ``model_stage_factory.source_checkpoint``."""
        return PrepareLoadModelStageResult()

    def register_events(self, bus: Any) -> None:  # noqa: B027
        """Subscribe handlers on the loop's event bus (called before the task's ``register_events``)."""

    def memory_hint(self, model: nn.Module | None) -> str:
        """What to change when ``model`` (the whole model, on meta; ``None`` when the check ran on ``num_params``,
        before any module was built) does not fit in memory: the end of the error.

        The configurators check, before allocating, that the weights, gradients and optimizer state fit in the
        device's memory (``d9dfn.loop.check_memory``); name your settings here (e.g. ``lower
        model.intermediate_size``). The default names the largest parameter.
        """
        if model is None:
            return "make the model smaller"
        name, param = max(model.named_parameters(), key=lambda item: item[1].numel())
        return f"make the model smaller (its largest parameter: {name}, {' x '.join(map(str, param.shape))})"

    def num_params(self) -> int | None:
        """The whole model's parameters (elements), from its config's arithmetic, or ``None`` (the default): not
        known before the skeleton is built. Every one is counted as trainable (a gradient and optimizer state each),
        so a provider whose ``parameters_to_train`` freezes some returns ``None`` rather than refuse a run that fits.

        With a number, the configurators check that the weights, gradients and optimizer state fit in memory first
        of all, before the run directory is locked and before any module is built (a model of 100,000 layers takes
        minutes to build even on the meta device); ``memory_hint`` then gets ``None`` for the model. The check on
        the skeleton follows as before.
        """
        return None

    def dump_hparams(self) -> dict[str, Any]:
        """Scalars that describe the model, logged once per run."""
        return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeDatasetContext:
    """What a dataset provider needs to know: the split, the batch sizes, and this process's DP rank."""

    split: str = "train"
    per_rank_batch_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeDatasetResult:
    """A map-style dataset (``__len__``, ``__getitem__``) and the collator that stacks its items."""

    dataset: Any
    collator: Callable[[Sequence[Any]], Any]
    shuffle: bool = True
    """Whether the loop shuffles the training items each epoch; ``False`` for a dataset that orders its items itself
    (``d9dfn.data.BufferSortedDataset``'s batches of similar lengths, which a shuffle would mix again)."""


@runtime_checkable
class DatasetProvider(Protocol):
    """``(InitializeDatasetContext) -> InitializeDatasetResult``: the whole split, not sharded.

    Unlike d9d, the loop itself gives each data-parallel rank its rows of every global batch, so the
    data order is that of one process and a run resumes on any number of ranks; ``dp_rank`` and
    ``dp_size`` in the context are for information (do not shard by them).
    """

    def __call__(self, context: InitializeDatasetContext, /) -> InitializeDatasetResult: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeLRSchedulerContext:
    """The run's length in optimizer steps (never microbatch batches, which d9d's ``Stepper(total_steps=len(
    data_loader_train))`` in ``d9d/loop/run/train.py`` counts when gradients accumulate)."""

    total_steps: int


@runtime_checkable
class LRSchedulerProvider(Protocol):
    """``(InitializeLRSchedulerContext) -> Schedule``: a multiplier of the optimizer's base learning rate."""

    def __call__(self, context: InitializeLRSchedulerContext, /) -> Schedule: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitializeOptimizerStageContext:
    """The trainable params (names, shapes, dtypes) and the learning-rate multiplier schedule."""

    params: Params
    lr_multiplier: Schedule


@runtime_checkable
class OptimizerProvider(Protocol):
    """``(InitializeOptimizerStageContext) -> Transform``."""

    def __call__(self, context: InitializeOptimizerStageContext, /) -> Transform: ...


@runtime_checkable
class TrainTaskProvider(Protocol):
    """``() -> TrainTask``; a lambda or the class itself will do."""

    def __call__(self) -> TrainTask: ...


@runtime_checkable
class InferenceTaskProvider(Protocol):
    """``() -> InferenceTask``."""

    def __call__(self) -> InferenceTask: ...


class AutoLRSchedulerProvider:
    """Builds the schedule from an ``AutoLRSchedulerConfig`` (``None``: a constant multiplier of 1)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __call__(self, context: InitializeLRSchedulerContext) -> Schedule:
        from d9dfn.config import build_lr_schedule

        if self.config is None:
            return lambda step: torch.ones((), dtype=torch.float32, device=step.device)
        return build_lr_schedule(self.config, context.total_steps)


class AutoOptimizerProvider:
    """Builds the optimizer from an ``AutoOptimizerConfig``; its learning rate is ``config.lr × multiplier``.

    The optimizer's state records the rate each update used; the step reports it (``optim.learning_rate``).
    """

    def __init__(self, config: Any, *, seed: int = 0) -> None:
        self.config = config
        self.seed = seed

    def __call__(self, context: InitializeOptimizerStageContext) -> Transform:
        from d9dfn.config import build_optimizer

        base_lr = float(self.config.lr)
        multiplier = context.lr_multiplier
        return build_optimizer(self.config, lambda step: base_lr * multiplier(step), key=self.seed)
