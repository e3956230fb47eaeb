"""Whether the code running now is being traced into a graph that will be replayed on other inputs.

A graph traced once and replayed (``torch.compile``'s, or the split backward's ``make_fx`` trace of a pipeline stage,
``d9dfn.pipeline``) keeps the shapes it saw while tracing. Code whose shapes may follow its data in eager mode (an MoE
layer's reference path: the tokens each expert got) asks :func:`replayed` and takes a path of static shapes then.
The split backward says so with :func:`tracing_for_replay`; ``torch.compile`` needs no word from us.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["replayed", "tracing_for_replay"]

_REPLAYED: contextvars.ContextVar[bool] = contextvars.ContextVar("d9dfn_replayed_trace", default=False)


@contextlib.contextmanager
def tracing_for_replay() -> Iterator[None]:
    """Within it, :func:`replayed` is true: what runs is traced into a graph replayed on other inputs.

    >>> with tracing_for_replay():
    ...     inside = replayed()
    >>> inside, replayed()
    (True, False)
    """
    token = _REPLAYED.set(True)
    try:
        yield
    finally:
        _REPLAYED.reset(token)


def replayed() -> bool:
    """True while ``torch.compile`` traces or within :func:`tracing_for_replay`: shapes must not follow data.
    (``is_compiling`` first: dynamo folds it to ``True`` and never reaches ``ContextVar.get``, which it cannot
    trace.)"""
    return torch.compiler.is_compiling() or _REPLAYED.get()
