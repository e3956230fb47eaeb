"""One C++ build per compiled graph (``d9dfn/_torch/_cpp_builds.py``, issue 25): the combined source's shape, that a
graph's kernels are built together and compute bitwise what torch's one-by-one builds compute, the fallback when the
combined source fails, and the switch; the vector-ISA check (``d9dfn/_torch/_vec_isa.py``)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import d9dfn._torch._cpp_builds as cpp_builds
import d9dfn._torch._vec_isa as vec_isa
from d9dfn._torch import PATCHES, chosen
from d9dfn._torch._cpp_builds import _PER_LIBRARY, batch_cpp_builds, combined_source, library_parts

KERNEL = """
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0] + %s;
}
"""


def test_the_combined_source_puts_each_kernel_in_a_namespace_with_one_binding_each() -> None:
    source = combined_source(
        [(["const float*", "float*"], KERNEL % "1.0f"), (["const float*", "float*"], KERNEL % "2")]
    )
    assert source.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1
    assert source.index("#include <torch/csrc/inductor/cpp_prefix.h>") < source.index("namespace d9dfn_k0")
    assert 'extern "C"  void  kernel' not in source
    assert source.count("void  kernel(const float* in_ptr0,") == 2
    assert "namespace d9dfn_k0 {" in source
    assert "namespace d9dfn_k1 {" in source
    assert "d9dfn_k1::kernel(parse_arg<float*>(args, 0), parse_arg<float*>(args, 1));" in source
    assert re.findall(r'\{"(kernel_\d)", kernel_\d_py', source) == ["kernel_0", "kernel_1"]
    assert source.count("PyMODINIT_FUNC PyInit_kernel(void)") == 1


@given(st.lists(st.sampled_from(["const float*", "float*", "const int64_t*", "int64_t", "float"]), max_size=6))
def test_each_binding_parses_every_argument_in_order(argtypes: list[str]) -> None:
    source = combined_source([(argtypes, KERNEL % "0")])
    call = re.search(r"d9dfn_k0::kernel\((.*)\);", source)
    assert call is not None
    parsed = re.findall(r"parse_arg<([^>]*)>\(args, (\d+)\)", call.group(1))
    assert parsed == [(t.replace("const ", ""), str(n)) for n, t in enumerate(argtypes)]
    assert f"PyTuple_GET_SIZE(args) != {len(argtypes)}" in source


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("void helper() {}", "no 'extern \"C\" ... kernel(' definition"),
        ('#define X 1\nextern "C" void kernel(float* a) { a[0] = X; }', "defines a macro"),
    ],
)
def test_a_kernel_it_cannot_namespace_is_refused_by_index(source: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"kernel 1: {re.escape(why)}"):
        combined_source([(["float*"], KERNEL % "0"), (["float*"], source)])


@given(st.integers(0, 2000), st.integers(1, 64))
def test_a_graphs_kernels_split_into_consecutive_parts_one_per_core_at_most(count: int, cores: int) -> None:
    parts = library_parts(count, cores)
    assert [i for part in parts for i in part] == list(range(count))
    assert 1 <= len(parts) <= cores
    if len(parts) > 1:
        assert min(len(p) for p in parts) >= _PER_LIBRARY
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("yes", True), ("0", False), ("false", False), (" OFF ", False)]
)
def test_the_environment_switch(value: str | None, on: bool) -> None:
    # D9DFN_BATCH_CPP_BUILDS, the older switch, is an alias of leaving the row out of D9DFN_TORCH_PATCHES
    rows = [row.name for row in PATCHES if row.kind != "required"]
    environ = {} if value is None else {"D9DFN_BATCH_CPP_BUILDS": value}
    assert (cpp_builds.BATCHED in chosen(environ, rows)) is on


def _several_kernels(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A graph inductor compiles to two C++ kernels around a matmul (reductions, a softmax, a cumsum)."""
    a = (x * 2 + 1).sum(0)
    b = torch.softmax(y * 3, dim=-1)
    c = torch.relu(x @ y) + a.unsqueeze(1).mean()
    return a, b, c.cumsum(0), (y - 1).amax(1)


@pytest.fixture
def batches(monkeypatch: Any) -> list[int]:
    """The size of every batch of kernels built from now on, in order."""
    assert batch_cpp_builds(), "torch 2.13's inductor: the batching installs"
    sizes: list[int] = []
    original = cpp_builds._Batch._build

    def spy(self: Any) -> Any:
        sizes.append(len(self.kernels))
        return original(self)

    monkeypatch.setattr(cpp_builds._Batch, "_build", spy)
    return sizes


def _compiled_fresh(on: bool, monkeypatch: Any) -> tuple[torch.Tensor, ...]:
    """``_several_kernels`` compiled with inductor from an empty cache, batching ``on`` or off."""
    from torch._inductor.utils import fresh_cache

    monkeypatch.setattr(cpp_builds, "_batching", on)
    torch._dynamo.reset()
    with fresh_cache():
        return torch.compile(_several_kernels, fullgraph=True, backend="inductor")(*_inputs())


@pytest.mark.slow
@pytest.mark.compiled
def test_a_graphs_kernels_build_as_one_library_and_compute_bitwise_what_one_by_one_builds_do(
    monkeypatch: Any, batches: list[int]
) -> None:
    expected = _compiled_fresh(False, monkeypatch)
    assert batches == [], "switched off, torch builds each kernel alone"
    got = _compiled_fresh(True, monkeypatch)
    assert batches == [2], "one build for the graph's two kernels"
    for index, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(e, g), f"output {index}: batched builds differ from torch's own"
    eager = _several_kernels(*_inputs())
    for e, g in zip(eager, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),
    )


@pytest.mark.slow
@pytest.mark.compiled
def test_a_combined_source_that_fails_to_build_falls_back_to_one_build_per_kernel(
    monkeypatch: Any, batches: list[int]
) -> None:
    monkeypatch.setattr(cpp_builds, "combined_source", lambda kernels: "this is not C++;\n")
    with pytest.warns(RuntimeWarning, match=r"building 2 inductor CPU kernels as one library failed \(CppCompileError"):
        got = _compiled_fresh(True, monkeypatch)
    assert batches == [2]
    for e, g in zip(_several_kernels(*_inputs()), got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("replies", "answers", "probes", "marked"),
    [
        ([True], [True, True, True], 1, True),  # loaded: later calls take the mark
        ([False, True], [False, True, True], 2, True),  # failed: probed again, then remembered
        ([False, False, False], [False, False, False], 3, False),  # never loads: never remembered
    ],
)
def test_a_vec_isa_probe_is_remembered_once_it_loaded(
    tmp_path: Any, replies: list[bool], answers: list[bool], probes: int, marked: bool
) -> None:
    calls: list[str] = []
    reply = iter(replies)

    def probe(isa: Any, library: str) -> bool:
        calls.append(library)
        return next(reply)

    remembered = vec_isa.remembering(probe, "cpu")
    library = str(tmp_path / "isa.so")
    assert [remembered(None, library) for _ in answers] == answers
    assert len(calls) == probes
    assert (tmp_path / "isa.so.loaded-cpu").exists() == marked
    assert not vec_isa.remembering(lambda isa, library: False, "other")(None, library)  # another CPU: its own mark


def test_an_unwritable_cache_only_means_probing_again(tmp_path: Any) -> None:
    calls: list[str] = []
    remembered = vec_isa.remembering(lambda isa, library: calls.append(library) or True, "cpu")
    missing = str(tmp_path / "gone" / "isa.so")  # its directory does not exist: the mark cannot be written
    assert remembered(None, missing)
    assert remembered(None, missing)
    assert len(calls) == 2


def test_torchs_probe_takes_the_mark_for_its_answer(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import cpu_vec_isa as isa

    assert vec_isa.remember_vec_isa_probes()  # installed once per process (the step builders call it too)
    library = str(tmp_path / "isa.so")
    children: list[Any] = []
    monkeypatch.setattr(isa.subprocess, "run", lambda *args, **kwargs: children.append(args))
    assert isa.VecAVX2()._probe_load(library)  # no mark: torch's child runs (a stand-in here, which succeeds)
    assert len(children) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("isa.so.loaded-")]
    assert isa.VecAVX2()._probe_load(library)  # marked: no child
    assert len(children) == 1


class _Isa:
    """A stand-in vector ISA: its name's words are the CPU flags it needs; ``bool`` is its (counted) check."""

    def __init__(self, name: str, passes: bool, checks: list[str], delay: float = 0.0) -> None:
        self.name, self.passes, self.checks, self.delay = name, passes, checks, delay

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        time.sleep(self.delay)
        self.checks.append(self.name)
        return self.passes


@given(
    passes=st.lists(st.booleans(), min_size=1, max_size=5),
    reported=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_best_passing_is_what_torchs_full_check_puts_first_and_checks_nothing_after_it(
    passes: list[bool], reported: list[bool]
) -> None:
    checks: list[str] = []
    candidates = [_Isa(f"isa{i}", ok, checks) for i, ok in enumerate(passes)]
    flags = [f"isa{i}" for i, on in enumerate(reported) if on]
    every = [c for c in candidates if str(c) in flags and c]  # torch's list: every reported set that passes
    checks.clear()
    best = vec_isa.best_passing(candidates, flags)
    assert best == every[:1]
    last = candidates.index(best[0]) if best else len(candidates) - 1
    assert checks == [str(c) for c in candidates[: last + 1] if str(c) in flags]


def test_best_first_checks_once_for_concurrent_callers_and_defers_to_torch_when_another_set_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    checks: list[str] = []
    candidates = [_Isa("amx", False, checks, delay=0.05), _Isa("avx512", True, checks), _Isa("avx2", True, checks)]
    torchs: list[int] = []

    def everything() -> list[Any]:
        torchs.append(1)
        return candidates[1:]

    cpp = SimpleNamespace(simdlen=None)
    valid = vec_isa.best_first(everything, candidates, lambda: ["amx", "avx512", "avx2"], cpp)
    answers: list[list[Any]] = []
    threads = [threading.Thread(target=lambda: answers.append(valid())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [[candidates[1]]] * 4
    assert checks == ["amx", "avx512"]  # once, for four callers; avx2 never
    assert not torchs
    cpp.simdlen = 256  # inductor picks by width from the full list
    assert valid() == candidates[1:]
    assert len(torchs) == 1
    cpp.simdlen = None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # so does a capability named in the environment
    assert valid() == candidates[1:]
    assert len(torchs) == 2


def test_torchs_pick_is_the_same_with_the_best_set_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU, with every check passing without a build (``vec_isa_ok``): torch's full list and the best-first
    one give ``pick_vec_isa`` the same set."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    torchs = inspect.unwrap(isa.valid_vec_isa_list)  # torch's, uncached (d9dfn's may be installed over it)
    with config.patch({"cpp.vec_isa_ok": True, "cpp.simdlen": None}):
        full = torchs()
        monkeypatch.setattr(isa, "valid_vec_isa_list", torchs)
        picked_by_torch = isa.pick_vec_isa()
        best = vec_isa.best_first(torchs, isa.supported_vec_isa_list, isa.x86_isa_checker, config.cpp)
        monkeypatch.setattr(isa, "valid_vec_isa_list", best)
        assert best() == full[:1]
        assert str(isa.pick_vec_isa()) == str(picked_by_torch)


def test_the_early_check_imports_setuptools_before_its_thread_starts(tmp_path: Any) -> None:
    """Setuptools edits ``sys.meta_path`` while it is imported; in the check's thread that raced the compiling thread's
    imports (a module that exists reported missing). A fresh interpreter, the thread's start recorded (and the thread
    not started: no builds)."""
    code = """
import sys, threading
import d9dfn._torch._vec_isa as vec_isa
seen = []
wanted = ("setuptools", "torch.utils.cpp_extension", "torch._inductor.codecache")
start = threading.Thread.start
def recording(self):
    if self.name == "d9dfn-vec-isa":
        seen.append(all(m in sys.modules for m in wanted))
        return None
    return start(self)
threading.Thread.start = recording
vec_isa.check_vec_isas_early()
print(seen)
"""
    environ = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=environ)
    assert out.stdout.strip().splitlines()[-1] == "[True]"


def test_a_batch_builds_behind_the_caller_and_each_kernels_first_call_puts_the_built_one_in_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release, threads = threading.Event(), []

    def build(self: Any) -> list[Any]:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return [lambda x: x + 1, lambda x: x * 2]

    monkeypatch.setattr(cpp_builds._Batch, "_build", build)
    batch = cpp_builds._Batch()
    batch.add(["float*"], "a")
    batch.add(["float*"], "b")
    batch.start()
    batch.start()  # once
    scope: dict[str, Any] = {}
    scope["k0"] = cpp_builds._Pending(batch, 0, scope, "k0")
    scope["k1"] = cpp_builds._Pending(batch, 1, scope, "k1")
    assert not batch.built  # the caller went on while it builds
    release.set()
    assert scope["k1"](5) == 10  # waits for the build
    assert batch.built
    assert threads == ["d9dfn-cpp-build"]
    assert not isinstance(scope["k1"], cpp_builds._Pending)  # the kernel itself now
    assert scope["k1"](5) == 10
    assert isinstance(scope["k0"], cpp_builds._Pending)  # not called yet
    assert scope["k0"](5) == 6


def test_a_build_that_fails_behind_the_caller_fails_again_at_the_kernels_call(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[str] = []

    def build(self: Any) -> list[Any]:
        attempts.append(threading.current_thread().name)
        raise RuntimeError("g++: error")

    monkeypatch.setattr(cpp_builds._Batch, "_build", build)
    batch = cpp_builds._Batch()
    batch.add(["float*"], "a")
    batch.start()
    scope: dict[str, Any] = {}
    scope["k0"] = cpp_builds._Pending(batch, 0, scope, "k0")
    for _ in range(100):  # the background attempt first (it would otherwise race the call below)
        if attempts:
            break
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="g\\+\\+: error"):
        scope["k0"](1)
    assert attempts[0] == "d9dfn-cpp-build"
    assert attempts[-1] == threading.current_thread().name  # the caller's own attempt raised


@pytest.mark.parametrize("early", [True, False])
def test_the_backward_is_compiled_with_its_forward_only_inside_and_only_where_builds_run_behind(
    monkeypatch: pytest.MonkeyPatch, early: bool
) -> None:
    from torch._functorch import config

    monkeypatch.setattr(cpp_builds, "_lowering_early", lambda: early)
    before = config.force_non_lazy_backward_lowering
    with cpp_builds.backward_compiled_early():
        assert config.force_non_lazy_backward_lowering is (early or before)
    assert config.force_non_lazy_backward_lowering is before
    with pytest.raises(ValueError, match="inside"), cpp_builds.backward_compiled_early():
        raise ValueError("inside")
    assert config.force_non_lazy_backward_lowering is before
