"""Strict test setup: warnings are errors (pyproject), fixed seeds, one hypothesis profile per context."""

from __future__ import annotations

import os
import random
import sys
import tempfile
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci": the fixed, derandomized profile CI runs (>= 200 examples for the property tests that ask for it).
settings.register_profile(
    "ci",
    max_examples=200,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# "dev": quicker local runs; still derandomized so failures reproduce.
settings.register_profile(
    "dev", max_examples=50, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("D9DFN_TEST_PROFILE", "dev"))

# The host's compile cache behind each run's (d9dfn.loop.host_compile_cache): one for this test session, shared by its
# workers and every process they start (set here in the pytest process, before xdist starts its workers, which inherit
# it; named by that process's id), so the suite neither reads nor fills the user's
# ~/.cache, and a model one test compiled is warm for the next. Tests of the cache itself set their own.
if "D9DFN_COMPILE_CACHE" not in os.environ:
    _session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    os.environ["D9DFN_COMPILE_CACHE"] = os.path.join(tempfile.gettempdir(), f"d9dfn-test-compile-cache-{_session}")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    # And no pool of C++ compile workers in each worker and each process a test starts (a torchrun rank inherits the
    # variable): with both cores busy it only adds processes. The README's two data-parallel commands, run side by
    # side once each way, took 198 s with it against 228 s without; the whole CI suite, 24 min 51 s against 24 min 33 s
    # the stop before (inside its noise). Read when inductor's config is first imported, after this.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


COSTS = ("ranks", "compiled", "cli")
"""The markers by cost: each implies ``slow``, and a test that incurs one in its own process without carrying it
fails at teardown (:func:`_costs_marked`), so the markers stay true as tests change."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(cost) for cost in COSTS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def _inductor_graphs() -> int:
    """Graphs inductor compiled, or took from its caches, in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return sum(inductor[key] for key in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass"))


_COSTS_SEEN: dict[str, int] = {"ranks": 0, "cli": 0}


def _counting(kind: str, function: Any, counts: Any = lambda *args, **kwargs: True) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        if counts(*args, **kwargs):
            _COSTS_SEEN[kind] += 1
        return function(*args, **kwargs)

    return counted


def _starts_python(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> bool:
    """Whether a ``subprocess.Popen`` runs Python on a module or a script (the CLI, torchrun, a test script), not a
    tool (the C compiler) or a ``python -c`` probe (inductor's vector-ISA check) that a compile starts."""
    argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    if not argv:
        return False
    if any(os.fsdecode(arg) in ("torch.distributed.run", "torchrun") for arg in argv[:3]):
        _RanksLock.hold()  # torchrun's ranks, as a test's own
    first = os.path.basename(os.fsdecode(argv[0]))
    python = os.path.realpath(os.fsdecode(argv[0])) == os.path.realpath(sys.executable) or first.startswith("python")
    return first.startswith(("torchrun", "d9dfn")) or (python and argv[1:2] != ["-c"])


def pytest_configure(config: pytest.Config) -> None:
    # What a test starts, counted where every start goes through: torch's process launcher (forked gloo ranks, as
    # tests/_ranks.py starts them) and subprocess.Popen (the CLI, torchrun, a script).
    import subprocess

    import torch.multiprocessing as mp

    mp.start_processes = _counting("ranks", mp.start_processes)
    subprocess.Popen.__init__ = _counting("cli", subprocess.Popen.__init__, _starts_python)  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _costs_marked(request: pytest.FixtureRequest) -> Any:
    """Fail a test that forks ranks, starts a subprocess or compiles with inductor without its marker."""
    seen, graphs = dict(_COSTS_SEEN), _inductor_graphs()
    yield
    incurred = {
        "ranks": _COSTS_SEEN["ranks"] > seen["ranks"],
        "cli": _COSTS_SEEN["cli"] > seen["cli"],
        "compiled": _inductor_graphs() > graphs,
    }
    missing = [cost for cost, yes in incurred.items() if yes and not request.node.get_closest_marker(cost)]
    if missing and os.environ.get("D9DFN_TEST_COSTS_LOG"):  # a survey of the suite: note them, fail nothing
        with open(os.environ["D9DFN_TEST_COSTS_LOG"], "a") as log:
            log.write(f"{request.node.nodeid}\t{' '.join(missing)}\n")
    elif missing:
        pytest.fail(
            f"{request.node.nodeid} {' and '.join(_WHAT[m] for m in missing)} but is not marked "
            f"{', '.join(missing)}: add {' '.join(f'@pytest.mark.{m}' for m in missing)} (tests/conftest.py COSTS)",
            pytrace=False,
        )


_WHAT = {"ranks": "starts ranks", "cli": "starts a subprocess", "compiled": "compiles with inductor"}


class _RanksLock:
    """The lock a test holds while its ranks run (a file lock the xdist workers share): never two tests' ranks at
    once, so never more ranks than the two cores (two workers would otherwise run four). A test marked ``ranks`` takes
    it before it starts; a test that starts ``torchrun`` takes it at that start; both let it go at the test's end."""

    path = os.environ.setdefault(
        "D9DFN_TEST_RANKS_LOCK",  # set in the pytest process, inherited by its workers: one lock per session
        os.path.join(
            tempfile.gettempdir(), f"d9dfn-test-ranks-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}.lock"
        ),
    )
    held: Any = None

    @classmethod
    def hold(cls) -> None:
        if cls.held is None:
            import fcntl

            cls.held = open(cls.path, "a")  # noqa: SIM115 (held across calls)
            fcntl.flock(cls.held, fcntl.LOCK_EX)

    @classmethod
    def release(cls) -> None:
        if cls.held is not None:
            import fcntl

            fcntl.flock(cls.held, fcntl.LOCK_UN)
            cls.held.close()
            cls.held = None


@pytest.fixture(autouse=True)
def _one_ranks_test_at_a_time(request: pytest.FixtureRequest) -> Any:
    if request.node.get_closest_marker("ranks") is not None:
        _RanksLock.hold()
    try:
        yield
    finally:
        _RanksLock.release()


def pytest_report_header(config: pytest.Config) -> list[str]:
    profile = settings.get_current_profile_name()
    return [f"hypothesis profile: {profile} (max_examples={settings().max_examples}, derandomize=True)"]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """dynamo's caches emptied after each test. Every step a test builds compiles its pieces under code objects that
    all steps share (a builder's inner functions, torch's wrapper of a callable object such as the tail), and an entry
    whose guarded object has died still counts toward the recompile limit of the next one there: in one xdist worker,
    the cache entries of earlier tests' steps made a later test's tail hit the limit of 8."""
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
