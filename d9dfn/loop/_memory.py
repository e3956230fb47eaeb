"""Will the model fit? The bytes a training run holds for certain, estimated on the meta device before allocating.

A model too large for the machine used to fail inside ``to_empty`` with the allocator's message (``can't allocate
memory: you tried to allocate 512000000000 bytes``) and a traceback that named no setting. The loop now
counts, from the skeleton built on ``meta``: the parameters (in ``precision.param_dtype``), their gradients (one
per trainable parameter, same dtype) and the optimizer state (the optimizer's own ``init`` run on meta tensors of the
trainable parameters, so every optimizer counts what it really keeps). Trainable is what the train state will train:
the loop passes the names ``d9dfn.step.frozen_names`` gives for the provider's ``parameters_to_train`` (a LoRA run's
frozen base holds weights only, no gradient, no moments). Activations, compiled code and buffers come on top: the
estimate is a lower bound, and a run is refused only when even that exceeds the device's *total* memory — never a run
that could fit, and every rank of a job decides alike (a total does not change while the job starts).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch

from d9dfn._pytree import tree_leaves
from d9dfn._types import Transform

__all__ = [
    "MemoryEstimate",
    "check_memory",
    "device_memory",
    "estimate_memory",
    "estimate_memory_of_count",
    "format_bytes",
    "processes_on_device",
]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What one copy of the model holds while it trains (bytes), before activations.

    Attributes:
        num_params: parameters (elements), trainable or not.
        params: bytes of the parameters.
        grads: bytes of the gradients of the trainable parameters.
        optimizer: bytes of the optimizer state.
        dtype: the parameters' dtype (for the message).
    """

    num_params: int
    params: int
    grads: int
    optimizer: int
    dtype: torch.dtype

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        """E.g. ``1.5e+12 parameters need at least 24.0 TB (weights 6.0 TB + gradients 6.0 TB + ...)``."""
        parts = [f"weights {format_bytes(self.params)}"]
        if self.grads:
            parts.append(f"gradients {format_bytes(self.grads)}")
        if self.optimizer:
            parts.append(f"optimizer state {format_bytes(self.optimizer)}")
        return (
            f"{self.num_params:.3g} parameters need at least {format_bytes(self.total)} ({' + '.join(parts)}, "
            f"{str(self.dtype).removeprefix('torch.')}; activations come on top)"
        )


def estimate_memory(
    params: Mapping[str, torch.Tensor],
    optimizer: Transform | None,
    *,
    param_dtype: torch.dtype,
    gradients: bool = True,
    frozen: Collection[str] = (),
) -> MemoryEstimate:
    """The bytes of ``params`` (any device, ``meta`` included), their gradients and ``optimizer``'s state.

    Args:
        params: the model's parameters by name (a meta skeleton's: nothing is allocated); those with
            ``requires_grad`` and not in ``frozen`` are trained.
        optimizer: the optimizer transform; its ``init`` runs on meta copies of the trainable params. ``None``
            counts no optimizer state (inference, or an optimizer the loop did not build).
        param_dtype: the dtype the parameters will be trained (or run) in.
        gradients: count a gradient per trainable parameter (``False`` for inference).
        frozen: names of parameters that do not train (the train state's ``frozen``): weights only.

    >>> from d9dfn import optim
    >>> weights = {"w": torch.nn.Parameter(torch.empty(1000, 1000, device="meta"))}
    >>> estimate = estimate_memory(weights, optim.adamw(1e-3), param_dtype=torch.float32)
    >>> estimate.params, estimate.grads, estimate.optimizer  # AdamW: two moments, a count and the lr
    (4000000, 4000000, 8000012)
    >>> weights["b"] = torch.nn.Parameter(torch.empty(1000, device="meta"))
    >>> estimate = estimate_memory(weights, optim.adamw(1e-3), param_dtype=torch.float32, frozen={"w"})
    >>> estimate.params, estimate.grads, estimate.optimizer  # "w" frozen: its weights alone
    (4004000, 4000, 8012)
    """
    itemsize = torch.empty((), dtype=param_dtype).element_size()
    num_params = sum(p.numel() for p in params.values())
    frozen = frozenset(frozen)
    trainable = {
        name: torch.empty(p.shape, dtype=param_dtype, device="meta")
        for name, p in params.items()
        if p.requires_grad and name not in frozen
    }
    optimizer_bytes = 0
    if optimizer is not None:
        state = optimizer.init(trainable)
        optimizer_bytes = sum(
            leaf.numel() * leaf.element_size() for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor)
        )
    return MemoryEstimate(
        num_params=num_params,
        params=num_params * itemsize,
        grads=sum(p.numel() for p in trainable.values()) * itemsize if gradients else 0,
        optimizer=optimizer_bytes,
        dtype=param_dtype,
    )


def estimate_memory_of_count(
    num_params: int, optimizer: Transform | None, *, param_dtype: torch.dtype, gradients: bool = True
) -> MemoryEstimate:
    """:func:`estimate_memory` of ``num_params`` trainable parameters, from the count alone: no module, no tensor of
    that size (a count beyond what a tensor can hold is estimated all the same).

    The optimizer's state is measured on two small meta vectors and extended linearly (exact for the elementwise
    optimizers of ``trainer.optimizer``: their state is some copies of the params plus a few scalars).

    >>> from d9dfn import optim
    >>> weights = {"w": torch.nn.Parameter(torch.empty(1000, 1000, device="meta"))}
    >>> estimate_memory_of_count(10**6, optim.adamw(1e-3), param_dtype=torch.float32) == estimate_memory(
    ...     weights, optim.adamw(1e-3), param_dtype=torch.float32)
    True
    """
    itemsize = torch.empty((), dtype=param_dtype).element_size()
    optimizer_bytes = 0
    if optimizer is not None:
        small, large = (
            estimate_memory(
                {"w": torch.empty(size, dtype=param_dtype, device="meta", requires_grad=True)},
                optimizer,
                param_dtype=param_dtype,
            ).optimizer
            for size in (1000, 2000)
        )
        per_param, fixed = (large - small) // 1000, 2 * small - large
        optimizer_bytes = per_param * num_params + fixed
    return MemoryEstimate(
        num_params=num_params,
        params=num_params * itemsize,
        grads=num_params * itemsize if gradients else 0,
        optimizer=optimizer_bytes,
        dtype=param_dtype,
    )


def device_memory(device: torch.device) -> int | None:
    """All the memory of ``device`` in bytes: a GPU's total, or the host's RAM (within a cgroup's limit, if any).

    ``None`` for a device whose memory is not known here (the check is then skipped).
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return None
    try:  # a container's limit (cgroup v2); "max" means none
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def check_memory(
    estimate: MemoryEstimate,
    device: torch.device,
    *,
    who: str,
    fix: str | Callable[[], str],
    shards: int = 1,
    processes: int = 1,
) -> None:
    """Refuse a run whose weights, gradients and optimizer state alone exceed ``device``'s total memory.

    Args:
        estimate: the whole model's :func:`estimate_memory`.
        device: where this process materializes its part.
        who: the caller, first in the message.
        fix: what to change (the caller knows its settings' names), last in the message; a callable is called
            only when the model does not fit.
        shards: how many processes split one copy of the model (pipeline degree × data-parallel shard degree);
            each holds ``1 / shards`` of it on average, so some process holds at least that much.
        processes: processes that share ``device`` (the ranks on one host, for the CPU).

    Raises:
        ValueError: one line with the estimate, the device's memory and ``fix``.
    """
    available = device_memory(device)
    if available is None:
        return
    needed = estimate.total * processes // shards
    if needed <= available:
        return
    split = ""
    if shards > 1 or processes > 1:
        split = f"; split {shards} way(s), {processes} process(es) on this {device.type} hold {format_bytes(needed)}"
    where = "this host's memory" if device.type == "cpu" else f"the memory of {device}"
    raise ValueError(
        f"{who}: the model's {estimate.describe()}{split}, more than {where} ({format_bytes(available)} in all); "
        f"{fix if isinstance(fix, str) else fix()}"
    )


def processes_on_device(device: torch.device) -> int:
    """How many of the job's processes share ``device``'s memory: ``torchrun``'s ranks on this host for the CPU
    (``LOCAL_WORLD_SIZE``), one for a GPU (each rank has its own)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in B, kB, MB, GB or TB (powers of 1000).

    >>> format_bytes(24_000_000_000_000), format_bytes(1234)
    ('24.0 TB', '1.2 kB')
    """
    for unit in ("B", "kB", "MB", "GB"):
        if abs(num_bytes) < 1000:
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"
