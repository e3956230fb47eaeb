"""The README's ``torchrun`` commands, run as written (compiled, the default) with a shortened run appended.

A README command that only eager tests cover can break unseen: the compiled data-parallel command once failed
on its first step while every multi-rank test, all eager, passed. So each ``torchrun`` line of the README runs
here as it is written, with only ``SHORTER`` appended (fewer steps and evaluation batches; ``--set`` applies in
order, so these come last and win), in a fresh working directory; d9d's MoE example (a config file) with
``MOE_SHORTER``, killed and resumed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
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

MOE_EXAMPLE = "examples/moe_pretrain.json"
"""d9d's Qwen3-MoE pretraining job, which the README runs from its config file."""


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


def _flag_commands() -> list[str]:
    """The README's ``torchrun`` lines that set the job with ``--set`` flags (every one but d9d's MoE example's)."""
    return [c for c in readme_torchrun_commands() if MOE_EXAMPLE not in c]


def test_readme_has_the_torchrun_commands_this_module_runs() -> None:
    moe = [c for c in readme_torchrun_commands() if MOE_EXAMPLE in c]
    assert moe == [f"torchrun --standalone --nproc-per-node 4 -m d9dfn train {MOE_EXAMPLE}"]
    commands = _flag_commands()
    assert len(commands) == 6, commands
    assert ["pipeline_parallel" in c for c in commands] == [False, False, False, False, True, True]
    assert [c.split()[6] for c in commands] == ["train", "train", "train", "train", "train", "infer"]
    names = ["stdlib-lm-dp", "stdlib-lm-tp", "stdlib-lm-cp", "stdlib-lm-fsdp", "stdlib-lm-pp", "stdlib-lm-pp"]
    assert [_run_name(c) for c in commands] == names
    assert 'mesh={"tensor_parallel": 2}' in commands[1]
    assert 'mesh={"context_parallel_shard": 2}' in commands[2]
    assert 'mesh={"data_parallel_shard": 2}' in commands[3]
    assert "trainer.activation_checkpointing" in commands[3]


ONE_PROCESS_LEAVES_OUT = ("mesh=", "trainer.activation_checkpointing=", "trainer.run.name=")
"""What a README line sets that its one-process reference leaves out: the layout, activation checkpointing (it
recomputes the forward in the backward and changes no number: the sharded command's job trained in one process with
it and without wrote byte-identical ``metrics.jsonl`` files) and the run's name (only the directory's)."""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[int, float]]:
    """The losses of a README line's job trained in this process, eager (its ``--set`` overrides but
    ``ONE_PROCESS_LEAVES_OUT``, then ``SHORTER``'s): the reference its ``torchrun`` run is compared with. Each distinct
    job is trained once for this module: the replicated and the sharded commands' are the same job (32 eager steps of
    the default model, about a minute of CPU on this 2-core machine)."""
    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig, default_job, train_lm

    trained: dict[str, dict[int, float]] = {}

    def job(line: str, save_dir: Path | str) -> LMJobConfig:
        overrides = [w for w in shlex.split(line) if "=" in w and not w.startswith(ONE_PROCESS_LEAVES_OUT)]
        overrides += [*SHORTER[1::2], f"trainer.checkpointing.save_dir={save_dir}", "trainer.compile=false"]
        return load_config(LMJobConfig, None, overrides, default=default_job())

    def losses(line: str) -> dict[int, float]:
        key = job(line, "one-process").model_dump_json()
        if key not in trained:
            trained[key] = _losses(train_lm(job(line, tmp_path_factory.mktemp("one-process"))).run_dir)
        return trained[key]

    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stdlib-lm-dp", "stdlib-lm-tp", "stdlib-lm-cp", "stdlib-lm-fsdp"])
@pytest.mark.cli
def test_readme_data_parallel_commands_compiled_train_like_one_process(
    name: str, tmp_path: Path, one_process: Callable[[str], dict[int, float]]
) -> None:
    """The replicated command, the tensor-parallel one (heads and MLP split, blocks' outputs all-reduced; the embedding
    and the head split by vocabulary rows, the loss on the split logits: mesh.vocab_parallel's default), the
    context-parallel one (each rank's head-tail chunks of every sequence, keys and values all-gathered), and the
    sharded one with activation checkpointing (each layer's params gathered where it runs, its forward recomputed in
    the backward): the losses of one process, up to float rounding."""
    line = next(c for c in readme_torchrun_commands() if _run_name(c) == name)
    done = _run(_command(line, "train"), tmp_path)
    assert done.stdout.count("d9dfn: trained 32 steps") == 1, done.stdout
    assert "d9dfn: validation perplexity" in done.stdout
    got = _losses(tmp_path / "runs" / name)

    # One process, the same job (the command's --set overrides but ONE_PROCESS_LEAVES_OUT), eager: the reference.
    expected = one_process(line)
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
    train_line, infer_line = _flag_commands()[4:]
    trained = _run(_command(train_line, "train"), tmp_path)
    assert trained.stdout.count("d9dfn: trained 32 steps") == 1, trained.stdout
    train_report = re.search(r"d9dfn: validation perplexity (\S+) .*checkpoint step 32\)", trained.stdout)
    assert train_report is not None, trained.stdout
    inferred = _run(_command(infer_line, "infer"), tmp_path)
    infer_report = re.search(r"d9dfn: validation perplexity (\S+) .*checkpoint step 32\)", inferred.stdout)
    assert infer_report is not None, inferred.stdout
    assert infer_report.group(1) == train_report.group(1)  # the same checkpoint, the same inference program
    assert "d9dfn: sample:" in inferred.stdout


MOE_SHORTER = (
    "trainer.total_steps=6",
    "trainer.checkpointing.period_steps=2",
    "trainer.logging.period_steps=2",
    "trainer.compile=false",
    "data.max_bytes=60000",
    "data.seq_len=32",
    "eval_batches=1",
    "sample.num_bytes=0",
)
"""d9d's Qwen3-MoE example (``MOE_EXAMPLE``) shortened: 6 steps, a checkpoint every 2 (the kill lands after one),
32-byte sequences, one evaluation batch, no sample; eager: compiling its 4 stages on 4 ranks took over 4 minutes on
this 2-core machine, three times over for the three runs (the compiled example is run by hand: README)."""


def test_moe_example_is_d9d_job_scaled_down_and_passes_the_job_checks() -> None:
    """d9d's layout (pp × dp_replicate with the experts over ep 2 carved out of it, looped BFS with 2 stages per rank),
    8 experts top-2, float32 compute (a pipelined MoE job needs it), compiled, and the job's own checks pass for the 4
    processes its command starts."""
    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig
    from d9dfn.jobs._checks import check_batching, check_experts
    from d9dfn.loop import mesh_axes

    job = load_config(LMJobConfig, ROOT / MOE_EXAMPLE)
    assert job.mesh is not None
    assert job.trainer.pipelining is not None
    assert job.model.moe is not None
    assert (job.mesh.world_size, job.mesh.pipeline_parallel, job.mesh.expert_parallel) == (4, 2, 2)
    axes = mesh_axes(job.mesh)
    assert dict(zip(axes.names, axes.sizes, strict=True)) == {"pp": 2, "dp_replicate": 1, "ep": 2, "dp_shard": 1}
    assert job.trainer.pipelining.schedule.options().program(2, 2).num_stages == 4
    assert (job.model.family, job.model.moe.num_experts, job.model.moe.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert job.trainer.compile
    check_batching(job, job.mesh.data_parallel_size)
    check_experts(job, job.mesh)


def _moe_command(line: str) -> list[str]:
    """The README's line for ``MOE_EXAMPLE`` as written, its config file named from the repository root and
    ``MOE_SHORTER`` appended."""
    words = [str(ROOT / MOE_EXAMPLE) if word == MOE_EXAMPLE else word for word in shlex.split(line)]
    return [sys.executable, "-m", "torch.distributed.run", *words[1:], *(a for s in MOE_SHORTER for a in ("--set", s))]


def _kill_everything(launcher: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun's workers (each leads a session of its own, inductor's helpers included) and torchrun: the
    machine lost at once, nothing given a chance to clean up."""
    import signal

    task = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    workers = [int(pid) for pid in task.read_text().split()]
    assert len(workers) == 4, workers
    for pid in workers:
        os.killpg(pid, signal.SIGKILL)
    launcher.kill()
    launcher.wait()


@pytest.mark.slow
@pytest.mark.cli
def test_readme_moe_example_resumes_bitwise_after_sigkill_and_exports_to_transformers(tmp_path: Path) -> None:
    """d9d's Qwen3-MoE pretraining job (``examples/moe_pretrain.json``: 4 gloo ranks as pp 2 × dp 2, looped BFS with
    2 stages per rank, 8 experts top-2 split over ep 2 in every stage), run by the README's command, shortened
    (``MOE_SHORTER``, eager): a clean run, and a run SIGKILLed (every process) after its first checkpoint and run
    again, whose ``metrics.jsonl`` is byte for byte the clean one's. The export of the resumed run loads in
    ``transformers`` with the d9dfn model's logits (within 1e-5)."""
    import time

    import transformers
    from test_train import _logged_steps, _run_cli

    from d9dfn.jobs import export_lm, load_model

    [line] = [c for c in readme_torchrun_commands() if MOE_EXAMPLE in c]
    command = _moe_command(line)
    for name in ("clean", "killed"):
        (tmp_path / name).mkdir()
    clean_log = tmp_path / "clean" / "run.log"
    assert _run_cli(Path(), clean_log, command=command).wait(timeout=900) == 0, clean_log.read_text()
    clean = tmp_path / "clean" / "runs" / "qwen3-moe-pretrain"
    assert "d9dfn: trained 6 steps" in clean_log.read_text()

    killed, log = tmp_path / "killed" / "runs" / "qwen3-moe-pretrain", tmp_path / "killed" / "run.log"
    launcher = _run_cli(Path(), log, command=command)
    deadline = time.monotonic() + 600
    while launcher.poll() is None and _logged_steps(killed / "metrics.jsonl") < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, f"the run ended before it could be killed:\n{log.read_text()}"
    _kill_everything(launcher)
    assert _run_cli(Path(), log, command=command).wait(timeout=600) == 0, log.read_text()
    assert f"d9dfn: resuming {killed.relative_to(tmp_path / 'killed')} from step " in log.read_text()

    records = [json.loads(row) for row in (clean / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert any(key.startswith("metrics/experts/tokens_per_expert/") for key in records[-1])
    assert (killed / "metrics.jsonl").read_bytes() == (clean / "metrics.jsonl").read_bytes()

    export_lm(killed, tmp_path / "hf", "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager").eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # Not bitwise at this config (measured max |Δ| 2.4e-7; the default sizes are: tests/test_qwen3_moe_job.py):
        # float32 rounding, not a wrong weight, which moves logits by 1e-2 or more.
        torch.testing.assert_close(theirs(input_ids=ids).logits, load_model(killed)(ids)["logits"], rtol=0, atol=1e-5)
