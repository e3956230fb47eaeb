"""A region call's schema built once per region while a per-block step compiles (torch re-traces the region for
every call otherwise; ``docs/design/step.md``, "Cold start, third session of 2026-11-27")."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["remembered_schemas"]


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
