"""SIGTERM and SIGINT during training: the step finishes, its checkpoint commits, one line, exit 143 / 130.

The loop's side (``d9dfn/loop/_signals.py``, ``Trainer.train``) in process; the command's side in child
processes (``d9dfn train``, and ``torchrun`` with 2 ranks), each resumed and compared byte for byte with an
uninterrupted run, as the SIGKILL tests in ``test_train.py`` do (their helpers are reused here).
"""

from __future__ import annotations

import contextlib
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The 8-step job trained from start to end in this process, once for this module (eager: what the in-process
    tests' stopped and resumed runs must equal)."""
    return train_lm(tiny_job(tmp_path_factory.mktemp("reference") / "clean", *OVERRIDES, "trainer.total_steps=8"))


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


def test_trainer_train_stops_on_sigterm_with_a_checkpoint_and_resumes_bitwise(tmp_path, reference):
    """A library caller: ``train()`` raises ``TrainingStopped`` after the step in flight, whose checkpoint is
    committed; the handlers come back; a second ``train()`` finishes the run as one uninterrupted run does."""
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


class _SignalsItselfInItsFirstLoss(CausalLMTask):
    """Sends its own process ``number`` from inside the step: its first ``compute_loss``, as a compile would get it."""

    def __init__(self, number: int) -> None:
        super().__init__()
        self.number, self.sent = number, False

    def compute_loss(self, outputs: Any, state: Any, step: Any) -> Any:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.number)
        return super().compute_loss(outputs, state, step)


def test_trainer_train_stops_inside_its_first_step_at_once_and_resumes_bitwise(tmp_path, reference):
    """A signal inside the process's first step (the compile's place) stops it there, before the step ends: nothing of
    the step is written (no checkpoint, no log record), the checkpoint before it is unchanged, and the next ``train()``
    redoes it as an uninterrupted run does. (Eager here; the command's compiled runs are the slow tests below.)"""
    job = tiny_job(tmp_path / "stopped", *OVERRIDES, "trainer.total_steps=8")
    with pytest.raises(TrainingStopped):  # after step 3, with its checkpoint: what the first step resumes from
        _trainer(job, _SignalsItselfAtStep(signal.SIGTERM, step=3)).train()
    trainer = _trainer(job, _SignalsItselfInItsFirstLoss(signal.SIGINT))
    logged = (trainer.run_dir / "metrics.jsonl").read_bytes()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert signal.getsignal(signal.SIGINT) is before
    assert trainer.task.sent
    assert (stopped.value.step, stopped.value.checkpoint_step, stopped.value.saved) == (3, 3, False)
    assert (stopped.value.during, stopped.value.exit_code) == ("the first step", 130)
    assert str(stopped.value) == (
        "stopped by SIGINT during the first step (step 4 of 8): no checkpoint written this run; checkpoint step 3 in "
        f"{trainer.checkpoints.directory} is unchanged"
    )
    assert committed_steps(trainer.checkpoints.directory) == [3]
    assert (trainer.run_dir / "metrics.jsonl").read_bytes() == logged  # nothing of step 4

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


_BLOCKED_IN_C = textwrap.dedent(
    """
    import ctypes, shlex, sys
    from d9dfn.loop._signals import StopSignals

    with StopSignals(lambda: "what is on disk", deadline_s=1.0) as signals, signals.abrupt("the first step's compile"):
        # C that retries its wait on EINTR: no Python handler runs meanwhile. The marker says it is waiting.
        ctypes.CDLL(None).system(f"touch {shlex.quote(sys.argv[1])}; sleep 30".encode())
    sys.exit(3)
    """
)


def test_a_main_thread_blocked_in_c_inside_abrupt_is_ended_at_the_deadline(tmp_path):
    """A rank waiting inside the compile's step for a peer that left, or a long kernel: the handler cannot run, so
    the watcher thread ends the process ``deadline_s`` after the signal, with one line (without it: 30 s here)."""
    marker, log = tmp_path / "inside", tmp_path / "log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", _BLOCKED_IN_C, str(marker)],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            stderr=out,
            start_new_session=True,  # its own group: the `sleep` it leaves behind is killed below
        )
    try:
        _wait_for(marker.exists, process, log, "the block", timeout_s=120)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 143, log.read_text()
        elapsed = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert 1.0 <= elapsed < 10, elapsed
    assert _messages(log) == [
        "d9dfn: stopped by SIGTERM during the first step's compile, still running 1 s later (blocked in C: a "
        "collective, a kernel): exited at once, no checkpoint written this run; what is on disk"
    ]


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.cli
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


def _at_once(seconds: float = 10.0) -> float:
    """How long a stop "at once" may take: ``seconds`` on an idle machine, stretched by the load average per core
    (the suite beside a second full run ran four test processes on two cores, and a stop took 14 s there). A stop
    that waited for the compile instead takes the compile's time (tens of seconds cold) under the same load."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@pytest.mark.slow
@pytest.mark.cli
def test_train_command_stops_at_once_during_the_first_compile_and_the_evaluations(tmp_path, monkeypatch):
    """SIGTERM while the first step compiles (cold): the command exits 143 within seconds, not after the compile, with
    one line and nothing written; its rerun trains to the end, byte-identical to an uninterrupted run, and SIGINT
    while the evaluation after it compiles exits 130 at once, saying the trained checkpoint is committed."""
    overrides = ("trainer.compile=true", "trainer.total_steps=6")  # checkpoints at 5 and 6
    clean = _job_file(tmp_path, "clean", *overrides)
    assert _run_cli(clean, tmp_path / "clean.log").wait(timeout=300) == 0, (tmp_path / "clean.log").read_text()
    config = _job_file(tmp_path, "stopped", *overrides)
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"

    with monkeypatch.context() as env:
        env.setenv("D9DFN_COMPILE_CACHE", "off")  # no host cache behind the run's: a cold compile, tens of seconds
        process = _run_cli(config, log)
    _wait_for(lambda: "compiling (first step)" in log.read_text(errors="replace"), process, log, "the compile")
    time.sleep(0.5)  # into dynamo's trace or inductor's codegen
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, log.read_text()
    elapsed = time.monotonic() - started
    assert elapsed < _at_once(), f"{elapsed:.1f} s:\n{log.read_text()}"
    command = shlex.join([sys.executable, "-m", "d9dfn", "train", str(config)])
    assert _messages(log) == [
        "d9dfn: stopped by SIGTERM during the first step's compile (step 1 of 6): no checkpoint written this run, "
        f"and none saved before; to resume, run the same command: {command}"
    ]
    assert "Traceback" not in log.read_text()
    assert committed_steps(run_dir / "checkpoints") == []
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_bytes()

    log.write_text("")
    process = _run_cli(config, log)
    _wait_for(lambda: "compiling (first batch)" in log.read_text(errors="replace"), process, log, "the evaluation")
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, log.read_text()
    elapsed = time.monotonic() - started
    assert elapsed < _at_once(), f"{elapsed:.1f} s:\n{log.read_text()}"
    assert _messages(log)[-1] == (
        "d9dfn: stopped by SIGINT during the evaluation after training: training had finished, its last checkpoint "
        f"(step 6) is committed in {run_dir}; to evaluate, run the same command: {command}"
    )
    assert "Traceback" not in log.read_text()
    assert committed_steps(run_dir / "checkpoints") == [5, 6]
    assert (run_dir / "metrics.jsonl").read_bytes() == (_run_dir(tmp_path, "clean") / "metrics.jsonl").read_bytes()


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
@pytest.mark.cli
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
@pytest.mark.cli
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
    assert time.monotonic() - started < _at_once()

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
@pytest.mark.cli
def test_torchrun_ranks_stop_after_the_same_step_and_resume_bitwise(tmp_path):
    """SIGTERM to rank 1 alone, then Ctrl-C's SIGINT to torchrun (which forwards it to both ranks): each time
    both ranks stop after the same step with one line from rank 0, and the resumed run ends byte-identical.

    ``logging.period_steps=3``: a stop mostly lands inside a logging period, whose ``metrics/*`` then come from both
    ranks' partial metric states in the checkpoint (a deterministic case: ``test_train_distributed.py::
    test_torchrun_resume_inside_a_logging_period_logs_byte_identical_metrics``).
    """
    overrides = ("trainer.logging.period_steps=3", "trainer.total_steps=30")
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
    resuming, line = _messages(log)
    assert resuming == f"d9dfn: resuming {run_dir} from step {first}"  # each rank its own metric state: no more
    match = STOPPED.fullmatch(line)
    assert match, line
    assert match.group(1) == "SIGINT"
    second = int(match.group(2))
    assert second > first
    assert committed_steps(run_dir / "checkpoints")[-1] == second == max(losses(run_dir))

    assert _run_cli(config, log, command=torchrun_command(config)).wait(timeout=300) == 0, log.read_text()
    assert (run_dir / "metrics.jsonl").read_bytes() == (_run_dir(tmp_path, "clean") / "metrics.jsonl").read_bytes()


# A torchrun worker (a script: torchrun takes no `-c`) whose rank 1 stalls inside its first compile (inductor's entry
# point sleeps, as a long compile runs, until a signal ends it) while rank 0 goes on and waits in a collective for it;
# each creates `<marker>.rank<N>` once there.
_RANK_1_COMPILES_SLOWLY = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    config, marker = sys.argv[1], Path(sys.argv[2])
    if os.environ["RANK"] == "1":
        import torch._inductor.compile_fx as inductor

        compile_fx = inductor.compile_fx

        def slowly(*args, **kwargs):
            marker.with_name(marker.name + ".rank1").touch()
            time.sleep(600)
            return compile_fx(*args, **kwargs)

        inductor.compile_fx = slowly
    else:
        import torch.distributed._functional_collectives as funcol

        wait_tensor = funcol.wait_tensor

        def wait(*args, **kwargs):
            marker.with_name(marker.name + ".rank0").touch()
            return wait_tensor(*args, **kwargs)

        funcol.wait_tensor = wait
    from d9dfn.cli import main

    sys.exit(main(["train", config]))
    """
)


@pytest.mark.slow
@pytest.mark.cli
def test_torchrun_sigterm_during_the_first_compile_stops_every_rank_inside_the_grace_and_resumes_bitwise(tmp_path):
    """SIGTERM to torchrun (which SIGTERMs its workers' process groups, then SIGKILLs them 30 s later) while rank 1
    compiles and rank 0 waits for it in a collective: rank 1 stops at once, rank 0's collective fails as rank 1 leaves,
    which is its stop too; both exit by themselves well inside the grace, rank 0 prints the one line, nothing is
    written, and the rerun ends byte-identical to an uninterrupted run."""
    overrides = ("trainer.compile=true", "trainer.total_steps=6")
    clean = _job_file(tmp_path, "clean", *overrides)
    clean_log = tmp_path / "clean.log"
    assert _run_cli(clean, clean_log, command=torchrun_command(clean)).wait(timeout=300) == 0, clean_log.read_text()
    config = _job_file(tmp_path, "stopped", *overrides)
    run_dir, log = _run_dir(tmp_path, "stopped"), tmp_path / "stopped.log"
    script, marker = tmp_path / "rank_1_compiles_slowly.py", tmp_path / "compile"
    script.write_text(_RANK_1_COMPILES_SLOWLY)
    command = [*torchrun_command(config)[:-4], str(script), str(config), str(marker)]  # not `-m d9dfn train CONFIG`

    launcher = _run_cli(config, log, command=command)
    there = [marker.with_name(f"compile.rank{rank}") for rank in (0, 1)]
    _wait_for(lambda: all(p.exists() for p in there), launcher, log, "rank 1 compiling, rank 0 waiting for it")
    time.sleep(1.0)  # rank 0 into the collective's wait
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 1, log.read_text()  # torchrun's own SignalException, once its workers ended
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    assert elapsed < 20, f"{elapsed:.1f} s:\n{text}"  # and not SIGKILLed by torchrun (its line for that):
    assert "forcefully exiting" not in text, text
    assert text.count("Traceback") == 1, text  # torchrun's; none from a worker
    assert _messages(log) == [
        "d9dfn: stopped by SIGTERM during the first step's compile (step 1 of 6): no checkpoint written this run, "
        f"and none saved before; to resume, run the same command: {shlex.join(command)}"
    ]
    assert committed_steps(run_dir / "checkpoints") == []

    resumed = _run_cli(config, log, command=torchrun_command(config))
    assert resumed.wait(timeout=300) == 0, log.read_text()
    assert (run_dir / "metrics.jsonl").read_bytes() == (_run_dir(tmp_path, "clean") / "metrics.jsonl").read_bytes()
