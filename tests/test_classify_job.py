"""The classification job from the command line (``"job": "classification"``): it trains (the loss falls, the
metrics are logged), and bad records are one line naming the file and the line (exit 2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from d9dfn.cli import main
from d9dfn.config import config_value

TINY = (
    "job=classification",
    "data.seq_len=16",
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=8",
    "model.intermediate_size=32",
    "trainer.compile=false",
    "trainer.lr_scheduler=null",
    "trainer.batching.global_batch_size=8",
    "trainer.batching.microbatch_size=4",
    "trainer.logging.period_steps=5",
)


def _records(path: Path, count: int = 64) -> Path:
    rng = random.Random(0)
    lines = []
    for index in range(count):
        label = index % 2  # the words say the label: learnable in a few steps
        lines.append(json.dumps({"text": ("good " if label else "bad ") * rng.randint(1, 3), "label": label}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _argv(tmp_path: Path, *overrides: str, command: str = "train") -> list[str]:
    sets = [*TINY, f"trainer.checkpointing.save_dir={tmp_path / 'runs'}", *overrides]
    return [command, *(arg for item in sets for arg in ("--set", item))]


def test_config_value_reads_the_job_key_from_overrides_and_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"job": "classification"}))
    assert config_value(path, [], "job") == "classification"
    assert config_value(path, ["job=lm"], "job") == "lm"
    assert config_value(None, [], "job") is None


def test_classification_job_trains_from_the_cli_and_logs_its_metrics(tmp_path, capsys):
    files = json.dumps([str(_records(tmp_path / "train.jsonl"))])
    code = main(
        _argv(tmp_path, f"data.files={files}", "trainer.total_steps=20", "trainer.checkpointing.period_steps=20")
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "runs" / "classify" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5  # it learns
    periods = [row for row in rows if "metrics/accuracy" in row]
    assert len(periods) == 4
    assert set(periods[-1]) >= {"metrics/loss", "metrics/accuracy", "metrics/f1", "metrics/auroc"}
    assert periods[-1]["metrics/accuracy"] == 1.0
    job = json.loads((tmp_path / "runs" / "classify" / "job.json").read_text())
    assert job["job"] == "classification"
    assert job["head"] == {"num_labels": 2, "pooling": "last"}


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"text": "no label"}, "line 3: the record has no 'label' field (it has: text); give every record that field"),
        ({"label": 1}, "line 3: the record has no 'text' field (it has: label)"),
        ({"text": "x", "label": 2}, "line 3: label 2 (field 'label') is not an integer in [0, 2)"),
        ({"text": "x", "label": "good"}, "line 3: label 'good' (field 'label') is not an integer in [0, 2)"),
        ({"text": 7, "label": 0}, "line 3: field 'text' is a int, not a string"),
    ],
)
def test_bad_record_is_one_line_naming_the_file_and_line_exit_2(tmp_path, capsys, record, expected):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"text": "fine", "label": 0})
    path.write_text(f"{good}\n{good}\n{json.dumps(record)}\n{good}\n")
    code = main(_argv(tmp_path, f"data.files={json.dumps([str(path)])}", "trainer.total_steps=2"))
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("d9dfn: error:")]
    assert len(lines) == 1, err
    assert f"{path} {expected}" in lines[0]
    assert not (tmp_path / "runs" / "classify" / "checkpoints").exists()


def test_classification_job_without_files_and_infer_are_refused_in_one_line(tmp_path, capsys):
    assert main(_argv(tmp_path, "trainer.total_steps=2")) == 2
    assert "data.files" in capsys.readouterr().err
    files = json.dumps([str(_records(tmp_path / "train.jsonl", 8))])
    assert main(_argv(tmp_path, f"data.files={files}", command="infer")) == 2
    assert "a classification job (job=classification) has no infer command yet" in capsys.readouterr().err
