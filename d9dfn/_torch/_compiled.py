"""``torch.compile`` for the step's pieces, each under a code object of its own.

dynamo keeps its compiled entries on the *code object* of the function it compiles, and counts them against
``torch._dynamo.config.recompile_limit`` (8). Every step built in a process compiles the same functions (a builder's
inner ``step``, ``RegionalStages``' ``train``, torch's one wrapper around any callable object such as the tail): each
new step adds entries to the same code objects, and entries whose guarded objects died (the last step's region
class) still count. The ninth step built in one process (a notebook, a sweep, a test session) failed with
``FailOnRecompileLimitHit`` (pytorch/pytorch#167504 is the same limit hit by compiling in a loop). Compiled under a
copy of its code, a piece's entries belong to it alone and die with it: the row ``code_object_per_piece`` of the
torch-patch table (``d9dfn/_torch/_table.py``), which patches nothing in torch but relies on where dynamo keeps its
entries; switched off, :func:`compile_piece` is plain ``torch.compile``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from d9dfn._torch._gate import enabled

__all__ = ["OWN_CODE", "capable", "compile_piece", "own_code"]

OWN_CODE = "code_object_per_piece"  # the row's name (d9dfn/_torch/_table.py)

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def compile_piece(
    fn: _Fn,
    backend: str | Callable[..., Any],
    *,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> _Fn:
    """``torch.compile(fn, fullgraph=True, ...)``, ``fn`` under a code object of its own (:func:`own_code`) while the
    row ``code_object_per_piece`` is on."""
    piece = own_code(fn) if enabled(OWN_CODE) else fn
    return cast(_Fn, torch.compile(piece, fullgraph=True, dynamic=dynamic, backend=backend, options=options))


def capable() -> bool:
    """The capability check of ``code_object_per_piece``: dynamo's per-code-object limit is still where it was."""
    from torch._dynamo import config

    return isinstance(getattr(config, "recompile_limit", None), int)


def own_code(fn: _Fn) -> _Fn:
    """``fn`` as a function whose code object no other function has: a copy of a plain function (same globals,
    closure, defaults and names), or a new function that calls any other callable (a module, an object with
    ``__call__``, a bound method).

    >>> def f(x):
    ...     return x + 1
    >>> g = own_code(f)
    >>> (g(1), g.__name__, g.__code__ is f.__code__, g.__code__.co_filename == f.__code__.co_filename)
    (2, 'f', False, True)
    >>> class Tail:
    ...     def __call__(self, x):
    ...         return x * 2
    >>> h = own_code(Tail())
    >>> (h(3), h.__code__.co_name, own_code(Tail()).__code__ is h.__code__)
    (6, 'Tail', False)
    """
    if isinstance(fn, types.FunctionType):
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        copy.__dict__.update(fn.__dict__)
        return cast(_Fn, copy)
    target: Callable[..., Any] = fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return target(*args, **kwargs)

    name = getattr(fn, "__name__", type(fn).__name__)
    # A code object of its own (every wrapper made here shares ``call``'s), named after the piece for dynamo's logs.
    call.__code__ = call.__code__.replace(co_name=name, co_qualname=name)
    call.__name__ = call.__qualname__ = name
    return cast(_Fn, call)
