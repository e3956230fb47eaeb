"""Activation checkpointing: what a training step's backward recomputes instead of keeping, per repeated block.

A block's forward keeps its activations alive until its backward unless the block is checkpointed: then it keeps
only its inputs (``"full"``), or the outputs of the ops a policy names (``"selective"``: the matmuls and attention
by default, so the backward recomputes only the cheap pointwise ops), and runs its forward again in the backward.
Every ``every``-th block is checkpointed (1: all). ``"budget"`` leaves the choice to the compiler's min-cut
partitioner (``torch._functorch.config.activation_memory_budget``: the fraction of the activations it may keep),
for the whole compiled step.

The recompute runs the same ops in the same order, so eager results are bitwise those without checkpointing, and
random ops draw the same numbers: d9dfn's dropout is a function of the step's key (``d9dfn.prng``), and torch's
global generator is restored for the recompute (``preserve_rng_state``). Anchors: ``torch.utils.checkpoint``
(non-reentrant) and ``create_selective_checkpoint_contexts``; torchtitan's full / selective-op / selective-layer
policies; JAX's ``remat`` policies (``checkpoint_dots``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from d9dfn._torch import activation_memory_budget

__all__ = ["ActivationCheckpointing", "SAVED_BY_SELECTIVE"]

SAVED_BY_SELECTIVE = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The aten ops whose outputs ``"selective"`` keeps by default: matmuls and attention (the expensive ops to rerun)."""


@dataclasses.dataclass(frozen=True)
class ActivationCheckpointing:
    """What the backward recomputes instead of keeping (``make_train_step(activation_checkpointing=...)``).

    Attributes:
        policy: ``"full"``: a checkpointed block keeps its inputs only and reruns its whole forward in the backward;
            ``"selective"``: it keeps the outputs of the ops in ``save`` and reruns the rest (torch's condition: the
            block's forward holds no in-place op, e.g. ``relu_``); ``"budget"``: no block is wrapped, the compiler
            keeps at most ``memory_budget`` of the activations (compiled steps only).
        every: checkpoint every ``every``-th repeated block, counting from the first (1: every block).
        save: ``"selective"``: the aten ops (by name, e.g. ``"mm"``) whose outputs are kept.
        memory_budget: ``"budget"``: the fraction of the activations the compiler may keep, in ``(0, 1]``.

    Raises:
        ValueError: an unknown policy, ``every < 1``, an empty ``save`` for ``"selective"``, or a budget outside
            ``(0, 1]``.

    >>> ActivationCheckpointing("selective", every=2).checkpoints(3)
    False
    """

    policy: Literal["full", "selective", "budget"] = "full"
    every: int = 1
    save: tuple[str, ...] = SAVED_BY_SELECTIVE
    memory_budget: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in ("full", "selective", "budget"):
            raise ValueError(f"ActivationCheckpointing: policy={self.policy!r}; choose 'full', 'selective' or 'budget'")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"ActivationCheckpointing: every={self.every!r}; pass a positive int (1: every block)")
        if self.policy == "selective" and not self.save:
            raise ValueError("ActivationCheckpointing: save=() keeps nothing; use policy='full' for that")
        if not 0.0 < self.memory_budget <= 1.0:
            raise ValueError(f"ActivationCheckpointing: memory_budget={self.memory_budget}; pass a fraction in (0, 1]")

    def checkpoints(self, index: int) -> bool:
        """Whether the block at ``index`` (in the whole model's block order) is checkpointed."""
        return self.policy != "budget" and index % self.every == 0

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` run under ``torch.utils.checkpoint`` (non-reentrant) with this policy."""
        if self.policy == "full":
            return functools.partial(checkpoint, forward, use_reentrant=False)
        saved = frozenset(self.save)

        def keep(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            name = getattr(getattr(op, "overloadpacket", op), "__name__", "")
            return CheckpointPolicy.MUST_SAVE if name in saved else CheckpointPolicy.PREFER_RECOMPUTE

        context = functools.partial(create_selective_checkpoint_contexts, keep)
        return functools.partial(checkpoint, forward, use_reentrant=False, context_fn=context)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """The compiler settings while a step compiles: the partitioner's memory budget for ``"budget"``."""
        if self.policy != "budget":
            yield
            return
        with activation_memory_budget(self.memory_budget):
            yield


def checkpointed_forward(forward: Callable[..., Any], policy: ActivationCheckpointing) -> Callable[..., Any]:
    """A method ``forward(self, *args, **kwargs)`` that runs ``forward`` under ``policy``'s checkpoint."""
    wrapped = policy.wrap(forward)

    def method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapped(self, *args, **kwargs)

    return method
