"""Inductor's vector-ISA check on CPU, made cheaper (``docs/design/step.md``, "Cold start").

Before its first CPU kernel of a process, inductor validates the vector instruction sets the CPU reports by building
and loading test libraries into its cache directory. Three changes to that check, each keeping inductor's answer:
:func:`check_best_vec_isa_only` stops at the best set that passes (the one inductor picks), :func:`check_vec_isas_early`
starts it in a background thread when a step is built, and :func:`remember_vec_isa_probes` loads each test library in
a child Python once per library and CPU, not once per process. Three rows of the torch-patch table
(``d9dfn/_torch/_table.py``): ``vec_isa_best_first``, ``vec_isa_probes_remembered`` (process-wide, each with an
``install`` that restores torch's function on ``uninstall``) and ``vec_isa_checked_early`` (a thread started by
:func:`check_vec_isas_early` while the row is on).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from d9dfn._torch._gate import enabled, restore, swap, swapped
from d9dfn._torch._gate import install as install_rows

__all__ = [
    "BEST_FIRST",
    "EARLY",
    "PROBES",
    "best_first",
    "best_passing",
    "capable_best_first",
    "capable_early",
    "capable_probes",
    "check_best_vec_isa_only",
    "check_vec_isas_early",
    "check_vec_isas_now",
    "install_best_first",
    "install_probes",
    "remember_vec_isa_probes",
    "remembering",
    "uninstall_best_first",
    "uninstall_probes",
]

BEST_FIRST, PROBES, EARLY = "vec_isa_best_first", "vec_isa_probes_remembered", "vec_isa_checked_early"

_log = logging.getLogger(__name__)


def remember_vec_isa_probes() -> bool:
    """Load each vector-ISA test library in a child Python once (per library and CPU), not once per process.

    Inductor's vector-ISA check (the first CPU compile of every process, and ``run_compile_cache``) builds a test
    library per ISA into its cache directory once, then loads it in a child Python at every process start (so that
    a library that cannot load fails the child, not this process): ten children here, ~2 s of every compiled
    process's start (``docs/design/step.md``). With this, a load that succeeded is remembered by an empty file
    beside the library (:func:`remembering`), and later processes take it for the child's answer; a load that
    failed is not remembered (checked again next time). The library's path already names the compiler, its flags
    and torch's version; the mark adds the CPU's reported ISAs. The row ``vec_isa_probes_remembered``, turned on
    through the switch and the gate; ``True`` when it is on.
    """
    return PROBES in install_rows([PROBES])


def capable_probes() -> bool:
    """The capability check of ``vec_isa_probes_remembered``: 2.13's private probe, and the CPU's reported ISAs."""
    try:
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return False
    return callable(getattr(isa.VecISA, "_probe_load", None)) and callable(getattr(isa, "x86_isa_checker", None))


def install_probes() -> None:
    """Wrap ``VecISA._probe_load`` in :func:`remembering` (the row's install)."""
    from torch._inductor import cpu_vec_isa as isa

    if swapped(isa.VecISA, "_probe_load"):
        return
    try:  # the CPU's reported sets: a mark says "loaded on a CPU like this one"
        reported = isa.x86_isa_checker() if os.uname().machine in ("x86_64", "AMD64") else []
    except Exception:
        reported = ["unknown"]  # a mark no other CPU shares
    tag = hashlib.sha256(" ".join(sorted(reported)).encode()).hexdigest()[:12]
    swap(isa.VecISA, "_probe_load", remembering(isa.VecISA._probe_load, tag))


def uninstall_probes() -> None:
    from torch._inductor import cpu_vec_isa as isa

    restore(isa.VecISA, "_probe_load")


def remembering(probe: Callable[[Any, str], bool], tag: str) -> Callable[[Any, str], bool]:
    """``probe(isa, library) -> loaded`` remembered on disk: after one ``True`` for ``library``, the file
    ``<library>.loaded-<tag>`` answers ``True`` without calling ``probe``; a ``False`` leaves nothing. A directory
    that cannot be written only means the next process probes again.

    >>> import tempfile, os
    >>> calls = []
    >>> probe = remembering(lambda isa, path: calls.append(path) or True, "cpu")
    >>> lib = os.path.join(tempfile.mkdtemp(), "isa.so")
    >>> probe(None, lib), probe(None, lib), len(calls), os.path.exists(lib + ".loaded-cpu")
    (True, True, 1, True)
    """

    def remembered(isa: Any, library: str) -> bool:
        mark = f"{library}.loaded-{tag}"
        if os.path.isfile(mark):
            return True
        loaded = probe(isa, library)
        if loaded:
            try:
                with open(mark, "a"):
                    pass
            except OSError:
                _log.debug("d9dfn: cannot mark %s as loaded", library, exc_info=True)
        return loaded

    return remembered


def best_passing(candidates: Sequence[Any], reported: Collection[str]) -> list[Any]:
    """The first of ``candidates`` (best first) whose flags the CPU reports and whose check (``bool``) passes, as a
    list of at most one; the candidates after it are never checked.

    >>> class Isa:
    ...     def __init__(self, name, ok): self.name, self.ok = name, ok
    ...     def __str__(self): return self.name
    ...     def __bool__(self): checked.append(self.name); return self.ok
    >>> checked = []
    >>> [str(i) for i in best_passing([Isa("amx", False), Isa("avx512", True), Isa("avx2", True)], ["avx512", "avx2"])]
    ['avx512']
    >>> checked  # amx is not reported by the CPU: not checked; avx2 comes after the best: not checked
    ['avx512']
    """
    for candidate in candidates:
        if all(flag in reported for flag in str(candidate).split()) and candidate:
            return [candidate]
    return []


def check_best_vec_isa_only() -> bool:
    """Inductor's vector-ISA check stops at the best instruction set that passes, not after every set the CPU reports.

    Before its first CPU kernel of a process, inductor validates every vector ISA the CPU reports, best first (AMX,
    AVX-512 VNNI, AVX-512, AVX2 here), by building and loading test libraries into its cache directory: ten builds
    here, four of them with ATen's vector headers (2-3 s each), 14 s of CPU on an empty cache directory. It then uses
    the first that passed (``pick_vec_isa``): unless ``ATEN_CPU_CAPABILITY`` or ``config.cpp.simdlen`` asks for
    another, the sets after it are built and loaded for nothing. With this, ``valid_vec_isa_list`` checks in the same
    order and stops at the first that passes (:func:`best_passing`): the same set picked, the same flags and cache
    keys, one chain of builds (4.4 s here). With either setting present it is torch's own list, every set checked.
    Concurrent callers (the early check's thread, inductor) wait for one answer. Linux x86-64 only (the one platform
    with several candidates). The row ``vec_isa_best_first``, turned on through the switch and the gate; ``True``
    when it is on.
    """
    return BEST_FIRST in install_rows([BEST_FIRST])


def capable_best_first() -> bool:
    """The capability check of ``vec_isa_best_first``: torch's list, its candidates and the CPU's reported sets, on
    Linux x86-64."""
    try:
        from torch._inductor import config
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return False
    return (
        callable(getattr(isa, "valid_vec_isa_list", None))
        and isinstance(getattr(isa, "supported_vec_isa_list", None), list)
        and callable(getattr(isa, "x86_isa_checker", None))
        and hasattr(config.cpp, "simdlen")
        and sys.platform == "linux"
        and platform.machine() == "x86_64"
    )


def install_best_first() -> None:
    """Replace ``cpu_vec_isa.valid_vec_isa_list`` with :func:`best_first` of it (the row's install)."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    if not swapped(isa, "valid_vec_isa_list"):
        best = best_first(isa.valid_vec_isa_list, isa.supported_vec_isa_list, isa.x86_isa_checker, config.cpp)
        swap(isa, "valid_vec_isa_list", best)


def uninstall_best_first() -> None:
    from torch._inductor import cpu_vec_isa as isa

    restore(isa, "valid_vec_isa_list")


def best_first(
    everything: Callable[[], list[Any]], candidates: Sequence[Any], reported_by: Callable[[], Collection[str]], cpp: Any
) -> Callable[[], list[Any]]:
    """A ``valid_vec_isa_list`` for inductor: :func:`best_passing` of ``candidates`` against the ISAs ``reported_by()``
    names, found once (concurrent callers wait for it), or ``everything()`` (torch's own list) when
    ``ATEN_CPU_CAPABILITY`` is set or ``cpp.simdlen`` (inductor's ``config.cpp``) is, either of which may pick a set
    other than the best."""
    lock = threading.Lock()
    found: list[list[Any]] = []

    def valid_vec_isa_list() -> list[Any]:
        if os.environ.get("ATEN_CPU_CAPABILITY") or cpp.simdlen is not None:
            return everything()
        with lock:
            if not found:
                found.append(best_passing(candidates, reported_by()))
            return found[0]

    valid_vec_isa_list.__wrapped__ = everything  # type: ignore[attr-defined]  # inspect.unwrap finds torch's
    return valid_vec_isa_list


_EARLY_STARTED: list[bool] = []  # the early check's thread was started in this process


def check_vec_isas_early() -> None:
    """Start inductor's check of the CPU's vector instruction sets now, in a background thread, while the row
    ``vec_isa_checked_early`` is on (once per process).

    Before its first CPU kernel, inductor builds and loads test libraries for the CPU's vector ISAs (the best that
    passes: :func:`check_best_vec_isa_only`; 4-5 s of builds without the precompiled header) unless its cache
    directory holds them from an earlier run. Started when the step is built, the check runs on another core while
    dynamo traces the step; inductor later finds the answer (or waits for it). A failure here only means inductor
    checks itself. Not on a host with a GPU, whose steps compile Triton kernels (a CPU step there checks when it
    needs to).
    """
    if _EARLY_STARTED or not enabled(EARLY):
        return
    import torch
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    if config.cpp.vec_isa_ok is not None or torch.cuda.is_available():  # torch skips them; a GPU step needs none
        return
    _EARLY_STARTED.append(True)
    _imports_of_the_check()
    threading.Thread(target=_check_quietly, args=(isa,), name="d9dfn-vec-isa", daemon=True).start()


def capable_early() -> bool:
    """The capability check of ``vec_isa_checked_early``: the function it calls and the setting that skips it."""
    try:
        from torch._inductor import config
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return False
    return callable(getattr(isa, "valid_vec_isa_list", None)) and hasattr(config.cpp, "vec_isa_ok")


def check_vec_isas_now() -> None:
    """Run inductor's vector-ISA check now, in this thread, against the current cache directory; its answer is kept
    for the process (``valid_vec_isa_list`` is cached, and ``clear_caches`` leaves it): ``run_compile_cache`` does
    it before it moves the cache directory, where a previous job has usually left the test libraries."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()


def _imports_of_the_check() -> None:
    """Import here what the check imports, before its thread starts: ``torch.utils.cpp_extension`` imports
    setuptools, which inserts and removes a finder in ``sys.meta_path`` while the compiling thread's own imports may
    be walking that list; a finder skipped that way made a module that exists "not found" (``No module named
    'torch._functorch.aot_autograd'``, once, in ``benchmarks/compile_time.py``). Inductor imports all three before its
    first C++ build anyway."""
    import torch._inductor.codecache
    import torch._inductor.cpp_builder
    import torch.utils.cpp_extension  # noqa: F401


def _check_quietly(isa: Any) -> None:
    try:
        isa.valid_vec_isa_list()
    except Exception:
        _log.debug("d9dfn: background check of the vector ISAs failed", exc_info=True)
