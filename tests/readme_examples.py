"""The README's commands that compile longer than a test may take (120 s), run compiled as written, shortened.

``python3 -m nox -s examples`` (CI runs it after the tests): d9d's Qwen3-MoE pretraining job
(``examples/moe_pretrain.json``, ``torchrun --nproc-per-node 4``) compiled, 2 steps, against the same command eager.
Its first compiled step alone takes 100 s on 4 ranks sharing 2 cores, so no test can run it; the eager command's kill,
resume and export are tested in ``tests/test_readme_commands.py``. Exit 0 when every check holds; else the first one
that failed, with the run's output, and exit 1.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_readme_commands import MOE_EXAMPLE, ROOT, readme_torchrun_commands  # noqa: E402

SHORTER = ("trainer.total_steps=2", "trainer.checkpointing.period_steps=2", "eval_batches=2", "sample.num_bytes=8")
"""The example shortened: 2 steps, one checkpoint, 2 evaluation batches, an 8-byte sample."""

LOSS_TOLERANCE = 1e-4
"""Inductor against eager, relative, per step's loss (inductor fuses and reorders float32 arithmetic)."""


def _run(line: str, save_dir: Path, compiled: bool) -> tuple[float, list[float], dict]:
    """The README's ``line`` (``examples/...`` named from the repository root) with :data:`SHORTER`, saving under
    ``save_dir``; its wall seconds, the logged losses and the train record of ``timings.jsonl``."""
    words = [str(ROOT / MOE_EXAMPLE) if word == MOE_EXAMPLE else word for word in shlex.split(line)]
    sets = [*SHORTER, f"trainer.checkpointing.save_dir={save_dir}", f"trainer.compile={str(compiled).lower()}"]
    command = [sys.executable, "-m", "torch.distributed.run", *words[1:], *(a for s in sets for a in ("--set", s))]
    # A cold compile cache of its own: the figure printed is a first run's, wherever this runs.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env["D9DFN_COMPILE_CACHE"] = str(save_dir / "host")
    start = time.monotonic()
    done = subprocess.run(command, cwd=save_dir, env=env, capture_output=True, text=True, timeout=1500, check=False)
    wall = time.monotonic() - start
    output = f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    _check(done.returncode == 0, f"exit {done.returncode}", output)
    _check("d9dfn: trained 2 steps" in done.stdout, "no 'trained 2 steps' line", output)
    _check("validation perplexity" in done.stdout, "no validation perplexity", output)
    run = save_dir / "qwen3-moe-pretrain"
    rows = [json.loads(row) for row in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    _check(len(losses) == 2 and all(math.isfinite(x) for x in losses), f"losses {losses}", output)
    timings = [json.loads(row) for row in (run / "timings.jsonl").read_text().splitlines()]
    (train,) = [t for t in timings if t["command"] == "train"]
    _check(train["compile"] is compiled, f"timings say compile={train['compile']}", output)
    return wall, losses, train


def _check(holds: bool, what: str, output: str) -> None:
    if not holds:
        print(f"readme_examples: FAILED: {what}\n{output}", file=sys.stderr)
        raise SystemExit(1)


def main() -> int:
    [line] = [c for c in readme_torchrun_commands() if MOE_EXAMPLE in c]
    with tempfile.TemporaryDirectory(prefix="d9dfn-readme-examples-") as tmp:
        (Path(tmp) / "compiled").mkdir()
        (Path(tmp) / "eager").mkdir()
        wall, compiled, train = _run(line, Path(tmp) / "compiled", compiled=True)
        eager_wall, eager, _ = _run(line, Path(tmp) / "eager", compiled=False)
    for step, (a, b) in enumerate(zip(compiled, eager, strict=True), start=1):
        _check(abs(a - b) <= LOSS_TOLERANCE * abs(b), f"step {step}: loss {a} compiled, {b} eager", "")
    print(
        f"readme_examples: {line}\n  compiled, 2 steps: {wall:.1f} s (first step {train['first_step_s']:.1f} s), "
        f"losses {compiled}\n  eager, 2 steps: {eager_wall:.1f} s, losses {eager} (within {LOSS_TOLERANCE:g})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
