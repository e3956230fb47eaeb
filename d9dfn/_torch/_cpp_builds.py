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

Three rows of the torch-patch table (``d9dfn/_torch/_table.py``): ``cpp_builds_batched`` (process-wide, installed
by the first step builder with an inductor backend: every inductor CPU graph compiled in the process after it),
``compile_pool_off`` (process-wide: on a host without a GPU, inductor's ``compile_threads`` set to 1 unless
``TORCHINDUCTOR_COMPILE_THREADS`` is set, since the batched builds do not use the pool of compile workers) and
``backward_lowered_early`` (scoped, around each train step call). ``D9DFN_TORCH_PATCHES`` leaves any of them out;
the older ``D9DFN_BATCH_CPP_BUILDS=0`` all three. The batching
rests on two methods of torch's private ``AsyncCompile`` (``cpp_pybinding``, ``wait``) and on the Python binding
protocol of ``CppPythonBindingsCodeCache`` (torch 2.13): :func:`capable` checks them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from d9dfn._torch._gate import enabled, restore, swap, swapped
from d9dfn._torch._gate import install as install_rows

__all__ = [
    "backward_compiled_early",
    "batch_cpp_builds",
    "capable",
    "combined_source",
    "install",
    "library_parts",
    "uninstall",
]

_log = logging.getLogger(__name__)
BATCHED, POOL, EARLY = "cpp_builds_batched", "compile_pool_off", "backward_lowered_early"  # d9dfn/_torch/_table.py
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
                    f"D9DFN_TORCH_PATCHES=-{BATCHED} skips the attempt.",
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


def _frame_ok() -> bool:
    try:
        before, init = _torch_binding_frame()
    except (KeyError, ValueError, IndexError):  # a template with other fields, or without the pieces cut at
        return False
    return "parse_arg" in before and "&py_module" in init


def capable() -> bool:
    """Whether this torch has the private pieces the batching relies on, in the shape it expects (the gate's
    capability check of ``cpp_builds_batched``)."""
    try:
        import torch
        from torch._inductor.async_compile import AsyncCompile, kernel_code_log  # noqa: F401
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
_POOL: list[contextlib.AbstractContextManager[Any]] = []  # the compile_threads patch, entered by install_pool


def install() -> None:
    """Install the batching (``cpp_builds_batched``'s install; :func:`d9dfn._torch.install` calls it once)."""
    from torch._inductor.async_compile import AsyncCompile, kernel_code_log
    from torch._inductor.codecache import LambdaFuture

    if swapped(AsyncCompile, "wait"):
        return

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

    swap(AsyncCompile, "cpp_pybinding", cpp_pybinding)
    swap(AsyncCompile, "wait", wait)


def uninstall() -> None:
    """Put torch's own ``AsyncCompile`` methods back."""
    from torch._inductor.async_compile import AsyncCompile

    restore(AsyncCompile, "cpp_pybinding")
    restore(AsyncCompile, "wait")


def batch_cpp_builds() -> bool:
    """Turn the batching on, as a step builder does (once per process, through the gate and the switch); ``True``
    when it is on."""
    return BATCHED in install_rows([BATCHED])


def _no_gpu() -> bool:
    # Not functools-cached: the train step calls it while dynamo traces the step (torch._dynamo.explain), and dynamo
    # warns at a cached function; torch caches the device count itself.
    import torch

    return not torch.cuda.is_available()


def _lowering_early() -> bool:
    return enabled(EARLY) and _no_gpu()


@contextlib.contextmanager
def backward_compiled_early() -> Iterator[None]:
    """Inside it, AOTAutograd compiles a graph's backward right after its forward (torch's
    ``force_non_lazy_backward_lowering``), not at the first backward call, on a host without a GPU while the row
    ``backward_lowered_early`` is on: with the batched builds the forward's C++ build then runs behind the backward's
    compile (:meth:`_Batch.start`) instead of before it. The train step enters it around each call (a few
    microseconds); torch's setting is restored after."""
    if not _lowering_early():
        yield
        return
    from torch._functorch import config

    before = config.force_non_lazy_backward_lowering
    config.force_non_lazy_backward_lowering = True
    try:
        yield
    finally:
        config.force_non_lazy_backward_lowering = before


def capable_early() -> bool:
    """The capability check of ``backward_lowered_early``: torch's AOTAutograd has the setting."""
    try:
        from torch._functorch import config
    except ImportError:
        return False
    return isinstance(getattr(config, "force_non_lazy_backward_lowering", None), bool)


def install_pool() -> None:
    """Without a GPU, no pool of compile worker processes (``compile_pool_off``'s install): batched CPU builds run in
    the compiling thread, and the pool's processes would only import torch on the cores the compile needs
    (``docs/design/step.md``). Left alone when ``TORCHINDUCTOR_COMPILE_THREADS`` is set or a GPU is present (its
    Triton kernels compile in the pool)."""
    from torch._inductor import config

    if not _POOL and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and _no_gpu():
        patch: contextlib.AbstractContextManager[Any] = config.patch(compile_threads=1)
        patch.__enter__()
        _POOL.append(patch)


def uninstall_pool() -> None:
    """Put inductor's ``compile_threads`` back as it was."""
    while _POOL:
        _POOL.pop().__exit__(None, None, None)


def capable_pool() -> bool:
    """The capability check of ``compile_pool_off``: inductor has the setting."""
    from torch._inductor import config

    return isinstance(getattr(config, "compile_threads", None), int)
