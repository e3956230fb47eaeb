"""A compile cache's seal (``d9dfn/loop/_cache_seal.py``, issue 44): what a start keeps and takes out of a cache
directory, what travels between the host's cache and a run's, and the in-use lock that keeps a live process's
unsealed files from another process's sweep."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d9dfn.loop import _compile_cache
from d9dfn.loop._cache_seal import (
    SEAL,
    Swept,
    cache_files,
    fingerprint,
    intact,
    link_from_host,
    publish_to_host,
    read_seal,
    seal,
    set_aside_folder,
    sweep,
)


def _write(root: Path, relative: str, data: bytes) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _flip(path: Path, at: int, count: int = 4) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, min(at + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_fingerprint_is_the_size_and_crc32(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.so", b"\x7fELF" * 1000)
    assert fingerprint(str(path)) == (4000, zlib.crc32(b"\x7fELF" * 1000))
    assert intact(str(path), (4000, zlib.crc32(b"\x7fELF" * 1000)))
    assert not intact(str(path), (4000, zlib.crc32(b"other")))
    assert not intact(str(tmp_path / "missing"), (4000, 0))
    empty = _write(tmp_path, "e.py", b"")
    assert not intact(str(empty), (0, 0))  # an empty file is never a good cache entry


DAMAGE = ["none", "empty", "truncate", "flip", "remove"]
NAMES = st.lists(
    st.tuples(
        st.sampled_from(["ab", "cd", "fxgraph/ef/fgh", "aotautograd/aij"]),
        st.text("abcdefgh0123456789", min_size=1, max_size=8),
        st.sampled_from([".so", ".py", ".main.cpp", ""]),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda t: (t[0], t[1], t[2]),
)


@settings(max_examples=40, deadline=None)
@given(
    names=NAMES,
    damage=st.data(),
    unsealed=st.lists(st.text("xyz", min_size=1, max_size=4), max_size=3, unique=True),
)
def test_a_sweep_keeps_exactly_the_sealed_intact_files(
    tmp_path_factory: Any, names: list[tuple[str, str, str]], damage: Any, unsealed: list[str]
) -> None:
    root = tmp_path_factory.mktemp("cache") / "rank_0"
    files = {f"{folder}/c{stem}{ext}": os.urandom(16 + len(stem) * 7) for folder, stem, ext in names}
    for relative, data in files.items():
        _write(root, relative, data)
    assert seal(str(root)) == len(files)
    what = {relative: damage.draw(st.sampled_from(DAMAGE), label=relative) for relative in files}
    for relative, kind in what.items():
        path = root / relative
        if kind == "empty":
            path.write_bytes(b"")
        elif kind == "truncate":
            path.write_bytes(files[relative][: len(files[relative]) // 2])
        elif kind == "flip":
            _flip(path, len(files[relative]) // 3)
        elif kind == "remove":
            path.unlink()
    for name in unsealed:  # written by a process that stopped before it sealed them; and its temporary files
        _write(root, f"zz/c{name}.so", b"\x7fELF unsealed")
        _write(root, f"zz/.c{name}.so.1.2.tmp", b"\x7fE")
        _write(root, f"triton/0/tmp.pid_1_{name}/kernel.cubin", b"half")

    swept = sweep(str(root))

    kept = {relative for relative, kind in what.items() if kind == "none"}
    damaged = {relative for relative, kind in what.items() if kind in ("empty", "truncate", "flip")}
    assert set(cache_files(str(root))) == kept
    assert set(read_seal(str(root))) == kept
    assert (swept.damaged, swept.unsealed) == (len(damaged), len(unsealed))
    assert not list(root.rglob("*.tmp"))
    assert not list(root.rglob("tmp.pid_*"))
    aside = Path(set_aside_folder(str(root)))
    assert {p.relative_to(aside).as_posix() for p in aside.rglob("*") if p.is_file()} == damaged
    assert all((root / relative).read_bytes() == files[relative] for relative in kept)
    assert not sweep(str(root))  # a second start finds nothing to take out
    assert set(cache_files(str(root))) == kept


def test_the_sweep_says_what_it_took_out_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "rank_0"
    good, bad = _write(root, "ab/cgood.so", b"good library"), _write(root, "ab/cbad.so", b"bad library")
    seal(str(root))
    bad.write_bytes(b"")
    _write(root, "cd/cnew.py", b"a module no process used")
    swept = sweep(str(root))
    assert swept == Swept(damaged=1, unsealed=1, set_aside_in=set_aside_folder(str(root)))
    line = swept.line(str(root))
    assert "\n" not in line
    assert line.startswith(f"d9dfn: compile cache {root}: set aside 1 damaged file(s) in ")
    assert "removed 1 file(s)" in line
    assert line.endswith("torch compiles them again")
    assert good.exists()
    assert not bad.exists()
    assert Swept().line(str(root)) == ""


def test_a_seal_adds_new_files_only_and_never_an_empty_one(tmp_path: Path) -> None:
    root = tmp_path / "rank_0"
    _write(root, "ab/ca.so", b"first")
    assert seal(str(root)) == 1
    _write(root, "ab/cb.py", b"second")
    _write(root, "ab/cempty.py", b"")
    _write(root, "locks/cb.lock", b"")
    _write(root, "ab/.cc.so.12.34.tmp", b"half")
    assert seal(str(root)) == 1
    assert set(read_seal(str(root))) == {"ab/ca.so", "ab/cb.py"}
    assert seal(str(root)) == 0
    record = json.loads((root / SEAL).read_text())
    assert record["version"] == 1
    assert record["files"]["ab/ca.so"] == [5, zlib.crc32(b"first")]


@pytest.mark.parametrize("seal_text", ["", "{", "[]", '{"version": 99, "files": {}}', '{"version": 1}'])
def test_a_damaged_seal_trusts_nothing(tmp_path: Path, seal_text: str) -> None:
    root = tmp_path / "rank_0"
    _write(root, "ab/ca.so", b"library")
    seal(str(root))
    (root / SEAL).write_text(seal_text)
    assert read_seal(str(root)) == {}
    assert sweep(str(root)).unsealed == 1
    assert cache_files(str(root)) == []


def test_a_sweep_beside_a_live_process_leaves_its_unsealed_files(tmp_path: Path) -> None:
    root = tmp_path / "rank_0"
    sealed = _write(root, "ab/ca.so", b"sealed library")
    seal(str(root))
    live = _write(root, "cd/cb.so", b"a live process's new library")
    building = _write(root, "cd/.cc.so.7.8.tmp", b"being written")
    sealed.write_bytes(b"damaged")
    swept = sweep(str(root), unsealed=False)
    assert (swept.damaged, swept.unsealed) == (1, 0)
    assert live.exists()
    assert building.exists()


def _host_and_run(tmp_path: Path) -> tuple[Path, Path]:
    host, run = tmp_path / "host" / "rank_0", tmp_path / "run" / "rank_0"
    for relative in ("ab/cgood.so", "ab/cbad.so", "fxgraph/ef/fgh/entry", "cd/chave.py"):
        _write(host, relative, f"host's {relative}".encode())
    seal(str(host))
    run.mkdir(parents=True)
    return host, run


def test_a_run_gets_only_the_hosts_sealed_intact_files(tmp_path: Path) -> None:
    host, run = _host_and_run(tmp_path)
    (host / "ab" / "cbad.so").write_bytes(b"")  # damaged in the host
    _write(host, "gh/cunsealed.so", b"left by a process that stopped while publishing")
    _write(host, "gh/.cpart.so.1.1.tmp", b"half")
    _write(run, "cd/chave.py", b"the run's own, sealed")
    seal(str(run))
    _write(run, "fxgraph/ef/fgh/entry", b"a live process's, unsealed")

    assert link_from_host(str(host), str(run)) == 1

    assert os.path.samefile(run / "ab" / "cgood.so", host / "ab" / "cgood.so")  # a link, not a copy
    assert not (run / "ab" / "cbad.so").exists()
    assert (run / "cd" / "chave.py").read_bytes() == b"the run's own, sealed"
    assert (run / "fxgraph" / "ef" / "fgh" / "entry").read_bytes() == b"a live process's, unsealed"
    assert set(read_seal(str(run))) == {"ab/cgood.so", "cd/chave.py"}
    # The host cleaned on the way: its damaged file set aside, its unsealed and temporary files gone.
    assert set(cache_files(str(host))) == {"ab/cgood.so", "cd/chave.py", "fxgraph/ef/fgh/entry"}
    assert set(read_seal(str(host))) == {"ab/cgood.so", "cd/chave.py", "fxgraph/ef/fgh/entry"}
    assert (Path(set_aside_folder(str(host))) / "ab" / "cbad.so").exists()
    assert not list(host.rglob("*.tmp"))


def test_damage_through_a_hard_link_is_found_in_both_caches(tmp_path: Path) -> None:
    host, run = _host_and_run(tmp_path)
    link_from_host(str(host), str(run))
    _flip(run / "ab" / "cgood.so", 2)  # one inode: the host's file is damaged too
    assert sweep(str(run)).damaged == 1
    assert link_from_host(str(host), str(run)) == 0  # the host's copy fails its check: not linked, set aside
    assert not (run / "ab" / "cgood.so").exists()
    assert not (host / "ab" / "cgood.so").exists()
    assert "ab/cgood.so" not in read_seal(str(host))


def test_only_sealed_intact_files_are_published(tmp_path: Path) -> None:
    host, run = tmp_path / "host" / "rank_0", tmp_path / "run" / "rank_0"
    _write(run, "ab/cgood.so", b"proved good")
    _write(run, "ab/cbad.so", b"damaged after it was sealed")
    _write(run, "cd/cleft.so", b"a leftover in the host, unsealed")
    seal(str(run))
    (run / "ab" / "cbad.so").write_bytes(b"\x00" * len(b"damaged after it was sealed"))
    _write(run, "cd/cnew.so", b"not used yet: unsealed")
    _write(host, "cd/cleft.so", b"half")  # a process stopped between its link and its seal

    assert publish_to_host(str(run), str(host)) == 2

    assert set(read_seal(str(host))) == {"ab/cgood.so", "cd/cleft.so"}
    assert os.path.samefile(host / "ab" / "cgood.so", run / "ab" / "cgood.so")
    assert (host / "cd" / "cleft.so").read_bytes() == b"a leftover in the host, unsealed"
    assert not (host / "ab" / "cbad.so").exists()
    assert not (host / "cd" / "cnew.so").exists()
    assert publish_to_host(str(run), str(host)) == 0


def test_a_process_using_the_run_cache_keeps_its_unsealed_files_from_another_start(
    tmp_path: Path, monkeypatch: Any
) -> None:
    fcntl = pytest.importorskip("fcntl")
    root = tmp_path / "rank_0"
    root.mkdir()
    monkeypatch.setattr(_compile_cache, "_IN_USE", {})
    new = _write(root, "ab/cnew.so", b"the live process's library, not sealed yet")
    with open(root / _compile_cache._IN_USE_LOCK, "a") as other:  # another process's lifetime lock
        fcntl.flock(other, fcntl.LOCK_SH)
        _compile_cache._open(str(root))
        assert new.exists()
    _compile_cache._open(str(root))  # alone now: the unsealed file goes (its own lock let go of first)
    assert not new.exists()
    os.close(_compile_cache._IN_USE.pop(str(root)))


def test_a_forked_child_does_not_keep_the_in_use_lock(tmp_path: Path, monkeypatch: Any) -> None:
    fcntl = pytest.importorskip("fcntl")
    root = tmp_path / "rank_0"
    root.mkdir()
    monkeypatch.setattr(_compile_cache, "_IN_USE", {})
    _compile_cache._open(str(root))
    started, ready = os.pipe()
    child = os.fork()
    if child == 0:  # a data-loading worker that outlives its parent a moment
        import time

        os.write(ready, b"1")  # the fork's handlers have run
        time.sleep(3)
        os._exit(0)
    try:
        assert os.read(started, 1) == b"1"
        os.close(_compile_cache._IN_USE.pop(str(root)))  # the parent is gone
        with open(root / _compile_cache._IN_USE_LOCK, "a") as other:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the next start has the cache to itself at once
    finally:
        os.waitpid(child, 0)
        os.close(started)
        os.close(ready)
