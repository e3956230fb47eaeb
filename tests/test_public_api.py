"""The public surface: every exported name resolves, and the list matches the committed snapshot.

A change to the public API is a deliberate act: update ``tests/public_api.txt`` in the same commit
(``python tests/test_public_api.py > tests/public_api.txt``) and say so in CHANGELOG.md.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = (
    "d9dfn",
    "d9dfn.checkpoint",
    "d9dfn.compat",
    "d9dfn.compat.megatron",
    "d9dfn.compat.timm",
    "d9dfn.config",
    "d9dfn.data",
    "d9dfn.jobs",
    "d9dfn.loop",
    "d9dfn.metrics",
    "d9dfn.models",
    "d9dfn.optim",
    "d9dfn.parallel",
    "d9dfn.pipeline",
    "d9dfn.prng",
    "d9dfn.schedules",
    "d9dfn.step",
    "d9dfn.tasks",
    "d9dfn.testing",
)
SNAPSHOT = Path(__file__).with_name("public_api.txt")


def surface() -> list[str]:
    lines = []
    for name in MODULES:
        module = importlib.import_module(name)
        lines.extend(f"{name}.{attr}" for attr in sorted(module.__all__))
    return lines


def test_every_exported_name_resolves():
    for name in MODULES:
        module = importlib.import_module(name)
        missing = [attr for attr in module.__all__ if not hasattr(module, attr)]
        assert not missing, f"{name}.__all__ names missing attributes: {missing}"
        assert len(module.__all__) == len(set(module.__all__)), f"{name}.__all__ has duplicates"


def test_public_surface_matches_the_committed_snapshot():
    assert surface() == SNAPSHOT.read_text().split(), (
        "the public API changed; if on purpose, regenerate tests/public_api.txt "
        "(python tests/test_public_api.py > tests/public_api.txt) and note it in CHANGELOG.md"
    )


@pytest.mark.slow
def test_import_d9dfn_stays_light():
    # The core must not pull in the edge (loop, configs, checkpoints, data, adapters, jobs), its heavy
    # dependencies (orbax, jax) or the hypothesis kit.
    edge = ("jax", "orbax", "hypothesis", "d9dfn.loop", "d9dfn.compat", "d9dfn.config", "d9dfn.checkpoint")
    edge += ("d9dfn.data", "d9dfn.jobs", "d9dfn.cli")
    code = f"import sys, d9dfn; print(sorted(m for m in sys.modules if m.startswith({edge!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


if __name__ == "__main__":
    print("\n".join(surface()))
