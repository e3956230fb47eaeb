"""The seam's two controls: one switch (``D9DFN_TORCH_PATCHES``) and a version gate
(``docs/design/torch-internals.md``).

Every use of torch's private API that changes what torch does is a row of :data:`d9dfn._torch.PATCHES` (a
:class:`Patch`). Whether a row is on in this process is decided here, once: the switch must choose it
(:func:`chosen`), and the gate must let it in (:func:`verdict`): on a torch version the row was verified on it
installs silently; on any other it installs only if its capability check passes, with one warning line, and a row
whose check fails is left out with one warning line too. Nothing turns itself off without saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

__all__ = [
    "CPP_BUILDS_ENV",
    "ENV",
    "Patch",
    "chosen",
    "enabled",
    "install",
    "installed",
    "register",
    "restore",
    "swap",
    "swapped",
    "torch_version",
    "uninstall",
    "verdict",
]

_log = logging.getLogger(__name__)

ENV = "D9DFN_TORCH_PATCHES"
"""The one switch: unset or ``all`` (every row), ``off`` (none), or a comma list of row names (``-name`` leaves one
out of all)."""

CPP_BUILDS_ENV = "D9DFN_BATCH_CPP_BUILDS"
"""The older switch, kept as an alias: ``0`` leaves out the rows in :data:`_CPP_BUILDS_ROWS`."""

_CPP_BUILDS_ROWS = ("cpp_builds_batched", "compile_pool_off", "backward_lowered_early")
_ALL = frozenset({"all", "on", "1", "true", "yes"})
_OFF = frozenset({"off", "none", "0", "false", "no", ""})

Kind = Literal["process", "scoped", "action", "required"]
"""``process``: installed once, changes torch for the whole process until :func:`uninstall`; ``scoped``: a torch
setting or attribute changed only inside a d9dfn call (its ``scope``), while the row is on; ``action``: work torch
would do anyway, started earlier by d9dfn while the row is on (no torch attribute changed); ``required``: a setting
or hook that a d9dfn feature needs to be correct (no switch: turning it off would change results, not speed)."""


def _nothing() -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Patch:
    """One row of the table: what d9dfn changes in torch, where, on which torch it was verified, and how to turn
    it off.

    Args:
        name: the row's name, as ``D9DFN_TORCH_PATCHES`` takes it.
        kind: ``"process"``, ``"scoped"`` or ``"required"`` (:data:`Kind`).
        summary: what it does and why, one or two sentences.
        touches: the torch attributes it replaces, sets or relies on (dotted paths).
        verified: the torch versions (``major.minor.patch``) its tests passed on.
        upstream: the torch issue or pull request behind it, or ``"none found"``.
        test: the test that shows its effect (``tests/test_x.py::test_name``).
        module: the ``d9dfn._torch`` module that holds it.
        capable: the capability check: whether this torch has the pieces it relies on, in the shape it expects.
        install: turns it on (process rows: patches torch; others: nothing, their code asks :func:`enabled`).
        uninstall: turns it off, restoring torch's original objects.
        scope: a scoped or required row's scope, as d9dfn enters it (the table's test enters it too).
    """

    name: str
    kind: Kind
    summary: str
    touches: tuple[str, ...]
    verified: tuple[str, ...]
    upstream: str
    test: str
    module: str
    capable: Callable[[], bool]
    install: Callable[[], None] = _nothing
    uninstall: Callable[[], None] = _nothing
    scope: Callable[[], AbstractContextManager[Any]] | None = None

    @property
    def switches(self) -> tuple[str, ...]:
        """The settings that turn it off, any one of them (none for a ``required`` row)."""
        if self.kind == "required":
            return ()
        alias = (f"{CPP_BUILDS_ENV}=0",) if self.name in _CPP_BUILDS_ROWS else ()
        return (f"{ENV}=-{self.name}", *alias)


_ROWS: dict[str, Patch] = {}
_ON: dict[str, bool] = {}  # row name -> on in this process (absent: not decided yet)
_SAID: set[str] = set()  # rows whose gate line was logged
_LOCK = threading.RLock()


def register(row: Patch) -> Patch:
    """Add ``row`` to the rows :func:`install` and :func:`enabled` know (``d9dfn/_torch/_table.py`` registers each)."""
    if row.name in _ROWS and _ROWS[row.name] is not row:
        raise AssertionError(f"register: a second row named {row.name!r}")
    _ROWS[row.name] = row
    return row


def _switchable() -> list[str]:
    return [name for name, row in _ROWS.items() if row.kind != "required"]


def chosen(environ: Mapping[str, str], names: Sequence[str]) -> frozenset[str]:
    """The rows among ``names`` that ``environ``'s switch chooses.

    ``D9DFN_TORCH_PATCHES`` unset, ``all``, ``on``: every row; ``off``, ``none``, ``0`` or empty: none; a comma list of
    names: those rows; names each preceded by ``-``: every row but those. ``D9DFN_BATCH_CPP_BUILDS=0`` (the older
    switch) leaves out the batched C++ builds, the compile pool's removal and the early backward whatever the list
    says.

    >>> rows = ["a", "b", "c"]
    >>> sorted(chosen({}, rows)), sorted(chosen({"D9DFN_TORCH_PATCHES": "off"}, rows))
    (['a', 'b', 'c'], [])
    >>> sorted(chosen({"D9DFN_TORCH_PATCHES": "a, c"}, rows)), sorted(chosen({"D9DFN_TORCH_PATCHES": "-b"}, rows))
    (['a', 'c'], ['a', 'c'])

    Raises:
        ValueError: a name that is no row's.
    """
    value = environ.get(ENV)
    setting = "all" if value is None else value.strip().lower()
    picked: set[str]
    if setting in _ALL:
        picked = set(names)
    elif setting in _OFF:
        picked = set()
    else:
        items = [item.strip() for item in value.split(",") if item.strip()] if value else []
        unknown = [item.lstrip("-") for item in items if item.lstrip("-") not in names]
        if unknown:
            raise ValueError(
                f"{ENV}={value!r}: no torch patch is named {unknown[0]!r}; name some of {', '.join(names)} "
                "(-name leaves one out of all), or set it to all or off (docs/design/torch-internals.md)"
            )
        added = {item for item in items if not item.startswith("-")}
        picked = (added or set(names)) - {item[1:] for item in items if item.startswith("-")}
    if environ.get(CPP_BUILDS_ENV, "1").strip().lower() in _OFF:
        picked -= set(_CPP_BUILDS_ROWS)
    return frozenset(picked)


_MISSING = object()
_SWAPPED: dict[tuple[object, str], object] = {}  # (owner, attribute) -> what the owner's own __dict__ held


def swap(owner: object, attribute: str, new: object) -> None:
    """Set ``owner.attribute`` to ``new``, remembering (the first time) what ``owner``'s own ``__dict__`` held, so
    that :func:`restore` puts back that very object (or removes the attribute, if it was inherited)."""
    _SWAPPED.setdefault((owner, attribute), vars(owner).get(attribute, _MISSING))
    setattr(owner, attribute, new)


def restore(owner: object, attribute: str) -> None:
    """Undo :func:`swap` of ``owner.attribute`` (nothing when it was not swapped)."""
    if (owner, attribute) not in _SWAPPED:
        return
    original = _SWAPPED.pop((owner, attribute))
    if original is _MISSING:
        delattr(owner, attribute)
    else:
        setattr(owner, attribute, original)


def swapped(owner: object, attribute: str) -> bool:
    """Whether ``owner.attribute`` is d9dfn's (swapped and not restored)."""
    return (owner, attribute) in _SWAPPED


def torch_version() -> str:
    """This torch's version without its local label: ``"2.13.0"`` for ``2.13.0+cpu``."""
    import torch

    return str(torch.__version__).split("+", 1)[0]


def verdict(name: str, verified: Collection[str], version: str, capable: bool) -> tuple[bool, str | None]:
    """The gate: whether row ``name`` installs on torch ``version``, and the one line to log (``None``: silent).

    >>> verdict("x", ["2.13.0"], "2.13.0", True)
    (True, None)
    >>> verdict("x", ["2.13.0"], "2.14.0", True)[0], verdict("x", ["2.13.0"], "2.14.0", False)[0]
    (True, False)
    """
    where = ", ".join(sorted(verified)) or "no version"
    if capable and version in verified:
        return True, None
    if capable:
        return True, (
            f"d9dfn: torch {version}: the torch patch {name!r} was verified on torch {where} only; its capability "
            f"check passed, so it is installed ({ENV}=-{name} leaves it out; docs/design/torch-internals.md)"
        )
    return False, (
        f"d9dfn: torch {version}: the torch patch {name!r} is not installed: its capability check failed (the torch "
        f"internals it patches differ from torch {where}'s); torch's own behaviour stands ({ENV}=-{name} or "
        f"{ENV}=off silences this; docs/design/torch-internals.md)"
    )


def _row(name: str) -> Patch:
    try:
        return _ROWS[name]
    except KeyError:
        raise ValueError(f"d9dfn._torch: no torch patch is named {name!r}; the rows are {', '.join(_ROWS)}") from None


def _turn_on(row: Patch, version: str) -> bool:
    try:
        capable = bool(row.capable())
    except Exception:  # a capability check that itself breaks on another torch is a failed check
        _log.debug("d9dfn: the capability check of %s raised", row.name, exc_info=True)
        capable = False
    on, line = verdict(row.name, row.verified, version, capable)
    if line is not None and row.name not in _SAID:
        _SAID.add(row.name)
        _log.warning(line)
    if on:
        row.install()
    return on


def install(names: Iterable[str] | None = None, environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Turn on the rows ``names`` (default: every switchable row) that the switch (``environ``, default the
    process's) chooses and the gate lets in, each once per process; returns which of ``names`` are on.

    A row already on stays on (a switch that now leaves it out does not uninstall it: :func:`uninstall` does). A
    ``required`` row is always on (its code runs where its feature is used).

    Raises:
        ValueError: a name that is no row's, or a switch that names one (:func:`chosen`).
    """
    rows = [_row(name) for name in (_switchable() if names is None else names)]
    wanted = chosen(os.environ if environ is None else environ, _switchable())
    with _LOCK:
        version = torch_version()
        for row in rows:
            if row.kind == "required" or _ON.get(row.name):
                continue
            _ON[row.name] = row.name in wanted and _turn_on(row, version)
        return frozenset(row.name for row in rows if row.kind == "required" or _ON[row.name])


def uninstall(names: Iterable[str] | None = None) -> None:
    """Turn off the rows ``names`` (default: every switchable row), restoring torch's own objects and settings where
    one was on; they stay off until :func:`install` turns them on again. A ``required`` row is left as it is."""
    with _LOCK:
        for row in [_row(name) for name in (_switchable() if names is None else names)]:
            if row.kind == "required":
                continue
            if _ON.get(row.name):
                row.uninstall()
            _ON[row.name] = False  # decided: off (a scoped row's first use does not turn it on)


def installed() -> frozenset[str]:
    """The switchable rows that are on in this process."""
    return frozenset(name for name, on in _ON.items() if on)


def enabled(name: str) -> bool:
    """Whether row ``name`` is on, deciding it (switch and gate, :func:`install`) at its first use in the process:
    what a scoped row's scope asks at each entry (a dict lookup once decided)."""
    on = _ON.get(name)
    if on is None:
        on = name in install([name])
    return on
