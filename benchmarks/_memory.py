"""Peak live bytes of one training step, split by what holds them: a tracker on torch's dispatch.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every operator that runs inside it hands it its outputs, and it
registers each new storage (a weak reference whose finalizer records the free). Bytes are storages' sizes, counted
once however many views share them. After the step each storage gets one category, and the timeline of
allocations and frees gives each category's peak and the breakdown at the moment of the total peak:

- ``params``: the train state's own params (a ``DTensor``'s local shard), and the new params the step returns;
- ``gathered``: copies made from params alone (an all-gather of shards, a cast to the compute dtype, a transposed
  copy): every op whose tensor inputs are all params or such copies (0-d tensors and ``*_like`` factories aside),
  up to the end of the last backward (after it such copies are the optimizer's: weight decay's ``λ·p``);
- ``grads``: what a backward leaves behind (storages made while autograd runs a node and still alive when the
  backward ends: the gradients), and everything made from them (their sum over microbatches, the reduce-scatter,
  the scaled and clipped gradients). A gradient made and freed inside the backward (a block's full gradient,
  reduce-scattered before the backward ends) is a backward temporary;
- ``optimizer``: the input and output optimizer state and every temporary made from it (Adam's update);
- ``activations``: storages made in a forward and *read by the backward* (tensors saved for backward; torch.func's
  transforms disable ``saved_tensors_hooks``, so this is how the tracker sees them under the traced step too);
- ``backward``: the backward's own temporaries (activation gradients, and forwards recomputed by activation
  checkpointing): made while autograd runs a node, gone before the backward ends;
- ``other``: the rest (the batch, buffers, forward temporaries, the step's scalars).

A backward is a run of ops during which ``torch._C._current_autograd_node()`` is set: autograd's engine, eager or
running a compiled graph's backward (AOTAutograd's ``CompiledFunction``). A step traced whole with ``torch.func``
and compiled has no backward at runtime (forward and backward are one graph): then ``StepMemory.num_backwards`` is
0, and its gradients, activations and backward temporaries all count as ``other``.

What it sees: every ATen op run eagerly, in ``torch.func`` transforms and in autograd's backward, and the ops of a
``DTensor`` after it desugars them into collectives on local tensors. Compiled code: :meth:`ignore_compile_internals`
is ``True``, so ``torch.compile`` compiles as usual and the compiled code runs with the tracker on. An
``aot_eager`` graph runs its ATen ops one by one at runtime, so the tracker sees them (the saved tensors the
partitioner chose; a nested compile region's subgraph is run in its sight); inductor's kernels allocate their
buffers without dispatch, so under inductor the tracker sees only the extern kernels' outputs (matmuls,
collectives) and its numbers are a lower bound. For a compiled step
:func:`allocator_peak` reads the allocator itself: the profiler's allocation events on CPU,
``torch.cuda.max_memory_allocated`` on CUDA; it has the total only, no categories.

Eager and compiled steps free at different times: Python keeps a function's locals until it returns, a compiled
graph frees each value after its last use, so an eager step's peak (its tail's above all) is higher.

Not seen: memory outside tensors (the allocator's caching and fragmentation, gloo's buffers, compiled code), and a
storage resized in place (``UntypedStorage.resize_``, which FSDP2 uses to free params; the step does not).

Usable beyond this benchmark (a ``d9dfn.loop`` profiling option could wrap one step in it); kept here, at the edge,
until a user asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

CATEGORIES = ("params", "gathered", "grads", "optimizer", "activations", "backward", "other")
"""The categories, in the order the tables print them."""
_NUM_LARGEST = 8

_LIKE = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty", "new_zeros")
"""Factories that take a tensor for its shape only: their outputs are not made *from* it."""


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s bytes: its own, or those of a wrapper subclass's inner tensors (a
    ``DTensor``'s local shard); none for meta tensors."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = [getattr(tensor, name) for name in names]  # a DTensor's local shard (and its opaque mesh)
        return [st for t in inner if isinstance(t, torch.Tensor) for st in storages(t)]
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one step held, in bytes.

    Attributes:
        peak: the most bytes alive at once during the step, what the caller held before it included.
        at_peak: ``peak`` split by category.
        peaks: each category's own highest value during the step (they need not coincide: their sum is at least
            ``peak``).
        before: bytes per category alive when the step started (what the caller passed in: the train state, the
            batch).
        num_ops: operators the tracker saw.
        num_backwards: backward passes (runs of ops inside autograd nodes) it saw.
        largest: the largest storages the step made that are alive at the peak: ``(category, the op that made it,
            bytes)``.
        activations_by_op: the bytes of every activation the step made, by the op that made it (``aten.mm.default``,
            ``_c10d_functional.all_gather_into_tensor.default``): what a layout shrinks or does not.
    """

    peak: int
    at_peak: dict[str, int]
    peaks: dict[str, int]
    before: dict[str, int]
    num_ops: int
    num_backwards: int
    largest: list[tuple[str, str, int]]
    activations_by_op: dict[str, int]


@dataclasses.dataclass
class _Storage:
    nbytes: int
    born: int  # op index at allocation
    in_backward: bool
    tag: str | None  # params/optimizer/other (given), gathered/grads/optimizer (lineage), None
    op: str  # the operator that made it
    read_in_backward: bool = False


class MemoryTracker(TorchDispatchMode):
    """Tracks live storages while a step runs (see the module doc); :meth:`result` splits them by category.

    Args:
        given: tensors alive before the step, by category (``"params"``, ``"optimizer"``, ``"other"``): their
            bytes count from the start, and what is made from params or optimizer state is attributed to them.
    """

    def __init__(self, given: Mapping[str, Iterable[torch.Tensor]]) -> None:
        super().__init__()
        self._storages: list[_Storage] = []
        self._serial: dict[int, int] = {}  # StorageImpl address -> index in _storages, while alive
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._events: list[tuple[int, int, int]] = []  # (op index, storage index, +1 allocated / -1 freed)
        self._ops = 0
        self._backward_start: int | None = None
        self._backward_ends: list[int] = []  # op index at which each backward ended
        self._closed = False
        for category, tensors in given.items():
            for tensor in tensors:
                for st in storages(tensor):
                    self._register(st, category, given=True)

    supports_higher_order_operators = True  # compiled graphs call nested compile regions (invoke_subgraph)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compile as usual and run the compiled code under the tracker (the default would make dynamo fall back
        to eager while any dispatch mode is on)."""
        return True

    # --- while the step runs ----------------------------------------------------------------------------------------

    def _register(self, st: torch.UntypedStorage, tag: str | None, op: str = "", given: bool = False) -> int | None:
        key = st._cdata
        if key in self._serial:
            return self._serial[key]
        nbytes = st.nbytes()
        if st.device.type == "meta" or (nbytes == 0 and not given):
            return None
        index = len(self._storages)
        self._storages.append(_Storage(nbytes, -1 if given else self._ops, self._backward_start is not None, tag, op))
        self._serial[key] = index
        self._refs[index] = weakref.ref(st, functools.partial(self._freed, key, index))
        self._events.append((-1 if given else self._ops, index, 1))
        return index

    def _freed(self, key: int, index: int, _: object) -> None:
        if self._closed:
            return
        self._serial.pop(key, None)
        self._refs.pop(index, None)
        self._events.append((self._ops, index, -1))

    def _index(self, tensor: torch.Tensor) -> list[int | None]:
        return [self._serial.get(st._cdata) for st in storages(tensor)]

    def _end_backward(self) -> None:
        """A backward just ended: what it made and is still alive is a gradient (autograd frees the rest)."""
        assert self._backward_start is not None
        for index in self._serial.values():
            info = self._storages[index]
            if info.in_backward and info.born >= self._backward_start and info.tag is None:
                info.tag = "grads"
        self._backward_start = None
        self._backward_ends.append(self._ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.higher_order.invoke_subgraph:  # a nested compile region: run its graph in sight
            subgraph, _, *operands = args
            with self:
                return subgraph(*operands)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)  # unseen inside
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let the subclass (DTensor) desugar it into ops on plain tensors, seen here
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward and self._backward_start is None:
            self._backward_start = self._ops
        elif not in_backward and self._backward_start is not None:
            self._end_backward()
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tags: list[str | None] = []
        for tensor in inputs:
            for index in self._index(tensor):
                info = None if index is None else self._storages[index]
                if info is not None and in_backward and not info.in_backward and info.born >= 0:
                    info.read_in_backward = True
                if tensor.dim() > 0:
                    tags.append(None if info is None else info.tag)
        out = func(*args, **kwargs)
        tag = None if func._overloadpacket.__name__ in _LIKE else _lineage(tags)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                for st in storages(tensor):
                    self._register(st, tag, str(func))
        self._ops += 1
        return out

    # --- after the step ---------------------------------------------------------------------------------------------

    def result(self, kept: Mapping[str, Iterable[torch.Tensor]]) -> StepMemory:
        """The step's memory; ``kept``: what the step returned, by category: its new ``"params"`` and
        ``"optimizer"`` state count as such from their allocation on, whatever they were made from (other
        categories are ignored: a returned scalar may have been saved for backward)."""
        if self._backward_start is not None:
            self._end_backward()
        self._closed = True
        last_backward = self._backward_ends[-1] if self._backward_ends else None
        categories = [_category(info, last_backward) for info in self._storages]
        for category, tensors in kept.items():
            if category not in ("params", "optimizer"):
                continue
            for tensor in tensors:
                for index in self._index(tensor):
                    if index is not None:
                        categories[index] = category
        before = dict.fromkeys(CATEGORIES, 0)
        live = dict.fromkeys(CATEGORIES, 0)
        peaks = dict.fromkeys(CATEGORIES, 0)
        peak, at_peak, peak_event = 0, dict(live), 0
        for event, (op, index, sign) in enumerate(self._events):
            category = categories[index]
            live[category] += sign * self._storages[index].nbytes
            if op < 0:
                before[category] = live[category]
            peaks[category] = max(peaks[category], live[category])
            total = sum(live.values())
            if total > peak:
                peak, at_peak, peak_event = total, dict(live), event
        alive: set[int] = set()
        for _, index, sign in self._events[: peak_event + 1]:
            (alive.add if sign > 0 else alive.discard)(index)
        made = [i for i in alive if self._storages[i].born >= 0]
        largest = sorted(made, key=lambda i: -self._storages[i].nbytes)[:_NUM_LARGEST]
        top = [(categories[i], self._storages[i].op, self._storages[i].nbytes) for i in largest]
        by_op: dict[str, int] = {}
        for info, category in zip(self._storages, categories, strict=True):
            if category == "activations":
                by_op[info.op] = by_op.get(info.op, 0) + info.nbytes
        return StepMemory(peak, at_peak, peaks, before, self._ops, len(self._backward_ends), top, by_op)


def _lineage(tags: list[str | None]) -> str | None:
    """The category an op's outputs inherit from its (non-scalar) tensor inputs' categories."""
    if not tags:
        return None
    if "optimizer" in tags:
        return "optimizer"
    if "grads" in tags:
        return "grads"
    if all(tag in ("params", "gathered") for tag in tags):
        return "gathered"
    return None


def _category(info: _Storage, last_backward: int | None) -> str:
    if info.tag == "gathered" and last_backward is not None and info.born >= last_backward:
        return "optimizer"  # made from params alone after the last backward: the tail's (weight decay's) temporary
    if info.tag is not None:
        return info.tag
    if info.in_backward:
        return "backward"
    if info.read_in_backward:
        return "activations"
    return "other"


# --- a train step -------------------------------------------------------------------------------------------------


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def state_tensors(train_state: Any, *extra: Any) -> dict[str, list[torch.Tensor]]:
    """A ``TrainState``'s tensors by category (params, optimizer state, everything else with ``extra``)."""
    rest = (train_state.buffers, train_state.step, train_state.rng, train_state.task_state, train_state.metric_state)
    return {
        "params": _tensors(train_state.params),
        "optimizer": _tensors(train_state.opt_state),
        "other": _tensors((*rest, *extra)),
    }


def track_step(
    step: Callable[[Any, Any], tuple[Any, Any]], train_state: Any, batch: Any
) -> tuple[Any, Any, StepMemory]:
    """``step(train_state, batch)`` under a :class:`MemoryTracker`: ``(new_state, output, StepMemory)``."""
    tracker = MemoryTracker(state_tensors(train_state, batch))
    with tracker:
        new_state, out = step(train_state, batch)
    return new_state, out, tracker.result(state_tensors(new_state, out))


# --- the allocator's view -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def allocator_peak(device: torch.device | str) -> Iterator[dict[str, int]]:
    """The highest bytes allocated during the ``with`` body above what was allocated when it began, from the
    allocator itself (compiled kernels' buffers included): the yielded dict's ``"peak"`` is filled on exit.

    CPU: the profiler's allocation events (``profile_memory=True``), summed in order. CUDA:
    ``torch.cuda.max_memory_allocated`` after a reset of the peak (block-rounded sizes).
    """
    result = {"peak": 0}
    device = torch.device(device)
    # Garbage from before (reference cycles: a tracker and its finalizers) freed inside the window would count as
    # negative allocations and lower the peak: collect it first.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - start
        return
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))  # type: ignore[union-attr]
    allocations = sorted((n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    live = 0
    for node in allocations:
        live += node.extra_fields.alloc_size
        result["peak"] = max(result["peak"], live)


def _walk(nodes: Iterable[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)
