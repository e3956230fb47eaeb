"""SIGTERM and SIGINT during training: the step finishes, its checkpoint commits, one line, exit 143 / 130.

The loop's side (``d9dfn/loop/_signals.py``, ``Trainer.train``) in process; the command's side in child
processes (``d9dfn train``, and ``torchrun`` with 2 ranks), each resumed and compared byte for byte with an
uninterrupted run, as the SIGKILL tests in ``test_train.py`` do (their helpers are reused here).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train import _logged_steps, _run_cli, losses, tiny_job
from test_train_distributed import torchrun_command

from d9dfn import cli
from d9dfn.cli._interrupt import resume_command
from d9dfn.config import DeviceMeshParameters
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, train_lm
from d9dfn.loop import TrainingConfigurator, TrainingStopped, committed_steps
from d9dfn.loop import _events as ev
from d9dfn.loop._signals import StopSignals
from d9dfn.tasks import CausalLMTask

# 24 eager steps; checkpoints every 5 and logs every 2, so a stop lands between both periods.
OVERRIDES = (
    "trainer.total_steps=24",
    "trainer.checkpointing.period_steps=5",
    "trainer.checkpointing.num_to_keep=null",
    "trainer.logging.period_steps=2",
    "eval_batches=1",
    "sample.num_bytes=0",
)
STOPPED = re.compile(
    r"d9dfn: stopped by (SIGTERM|SIGINT) after step (\d+) of (\d+): checkpoint step (\d+) saved in (\S+); to resume, "
    r"run the same command: (.+)"
)


def _job_file(tmp_path: Path, name: str, *overrides: str) -> Path:
    job = tiny_job(tmp_path / name, *OVERRIDES, *overrides)
    path = tmp_path / f"{name}.json"
    path.write_text(job.model_dump_json())
    return path


def _run_dir(tmp_path: Path, name: str) -> Path:
    return tmp_path / name / "stdlib-lm"


def _messages(log: Path) -> list[str]:
    """The ``d9dfn:`` lines of a run's output (the progress bar's carriage returns split off)."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("d9dfn:")]


def _wait_for(condition: Any, process: subprocess.Popen, log: Path, what: str, timeout_s: float = 240) -> None:
    """Poll ``condition()`` until true; fail if ``process`` ends first or it takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the run ended ({process.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{log.read_text()}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """``metrics.jsonl`` of the job run from start to end by the command line, once for this module."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    config = _job_file(tmp_path, "clean")
    process = _run_cli(config, tmp_path / "clean.log")
    assert process.wait(timeout=300) == 0, (tmp_path / "clean.log").read_text()
    return (_run_dir(tmp_path, "clean") / "metrics.jsonl").read_bytes()


# --- the loop, in process ---------------------------------------------------------------------------


class _SignalsItselfAtStep(CausalLMTask):
    """Sends its own process ``number`` just before step ``step``."""

    def __init__(self, number: int, step: int) -> None:
        super().__init__()
        self.number, self.step = number, step

    def register_events(self, bus: ev.EventBus) -> None:
        super().register_events(bus)

        def maybe_signal(context: Any) -> None:
            if context.step == self.step:
                os.kill(os.getpid(), self.number)

        bus.subscribe(ev.EVENT_TRAIN_STEP_PRE, maybe_signal)


def _trainer(job: LMJobConfig, task: Any) -> Any:
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=lambda: task,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()


def test_trainer_train_stops_on_sigterm_with_a_checkpoint_and_resumes_bitwise(tmp_path):
    """A library caller: ``train()`` raises ``TrainingStopped`` after the step in flight, whose checkpoint is
    committed; the handlers come back; a second ``train()`` finishes the run as one uninterrupted run does."""
    reference = train_lm(tiny_job(tmp_path / "clean", *OVERRIDES, "trainer.total_steps=8"))
    job = tiny_job(tmp_path / "stopped", *OVERRIDES, "trainer.total_steps=8")
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(job, _SignalsItselfAtStep(signal.SIGTERM, step=3))
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) is before
    assert (stopped.value.step, stopped.value.checkpoint_step, stopped.value.exit_code) == (3, 3, 143)
    assert str(stopped.value) == (
        f"stopped by SIGTERM after step 3 of 8: checkpoint step 3 saved in {trainer.checkpoints.directory}"
    )
    assert committed_steps(trainer.checkpoints.directory) == [3]  # before the first periodic save (5)
    assert max(losses(trainer.run_dir)) == 3  # logged up to the step it stopped at, mid logging period

    resumed = _trainer(job, CausalLMTask()).train()
    assert resumed.steps_run == 8 - 3
    assert (trainer.run_dir / "metrics.jsonl").read_bytes() == (reference.run_dir / "metrics.jsonl").read_bytes()
    torch.testing.assert_close(resumed.state.params, reference.state.params, rtol=0, atol=0)


def test_stop_signals_note_the_first_signal_and_give_the_handlers_back():
    calls: list[int] = []

    def previous(number: int, frame: Any) -> None:
        calls.append(number)

    original = signal.signal(signal.SIGINT, previous)
    try:
        stop = TrainingStopped(
            signal.SIGINT, step=1, total_steps=2, checkpoint_step=1, checkpoint_dir=Path(), saved=True
        )
        with pytest.raises(TrainingStopped), StopSignals(lambda: "nothing on disk") as signals:  # noqa: PT012
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.received == signal.SIGINT  # the Python handler ran before os.kill returned
            raise stop
        assert signal.getsignal(signal.SIGINT) is previous
        assert calls == []  # acted on: not passed on

        with StopSignals(lambda: "nothing on disk") as signals:  # one that came after the loop's last look
            os.kill(os.getpid(), signal.SIGINT)
        assert calls == [signal.SIGINT]  # passed on to the handler it would have reached
    finally:
        signal.signal(signal.SIGINT, original)


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_train_command_stops_on_sigterm_with_one_line_and_resumes_bitwise(tmp_path, uninterrupted):
    """SIGTERM while it steps. (SIGINT from outside: the next test, and the torchrun test while it steps.)"""
    number = signal.SIGTERM
    config = _job_file(tmp_path, "stopped")
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"
    process = _run_cli(config, log)
    _wait_for(lambda: _logged_steps(run_dir / "metrics.jsonl") >= 3, process, log, "step 3")
    process.send_signal(number)
    assert process.wait(timeout=120) == 128 + number, log.read_text()

    [line] = _messages(log)
    match = STOPPED.fullmatch(line)
    assert match, line
    name, step, total, saved, directory, command = match.groups()
    assert (name, total, saved, directory) == ("SIGTERM", "24", step, str(run_dir / "checkpoints"))
    assert shlex.split(command) == [sys.executable, "-m", "d9dfn", "train", str(config)]
    assert "Traceback" not in log.read_text()
    assert committed_steps(run_dir / "checkpoints")[-1] == int(step)
    assert max(losses(run_dir)) == int(step)

    resumed = _run_cli(config, log, command=shlex.split(command))  # the command the line gives, as given
    assert resumed.wait(timeout=300) == 0, log.read_text()
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted


# A `d9dfn train` whose orbax commit (the rename of `<step>.orbax-checkpoint-tmp` to `<step>`) of one step waits
# for the test: it creates `<marker>.reached` there, then `mode` says what it waits for.
_STALLED_COMMIT = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path

    config, step, mode, marker = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    real_rename = os.rename

    def rename(source, target):
        if os.path.basename(target) == step:
            (marker.parent / (marker.name + ".reached")).touch()
            if mode == "until-released":  # the test signals, then removes the marker: the commit goes on
                while (marker.parent / (marker.name + ".reached")).exists():
                    time.sleep(0.01)
            else:  # "forever", once the first signal is noted: only a second signal ends it
                while not signal.getsignal(signal.SIGTERM).__self__.received:
                    time.sleep(0.01)
                (marker.parent / (marker.name + ".noted")).touch()
                time.sleep(600)
        real_rename(source, target)

    os.rename = rename
    from d9dfn.cli import main

    sys.exit(main(["train", config]))
    """
)


def _stalled_commit(config: Path, step: int, mode: str, log: Path) -> tuple[subprocess.Popen, Path]:
    marker = log.parent / "commit"
    command = [sys.executable, "-c", _STALLED_COMMIT, str(config), str(step), mode, str(marker)]
    return _run_cli(config, log, command=command), marker


@pytest.mark.slow
def test_ctrl_c_during_a_checkpoint_write_lets_it_commit_then_stops_there(tmp_path, uninterrupted):
    config = _job_file(tmp_path, "stopped")
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"
    process, marker = _stalled_commit(config, 10, "until-released", log)
    reached = marker.with_name("commit.reached")
    _wait_for(reached.exists, process, log, "the commit of step 10")
    process.send_signal(signal.SIGINT)  # inside the commit's rename (Python's KeyboardInterrupt would land there)
    reached.unlink()
    assert process.wait(timeout=120) == 130, log.read_text()

    [line] = _messages(log)
    assert line.startswith(f"d9dfn: stopped by SIGINT after step 10 of 24: checkpoint step 10 saved in {run_dir}"), line
    assert "Traceback" not in log.read_text()
    assert committed_steps(run_dir / "checkpoints") == [5, 10]
    assert _run_cli(config, log).wait(timeout=300) == 0, log.read_text()
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_the_uncommitted_step_is_ignored(tmp_path, uninterrupted):
    config = _job_file(tmp_path, "stopped")
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"
    process, marker = _stalled_commit(config, 10, "forever", log)
    _wait_for(marker.with_name("commit.reached").exists, process, log, "the commit of step 10")
    process.send_signal(signal.SIGTERM)
    _wait_for(marker.with_name("commit.noted").exists, process, log, "the first signal noted")
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)  # the main thread is inside the commit: a thread counts the second one
    assert process.wait(timeout=60) == 143, log.read_text()
    assert time.monotonic() - started < 10

    checkpoints = run_dir / "checkpoints"
    assert _messages(log) == [
        "d9dfn: SIGTERM again while stopping: exited at once, without waiting for the step or its checkpoint; the "
        f"newest committed checkpoint is step 5 in {checkpoints}: rerun the same command to resume from it"
    ]
    assert any(p.name.startswith("10.orbax-checkpoint-tmp") for p in checkpoints.iterdir()), "no partial save"
    assert committed_steps(checkpoints) == [5]

    assert _run_cli(config, log).wait(timeout=300) == 0, log.read_text()  # resumes from step 5
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted
    assert not any("orbax-checkpoint-tmp" in p.name for p in checkpoints.iterdir())  # the store removed it


def test_resume_command_is_the_command_without_resume_from(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = ["train", "job.json", "--resume-from", "4", "--set", "a.b=my value", "--resume-from=newest-intact"]
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "dev", "-m", "d9dfn", *argv])
    assert resume_command(argv) == "python3 -X dev -m d9dfn train job.json --set 'a.b=my value'"
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "/nowhere/bin/d9dfn", *argv])  # not on PATH
    assert resume_command(argv) == "/nowhere/bin/d9dfn train job.json --set 'a.b=my value'"


def test_a_signal_during_set_up_prints_one_line_and_exits_with_its_code(capsys, tmp_path, monkeypatch):
    """Before the loop runs there is no step to finish: the command stops where it is (here, loading the job)."""
    import d9dfn.config as config_module

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted at once
        raise AssertionError("SIGTERM did not interrupt the set-up")

    monkeypatch.setattr(config_module, "load_config", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["train", "--set", f"trainer.checkpointing.save_dir={tmp_path}"]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "d9dfn: stopped by SIGTERM during set-up (no training step was running); to retry, run the same command: "
        f"d9dfn train --set trainer.checkpointing.save_dir={tmp_path}"
    ]


# --- torchrun ---------------------------------------------------------------------------------------


def _worker_pids(launcher: subprocess.Popen, run_dir: Path) -> tuple[int, int]:
    """(rank 0, rank 1): torchrun's children; rank 0 is the one holding the run directory's lock."""
    children = [int(pid) for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
    holder = (run_dir / ".lock").read_text()
    [rank0] = [pid for pid in children if f"pid {pid} " in holder]
    [rank1] = [pid for pid in children if pid != rank0]
    return rank0, rank1


@pytest.mark.slow
def test_torchrun_ranks_stop_after_the_same_step_and_resume_bitwise(tmp_path):
    """SIGTERM to rank 1 alone, then Ctrl-C's SIGINT to torchrun (which forwards it to both ranks): each time
    both ranks stop after the same step with one line from rank 0, and the resumed run ends byte-identical.

    ``logging.period_steps=1``: the task's metric state of a rank other than 0 is not in the checkpoint, so a
    multi-rank resume from a step inside a logging period logs other ``metrics/*`` values (losses stay equal).
    """
    overrides = ("trainer.logging.period_steps=1", "trainer.total_steps=30")
    clean = _job_file(tmp_path, "clean", *overrides)
    assert _run_cli(clean, tmp_path / "clean.log", command=torchrun_command(clean)).wait(timeout=300) == 0
    config = _job_file(tmp_path, "stopped", *overrides)
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"

    launcher = _run_cli(config, log, command=torchrun_command(config))
    _wait_for(lambda: _logged_steps(run_dir / "metrics.jsonl") >= 3, launcher, log, "step 3")
    os.kill(_worker_pids(launcher, run_dir)[1], signal.SIGTERM)
    assert launcher.wait(timeout=120) == 1  # torchrun reports its workers' exits (143) as a failure
    [line] = _messages(log)
    match = STOPPED.fullmatch(line)
    assert match, line
    assert match.group(1) == "SIGTERM"
    first = int(match.group(2))
    assert shlex.split(match.group(6)) == torchrun_command(config)  # torchrun's command line, not a worker's
    assert sorted(re.findall(r"exitcode\s+: (-?\d+)", log.read_text())) == ["143", "143"]  # both ranks, as stopped
    assert committed_steps(run_dir / "checkpoints")[-1] == first == max(losses(run_dir))

    log.write_text("")
    launcher = _run_cli(config, log, command=torchrun_command(config))
    _wait_for(lambda: _logged_steps(run_dir / "metrics.jsonl") >= first + 3, launcher, log, f"step {first + 3}")
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=120) == 1  # torchrun's own SignalException, once its workers have stopped
    [line] = _messages(log)
    match = STOPPED.fullmatch(line)
    assert match, line
    assert match.group(1) == "SIGINT"
    second = int(match.group(2))
    assert second > first
    assert committed_steps(run_dir / "checkpoints")[-1] == second == max(losses(run_dir))

    assert _run_cli(config, log, command=torchrun_command(config)).wait(timeout=300) == 0, log.read_text()
    assert (run_dir / "metrics.jsonl").read_bytes() == (_run_dir(tmp_path, "clean") / "metrics.jsonl").read_bytes()
