"""The torch settings a per-block step's regions (``nested_compile_region``) are traced and compiled under, and a
region call's schema built once per region (``docs/design/step.md``, "Compiling a repeated block once").

Three rows of the torch-patch table (``d9dfn/_torch/_table.py``): ``region_settings`` (required: without them a
region's gradients are wrong or its trace fails), ``region_schemas_remembered`` (scoped: torch re-traces the
region for every call otherwise) and ``activation_memory_budget`` (required by the ``"budget"`` checkpointing
policy). :func:`region_tracing` enters both; ``d9dfn/step/_blocks.py`` enters it around
every call of a compiled function whose graph holds regions.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from d9dfn._torch._gate import enabled

__all__ = [
    "REGION_INDUCTOR_OPTIONS",
    "SCHEMAS",
    "activation_memory_budget",
    "capable_budget",
    "capable_schemas",
    "capable_settings",
    "region_tracing",
    "remembered_schemas",
]

SCHEMAS = "region_schemas_remembered"  # the row's name (d9dfn/_torch/_table.py)

REGION_INDUCTOR_OPTIONS: dict[str, Any] = {"allow_buffer_reuse": False}
"""Inductor's options for a graph that holds regions: with buffer reuse on, inductor reuses the storage of tensors a
region saved for backward, and the gradients are wrong (``d9dfn/step/_blocks.py::region_compile``)."""

_DEPTH = threading.local()  # how many region_tracing scopes this thread is inside


@contextlib.contextmanager
def region_tracing() -> Iterator[None]:
    """The AOTAutograd and dynamo settings a region's first (compiling) call needs, and (outermost scope, while
    ``region_schemas_remembered`` is on) the region schemas remembered.

    No donated backward buffers (pytorch/pytorch#193960: a reused region's backward may overwrite a donated buffer
    that a later invocation still reads); Python floats stay constants (``specialize_float``: a block traced again
    with another float, such as another model's dropout probability in the same process, would otherwise get it as
    an input, which a region cannot take). Read at compile time only; cheap to enter on every call; nests.
    """
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config

    depth = getattr(_DEPTH, "value", 0)
    schemas = depth == 0 and enabled(SCHEMAS)
    _DEPTH.value = depth + 1
    if schemas:
        remembered_schemas(True)
    try:
        with functorch_config.patch(donated_buffer=False), dynamo_config.patch(specialize_float=True):
            yield
    finally:
        _DEPTH.value = depth
        if schemas:
            remembered_schemas(False)


def capable_settings() -> bool:
    """The capability check of ``region_settings``: the settings exist in this torch's configs."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    return (
        hasattr(functorch_config, "donated_buffer")
        and hasattr(dynamo_config, "specialize_float")
        and hasattr(inductor_config, "allow_buffer_reuse")
    )


def capable_schemas() -> bool:
    """The capability check of ``region_schemas_remembered``: torch's region operator computes its schema per call in
    a method of its class (``InvokeSubgraphHOP.gen_schema``), which an instance attribute can stand in for."""
    try:
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    except ImportError:
        return False
    return callable(getattr(type(invoke_subgraph), "gen_schema", None)) and hasattr(invoke_subgraph, "__dict__")


def remembered_schemas(on: bool) -> None:
    """While on, torch's schema of a region call (``invoke_subgraph.gen_schema``) is computed once per region graph
    and inputs' metadata, not once per call.

    AOTAutograd's joint trace asks for the schema of every region call that needs gradients, to refuse a region that
    writes into its inputs, and torch builds it by tracing the region's graph again (``materialize_as_graph``): a
    re-trace of the whole block per block, some 0.15 s each on this CPU (32 calls at 16 layers). The answer depends
    only on the graph and the inputs' shapes, strides, dtypes and ``requires_grad``, so the first call's is reused;
    a region that does write into an input is refused at its first call, as before. Nothing is patched on a torch
    without this method."""
    try:
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    except ImportError:
        return
    if not on:
        invoke_subgraph.__dict__.pop("gen_schema", None)
    elif hasattr(type(invoke_subgraph), "gen_schema"):
        remembered = functools.partial(_schema_once, type(invoke_subgraph).gen_schema, invoke_subgraph)
        invoke_subgraph.__dict__["gen_schema"] = remembered  # the instance's, over its class's method


_SCHEMAS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def _schema_once(compute: Callable[..., Any], hop: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
    """``compute(hop, subgraph, identifier, *operands)``, remembered per ``subgraph`` object for the same identifier
    and operands' metadata (tensors and ints only; anything else is computed every time)."""
    key: tuple[Any, ...] = (identifier,)
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            sizes = (*operand.shape, *operand.stride())
            if not all(type(size) is int for size in sizes):  # symbolic sizes: not hashed, computed every time
                return compute(hop, subgraph, identifier, *operands)
            key += ((type(operand), sizes, operand.dtype, operand.device, operand.requires_grad),)
        elif type(operand) is int or operand is None:
            key += ((type(operand), operand),)
        else:
            return compute(hop, subgraph, identifier, *operands)
    try:
        known = _SCHEMAS.setdefault(subgraph, {})
    except TypeError:  # not weakly referable
        return compute(hop, subgraph, identifier, *operands)
    if key not in known:
        known[key] = compute(hop, subgraph, identifier, *operands)
    return known[key]


@contextlib.contextmanager
def activation_memory_budget(fraction: float) -> Iterator[None]:
    """Inside it, AOTAutograd's partitioner keeps at most ``fraction`` of the activations it would keep (the
    ``"budget"`` policy of ``d9dfn.step.ActivationCheckpointing``; the row ``activation_memory_budget``, required by
    that policy)."""
    from torch._functorch import config

    with config.patch(activation_memory_budget=fraction):
        yield


def capable_budget() -> bool:
    """The capability check of ``activation_memory_budget``: the partitioner has the setting."""
    from torch._functorch import config

    return isinstance(getattr(config, "activation_memory_budget", None), float)


def static_shapes() -> contextlib.AbstractContextManager[Any]:
    """Inside it, dynamo compiles each input shape as a graph of its own instead of making a length symbolic at its
    second value (``automatic_dynamic_shapes`` off): the job's padded lengths with packing off (at most 4), whose
    symbolic graph torch 2.13's FX graph cache cannot load back (it warns at every start)."""
    from torch._dynamo import config

    patch: contextlib.AbstractContextManager[Any] = config.patch(automatic_dynamic_shapes=False)
    return patch


def capable_static_shapes() -> bool:
    """The capability check of ``static_shapes``: dynamo has the setting."""
    from torch._dynamo import config

    return isinstance(getattr(config, "automatic_dynamic_shapes", None), bool)
