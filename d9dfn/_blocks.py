"""Compiling a repeated block once: the decoder layers of a model traced and compiled as one region.

A model of ``L`` identical blocks compiled whole costs a compile per block: inductor sees ``L`` copies. torch's
``nested_compile_region`` traces the first call of a function and reuses that subgraph for every later call
with matching inputs, so the layers stop adding to cold compile time. On torch 2.13 it works only in one form
(``docs/design/step.md``, "Compiling a repeated block once"), which this module owns:

- the region is the block class's ``forward``, set on a *copy* of the model (a subclass assigned to the copied
  instances; the caller's classes and modules are untouched);
- the params are swapped into that copy *outside* the compiled call (:func:`swapped_in`), so every reused layer
  reads its own tensors, and the gradient comes from autograd (AOTAutograd's compiled backward), not from
  ``grad_and_value`` (which does not trace through a region);
- inductor's buffer reuse is off for the compiled call (:func:`region_compile_options`): with it on, inductor
  reuses the storage of tensors a region saved for backward, and the gradients are wrong.

The tail's per-leaf work would then be what grows with depth: ``d9dfn._tail.BlockwiseTail`` sends each block's
leaves through one region too.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless

from d9dfn._precision import Precision
from d9dfn._pytree import tree_map
from d9dfn._step_parts import (
    Microbatch,
    _call_model,
    _checked_outputs,
    _compile,
    _structural_copy,
    _with_pieces,
)
from d9dfn._train_state import TrainState
from d9dfn._types import Batch, Buffers, Params

ModelCall = Callable[[Params, Buffers, dict[str, Any], dict[str, Any]], Any]
"""``call(params, buffers, inputs, kwargs) -> outputs``: how a forward-only piece runs the model."""

__all__ = ["forward_piece", "regional_train_step", "repeated_classes", "with_block_regions"]


_REGION_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _region_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with ``forward`` as one nested compile region, one per class (torch reuses a region per function)."""
    if cls not in _REGION_CLASSES:
        forward = torch.compiler.nested_compile_region(cls.forward)
        names = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _REGION_CLASSES[cls] = type(cls.__name__, (cls,), names)
    return _REGION_CLASSES[cls]


def with_block_regions(owner: str, model: nn.Module, blocks: Sequence[type[nn.Module]]) -> nn.Module:
    """A structural copy of ``model`` (same tensors) whose instances of ``blocks`` each run as one shared region.

    Raises:
        ValueError: a class in ``blocks`` that no submodule of ``model`` is an instance of, or an instance that
            holds buffers (torch 2.13 refuses to train a region that may write into them).
    """
    wanted = frozenset(blocks)
    present = {type(module) for module in model.modules()}
    for cls in wanted:
        if cls not in present:
            raise ValueError(
                f"{owner}: repeated_blocks names {cls.__module__}.{cls.__qualname__}, but no module of "
                f"{type(model).__name__} is one; pass the class of the model's repeated block (classes here that "
                f"occur more than once: {repeated_classes(model)})"
            )
    for name, module in model.named_modules():
        buffer = next((b for b, _ in module.named_buffers()), None)
        if type(module) in wanted and buffer is not None:
            raise ValueError(
                f"{owner}: repeated_blocks includes {type(module).__name__}, but {name}.{buffer} is a buffer; torch's "
                "nested compile regions cannot train through a block's buffers (BatchNorm writes its statistics in "
                "place), so pass repeated_blocks without that class"
            )
    copied = _structural_copy(model)
    for module in copied.modules():
        if type(module) in wanted:
            module.__class__ = _region_class(type(module))
    return copied


def repeated_classes(model: nn.Module) -> list[str]:
    """The names of the module classes that occur more than once in ``model``, sorted: the candidates for
    ``repeated_blocks`` an error lists."""
    counts = Counter(type(module).__name__ for module in model.modules())
    return sorted(name for name, count in counts.items() if count > 1)


@contextlib.contextmanager
def swapped_in(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model``'s params and buffers replaced by ``tensors`` (every one of them, by name) for the ``with`` body."""
    with stateless._reparametrize_module(model, dict(tensors), strict=True):
        yield


def region_compile_options(backend: str) -> dict[str, Any]:
    """``torch.compile`` options for a graph holding regions: inductor must not reuse buffers (see the module doc)."""
    return {"options": {"allow_buffer_reuse": False}} if backend == "inductor" else {}


@contextlib.contextmanager
def swapped_call(model: nn.Module, params: Params, buffers: Buffers, mutable: frozenset[str]) -> Iterator[Buffers]:
    """``model`` holding ``params`` and ``buffers`` (``mutable`` ones cloned: the call must not write into the
    caller's) for one call of a compiled region piece; yields the buffers it runs on."""
    current = {name: (b.clone() if name in mutable else b) for name, b in buffers.items()}
    with swapped_in(model, {**params, **current}), region_tracing():
        yield current


def forward_piece(
    owner: str,
    model: nn.Module,
    blocks: Sequence[type[nn.Module]],
    mutable: frozenset[str],
    precision: Precision | None,
    piece_of: Callable[[ModelCall], Callable[..., Any]],
    compile: bool,
    backend: str,
) -> Callable[..., Any]:
    """A forward-only piece ``piece(consts, carry, microbatch)`` (``consts`` start with params and buffers), built
    by ``piece_of(call)`` around ``call(params, buffers, inputs, kwargs) -> outputs``, and compiled.

    Without ``blocks`` ``call`` is the functional call (``_call_model``) inside the compiled piece. With ``blocks``
    it calls a copy of ``model`` whose blocks are regions (:func:`with_block_regions`), and the params and buffers
    are swapped into that copy around the compiled piece (:func:`swapped_call`): the form of a reused region
    that reads every layer's own weights.
    """
    if not blocks:

        def functional(params: Params, buffers: Buffers, inputs: dict[str, Any], kwargs: dict[str, Any]) -> Any:
            return _call_model(model, params, buffers, mutable, inputs, kwargs, precision)[0]

        return _compile(piece_of(functional), compile, backend)
    regional = with_block_regions(owner, model, blocks)

    def swapped(params: Params, buffers: Buffers, inputs: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        del params, buffers  # in the module already (run below)
        if precision is not None and precision.casts:
            inputs, kwargs = precision.cast_inputs(inputs), precision.cast_inputs(kwargs)
        return _checked_outputs(regional, regional(**inputs, **kwargs))

    piece = piece_of(swapped)
    compiled = (
        torch.compile(piece, fullgraph=True, backend=backend, **region_compile_options(backend)) if compile else piece
    )

    def run(consts: tuple[Any, ...], carry: Any, microbatch: Microbatch) -> Any:
        params = precision.cast_params(consts[0]) if precision is not None and precision.casts else consts[0]
        with swapped_call(regional, params, consts[1], mutable):
            return compiled(consts, carry, microbatch)

    return run


@contextlib.contextmanager
def region_tracing() -> Iterator[None]:
    """The AOTAutograd settings a region's first (compiling) call needs: no donated backward buffers.

    pytorch/pytorch#193960: a reused region's backward may overwrite a donated buffer that a later invocation
    still reads. Read at compile time only; cheap to enter on every call.
    """
    with torch._functorch.config.patch(donated_buffer=False):
        yield


def regional_train_step(
    model: nn.Module,
    mutable: frozenset[str],
    precision: Precision | None,
    microbatch_loss: Callable[..., tuple[torch.Tensor, tuple[Any, ...]]],
    head_fn: Callable[..., Any],
    tail_fn: Callable[..., Any],
    compile: bool,
    backend: str,
) -> Callable[[TrainState, Batch], tuple[TrainState, Any]]:
    """``make_train_step`` with ``repeated_blocks``: its head, then per microbatch a compiled forward and loss
    (``model``'s blocks as regions, :func:`with_block_regions`) with the params swapped in and autograd's
    backward, then its tail. Gradients accumulate in ``.grad`` in microbatch order (``g₁``, ``g₁ + g₂``, ...),
    as the default piece's sums do."""

    def forward(microbatch: Microbatch, step: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        inputs, kwargs, state = microbatch
        if precision is not None and precision.casts:
            inputs, kwargs = precision.cast_inputs(inputs), precision.cast_inputs(kwargs)
        return microbatch_loss(_checked_outputs(model, model(**inputs, **kwargs)), state, step)

    forward_fn = (
        torch.compile(forward, fullgraph=True, backend=backend, **region_compile_options(backend))
        if compile
        else forward
    )

    def step(train_state: TrainState, batch: Batch) -> tuple[TrainState, Any]:
        full_params, microbatches, _ = head_fn(train_state, batch)
        params = train_state.params if full_params is None else full_params
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        model_params = precision.cast_params(leaves) if precision is not None and precision.casts else leaves
        buffers, outs, weighted = train_state.buffers, [], []
        for microbatch in microbatches:
            with swapped_call(model, model_params, buffers, mutable) as current:
                weighted_loss, out = forward_fn(microbatch, train_state.step)
            # Into each leaf's .grad: g₁, then g₁ + g₂, ... in microbatch order.
            weighted_loss.backward()  # type: ignore[no-untyped-call]
            buffers = {**buffers, **{name: current[name] for name in mutable}}
            weighted.append(weighted_loss.detach())
            outs.append(tree_map(torch.Tensor.detach, out))
        grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in leaves.items()}
        sums = (grads, functools.reduce(operator.add, weighted), functools.reduce(operator.add, (o[2] for o in outs)))
        new_state, output = tail_fn(train_state, buffers, sums, outs)
        return new_state, output

    return _with_pieces(step, head=head_fn, microbatch=forward_fn, tail=tail_fn)
