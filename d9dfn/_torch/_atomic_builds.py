"""Inductor's C++ builds made safe to kill, and a library that fails to load built again (issue 44).

torch 2.13 builds a kernel library, an object file or a precompiled header with ``g++ -o <final path>``
(``CppBuilder.build``), and ``_worker_compile_cpp`` takes any file at that path for built: a process killed in the
seconds ``g++`` writes leaves a partial (often empty) ``.so`` under its final name, which every later process loads
(``ImportError: ….main.so: file too short``). Every other file torch caches (generated modules, sources, FX-graph and
AOTAutograd entries) it writes to a temporary name and renames.

:func:`atomic_cpp_builds` makes each build write a temporary file beside its target
(``.<name>.<pid>.<thread>.tmp``, a name the cache walkers of ``d9dfn/loop/_cache_seal.py`` skip) and rename it
onto the target once ``g++`` succeeded: a kill leaves a temporary file, never a partial file under the final name.

:func:`rebuild_unloadable_libraries` is the last line of defence behind the run's sealed cache
(``d9dfn/loop/_cache_seal.py``), for the caches d9dfn does not seal (a user's ``TORCHINDUCTOR_CACHE_DIR``, torch's
default directory): a library that exists but fails to load (``ImportError`` / ``OSError`` from ``dlopen``) is a
miss: it is deleted, built again once, and one line says so. A library that fails again was not damaged on disk (a
missing system library, a ``noexec`` mount): that error propagates as it is.

Both are process-wide patches of torch's private API, the rows ``cpp_builds_atomic`` and ``libraries_rebuilt`` of the
torch-patch table (``d9dfn/_torch/_table.py``), installed once by whatever compiles with inductor under d9dfn (the
step builders, ``run_compile_cache``): ``CppBuilder.build`` and its ``_target_file`` / ``_output`` attributes,
``CppCodeCache.load_async`` and ``CppCodeCache._load_library`` (torch 2.13). :func:`supported` is their capability
check; ``uninstall`` puts torch's own methods back.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from d9dfn._torch._gate import install as install_rows
from d9dfn._torch._gate import restore, swap, swapped

__all__ = [
    "ATOMIC",
    "REBUILT",
    "atomic_cpp_builds",
    "install_atomic",
    "install_rebuilt",
    "rebuild_unloadable_libraries",
    "supported",
    "temporary_name",
    "uninstall_atomic",
    "uninstall_rebuilt",
]

ATOMIC, REBUILT = "cpp_builds_atomic", "libraries_rebuilt"  # the rows' names (d9dfn/_torch/_table.py)

_log = logging.getLogger(__name__)
_PATH = "d9dfn_library"  # the attribute _load_library puts on a load error: the library's path


def temporary_name(target: str, pid: int, thread: int) -> str:
    """Where a build of ``target`` writes before it is renamed: beside it, hidden, ending in ``.tmp``.

    >>> temporary_name("/c/ab/cabc.main.so", 7, 3)
    '/c/ab/.cabc.main.so.7.3.tmp'
    """
    folder, name = os.path.split(target)
    return os.path.join(folder, f".{name}.{pid}.{thread}.tmp")


def supported() -> bool:
    """Whether this torch has the private pieces the two patches rely on, in the shape they expect."""
    try:
        from torch._inductor.codecache import CppCodeCache
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        return False
    methods = CppCodeCache.__dict__
    return (
        callable(getattr(CppBuilder, "build", None))
        and isinstance(methods.get("load_async"), classmethod)
        and isinstance(methods.get("_load_library"), classmethod)
    )


def _renamed_into_place(build: Callable[[Any], None]) -> Callable[[Any], None]:
    """``build(builder)`` made to write ``g++``'s output under :func:`temporary_name` and rename it onto the target.

    A builder whose output flag is not ``... <target>`` (a remote build with relative paths, Windows' ``/Fe``) is
    built as torch builds it."""

    @functools.wraps(build)
    def renamed(self: Any) -> None:
        target, output = getattr(self, "_target_file", None), getattr(self, "_output", None)
        if (
            getattr(self, "_use_relative_path", True)
            or not isinstance(target, str)
            or not isinstance(output, str)
            or not target
            or not output.endswith(f" {target}")
        ):
            build(self)
            return
        temporary = temporary_name(target, os.getpid(), threading.get_ident())
        builder = copy.copy(self)  # the caller's builder keeps its own target
        builder._target_file, builder._output = temporary, output[: -len(target)] + temporary
        try:
            build(builder)
            os.replace(temporary, target)
        finally:
            if os.path.lexists(temporary):  # g++ failed (or wrote nothing): no file under either name
                os.unlink(temporary)

    renamed.d9dfn_atomic = True  # type: ignore[attr-defined]
    return renamed


def atomic_cpp_builds() -> bool:
    """Turn on the rename-into-place of inductor's C++ builds (the row ``cpp_builds_atomic``, through the switch and
    the gate; once per process); ``True`` when it is on."""
    return ATOMIC in install_rows([ATOMIC])


def install_atomic() -> None:
    from torch._inductor.cpp_builder import CppBuilder

    if not swapped(CppBuilder, "build"):
        swap(CppBuilder, "build", _renamed_into_place(CppBuilder.build))


def uninstall_atomic() -> None:
    from torch._inductor.cpp_builder import CppBuilder

    restore(CppBuilder, "build")


def _load_or_build_again(load: Callable[[], Any]) -> Any:
    """``load()``; if it fails on a library file that exists, that file deleted and ``load()`` once more (torch's
    loader builds a missing library before loading it)."""
    try:
        return load()
    except (ImportError, OSError) as error:
        path = getattr(error, _PATH, None)
        if not isinstance(path, str) or not os.path.isfile(path):
            raise
        first = next(iter(str(error).splitlines()), type(error).__name__)
        _log.warning(
            "d9dfn: compile cache %s: the library %s fails to load (%s); it is compiled again",
            os.path.dirname(os.path.dirname(path)),
            os.path.basename(path),
            first,
        )
        os.unlink(path)  # nothing in it is worth keeping; the build writes the same name
    return load()


def rebuild_unloadable_libraries() -> bool:
    """Turn on the rebuild of an inductor C++ library that fails to load (the row ``libraries_rebuilt``, through the
    switch and the gate; once per process); ``True`` when it is on."""
    return REBUILT in install_rows([REBUILT])


def install_rebuilt() -> None:
    from torch._inductor.codecache import CppCodeCache

    if swapped(CppCodeCache, "load_async"):
        return
    library = CppCodeCache.__dict__["_load_library"].__func__
    load_async = CppCodeCache.__dict__["load_async"].__func__

    def _load_library(cls: Any, path: str, key: str) -> Any:
        try:
            return library(cls, path, key)
        except (ImportError, OSError) as error:
            setattr(error, _PATH, path)
            raise

    def load_async_or_build_again(cls: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return functools.partial(_load_or_build_again, load_async(cls, *args, **kwargs))

    swap(CppCodeCache, "_load_library", classmethod(_load_library))
    swap(CppCodeCache, "load_async", classmethod(load_async_or_build_again))


def uninstall_rebuilt() -> None:
    from torch._inductor.codecache import CppCodeCache

    restore(CppCodeCache, "_load_library")
    restore(CppCodeCache, "load_async")
