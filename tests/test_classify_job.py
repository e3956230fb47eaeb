"""The classification job from the command line (``"job": "classification"``): it trains (the loss falls, the
metrics are logged), and bad records are one line naming the file and the line (exit 2)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

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


# --- model.source: a Hugging Face folder's decoder, tokenizer and (for a classifier folder) score ----------------

SOURCE_TINY = tuple(item for item in TINY if not item.startswith("model."))
"""The tiny job without its model sizes: the folder gives them."""


def _classifier_folder(path: Path, num_labels: int = 3) -> Path:
    """A ``Qwen3ForSequenceClassification`` folder (pad id 0, norm weights perturbed) with a BPE trained here."""
    transformers = pytest.importorskip("transformers")
    from test_hf import _hf_model
    from test_hf_source import _bpe

    causal = _hf_model(False, "qwen3", vocab_size=320, max_position_embeddings=512, rope_theta=1e6)
    config = causal.config
    config.num_labels, config.pad_token_id, config.architectures = num_labels, 0, None
    torch.manual_seed(1)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.model.load_state_dict(causal.model.state_dict())
    model.save_pretrained(path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(300), eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return path


def _captured(monkeypatch) -> dict:
    """The configured ``Trainer`` of the next job, under ``"trainer"``."""
    from d9dfn.loop import TrainingConfigurator

    seen: dict = {}
    configure = TrainingConfigurator.configure

    def capture(self):
        seen["trainer"] = configure(self)
        return seen["trainer"]

    monkeypatch.setattr(TrainingConfigurator, "configure", capture)
    return seen


def test_classification_job_on_a_causal_lm_folder_starts_from_its_decoder_and_tokenizer(tmp_path, capsys, monkeypatch):
    """``model.source`` = a ``Qwen3ForCausalLM`` folder: the folder's sizes and tokenizer, its decoder's weights
    bitwise at the start (the LM head dropped, the score from its init); from the CLI the loss falls and ``job.json``
    records the folder's model."""
    pytest.importorskip("transformers")
    from test_hf_source import _folder

    from d9dfn.config import load_config
    from d9dfn.data import HFTokenizer
    from d9dfn.jobs import ClassificationJobConfig, default_classification_job, train_classifier

    source = _folder(tmp_path / "src", tie=False)
    files = json.dumps([str(_records(tmp_path / "train.jsonl"))])
    sets = [*SOURCE_TINY, f"model.source={source}", f"data.files={files}", "trainer.total_steps=1"]
    sets.append(f"trainer.checkpointing.save_dir={tmp_path / 'py'}")
    job = load_config(ClassificationJobConfig, None, sets, default=default_classification_job())
    seen = _captured(monkeypatch)
    train_classifier(job, on_ready=lambda: seen.setdefault("start", seen["trainer"].initial_state()))
    monkeypatch.undo()
    start = seen["start"].params
    transformers = pytest.importorskip("transformers")
    folder = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
    backbone = [name for name in start if name.startswith("model.")]
    assert backbone
    assert all(torch.equal(start[name], folder[name]) for name in backbone)
    assert set(start) - set(backbone) == {"score.weight"}  # no LM head; the score is the classifier's own
    from d9dfn.jobs import ClassificationProvider

    tokenizer = HFTokenizer.from_folder(source)  # the job's batches go through the folder's tokenizer
    texts = ClassificationProvider(job.data, job.head, tokenizer, say=lambda line: None).splits["train"]
    assert torch.equal(seen["trainer"].data.dataset.input_ids, texts.input_ids)
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])["text"]
    ids = list(tokenizer.encode(first))
    assert texts.input_ids[0, : len(ids)].tolist() == ids
    assert ids != list(first.encode())  # BPE ids, not bytes

    sets = (*SOURCE_TINY, f"trainer.checkpointing.save_dir={tmp_path / 'runs'}", f"model.source={source}")
    sets += (f"data.files={files}", "trainer.total_steps=20", "trainer.checkpointing.period_steps=20")
    code = main(["train", *(arg for item in sets for arg in ("--set", item))])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "runs" / "classify" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses  # it learns
    recorded = json.loads((tmp_path / "runs" / "classify" / "job.json").read_text())
    assert (recorded["model"]["hidden_size"], recorded["model"]["num_layers"]) == (32, 2)  # the folder's sizes
    assert recorded["model"]["source"] == str(source)


def test_classification_job_on_a_classifier_folder_loads_its_score_labels_and_pad_with_equal_logits(
    tmp_path, monkeypatch
):
    """``model.source`` = a ``Qwen3ForSequenceClassification`` folder: ``head.num_labels`` and the pad id are the
    folder's, the whole classifier (score included) is read, and its logits at the start are ``transformers``',
    bitwise, on right-padded texts; a ``head.num_labels`` that contradicts the folder is one line."""
    transformers = pytest.importorskip("transformers")
    from d9dfn.config import load_config
    from d9dfn.jobs import ClassificationJobConfig, default_classification_job, train_classifier

    source = _classifier_folder(tmp_path / "src")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"{'ab ' * (i + 1)}x", "label": i % 3}) + "\n" for i in range(16)))
    sets = [*SOURCE_TINY, f"model.source={source}", f'data.files=["{path}"]', "trainer.total_steps=1"]
    sets.append(f"trainer.checkpointing.save_dir={tmp_path / 'runs'}")
    job = load_config(ClassificationJobConfig, None, sets, default=default_classification_job())
    seen = _captured(monkeypatch)
    train_classifier(job, on_ready=lambda: seen.setdefault("logits", _logits(seen["trainer"].model)))
    monkeypatch.undo()
    assert seen["trainer"].task.num_labels == 3  # from the folder's id2label
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        expected = hf(input_ids=IDS).logits
    assert torch.equal(seen["logits"], expected)
    recorded = json.loads((tmp_path / "runs" / "classify" / "job.json").read_text())
    assert recorded["head"]["num_labels"] == 3

    explicit = load_config(
        ClassificationJobConfig, None, [*sets, "head.num_labels=2"], default=default_classification_job()
    )
    with pytest.raises(ValueError, match=r"head.num_labels=2 contradicts model.source: .* with 3 labels"):
        train_classifier(explicit)


IDS = torch.tensor([[5, 17, 260, 33, 0, 0], [101, 7, 299, 64, 12, 9]])
"""Right-padded with the folder's pad id 0: ``last`` pooling reads position 3 of the first row."""


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)["logits"]
