"""Prefetch: each block's all-gather issued one block ahead, so that it travels while the block before computes.

Under ``torch.compile`` a functional collective is waited for where it is used: the step's graph issues a block's
all-gather right before the block and waits for it at once, so nothing overlaps. :func:`prefetch_gathers` is a pass
over a compiled step's graph (AOTAutograd's partitioned forward and backward, or inductor's post-grad graph): it moves
every all-gather but the first, with the nodes it needs that come later (its input's cast), to just after the
previous all-gather's wait. Block ``k + 1``'s gather then runs during block ``k``'s compute, forward and backward
(there the partitioner's recomputed gathers come in the order the blocks' backward uses them), and at most two
blocks' full params are alive at a time. Every rank runs the same pass on the same graph, so the collectives keep
one order on every rank.

:func:`prefetching_backend` wraps a backend (``"inductor"`` or ``"aot_eager"``) so that its graphs get the pass.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from d9dfn._torch import aot_eager_with, post_grad_pass

__all__ = ["PREFETCH_BACKENDS", "prefetch_gathers", "prefetching_backend"]

PREFETCH_BACKENDS = ("inductor", "aot_eager")
"""The backends whose graphs :func:`prefetching_backend` can rewrite."""


def _op(name: str) -> Any:
    return getattr(torch.ops._c10d_functional, name).default


def _is(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and node.target is _op(name)


def _movable(node: torch.fx.Node) -> bool:
    """Whether ``node`` may run earlier: a pure aten or prims op (no collective, no mutation, no random draw)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    pure = target.namespace in ("aten", "prims") and not target._schema.is_mutable
    return pure and torch.Tag.nondeterministic_seeded not in target.tags


def prefetch_gathers(graph: torch.fx.Graph) -> int:
    """Move each all-gather of ``graph`` after the first to just after the previous one's wait, with the nodes it
    needs that come later (its input's cast); returns how many moved. An all-gather whose inputs need anything else
    (a collective, a mutation, a random op) stays where it is."""
    gathers = [node for node in graph.nodes if _is(node, "all_gather_into_tensor")]
    moved = 0
    for previous, gather in itertools.pairwise(gathers):
        waits = [user for user in previous.users if _is(user, "wait_tensor")]
        if len(waits) != 1:
            continue
        order = {node: index for index, node in enumerate(graph.nodes)}
        anchor = waits[0]
        if order[gather] < order[anchor]:
            continue
        chain = _later_ancestors(gather, order[anchor], order)
        if not all(_movable(node) for node in chain):
            continue
        placed = [*sorted(chain, key=order.__getitem__), gather]
        if order[gather] - order[anchor] == len(placed):  # already just after the wait
            continue
        for node in placed:
            anchor.append(node)
            anchor = node
        moved += 1
    return moved


def _later_ancestors(node: torch.fx.Node, after: int, order: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """The nodes ``node`` depends on (transitively) that come after position ``after``."""
    found: set[torch.fx.Node] = set()
    stack = [n for n in node.all_input_nodes if order[n] > after]
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(n for n in current.all_input_nodes if order[n] > after)
    return found


def _rewritten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    if prefetch_gathers(gm.graph):
        gm.graph.lint()
        gm.recompile()
    return gm


@functools.cache
def _inductor_pass() -> Any:
    """The pass as inductor's post-grad pass, one object per process (made on first use: inductor imports late); its
    uuid keys inductor's cache on this file (the seam's ``prefetch_pass_hooks``, ``d9dfn/_torch/_graph_passes.py``)."""
    return post_grad_pass(prefetch_gathers, (__file__,))


def prefetching_backend(backend: str) -> tuple[str | Callable[..., Any], dict[str, Any]]:
    """``(backend, inductor options)`` for ``torch.compile`` that run :func:`prefetch_gathers` on ``backend``'s
    graphs: inductor with the pass as its post-grad pass, or ``aot_eager``'s AOTAutograd with the pass on the
    partitioned forward and backward graphs."""
    if backend == "inductor":
        return "inductor", {"post_grad_custom_post_pass": _inductor_pass()}
    if backend == "aot_eager":
        return _aot_eager_prefetching(), {}
    raise ValueError(f"prefetching_backend: backend={backend!r}; prefetch runs with {' or '.join(PREFETCH_BACKENDS)}")


@functools.cache
def _aot_eager_prefetching() -> Callable[..., Any]:
    return aot_eager_with(_rewritten)
