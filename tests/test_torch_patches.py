"""The torch-patch table (``d9dfn/_torch/``, issue 40): each row installs on the pinned torch and leaves torch as it
was when off; the switch (``D9DFN_TORCH_PATCHES``); the version gate; ``docs/design/torch-internals.md`` generated
from the table; no torch private module used for these outside the seam."""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import d9dfn
from d9dfn import _torch
from d9dfn._torch import _compiled, _gate, _vec_isa
from d9dfn._torch._doc import render
from d9dfn._torch._gate import Patch, chosen, torch_version, verdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = {row.name: row for row in _torch.PATCHES}
SWITCHABLE = [row.name for row in _torch.PATCHES if row.kind != "required"]
PROCESS = [row for row in _torch.PATCHES if row.kind == "process"]
WITH_SCOPE = [row for row in _torch.PATCHES if row.scope is not None]
_MISSING = object()
pinned = pytest.mark.skipif(
    torch_version() != _torch.PINNED, reason=f"the rows are verified on torch {_torch.PINNED}, not {torch_version()}"
)


def _owner(path: str) -> tuple[Any, str]:
    """The object holding the last attribute of a dotted torch path, and that attribute's name."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise AssertionError(f"{path}: no importable module")


def _read(path: str) -> Any:
    """What ``path`` holds now: a config's value, else the object in its owner's own ``__dict__`` (so that a method
    put on an instance, or a classmethod object, is compared as the very object torch defines)."""
    from torch.utils._config_module import ConfigModule, SubConfigProxy

    owner, attribute = _owner(path)
    if isinstance(owner, ConfigModule | SubConfigProxy):
        return getattr(owner, attribute)
    return vars(owner).get(attribute, _MISSING)


def _snapshot(row: Patch) -> list[Any]:
    return [_read(path) for path in row.touches]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(x is y for x, y in zip(a, b, strict=True))


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Contexts the test enters, closed when it ends."""
    with contextlib.ExitStack() as entered:
        yield entered


def _a_compile_pool() -> contextlib.AbstractContextManager[Any]:
    """inductor's ``compile_threads`` at 2 (an xdist worker has it at 1 already: ``tests/conftest.py``)."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(compile_threads=2)


@pytest.fixture
def restored() -> Iterator[None]:
    """The rows on before the test are on after it, the others as the test found them: off, or not yet decided (a
    scoped row decides at its first use; left decided off, it would stay off for the later tests of the process)."""
    decided = dict(_gate._ON)
    before = _torch.installed()
    yield
    _torch.uninstall([name for name in _torch.installed() if name not in before])
    _torch.install(sorted(before), environ={})
    _gate._ON.clear()
    _gate._ON.update(decided)


@pinned
@pytest.mark.parametrize("row", _torch.PATCHES, ids=lambda row: row.name)
def test_each_row_names_what_it_touches_its_test_and_passes_its_capability_check(row: Patch) -> None:
    assert _torch.PINNED in row.verified
    assert row.capable(), f"{row.name}: the capability check fails on the pinned torch"
    for path in row.touches:
        owner, attribute = _owner(path)
        assert hasattr(owner, attribute), f"{row.name}: torch has no {path}"
    test_file, _, test_name = row.test.partition("::")
    assert f"def {test_name}(" in (ROOT / test_file).read_text(), f"{row.name}: no test {row.test}"
    assert (ROOT / "d9dfn" / "_torch" / f"{row.module}.py").is_file()


@pinned
@pytest.mark.parametrize("row", PROCESS, ids=lambda row: row.name)
def test_a_process_row_installs_once_and_off_leaves_torch_as_it_was(
    row: Patch, restored: None, monkeypatch: pytest.MonkeyPatch, stack: contextlib.ExitStack
) -> None:
    if row.name == "compile_pool_off" and torch.cuda.is_available():
        pytest.skip("with a GPU the compile pool stays (its Triton kernels compile there)")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    _torch.uninstall([row.name])
    if row.name == "compile_pool_off":  # a pool torch would start here (an xdist worker's setting is already 1)
        stack.enter_context(_a_compile_pool())
    torchs = _snapshot(row)
    assert row.name not in _torch.install([row.name], environ={"D9DFN_TORCH_PATCHES": "off"})
    assert _same(_snapshot(row), torchs), "switched off: torch's own objects"
    assert _torch.install([row.name], environ={}) == {row.name}
    patched = _snapshot(row)
    assert not _same(patched, torchs), f"{row.name}: installed, yet every attribute it touches is torch's"
    assert _torch.install([row.name], environ={}) == {row.name}
    assert _same(_snapshot(row), patched), "installed twice: wrapped once"
    _torch.uninstall([row.name])
    assert _same(_snapshot(row), torchs), "uninstalled: torch's own objects back"
    assert row.name not in _torch.installed()


@pinned
@pytest.mark.skipif(torch.cuda.is_available(), reason="the early backward is for hosts without a GPU")
@pytest.mark.parametrize("row", WITH_SCOPE, ids=lambda row: row.name)
def test_a_scoped_row_changes_torch_only_inside_its_scope(row: Patch, restored: None) -> None:
    assert row.scope is not None
    torchs = _snapshot(row)
    if row.kind != "required":
        _torch.install([row.name], environ={})
    with row.scope():
        assert not _same(_snapshot(row), torchs), f"{row.name}: inside its scope, torch is as it ships"
    assert _same(_snapshot(row), torchs), "after its scope: torch's own objects and settings"
    if row.kind != "required":
        _torch.uninstall([row.name])
        with row.scope():
            assert _same(_snapshot(row), torchs), "switched off: its scope leaves torch alone"


def test_a_piece_has_a_code_object_of_its_own_only_while_its_row_is_on(
    monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    compiled: list[Any] = []
    monkeypatch.setattr(_compiled.torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)

    def piece(x: int) -> int:
        return x + 1

    _torch.install([_compiled.OWN_CODE], environ={})
    assert _torch.compile_piece(piece, "eager")(1) == 2
    assert compiled[-1].__code__ is not piece.__code__
    _torch.uninstall([_compiled.OWN_CODE])
    _torch.compile_piece(piece, "eager")
    assert compiled[-1] is piece


@pytest.mark.skipif(torch.cuda.is_available(), reason="the early check is for hosts without a GPU")
def test_the_early_vec_isa_check_starts_only_while_its_row_is_on(
    monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    started: list[str] = []
    monkeypatch.setattr(_vec_isa, "_EARLY_STARTED", [])
    monkeypatch.setattr(_vec_isa, "_imports_of_the_check", lambda: None)
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name))
    _torch.uninstall([_vec_isa.EARLY])
    _torch.check_vec_isas_early()
    assert started == []
    _torch.install([_vec_isa.EARLY], environ={})
    _torch.check_vec_isas_early()
    _torch.check_vec_isas_early()  # once per process
    assert started == ["d9dfn-vec-isa"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, SWITCHABLE),
        ({"D9DFN_TORCH_PATCHES": "all"}, SWITCHABLE),
        ({"D9DFN_TORCH_PATCHES": " OFF "}, []),
        ({"D9DFN_TORCH_PATCHES": ""}, []),
        ({"D9DFN_TORCH_PATCHES": "cpp_builds_atomic, vec_isa_best_first"}, ["cpp_builds_atomic", "vec_isa_best_first"]),
        ({"D9DFN_TORCH_PATCHES": "-cpp_builds_batched"}, [n for n in SWITCHABLE if n != "cpp_builds_batched"]),
        (
            {"D9DFN_BATCH_CPP_BUILDS": "0"},
            [n for n in SWITCHABLE if n not in ("cpp_builds_batched", "compile_pool_off", "backward_lowered_early")],
        ),
        (
            {"D9DFN_BATCH_CPP_BUILDS": "0", "D9DFN_TORCH_PATCHES": "cpp_builds_batched,cpp_builds_atomic"},
            ["cpp_builds_atomic"],
        ),
    ],
    ids=["unset", "all", "off", "empty", "list", "all-but", "old-switch", "old-switch-wins"],
)
def test_the_switch_chooses_the_rows(environ: dict[str, str], expected: list[str]) -> None:
    assert chosen(environ, SWITCHABLE) == frozenset(expected)


def test_the_switch_refuses_a_name_that_is_no_rows() -> None:
    with pytest.raises(ValueError, match=r"D9DFN_TORCH_PATCHES='cpp_builds,-x': no torch patch is named 'cpp_builds'"):
        chosen({"D9DFN_TORCH_PATCHES": "cpp_builds,-x"}, SWITCHABLE)
    with pytest.raises(ValueError, match="name some of cpp_builds_batched"):
        _torch.install(environ={"D9DFN_TORCH_PATCHES": "nope"})


def test_the_gate_is_silent_on_a_verified_torch_and_says_one_line_otherwise() -> None:
    assert verdict("r", ["2.13.0"], "2.13.0", True) == (True, None)
    on, line = verdict("r", ["2.13.0"], "2.14.1", True)
    assert on
    assert line is not None
    assert "torch 2.14.1" in line
    assert "'r'" in line
    assert "installed" in line
    assert "\n" not in line
    on, line = verdict("r", ["2.13.0"], "2.11.0", False)
    assert not on
    assert line is not None
    assert "torch 2.11.0" in line
    assert "not installed" in line
    assert "D9DFN_TORCH_PATCHES" in line
    assert verdict("r", ["2.13.0"], "2.13.0", False)[0] is False  # a verified version whose check fails: left out too


@pytest.mark.parametrize(
    ("capable", "on"),
    [(lambda: True, True), (lambda: False, False), (lambda: 1 / 0, False)],
    ids=["ok", "no", "raises"],
)
def test_a_row_on_an_unverified_torch_installs_only_if_capable_with_one_line_once(
    capable: Any, on: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installs: list[int] = []
    row = Patch(
        name="test_row",
        kind="process",
        summary="",
        touches=(),
        verified=("2.13.0",),
        upstream="",
        test="",
        module="",
        capable=capable,
        install=lambda: installs.append(1),
    )
    monkeypatch.setitem(_gate._ROWS, row.name, row)
    monkeypatch.setattr(_gate, "_ON", {})
    monkeypatch.setattr(_gate, "_SAID", set())
    monkeypatch.setattr(_gate, "torch_version", lambda: "9.9.0")
    with caplog.at_level(logging.WARNING, logger="d9dfn._torch._gate"):
        for _ in range(3):
            assert (row.name in _torch.install([row.name], environ={})) is on
    lines = [r.getMessage() for r in caplog.records if "'test_row'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "torch 9.9.0" in lines[0]
    assert "D9DFN_TORCH_PATCHES" in lines[0]
    assert ("not installed" in lines[0]) is not on
    assert installs == ([1] if on else [])
    assert _torch.enabled(row.name) is on


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.embed(input_ids))}


def _built_inductor_step() -> None:
    model, opt = _Tiny(), d9dfn.optim.sgd(0.1)
    d9dfn.make_train_step(model, d9dfn.tasks.CausalLMTask(), opt, compile="inductor")  # builds; compiles nothing yet


@pinned
def test_off_leaves_torch_as_it_ships_when_a_step_is_built(
    monkeypatch: pytest.MonkeyPatch, restored: None, stack: contextlib.ExitStack
) -> None:
    monkeypatch.setattr(_vec_isa, "_EARLY_STARTED", [True])  # no background ISA check (seconds of C++ builds)
    _torch.uninstall()
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)  # an xdist worker sets it (tests/conftest.py)
    stack.enter_context(_a_compile_pool())  # a pool torch would start, which the row turns off
    torchs = {row.name: _snapshot(row) for row in PROCESS}
    monkeypatch.setenv("D9DFN_TORCH_PATCHES", "off")
    _built_inductor_step()
    assert _torch.installed() == frozenset()
    assert all(_same(_snapshot(row), torchs[row.name]) for row in PROCESS)
    assert not any(_torch.enabled(name) for name in SWITCHABLE)
    monkeypatch.delenv("D9DFN_TORCH_PATCHES")
    _torch.uninstall()
    _built_inductor_step()
    assert set(_torch.INDUCTOR_ROWS) <= _torch.installed()
    assert all(not _same(_snapshot(ROWS[name]), torchs[name]) for name in _torch.INDUCTOR_ROWS)


def test_the_design_page_is_generated_from_the_table() -> None:
    page = ROOT / "docs" / "design" / "torch-internals.md"
    assert page.read_text() == render(_torch.PATCHES), (
        "docs/design/torch-internals.md differs from the table: python -m d9dfn._torch > docs/design/torch-internals.md"
    )


_PRIVATE = ("torch._inductor", "torch._dynamo", "torch._functorch", "torch._higher_order_ops", "torch._C._dynamo")


def test_no_module_outside_the_seam_reaches_the_torch_internals_it_holds() -> None:
    found = []
    for path in sorted((ROOT / "d9dfn").rglob("*.py")):
        if path.parent.name == "_torch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            else:
                continue
            if any(name.startswith(_PRIVATE) for name in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {names[0]}")
    assert not found, "torch internals used outside d9dfn/_torch/ (go through the seam): " + "; ".join(found)
