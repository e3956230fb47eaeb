"""Inductor's C++ builds renamed into place, and a library that fails to load built again
(``d9dfn/_torch/_atomic_builds.py``, issue 44)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from d9dfn._torch._atomic_builds import atomic_cpp_builds, rebuild_unloadable_libraries, supported, temporary_name

SOURCE = 'extern "C" int answer() { return 42; }\n'


def _builder(folder: Path, source: str = SOURCE) -> Any:
    from torch._inductor.cpp_builder import CppBuilder, CppOptions

    (folder / "lib.cpp").write_text(source)
    return CppBuilder(name="lib", sources=str(folder / "lib.cpp"), BuildOption=CppOptions(), output_dir=str(folder))


def test_the_patches_install_on_this_torch() -> None:
    from torch._inductor.cpp_builder import CppBuilder

    assert supported()
    assert atomic_cpp_builds()
    assert rebuild_unloadable_libraries()
    assert getattr(CppBuilder.build, "d9dfn_atomic", False)
    assert atomic_cpp_builds()  # once per process: not wrapped twice
    assert not hasattr(CppBuilder.build.__wrapped__, "d9dfn_atomic")  # type: ignore[attr-defined]


def test_a_build_writes_a_temporary_file_and_renames_it(tmp_path: Path, monkeypatch: Any) -> None:
    from torch._inductor import cpp_builder

    atomic_cpp_builds()
    seen = []
    compile_command = cpp_builder.run_compile_cmd

    def watched(command: str, cwd: str) -> None:
        seen.append(command)
        compile_command(command, cwd)
        assert not os.path.exists(tmp_path / "lib.so")  # g++ is done; the target appears only with the rename

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", watched)
    builder = _builder(tmp_path)
    builder.build()
    target = builder.get_target_file_path()
    assert target == str(tmp_path / "lib.so")  # the caller's builder keeps its target
    assert os.path.getsize(target) > 0
    assert f" -o {temporary_name(target, os.getpid(), __import__('threading').get_ident())}" in seen[0]
    assert sorted(os.listdir(tmp_path)) == ["lib.cpp", "lib.so"]


def test_a_failed_build_leaves_no_file_under_either_name(tmp_path: Path) -> None:
    from torch._inductor.exc import CppCompileError

    atomic_cpp_builds()
    builder = _builder(tmp_path, "this is not C++\n")
    with pytest.raises(CppCompileError):
        builder.build()
    assert [path.name for path in tmp_path.rglob("*") if path.is_file()] == ["lib.cpp"]


KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, shlex, signal, sys
    from d9dfn._torch._atomic_builds import atomic_cpp_builds
    from torch._inductor import cpp_builder

    if sys.argv[2] == "atomic":
        atomic_cpp_builds()

    def killed_while_writing(command, cwd):  # g++ has written part of its output when the process is killed
        words = shlex.split(command)
        with open(words[words.index("-o") + 1], "wb") as out:
            out.write(b"\\x7fELF partial")
        os.kill(os.getpid(), signal.SIGKILL)

    cpp_builder.run_compile_cmd = killed_while_writing
    folder = sys.argv[1]
    builder = cpp_builder.CppBuilder(
        name="lib", sources=os.path.join(folder, "lib.cpp"), BuildOption=cpp_builder.CppOptions(), output_dir=folder
    )
    builder.build()
    """
)


@pytest.mark.slow
def test_a_kill_while_g_plus_plus_writes_leaves_no_library_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "lib.cpp").write_text(SOURCE)
    done = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path), "atomic"], check=False, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert not (tmp_path / "lib.so").exists()
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]  # what the next start's sweep removes


def _kernel_cache(tmp_path: Path, monkeypatch: Any) -> Any:
    """torch's C++ code cache, empty, in a folder of this test's."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    clear_caches()
    atomic_cpp_builds()
    rebuild_unloadable_libraries()
    return CppPythonBindingsCodeCache


KERNEL = 'extern "C" void kernel(float* out_ptr0) { out_ptr0[0] = 42.0f; }\n'


def _call(cache: Any) -> float:
    import torch

    out = torch.zeros(1)
    cache.load_pybinding(["float*"], KERNEL)(out)
    return float(out[0])


@pytest.mark.slow
def test_a_library_that_fails_to_load_is_compiled_again(tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    import shutil

    from torch._inductor.utils import clear_caches

    cache = _kernel_cache(tmp_path, monkeypatch)
    assert _call(cache) == 42.0
    # The same cache under a path this process never loaded (dlopen answers a loaded path from memory), its library
    # emptied: what a kill left before builds were renamed into place, or a damaged disk.
    shutil.copytree(tmp_path / "cache", tmp_path / "copy", symlinks=True)
    (library,) = (tmp_path / "copy").rglob("*.main.so")
    library.write_bytes(b"")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "copy"))
    clear_caches()
    with caplog.at_level(logging.WARNING, logger="d9dfn._torch._atomic_builds"):
        assert _call(cache) == 42.0
    (line,) = [record.getMessage() for record in caplog.records if record.name.startswith("d9dfn")]
    assert line.startswith(f"d9dfn: compile cache {tmp_path / 'copy'}: the library {library.name} fails to load")
    assert line.endswith("it is compiled again")
    assert library.stat().st_size > 0
    clear_caches()


@pytest.mark.slow
def test_a_library_that_fails_again_raises_its_own_error(tmp_path: Path, monkeypatch: Any) -> None:
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.utils import clear_caches

    cache = _kernel_cache(tmp_path, monkeypatch)
    calls = []

    def never_loads(path: str, key: str) -> Any:
        calls.append(path)
        raise ImportError(f"{path}: libsomething.so: cannot open shared object file")

    monkeypatch.setattr(CppPythonBindingsCodeCache, "_load_library_inner", never_loads)
    with pytest.raises(ImportError, match="libsomething"):
        _call(cache)
    assert len(calls) == 2  # once, then once more after building it again; never a loop
    clear_caches()
