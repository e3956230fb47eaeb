"""The vocabulary of d9dfn: every alias and callable protocol that more than one module speaks.

Open this file first. Everything else imports these names rather than inventing its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, TypeAlias

import torch

__all__ = [
    "Batch",
    "Buffers",
    "DataParallel",
    "FusedUpdate",
    "FusedUpdateFn",
    "GradientReduction",
    "GradientTransformation",
    "Grads",
    "KeyPath",
    "OptState",
    "Params",
    "PathPredicate",
    "PipelineStageInfo",
    "PyTree",
    "Schedule",
    "StateUpdate",
    "Sums",
    "Transform",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
]

PyTree: TypeAlias = Any
"""Any nesting of dicts, lists, tuples, ``None`` and registered d9dfn dataclasses, with arbitrary leaves."""

KeyPath: TypeAlias = tuple[Any, ...]
"""A leaf's position in a tree: dict keys, sequence indices and attribute names, outermost first."""

Params: TypeAlias = dict[str, torch.Tensor]
"""Trainable parameters, flat, keyed by fully qualified module name (``"layers.0.mlp.up.weight"``)."""

Buffers: TypeAlias = dict[str, torch.Tensor]
"""Non-trainable module state (BatchNorm statistics, frozen weights), flat by fully qualified name."""

Grads: TypeAlias = Params
"""Gradients: the same keys and shapes as the params they belong to."""

Updates: TypeAlias = Params
"""What an optimizer transform returns: deltas that ``apply_updates`` adds to the params."""

OptState: TypeAlias = PyTree
"""An optimizer transform's state: a NamedTuple named after the transform (``AdamWState``)."""

Batch: TypeAlias = PyTree
"""One global (per-process) batch as the collator made it."""


class Sums(NamedTuple):
    """What a training step accumulates over its microbatches before the tail divides: every executor returns it.

    Attributes:
        grads: ``Σwᵢ∇ℓᵢ`` per trainable param (keyed as the params; gradients of the full, gathered params).
        loss: ``Σwᵢℓᵢ`` (0-d float32).
        weight: ``Σwᵢ`` (0-d float32).
    """

    grads: Grads
    loss: torch.Tensor
    weight: torch.Tensor


GradientReduction: TypeAlias = Callable[[Grads, torch.Tensor, torch.Tensor], tuple[Grads, torch.Tensor, torch.Tensor]]
"""``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ) -> (same)``: how the step combines its local sums across processes (data parallel)."""


class DataParallel(NamedTuple):
    """How a step takes part in data parallelism (``make_train_step(data_parallel=...)``).

    Attributes:
        reduce: sums the local ``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ)`` over the data-parallel group, inside the compiled step
            (``d9dfn.parallel.data_parallel_reduction(group)``), so the gradient is that of the global weighted
            mean; it must be traceable and must not mutate its inputs. Gradients of ``DTensor`` params reach it
            already reduced to their param's placement.
        rank: this process's index among the data-parallel ranks, which feed consecutive slices of the global
            batch: it numbers the microbatches' keys globally, so a data-parallel run draws the dropout masks one
            process draws on the whole batch.
    """

    reduce: GradientReduction
    rank: int = 0


class StateUpdate(NamedTuple):
    """A pure update of the model's state (its buffers: an MoE layer's balancing bias) that the train step applies
    after the optimizer, from statistics the model's forward returns. A model offers one by a method
    ``state_update() -> StateUpdate | None`` (``d9dfn.models.qwen3_moe.Qwen3MoeLM.state_update``); the forward itself
    only reads that state, so a block holding it compiles once and a recompute (activation checkpointing) counts
    nothing twice.

    Attributes:
        outputs: the names of the model outputs (tensors of one fixed shape) the update reads; the step sums each
            over its microbatches and its data-parallel ranks (the plan's token axes), so every rank computes the
            same new state.
        update: ``(buffers, sums) -> buffers``: every buffer (the changed ones new) from the step's buffers and the
            sums of ``outputs`` by name; pure and traceable, no host sync. Under pipeline ranks ``buffers`` holds
            this rank's stages' buffers only: the update leaves out the names it does not find.
        shapes: each output's shape (float32), which a pipeline rank without the last stage sums as zeros before
            the sums cross the pipeline (the outputs come from the last stage's forward): every stage's rank then
            updates its own buffers from the same sums. ``None``: the update cannot run under pipeline ranks.
    """

    outputs: tuple[str, ...]
    update: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    shapes: Mapping[str, tuple[int, ...]] | None = None


class PathPredicate(Protocol):
    """Selects leaves by position and value, e.g. which params get weight decay or stay frozen."""

    def __call__(self, path: str, leaf: torch.Tensor, /) -> bool: ...


class Schedule(Protocol):
    """A pure function of a 0-d step tensor (Python ints would recompile a compiled step every step)."""

    def __call__(self, step: torch.Tensor, /) -> torch.Tensor: ...


class TransformInitFn(Protocol):
    """Builds a transform's state from the params it will update."""

    def __call__(self, params: Params, /) -> OptState: ...


class TransformUpdateFn(Protocol):
    """Turns gradients into updates; pure: returns the new state instead of mutating the old."""

    def __call__(self, grads: Grads, state: OptState, params: Params | None = None, /) -> tuple[Updates, OptState]: ...


class FusedUpdateFn(Protocol):
    """``update`` then ``apply_updates`` in one of torch's fused kernels: the new params and state.

    ``grads`` are divided by ``grad_scale`` (a 0-d float32 tensor) before the update. Where ``found_inf`` (a 0-d
    float32 tensor, or ``None``) is nonzero, the params and the per-param state come back unchanged; the state's
    other leaves (``count``, ``lr``) come back as if updated, for the caller to keep. May overwrite ``grads`` (the
    kernels write the unscaled gradients back). With ``in_place=False`` it never mutates ``params`` or ``state`` (it
    updates copies); with ``in_place=True`` (a donating step) it updates their tensors in place and returns them.
    """

    def __call__(
        self,
        grads: Grads,
        state: OptState,
        params: Params,
        grad_scale: torch.Tensor,
        found_inf: torch.Tensor | None,
        /,
        *,
        in_place: bool = False,
    ) -> tuple[Params, OptState]: ...


@dataclasses.dataclass(frozen=True)
class FusedUpdate:
    """A transform's update as one fused kernel, run eagerly by the step in place of the compiled optimizer tail.

    Attributes:
        apply: the update (:class:`FusedUpdateFn`).
        auto: chosen by default (the factory's ``fused=None``) rather than asked for: the step then takes it for
            params on the CPU only, where it compiles nothing and measured as fast as the compiled tail
            (``docs/design/step.md``, "The fused optimizer tail"); on CUDA it is not measured yet.
    """

    apply: FusedUpdateFn
    auto: bool = False

    def wanted(self, device: torch.device) -> bool:
        """Whether the step runs this kernel for params on ``device``."""
        return not self.auto or device.type == "cpu"


class Transform(NamedTuple):
    """A gradient transformation: a pair of pure functions made by a factory (``adamw(lr=...)``).

    ``leafwise`` declares that ``update`` treats each element of each param on its own and never reads names:
    restricted to any subset of the params, or to a shard of a param (every state dict keyed by param names
    restricted alike, keys renamed), it gives that part of the full update, and the state's other tensors
    (``count``, ``lr``) come out the same for every part. Per-element maths without name masks is (``adamw``,
    ``sgd``); a global or per-leaf norm, a name predicate or a per-leaf random stream is not. Only then may the step
    update a repeated block's leaves through one compiled region, on a ``DTensor``'s local shard
    (``make_train_step(repeated_blocks=...)``); ``False`` is the default for a hand-made transform.
    """

    init: TransformInitFn
    update: TransformUpdateFn
    leafwise: bool = False
    fused: FusedUpdate | None = None
    """The same update as one of torch's fused kernels (``adamw(fused=...)``), or ``None``."""


GradientTransformation = Transform
"""optax's name for :class:`Transform`, for readers who come from JAX."""


@dataclasses.dataclass(frozen=True)
class PipelineStageInfo:
    """Which pipeline stage a model builds: d9d's ``PipelineStageInfo`` (``d9d.pipelining.api``), frozen.

    Models read it to build only their slice (``Qwen3LM(config, stage=...)``); ``d9dfn.pipeline`` re-exports it.

    >>> info = PipelineStageInfo(current_stage=0, num_stages=2)
    >>> info.is_current_stage_first, info.is_current_stage_last
    (True, False)

    Raises:
        ValueError: ``num_stages < 1`` or ``current_stage`` outside ``[0, num_stages)``.
    """

    current_stage: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("current_stage", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"PipelineStageInfo: {name}={value!r} must be an int")
        if self.num_stages < 1 or not 0 <= self.current_stage < self.num_stages:
            raise ValueError(
                f"PipelineStageInfo: current_stage={self.current_stage} with num_stages={self.num_stages}; "
                "pass num_stages >= 1 and 0 <= current_stage < num_stages"
            )

    @property
    def is_current_stage_first(self) -> bool:
        """The stage that takes the task's ``inputs`` (index 0)."""
        return self.current_stage == 0

    @property
    def is_current_stage_last(self) -> bool:
        """The stage whose outputs go to ``compute_loss`` (index ``num_stages - 1``)."""
        return self.current_stage == self.num_stages - 1
