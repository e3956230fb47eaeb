"""The run directory: one writer (the lock), folders checked before step 1, atomic rewrites of run files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, job_argv
from _ranks import _init, _run_ranks

from d9dfn.cli import main
from d9dfn.loop import JsonlTracker, RunDirectoryError, RunLock, atomic_write

TINY = (*TINY_TRAINER, "trainer.logging.period_steps=1", *TINY_MODEL, *TINY_DATA)


def _argv(command: str, save_dir: Path, *overrides: str) -> list[str]:
    return job_argv(command, save_dir, *overrides, base=TINY)


def _env() -> dict[str, str]:
    # The child must import this tree's d9dfn, not an installed one.
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


# --- the lock ---------------------------------------------------------------------------------------------


def test_run_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirectoryError, match=rf"pid {os.getpid()} on host .*wait for that run"):
        RunLock(tmp_path).acquire()
    first.acquire()  # re-acquiring one's own lock is a no-op
    first.release()
    second = RunLock(tmp_path)
    second.acquire()
    assert second.held
    second.release()


def test_run_lock_of_a_sigkilled_process_is_free_at_once(tmp_path):
    # An OS lock dies with its process: no stale-lock cleanup, no timeout.
    code = (
        "import sys, time; from pathlib import Path; from d9dfn.loop import RunLock\n"
        f"lock = RunLock(Path({str(tmp_path)!r})); lock.acquire(); print('locked', flush=True); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(RunDirectoryError, match=rf"pid {holder.pid} "):
                RunLock(tmp_path).acquire()
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the file (with the dead pid) is still there; its lock is not
    assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()} ")
    lock.release()


@pytest.mark.slow
@pytest.mark.cli
def test_two_concurrent_trains_on_one_run_the_second_is_refused_and_nothing_is_logged_twice(tmp_path, capsys):
    overrides = ("trainer.total_steps=60", "trainer.checkpointing.period_steps=20")
    log = tmp_path / "first.log"
    with (
        log.open("wb") as out,
        subprocess.Popen(
            [sys.executable, "-m", "d9dfn", *_argv("train", tmp_path, *overrides)], env=_env(), stdout=out, stderr=out
        ) as first,
    ):
        metrics = tmp_path / "stdlib-lm" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert first.poll() is None, log.read_text()
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before the second could start"
        assert main(_argv("train", tmp_path, *overrides)) == 2
        err = capsys.readouterr().err
        assert f"pid {first.pid} on host" in err
        assert "is being written by" in err
        assert "Traceback" not in err
        assert first.wait(timeout=300) == 0, log.read_text()
    steps = [record["step"] for line in metrics.read_text().splitlines() if "loss" in (record := json.loads(line))]
    assert steps == list(range(1, 61))  # every step once, in order


# --- folders checked before the first step ------------------------------------------------------------------


def test_train_with_an_unwritable_run_folder_exits_2_before_the_first_step(tmp_path, capsys):
    # As root, permission bits do not stop writes; a file where the folder should be stops everyone.
    (tmp_path / "save").write_text("not a folder")
    assert main(_argv("train", tmp_path / "save", "trainer.total_steps=2")) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "save" / "stdlib-lm") in err
    assert "trainer.checkpointing.save_dir" in err
    assert "Traceback" not in err


def test_train_with_an_unwritable_checkpoint_folder_exits_2_before_the_first_step(tmp_path, capsys, monkeypatch):
    run = tmp_path / "stdlib-lm"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")
    from d9dfn import step

    def no_step(*args, **kwargs):
        raise AssertionError("the step was built: the folder was checked too late")

    monkeypatch.setattr("d9dfn.loop._train.make_train_step", no_step)
    assert step.make_train_step  # the step module stays importable; only its factory is replaced
    assert main(_argv("train", tmp_path, "trainer.total_steps=2")) == 2
    err = capsys.readouterr().err
    assert str(run / "checkpoints") in err
    assert "checkpoints/ folder" in err
    assert not (run / "metrics.jsonl").exists()


# --- atomic rewrites ---------------------------------------------------------------------------------------------


def _lock_on_ranks(rank: int, world_size: int, init_file: str, run_dirs: list[str], out: str) -> None:
    """Each rank checks its own view of the run directory (``run_dirs[rank]``) as ``configure`` does; what it raised
    goes to ``out/rank<r>``."""
    import socket

    dist = _init(rank, world_size, init_file)
    from d9dfn.loop._train import _lock_run_dir

    try:
        lock = _lock_run_dir(Path(run_dirs[rank]), main=rank == 0, distributed=True)
        outcome = "ok" if (lock is not None) == (rank == 0) else "lock held by the wrong rank"
    except RunDirectoryError as error:
        outcome = str(error)
        if rank == 0:  # a refused run lets its lock go: another lock on the folder is taken at once
            RunLock(Path(run_dirs[0])).acquire()
    Path(out, f"rank{rank}").write_text(f"{socket.gethostname()}\n{outcome}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("view", ["unwritable-checkpoints", "another-folder"])
@pytest.mark.ranks
def test_every_rank_checks_its_run_directory_before_step_1_and_all_fail_alike(tmp_path, view):
    # Issue 44 point 6: rank 1's run directory was found unwritable at the first checkpoint (steps lost, and advice
    # to rerun that failed again); rank 0's alone was checked up front. A rank sees the run directory as it is on
    # its host: here rank 1 is given its own view of it.
    run, seen = tmp_path / "run", tmp_path / "rank1-view"
    seen.mkdir()
    if view == "unwritable-checkpoints":
        (seen / ".lock").write_text("rank 0's lock, as this host sees it")
        (seen / "checkpoints").write_text("a file where the folder should be")  # unwritable even for root
    out = tmp_path / "out"
    out.mkdir()
    _run_ranks(_lock_on_ranks, 2, tmp_path, [str(run), str(seen)], str(out))
    host, outcome = (out / "rank1").read_text().split("\n", 1)
    assert (out / "rank0").read_text().split("\n", 1)[1] == outcome  # every rank fails alike, with the same line
    assert outcome.startswith(f"TrainingConfigurator: rank 1 (host {host}): ")
    if view == "unwritable-checkpoints":
        assert f"the run cannot write to {seen / 'checkpoints'} (" in outcome
    else:
        assert f"it does not see {seen / '.lock'}, which rank 0 has just written" in outcome
        assert "on a filesystem that every host shares" in outcome


@pytest.mark.ranks
def test_two_ranks_that_can_write_the_run_directory_go_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _run_ranks(_lock_on_ranks, 2, tmp_path, [str(tmp_path / "run")] * 2, str(out))
    assert [(out / f"rank{r}").read_text().split("\n", 1)[1] for r in (0, 1)] == ["ok", "ok"]


def test_atomic_write_leaves_the_old_file_when_the_writer_fails(tmp_path):
    target = atomic_write(tmp_path / "job.json", "old")

    def fails(file):
        file.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fails)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json"]  # no temporary left behind
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_jsonl_tracker_truncate_replaces_the_file_atomically(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log([{"step": 1}, {"step": 2}, {"step": 3}])
    inode = tracker.path.stat().st_ino
    tracker.truncate(3)  # nothing to forget: untouched
    assert tracker.path.stat().st_ino == inode
    with tracker.path.open("ab") as file:
        file.write(b'{"step": 4, "lo')  # a half-written line from a killed run
    tracker.truncate(2)
    assert tracker.path.stat().st_ino != inode  # a new file renamed over the old one
    assert tracker.records() == [{"step": 1}, {"step": 2}]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
