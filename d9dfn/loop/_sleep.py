"""Sleep and wake: a run's tensors moved to host memory and back, in place (d9d's DEP-0006, ``Trainer.sleep`` /
``wake``, for colocated RL: the trainer gives the accelerator's memory to a rollout engine between steps).

Each tensor keeps its Python identity: its ``.data`` is rebound to a host copy and later to a fresh device copy (the
mechanism of d9d's ``offload_tensor``), so whatever holds the state (the loop, an event's context, the model) sees
it move, and the compiled step, which guards on devices, dtypes, shapes and strides, never on addresses, runs
again without a recompile. Tensors that share a storage (views of one buffer) are moved as that one storage and
keep sharing it, at the same offsets and strides.

On a GPU the host copies are pinned (page-locked) memory and the device memory is given back to the caching
allocator's pool and then to the driver (``torch.cuda.empty_cache``). On a CPU the "host" is the same memory: a
sleep copies every storage into a new one and releases the old, a wake copies it back into another; nothing is
freed overall, but the round trip (identity, values, aliasing, no recompile) is the same code and is tested there.

A sharded run's ``DTensor`` s move their local shards: the wrapper keeps its identity, mesh and placements, and only the
tensor it holds (``__tensor_flatten__``'s) is rebound, on every rank (``tests/test_sleep.py`` runs two gloo ranks).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import torch

__all__ = ["DEFAULT_SLEEP_TAGS", "Offloaded", "SleepTag", "offload", "onload"]


class SleepTag(enum.StrEnum):
    """What a sleep releases (d9d's ``SleepTag``)."""

    TENSOR_STATES = "tensor_states"
    """Params, buffers, optimizer, metric and task state (and the model's own weights): moved to host memory."""
    COMMS = "comms"
    """The process groups' communicators (NCCL): not implemented, as in d9d (refused)."""


DEFAULT_SLEEP_TAGS: frozenset[SleepTag] = frozenset({SleepTag.TENSOR_STATES})
"""What ``Trainer.sleep()`` releases by default."""


@dataclasses.dataclass(frozen=True)
class _Binding:
    tensor: torch.Tensor
    storage: int  # index into Offloaded.storages
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Offloaded:
    """Where each moved tensor's data went: its host storage and its place in it, to bring it back with
    :func:`onload`.

    Attributes:
        device: the device the tensors came from (and go back to).
        storages: the host copies, one per distinct device storage.
        num_bytes: the bytes moved (the storages' sizes).
    """

    device: torch.device
    storages: tuple[torch.UntypedStorage, ...]
    bindings: tuple[_Binding, ...]
    num_bytes: int


def _view(storage: torch.UntypedStorage, binding: _Binding, dtype: torch.dtype) -> torch.Tensor:
    empty = torch.empty(0, dtype=dtype, device=storage.device)
    return empty.set_(storage, binding.offset, binding.size, binding.stride)


def _new_storage(num_bytes: int, device: torch.device, *, pin_memory: bool) -> torch.UntypedStorage:
    return torch.empty(num_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory).untyped_storage()


def _holders(tensor: torch.Tensor, where: str) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or, for a wrapper subclass (a ``DTensor``: its local
    shard), its inner tensors as ``__tensor_flatten__`` names them (the protocol ``torch.compile`` reads them by), so
    rebinding their data moves the wrapper's.

    Raises:
        ValueError: a tensor subclass that is not a wrapper of plain tensors.
    """
    if type(tensor) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        return [tensor]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        raise ValueError(
            f"{where}: a {type(tensor).__name__} is neither a plain tensor nor a wrapper of plain tensors "
            "(__tensor_flatten__, as DTensor), so its data cannot be moved by rebinding; keep such tensors out of the "
            "train state, or do not sleep this run"
        )
    names, _ = flatten()
    inner = [getattr(tensor, name) for name in names]  # a DTensor names its mesh too: not a tensor, nothing to move
    return [held for value in inner if isinstance(value, torch.Tensor) for held in _holders(value, where)]


def offload(tensors: Iterable[torch.Tensor], device: torch.device, *, pin_memory: bool) -> Offloaded:
    """Move every tensor of ``tensors`` that lives on ``device`` to host memory, in place (``.data`` rebound).

    Args:
        tensors: the tensors (duplicates and views of one storage are fine: each storage moves once); a ``DTensor``
            moves its local shard.
        device: whose tensors move; others are left where they are.
        pin_memory: page-locked host copies (on CUDA: the copies back are asynchronous and faster).

    Returns:
        What :func:`onload` needs to bring them back.

    Raises:
        ValueError: a tensor subclass that does not wrap plain tensors among them.

    >>> a = torch.arange(6.0)
    >>> view = a[2:4]
    >>> record = offload([a, view], torch.device("cpu"), pin_memory=False)
    >>> shared = view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    >>> record.num_bytes, len(record.storages), shared
    (24, 1, True)
    >>> onload(record); view
    tensor([2., 3.])
    """
    storages: list[torch.UntypedStorage] = []
    bindings: list[_Binding] = []
    index_of: dict[int, int] = {}  # a device storage's address -> its host copy
    seen: set[int] = set()
    for tensor in (held for outer in tensors for held in _holders(outer, "offload")):
        if id(tensor) in seen or tensor.device != device:
            continue
        seen.add(id(tensor))
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in index_of:
            host = _new_storage(storage.nbytes(), torch.device("cpu"), pin_memory=pin_memory)
            host.copy_(storage, non_blocking=pin_memory)
            index_of[key] = len(storages)
            storages.append(host)
        bindings.append(
            _Binding(tensor, index_of[key], int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies are done before the device storages go
    for binding in bindings:
        binding.tensor.data = _view(storages[binding.storage], binding, binding.tensor.dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # back to the driver, for the process that uses the device next
    return Offloaded(device, tuple(storages), tuple(bindings), sum(s.nbytes() for s in storages))


def onload(record: Offloaded) -> None:
    """Bring back what :func:`offload` moved: fresh device storages, each tensor rebound at its place in them."""
    fresh = []
    for host in record.storages:
        storage = _new_storage(host.nbytes(), record.device, pin_memory=False)
        storage.copy_(host, non_blocking=host.is_pinned())
        fresh.append(storage)
    for binding in record.bindings:
        binding.tensor.data = _view(fresh[binding.storage], binding, binding.tensor.dtype)
    if record.device.type == "cuda":
        torch.cuda.synchronize(record.device)  # the host copies may go once the data is on the device
