"""Tests for d9dfn.loop._trackers: logging.tracker, the JSONL and null trackers, and their resume position."""

from __future__ import annotations

import json

import pytest
from test_train import _configure_probed, losses, tiny_job

from d9dfn.config import JsonlTrackerConfig, NullTrackerConfig, TensorBoardTrackerConfig
from d9dfn.jobs import train_lm
from d9dfn.loop import JsonlTracker, NullTracker, Tracker, build_tracker
from d9dfn.loop import _events as ev


def test_build_tracker_matches_the_config_and_is_null_off_the_main_process(tmp_path) -> None:
    jsonl = build_tracker(JsonlTrackerConfig(filename="m.jsonl"), tmp_path)
    assert isinstance(jsonl, JsonlTracker)
    assert jsonl.path == tmp_path / "m.jsonl"
    assert isinstance(build_tracker(NullTrackerConfig(), tmp_path), NullTracker)
    assert isinstance(build_tracker(JsonlTrackerConfig(), tmp_path / "rank1", enabled=False), NullTracker)
    assert not (tmp_path / "rank1").exists()
    assert all(isinstance(t, Tracker) for t in (jsonl, NullTracker()))
    with pytest.raises(TypeError, match="build_tracker: dict is not a tracker config"):
        build_tracker({"provider": "jsonl"}, tmp_path)  # type: ignore[arg-type]


def test_jsonl_tracker_truncate_drops_a_half_written_line(tmp_path) -> None:
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    tracker.log([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}])
    with tracker.path.open("a") as file:
        file.write('{"step": 3, "lo')  # a kill mid-write
    assert tracker.position() == 2
    tracker.truncate(tracker.position())
    assert tracker.records() == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


def test_trainer_writes_the_configured_jsonl_filename(tmp_path) -> None:
    job = tiny_job(
        tmp_path, "trainer.total_steps=2", 'trainer.logging.tracker={"provider": "jsonl", "filename": "x.jsonl"}'
    )
    result = train_lm(job)
    assert not (result.run_dir / "metrics.jsonl").exists()
    records = [json.loads(line) for line in (result.run_dir / "x.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_trainer_with_the_null_tracker_records_nothing_and_skips_the_plot(tmp_path, capsys) -> None:
    job = tiny_job(tmp_path, "trainer.total_steps=4", 'trainer.logging.tracker={"provider": "null"}')
    result = train_lm(job)
    assert int(result.state.step) == 4
    assert [path.name for path in result.run_dir.glob("*.jsonl")] == ["timings.jsonl"]  # the loop's, not a tracker's
    assert result.plot_path is None
    assert "NullTracker keeps no records; skipping the loss plot" in capsys.readouterr().out


def test_trainer_resume_cuts_the_log_back_to_the_checkpoint(tmp_path) -> None:
    job = tiny_job(tmp_path, "trainer.total_steps=8")  # checkpoints at 4 and 8, logs every 2 steps

    def crash_at_7(ctx):
        if ctx.step == 7:
            raise KeyboardInterrupt  # steps 5-6 are logged, but the last checkpoint is step 4

    with pytest.raises(KeyboardInterrupt):
        _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, crash_at_7).train()
    assert sorted(losses(job.trainer.run_dir)) == [1, 2, 3, 4, 5, 6]
    _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None).train()
    assert sorted(losses(job.trainer.run_dir)) == list(range(1, 9))  # `losses` fails on a step logged twice


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``log_dir``'s event files, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return {tag: [(event.step, event.value) for event in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _as_tensorboard_stores(run_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's series as TensorBoard keeps them: (step, float32 value) per key, in order."""
    import numpy as np

    series: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step":
                series.setdefault(key, []).append((record["step"], float(np.float32(value))))
    return series


def test_tensorboard_tracker_event_files_equal_metrics_jsonl_after_a_crash_and_resume(tmp_path) -> None:
    """The event files, read with tensorboard's EventAccumulator, hold exactly metrics.jsonl's scalars and steps,
    validation included; the records a crash left after the last checkpoint are not shown twice."""
    tracker = 'trainer.logging.tracker={"provider": "tensorboard", "log_dir": "tb"}'
    job = tiny_job(tmp_path, "trainer.total_steps=8", "trainer.evaluation.period_steps=3", tracker)

    def crash_at_7(ctx):
        if ctx.step == 7:
            raise KeyboardInterrupt  # steps 5-6 (and validation at 6) logged; the last checkpoint is step 4

    with pytest.raises(KeyboardInterrupt):
        _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, crash_at_7).train()
    run_dir = job.trainer.run_dir
    assert [step for step, _ in _tensorboard_scalars(run_dir / "tb")["loss"]] == [1, 2, 3, 4, 5, 6]
    _configure_probed(job, ev.EVENT_TRAIN_STEP_PRE, lambda ctx: None).train()
    expected = _as_tensorboard_stores(run_dir)
    assert [step for step, _ in expected["loss"]] == list(range(1, 9))
    assert [step for step, _ in expected["val/loss"]] == [3, 6, 8]
    assert _tensorboard_scalars(run_dir / "tb") == expected
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 1  # rewritten on resume, not appended to


def test_tensorboard_tracker_without_the_package_is_a_one_line_error_naming_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    from _jobs import job_argv

    from d9dfn.cli import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` raises ImportError
    with pytest.raises(ValueError, match=r"needs the tensorboard package.*pip install 'd9dfn\[tb\]'"):
        build_tracker(TensorBoardTrackerConfig(), tmp_path)
    code = main(job_argv("train", tmp_path, 'trainer.logging.tracker={"provider": "tensorboard"}'))
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "d9dfn: error: logging.tracker.provider 'tensorboard' needs the tensorboard package, "
        "which is not installed: pip install 'd9dfn[tb]' (or choose provider 'jsonl')"
    ]
