"""The README's example is examples/sft.py, verbatim, and it runs: the loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_is_examples_sft_py():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    example = (ROOT / "examples" / "sft.py").read_text()
    body = example.split('"""', 2)[2].lstrip("\n")  # the file minus its docstring
    assert blocks[0] == body


@pytest.mark.slow
@pytest.mark.cli
def test_examples_sft_py_trains_and_the_loss_falls():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sft.py")], capture_output=True, text=True, check=True, timeout=600
    ).stdout
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 6
    assert losses[-1] < losses[0] / 2


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = re.search(
        r"# The checks and tests \(what CI runs, via \.ci/run\).*\n.*&& (python3 -m nox -s [^\n]+)", readme
    )
    assert command is not None, "README lost its test command"
    assert command.group(1) in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.cli
def test_examples_pipeline_py_is_bitwise_the_unpipelined_step():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pipeline.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "r0 F0 F1" in out  # the 1F1B timeline the README shows
    assert out.rstrip().endswith("params bitwise equal to the unpipelined step: True")
