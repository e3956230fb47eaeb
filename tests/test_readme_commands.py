"""The README's ``torchrun`` commands, run as written (compiled, the default) with a shortened run appended.

A README command that only eager tests cover can break unseen: the compiled data-parallel command once failed
on its first step while every multi-rank test, all eager, passed. So each ``torchrun`` line of the README runs
here as it is written, with only ``SHORTER`` appended (fewer steps and evaluation batches; ``--set`` applies in
order, so these come last and win), in a fresh working directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

SHORTER = (
    "--set",
    "trainer.total_steps=32",
    "--set",
    "eval_batches=2",
    "--set",
    "sample.num_bytes=16",
)


def readme_torchrun_commands() -> list[str]:
    """Every line of the README's bash blocks that starts with ``torchrun``, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.startswith("torchrun ")]


def _command(line: str, subcommand: str) -> list[str]:
    words = shlex.split(line)
    assert words[0] == "torchrun"
    assert subcommand in words, line
    overrides = SHORTER if subcommand == "train" else SHORTER[2:]  # infer reads the trained run's steps
    return [sys.executable, "-m", "torch.distributed.run", *words[1:], *overrides]


def _run(command: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, shlex.join(command) + "\n" + done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _run_name(line: str) -> str:
    """The run directory's name a README line chooses with ``--set trainer.run.name=...`` (the default's if none)."""
    names = [word.split("=", 1)[1] for word in shlex.split(line) if word.startswith("trainer.run.name=")]
    return names[-1] if names else "stdlib-lm"


def test_readme_has_the_torchrun_commands_this_module_runs() -> None:
    commands = readme_torchrun_commands()
    assert len(commands) == 5, commands
    assert ["pipeline_parallel" in c for c in commands] == [False, False, False, True, True]
    assert [c.split()[6] for c in commands] == ["train", "train", "train", "train", "infer"]
    names = ["stdlib-lm-dp", "stdlib-lm-tp", "stdlib-lm-fsdp", "stdlib-lm-pp", "stdlib-lm-pp"]
    assert [_run_name(c) for c in commands] == names
    assert 'mesh={"tensor_parallel": 2}' in commands[1]
    assert 'mesh={"data_parallel_shard": 2}' in commands[2]
    assert "trainer.activation_checkpointing" in commands[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stdlib-lm-dp", "stdlib-lm-tp", "stdlib-lm-fsdp"])
@pytest.mark.cli
def test_readme_data_parallel_commands_compiled_train_like_one_process(name: str, tmp_path: Path) -> None:
    """The replicated command, the tensor-parallel one (heads and MLP split, blocks' outputs all-reduced), and the
    sharded one with activation checkpointing (each layer's params gathered where it runs, its forward recomputed in
    the backward): the losses of one process, up to float rounding."""
    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig, default_job, train_lm

    line = next(c for c in readme_torchrun_commands() if _run_name(c) == name)
    done = _run(_command(line, "train"), tmp_path)
    assert done.stdout.count("d9dfn: trained 32 steps") == 1, done.stdout
    assert "d9dfn: validation perplexity" in done.stdout
    got = _losses(tmp_path / "runs" / name)

    # One process, the same job (the command's --set overrides but the mesh), eager: the reference.
    overrides = [word for word in shlex.split(line) if "=" in word and not word.startswith("mesh=")]
    overrides += [*SHORTER[1::2], f"trainer.checkpointing.save_dir={tmp_path / 'one'}", "trainer.compile=false"]
    job = load_config(LMJobConfig, None, overrides, default=default_job())
    expected = _losses(train_lm(job).run_dir)
    assert sorted(got) == sorted(expected)
    assert len(got) >= 3
    # Inductor's fused kernels against eager ATen, and a sum over 2 ranks: float32 rounding that Adam carries
    # through 32 steps, not a different computation (measured max relative difference: see the closing note).
    ours, theirs = torch.tensor([got[s] for s in sorted(got)]), torch.tensor([expected[s] for s in sorted(got)])
    print(f"{name}: max relative loss difference against one process {((ours - theirs).abs() / theirs).max():.2e}")
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=0)


@pytest.mark.slow
@pytest.mark.cli
def test_readme_pipeline_commands_compiled_train_then_infer(tmp_path: Path) -> None:
    train_line, infer_line = readme_torchrun_commands()[3:]
    trained = _run(_command(train_line, "train"), tmp_path)
    assert trained.stdout.count("d9dfn: trained 32 steps") == 1, trained.stdout
    train_report = re.search(r"d9dfn: validation perplexity (\S+) .*checkpoint step 32\)", trained.stdout)
    assert train_report is not None, trained.stdout
    inferred = _run(_command(infer_line, "infer"), tmp_path)
    infer_report = re.search(r"d9dfn: validation perplexity (\S+) .*checkpoint step 32\)", inferred.stdout)
    assert infer_report is not None, inferred.stdout
    assert infer_report.group(1) == train_report.group(1)  # the same checkpoint, the same inference program
    assert "d9dfn: sample:" in inferred.stdout
