"""Strict test setup: warnings are errors (pyproject), fixed seeds, one hypothesis profile per context."""

from __future__ import annotations

import os
import random
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
    import tempfile

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
