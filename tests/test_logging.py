"""Tests for d9dfn.loop._logging: the progress bar's first-step status line, and progress in evaluation."""

from __future__ import annotations

import re

from test_train import tiny_job

from d9dfn.jobs import evaluate_lm, train_lm
from d9dfn.loop import ProgressBar


def test_progress_bar_shows_compiling_with_elapsed_time_then_a_bar_that_counts_warm_steps(capsys) -> None:
    bar = ProgressBar(10, initial=3, tick_s=0.01)
    with bar.first_step("compiling (first step)"):
        assert bar.ticker is not None
        assert bar.ticker.ticked.wait(10)  # the thread redrew the line while the "step" ran
        during = capsys.readouterr().err
    assert "train: compiling (first step)… 00:00" in during
    assert "%|" not in during  # no bar, no ETA while compiling
    assert bar.first_step_s is not None
    assert bar.first_step_s > 0
    bar.update(4, tokens=100, loss=2.5)
    bar.update(5, tokens=100, loss=2.0)
    bar.close()
    after = capsys.readouterr().err
    assert re.search(r"train:  50%\|.*\| 5/10 .*loss=2\.0000, first step=\d+\.\ds", after), after
    assert not bar.ticker._thread.is_alive()


def test_progress_bar_off_the_main_process_times_the_first_step_silently(capsys) -> None:
    bar = ProgressBar(4, enabled=False, tick_s=0.01)
    with bar.first_step():
        pass
    bar.update(1, tokens=1)
    bar.close()
    assert bar.first_step_s is not None
    assert bar.ticker is None
    assert capsys.readouterr().err == ""


def test_training_and_evaluation_draw_their_progress(tmp_path, capsys) -> None:
    job = tiny_job(tmp_path, "trainer.total_steps=2", "trainer.evaluation.period_steps=2")
    train_lm(job)
    err = capsys.readouterr().err
    assert "train: first step… " in err  # eager: nothing compiles, the line says so
    assert re.search(r"train: 100%\|.*\| 2/2 ", err), err
    assert "validation at step 2: first batch… " in err
    evaluate_lm(job)
    err = capsys.readouterr().err
    assert "evaluate: first batch… " in err
    # tqdm writes a rate below one batch a second as seconds per batch (a loaded machine: 1.56s/batch)
    assert re.search(r"evaluate: 100%\|.*\| 2/2 .*(batch/s|s/batch)", err), err
