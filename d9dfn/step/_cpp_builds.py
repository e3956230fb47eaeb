"""One C++ build per compiled graph on CPU, not one per kernel (inductor's CPU backend; ``docs/design/step.md``).

Inductor's CPU backend writes every fused kernel of a graph as its own C++ source and builds each into its own
Python extension: one ``g++`` run per kernel, each loading the 155 MB precompiled header of ``cpp_prefix.h`` (0.6 s)
and linking (0.4 s) before it compiles a line of the kernel (0.1-0.3 s). A per-block Qwen3 step has 26 such kernels;
their builds were the largest single item of the first step (``benchmarks/compile_time.py --breakdown``).

:func:`batch_cpp_builds` makes a graph's kernels one translation unit instead: each kernel's code in a namespace
of its own, one Python module exposing ``kernel_0 … kernel_{n-1}``, built by torch's own code cache (the same
compiler flags, precompiled header, file lock and on-disk cache as a single kernel; a warm cache finds the built
library by the combined source's hash). The kernels' code is unchanged, so the graph computes bitwise what it
computes without batching (``tests/test_cpp_builds.py``). If the combined source fails to build, each kernel is
built alone, as torch would have, and a warning names the error.

The build runs behind the compile: when the generated module asks for its kernels (``AsyncCompile.wait``) the
library starts building in a thread of its own and each kernel's name holds a stand-in whose first call waits for
it. Inside the train step (:func:`backward_compiled_early`) AOTAutograd compiles a graph's backward right after its
forward, so the forward's ``g++`` run overlaps the backward's compile instead of coming before it.

It applies to every inductor CPU graph compiled in the process after the first call (a step builder makes it when
its backend is inductor), and on a host without a GPU it sets inductor's ``compile_threads`` to 1 unless
``TORCHINDUCTOR_COMPILE_THREADS`` is set (the batched builds do not use the pool of compile workers);
``D9DFN_BATCH_CPP_BUILDS=0`` in the environment leaves torch's builds and settings as they are. It
rests on two methods of torch's private ``AsyncCompile`` (``cpp_pybinding``, ``wait``) and on the Python binding
protocol of ``CppPythonBindingsCodeCache`` (torch 2.13); on a torch whose versions of them differ it installs
nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import platform
import re
import sys
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = [
    "backward_compiled_early",
    "batch_cpp_builds",
    "best_first",
    "best_passing",
    "check_best_vec_isa_only",
    "check_vec_isas_early",
    "combined_source",
    "library_parts",
    "remember_vec_isa_probes",
    "remembering",
    "wanted",
]

_log = logging.getLogger(__name__)
_ENV = "D9DFN_BATCH_CPP_BUILDS"
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b.*$", re.MULTILINE)
_ENTRY = re.compile(r'extern\s+"C"\s+((?:\w+\s+)*?)kernel\s*\(')  # the kernel's definition, as inductor writes it


def _namespaced(index: int, source: str) -> str:
    """``source`` without its ``#include`` lines, in namespace ``d9dfn_k<index>``, its ``extern "C" kernel`` made a
    C++ function of that namespace."""
    body, found = _ENTRY.subn(r"\1kernel(", _INCLUDE.sub("", source), count=1)
    if found != 1:
        raise ValueError(f"kernel {index}: no 'extern \"C\" ... kernel(' definition")
    if "#define" in body or "#undef" in body:  # a macro would reach the kernels after it
        raise ValueError(f"kernel {index}: defines a macro")
    return f"namespace d9dfn_k{index} {{\n{body}\n}}  // namespace d9dfn_k{index}\n"


def _binding(index: int, argtypes: Sequence[str]) -> str:
    args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes))
    return f"""
static PyObject* kernel_{index}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {len(argtypes)}) [[unlikely]]
            throw std::runtime_error("kernel_{index} takes a tuple of {len(argtypes)} args");
        d9dfn_k{index}::kernel({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
"""


@functools.cache
def _torch_binding_frame() -> tuple[str, str]:
    """Torch's own Python-binding code for one kernel, cut around its one entry point: what comes before it (the
    includes, the tensor → pointer function, ``parse_arg``) and the module's init from ``PyInit_kernel`` on, which
    reads ``py_module`` (``CppPythonBindingsCodeCache.suffix_template``, formatted as torch formats it)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    text = CppPythonBindingsCodeCache.suffix_template.format(
        arg_len=0, call_entry_func="", entry_func="kernel", extra_parse_arg=CppPythonBindingsCodeCache.extra_parse_arg
    )
    return text[: text.index("static PyObject* kernel_py(")], text[text.index("PyMODINIT_FUNC PyInit_kernel(void)") :]


def combined_source(kernels: Sequence[tuple[Sequence[str], str]]) -> str:
    """One C++ source for ``kernels`` (``(argtypes, source)`` pairs, as inductor hands them to ``cpp_pybinding``):
    their ``#include`` lines once, each kernel in its own namespace, and a Python module ``kernel`` whose function
    ``kernel_<i>`` calls kernel ``i``, parsing its arguments with torch's own binding code.

    Raises:
        ValueError: a kernel without inductor's ``extern "C" ... kernel(`` definition, or one defining a macro.
    """
    includes = list(dict.fromkeys(line.strip() for _, source in kernels for line in _INCLUDE.findall(source)))
    before, init = _torch_binding_frame()
    parts = ["\n".join(includes), *(_namespaced(i, source) for i, (_, source) in enumerate(kernels)), before]
    parts += [_binding(i, argtypes) for i, (argtypes, _) in enumerate(kernels)]
    methods = "".join(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},\n' for i in range(len(kernels)))
    parts.append(f"static PyMethodDef py_methods[] = {{\n{methods}    {{NULL, NULL, 0, NULL}}}};\n")
    parts.append('static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, py_methods};\n')
    parts.append(init)
    return "\n".join(parts)


class _Batch:
    """The kernels one generated module asked for, built together the first time any of them is needed."""

    def __init__(self) -> None:
        self.kernels: list[tuple[tuple[str, ...], str]] = []  # (argtypes, source), as combined_source takes them
        self._functions: list[Callable[..., Any]] | None = None
        self._lock = threading.Lock()
        self._started = False  # its build runs in a thread of its own (start)

    @property
    def built(self) -> bool:
        return self._functions is not None

    def add(self, argtypes: Sequence[str], source: str) -> int:
        self.kernels.append((tuple(argtypes), source))
        return len(self.kernels) - 1

    def function(self, index: int) -> Callable[..., Any]:
        with self._lock:
            if self._functions is None:
                self._functions = self._build()
        return self._functions[index]

    def start(self) -> None:
        """Build in a thread of its own, behind whatever the caller does next; a caller of :meth:`function` waits for
        it (the lock). A build that fails there is left for that caller, which builds again and sees the error."""
        if self._started or self.built:
            return
        self._started = True
        threading.Thread(target=self._build_quietly, name="d9dfn-cpp-build", daemon=True).start()

    def _build_quietly(self) -> None:
        try:
            self.function(0)
        except Exception:
            _log.debug("d9dfn: a background C++ build failed; the first call builds again", exc_info=True)

    def _build(self) -> list[Callable[..., Any]]:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        if len(self.kernels) > 1:
            try:
                parts = library_parts(len(self.kernels), _cores())
                with ThreadPoolExecutor(len(parts)) as pool:  # each part one g++ run; the GIL is free while it runs
                    built = list(pool.map(self._library, parts))
                return [function for functions in built for function in functions]
            except Exception as error:
                first = str(error).strip().splitlines()[:1]
                warnings.warn(
                    f"d9dfn: building {len(self.kernels)} inductor CPU kernels as one library failed "
                    f"({type(error).__name__}: {first[0] if first else ''}); building each alone. "
                    f"{_ENV}=0 skips the attempt.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return [CppPythonBindingsCodeCache.load_pybinding(list(argtypes), source) for argtypes, source in self.kernels]

    def _library(self, part: range) -> list[Callable[..., Any]]:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        source = combined_source([self.kernels[i] for i in part])
        module = CppPythonBindingsCodeCache.load_async(source, "cpu")()
        return [getattr(module, f"kernel_{i}") for i in range(len(part))]


class _Pending:
    """Kernel ``index`` of a batch still building, under ``name`` in a generated module's ``scope``: its first call
    waits for the build and puts the built function in its place, so later calls reach the kernel directly."""

    def __init__(self, batch: _Batch, index: int, scope: dict[str, Any], name: str) -> None:
        self.batch, self.index, self.scope, self.name = batch, index, scope, name

    def __call__(self, *args: Any) -> Any:
        function = self.batch.function(self.index)
        self.scope[self.name] = function
        return function(*args)


_PER_LIBRARY = 32
"""Kernels per library before a graph's kernels are split over the cores: each library costs about 1 s of header
loading and linking, each kernel 0.1-0.3 s of compiling (a per-block step's graphs have 2-11 kernels; a 16-layer
model traced whole has hundreds, one g++ run of them took 17 s)."""


def library_parts(count: int, cores: int) -> list[range]:
    """``range(count)`` cut into at most ``cores`` consecutive parts of at least ``_PER_LIBRARY`` kernels each (one
    part when ``count`` is smaller), as even as integer division allows."""
    parts = max(1, min(cores, count // _PER_LIBRARY))
    bounds = [count * i // parts for i in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` leaves the batching on: ``D9DFN_BATCH_CPP_BUILDS`` unset, or anything but ``0``,
    ``false``, ``no``, ``off`` (any case) or empty."""
    return environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off", "")


def _frame_ok() -> bool:
    try:
        before, init = _torch_binding_frame()
    except (KeyError, ValueError, IndexError):  # a template with other fields, or without the pieces cut at
        return False
    return "parse_arg" in before and "&py_module" in init


def _supported() -> bool:
    """Whether this torch has the private pieces the batching relies on, in the shape it expects."""
    try:
        import torch
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import CppPythonBindingsCodeCache, LambdaFuture  # noqa: F401
    except ImportError:
        return False
    binding = CppPythonBindingsCodeCache
    return (
        callable(getattr(AsyncCompile, "cpp_pybinding", None))
        and callable(getattr(AsyncCompile, "wait", None))
        and callable(getattr(binding, "load_async", None))
        and binding.entry_function == "kernel"
        and getattr(binding, "extra_parse_arg", None) == ""
        and _frame_ok()
        and hasattr(torch._C._dynamo.guards, "_torchinductor_pyobject_tensor_data_ptr")
    )


_batching = True  # tests turn it off to compare against torch's own builds in one process
_early_backward = False  # set when the batching is installed on a host without a GPU (backward_compiled_early)


@functools.cache
def batch_cpp_builds() -> bool:
    """Install the batching (once per process); ``True`` when it is on. Off when ``D9DFN_BATCH_CPP_BUILDS=0`` or
    when this torch's private pieces are not the ones it was written against."""
    if not wanted(os.environ):
        return False
    if not _supported():
        _log.info("d9dfn: this torch's inductor C++ bindings differ from 2.13's; kernels are built one by one")
        return False
    import torch
    from torch._inductor.async_compile import AsyncCompile, kernel_code_log
    from torch._inductor.codecache import LambdaFuture

    class BatchedKernel(LambdaFuture):
        """Kernel ``index`` of ``batch``: a future that builds the whole batch when the first of them is needed."""

        def __init__(self, batch: _Batch, index: int) -> None:
            super().__init__(functools.partial(batch.function, index))
            self.batch, self.index = batch, index

    original_pybinding = AsyncCompile.cpp_pybinding

    def cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
        if not _batching:
            return original_pybinding(self, argtypes, source_code)
        kernel_code_log.info("CPP+Bindings Kernel:\n%s", source_code)  # what torch's cpp_pybinding logs
        batch = self.__dict__.get("_d9dfn_batch")
        if batch is None or batch.built:
            batch = self.__dict__["_d9dfn_batch"] = _Batch()
        return BatchedKernel(batch, batch.add(argtypes, source_code))

    original_wait = AsyncCompile.wait

    def wait(self: Any, scope: dict[str, Any]) -> None:
        # torch resolves futures in wait() only with compile threads; a batch's build starts here, behind the compile
        for name, value in list(scope.items()):
            if isinstance(value, BatchedKernel):
                value.batch.start()
                scope[name] = _Pending(value.batch, value.index, scope, name)
        original_wait(self, scope)

    AsyncCompile.cpp_pybinding = cpp_pybinding  # type: ignore[method-assign]
    AsyncCompile.wait = wait  # type: ignore[method-assign]
    _no_compile_pool()
    global _early_backward
    _early_backward = not torch.cuda.is_available()
    return True


@contextlib.contextmanager
def backward_compiled_early() -> Iterator[None]:
    """Inside it, AOTAutograd compiles a graph's backward right after its forward (torch's
    ``force_non_lazy_backward_lowering``), not at the first backward call, on a host without a GPU where the batched
    builds are on: the forward's C++ build then runs behind the backward's compile (:meth:`_Batch.start`) instead of
    before it. The train step enters it around each call (a few microseconds); torch's setting is restored after."""
    if not _early_backward:
        yield
        return
    from torch._functorch import config

    before = config.force_non_lazy_backward_lowering
    config.force_non_lazy_backward_lowering = True
    try:
        yield
    finally:
        config.force_non_lazy_backward_lowering = before


def _no_compile_pool() -> None:
    """Without a GPU, no pool of compile worker processes: batched CPU builds run in the compiling thread, and the
    pool's processes would only import torch on the cores the compile needs (``docs/design/step.md``). Left alone
    when ``TORCHINDUCTOR_COMPILE_THREADS`` is set or a GPU is present (its Triton kernels compile in the pool)."""
    import torch
    from torch._inductor import config

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and not torch.cuda.is_available():
        config.compile_threads = 1


@functools.cache
def remember_vec_isa_probes() -> bool:
    """Load each vector-ISA test library in a child Python once (per library and CPU), not once per process.

    Inductor's vector-ISA check (the first CPU compile of every process, and ``run_compile_cache``) builds a test
    library per ISA into its cache directory once, then loads it in a child Python at every process start (so that
    a library that cannot load fails the child, not this process): ten children here, ~2 s of every compiled
    process's start (``docs/design/step.md``). With this, a load that succeeded is remembered by an empty file
    beside the library (:func:`remembering`), and later processes take it for the child's answer; a load that
    failed is not remembered (checked again next time). The library's path already names the compiler, its flags
    and torch's version; the mark adds the CPU's reported ISAs. Installed once per process; ``True`` when installed,
    not on a torch without ``VecISA._probe_load`` (2.13's private probe).
    """
    try:
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return False
    probe = getattr(isa.VecISA, "_probe_load", None)
    if probe is None:
        return False
    try:  # the CPU's reported sets: a mark says "loaded on a CPU like this one"
        reported = isa.x86_isa_checker() if os.uname().machine in ("x86_64", "AMD64") else []
    except Exception:
        return False
    tag = hashlib.sha256(" ".join(sorted(reported)).encode()).hexdigest()[:12]
    isa.VecISA._probe_load = remembering(probe, tag)  # type: ignore[method-assign,assignment]
    return True


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


@functools.cache
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
    with several candidates); ``True`` when installed, not on a torch without the 2.13 pieces it replaces.
    """
    try:
        from torch._inductor import config
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return False
    everything = getattr(isa, "valid_vec_isa_list", None)
    candidates = getattr(isa, "supported_vec_isa_list", None)
    reported_by = getattr(isa, "x86_isa_checker", None)
    if everything is None or candidates is None or reported_by is None:
        return False
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    isa.valid_vec_isa_list = best_first(everything, candidates, reported_by, config.cpp)  # type: ignore[assignment]
    return True


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


@functools.cache
def check_vec_isas_early() -> None:
    """Start inductor's check of the CPU's vector instruction sets now, in a background thread.

    Before its first CPU kernel, inductor builds and loads test libraries for the CPU's vector ISAs (the best that
    passes: :func:`check_best_vec_isa_only`; 4-5 s of builds without the precompiled header) unless its cache
    directory holds them from an earlier run. Started when the step is built, the check runs on another core while
    dynamo traces the step; inductor later finds the answer (or waits for it). A failure here only means inductor
    checks itself. Not on a host with a GPU, whose steps compile Triton kernels (a CPU step there checks when it
    needs to).
    """
    try:
        import torch
        from torch._inductor import config
        from torch._inductor import cpu_vec_isa as isa
    except ImportError:
        return
    if config.cpp.vec_isa_ok is not None or torch.cuda.is_available():  # torch skips them; a GPU step needs none
        return
    remember_vec_isa_probes()
    check_best_vec_isa_only()
    _imports_of_the_check()
    threading.Thread(target=_check_quietly, args=(isa,), name="d9dfn-vec-isa", daemon=True).start()


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
