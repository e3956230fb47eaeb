"""``model.source``: a Hugging Face folder's model and tokenizer trained by the job, exported back as a folder that
``AutoModelForCausalLM`` and ``AutoTokenizer`` load with the same logits; every bad folder refused in one line.

Folders are built here: a tiny ``transformers`` model and a BPE tokenizer trained by ``tokenizers`` on a few KB of
the stdlib (no downloads); both packages come with the ``hf`` extra.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from _jobs import TINY_DATA, TINY_TRAINER, job_argv, tiny_job
from hypothesis import given
from hypothesis import strategies as st
from test_data_files import _jsonl
from test_hf import _hf_model

from d9dfn.checkpoint import load_initial_weights
from d9dfn.cli import main
from d9dfn.data import HFTokenizer
from d9dfn.jobs import (
    CorpusProvider,
    FilesConfig,
    FilesProvider,
    TokenWindowDataset,
    load_model,
    resolve_source,
    token_stream,
)
from d9dfn.loop import InitializeDatasetContext
from d9dfn.models import Qwen3LM, check_hf_config, from_hf_config, from_hf_state, to_hf_config
from d9dfn.pipeline import PipelineStageInfo
from d9dfn.tasks import IGNORE_INDEX

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

BASE = (*TINY_TRAINER, *TINY_DATA, "data.seq_len=32")
"""The tiny job without its model sizes: the folder gives them."""


def _text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return ((stdlib / "json" / "decoder.py").read_text() + (stdlib / "textwrap.py").read_text())[:8000]


def _bpe(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on 8 KB of the stdlib, with one special token."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([_text()], trainer)
    return bpe


def _folder(path: Path, *, tie: bool = True, tokens: int = 300, shard: str | None = None, **config) -> Path:
    """A Qwen3 folder as the hub has them: ``save_pretrained``'s weights and config, a fast tokenizer's files."""
    fields = {"vocab_size": 320, "max_position_embeddings": 512, "rope_theta": 1e6, **config}
    model = _hf_model(tie, "qwen3", **fields)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(tokens), eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return path


@given(num_ids=st.integers(2, 200), seq_len=st.integers(1, 40))
def test_token_windows_label_every_id_after_the_first_once_in_order(num_ids, seq_len):
    ids = torch.randint(0, 1000, (num_ids,), generator=torch.Generator().manual_seed(num_ids))
    if num_ids < seq_len + 1:
        with pytest.raises(ValueError, match=r"hold no window of seq_len \+ 1"):
            TokenWindowDataset(ids, seq_len)
        return
    dataset = TokenWindowDataset(ids, seq_len)
    windows = [dataset[index] for index in range(len(dataset))]
    labels = torch.cat([window["labels"] for window in windows])
    assert torch.equal(labels, ids[1 : 1 + len(labels)])  # in order, none twice
    assert len(labels) > num_ids - 1 - seq_len  # what is left over is shorter than a window
    for window in windows:
        assert torch.equal(window["input_ids"][1:], window["labels"][:-1])


def test_folder_gives_the_job_its_model_sizes_and_tokenizer(tmp_path):
    source = _folder(tmp_path / "src")
    job, tokenizer = resolve_source(tiny_job(tmp_path, f"model.source={source}", base=BASE))
    assert job.model.model_dump(exclude={"source", "dropout"}) == {
        "family": "qwen3",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "moe": None,  # a dense family has no experts
    }
    config = job.model.to_qwen3(job.data.seq_len)
    assert (config.vocab_size, config.max_seq_len) == (320, 32)
    check_hf_config(config, json.loads((source / "config.json").read_text()))
    # The corpus goes through the folder's tokenizer: ids above 255 occur, and they are the tokenizer's.
    dataset = CorpusProvider(job.data, tokenizer)(InitializeDatasetContext(split="validation")).dataset
    window = dataset[0]["input_ids"]
    assert window.max() >= 256
    assert tokenizer.encode(tokenizer.decode(window.tolist())) == window.tolist()
    assert token_stream(tokenizer, ["def f(x):"]).tolist() == _bpe().encode("def f(x):").ids
    # A job given the folder's own values explicitly is the same job.
    same, _ = resolve_source(tiny_job(tmp_path, f"model.source={source}", "model.hidden_size=32", base=BASE))
    assert same.model == job.model


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("model.hidden_size=64",), r"model.hidden_size=64 contradicts model.source: .*config.json describes "),
        # The byte job's default, given explicitly: still not the folder's.
        (("model.hidden_size=128",), r"hidden_size=128 contradicts .*describes hidden_size=32; drop model.hidden_size"),
        (("model.family=llama",), r"model.family=\"llama\" contradicts .* describes family=\"qwen3\""),
        (("model.tie_word_embeddings=false",), r"tie_word_embeddings=false contradicts .*=true"),
        (
            ("model.moe.capacity_factor=1.5",),
            r"model.moe is set but model.source .* is a qwen3 model, which has no experts",
        ),
        (
            ("data.seq_len=600",),
            r"config.json: .*max_position_embeddings=512 .* at most 512: set --set data.seq_len=512",
        ),
    ],
    ids=[
        "hidden-size",
        "a-default-value-given",
        "family",
        "tie",
        "experts-on-a-dense-folder",
        "seq-len-beyond-positions",
    ],
)
def test_job_settings_that_contradict_the_folder_are_refused_naming_both(tmp_path, sets, message):
    source = _folder(tmp_path / "src")
    with pytest.raises(ValueError, match=message):
        resolve_source(tiny_job(tmp_path, f"model.source={source}", *sets, base=BASE))


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    source = _folder(tmp_path / "src", tokens=400)
    with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json gives ids up to 399, but .* vocab_size=320 rows"):
        resolve_source(tiny_job(tmp_path, f"model.source={source}", base=BASE))


def test_missing_tokenizer_or_package_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    source = _folder(tmp_path / "src")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ValueError, match=r"tokenizer.json needs the tokenizers package.*pip install 'd9dfn\[hf\]'"):
        HFTokenizer.from_folder(source)
    with pytest.raises(ValueError, match=r"^model.source: reading .*tokenizer.json needs the tokenizers package"):
        resolve_source(tiny_job(tmp_path, f"model.source={source}", base=BASE))
    monkeypatch.undo()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer \(tokenizer.json, or tokenizer_config.json"):
        HFTokenizer.from_folder(source)
    with pytest.raises(FileNotFoundError, match=r"no-such-folder is not a folder; point --set model.source"):
        resolve_source(tiny_job(tmp_path, f"model.source={tmp_path / 'no-such-folder'}", base=BASE))


def test_folder_without_tokenizer_json_reads_through_autotokenizer(tmp_path, monkeypatch):
    source = _folder(tmp_path / "src")
    bpe = _bpe()
    # GPT-2's files instead of tokenizer.json: vocab.json, merges.txt and a tokenizer_config.json naming the class.
    (source / "tokenizer.json").unlink()
    bpe.model.save(str(source))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    tokenizer = HFTokenizer.from_folder(source)
    assert tokenizer.name.endswith("tokenizer_config.json")
    assert tokenizer.vocab_size == 300
    text = "def decode(self, s):\n    return s"
    assert tokenizer.encode(text) == bpe.encode(text).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` raises ImportError
    with pytest.raises(ValueError, match=r"has no tokenizer.json, and reading .*tokenizer_config.json needs the "):
        HFTokenizer.from_folder(source)


def test_a_python_tokenizer_reads_through_autotokenizer_and_its_files_key_the_cache(tmp_path):
    transformers.ByT5Tokenizer().save_pretrained(tmp_path)  # a Python tokenizer: no tokenizers.Tokenizer behind it
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert not auto.is_fast
    tokenizer = HFTokenizer.from_folder(tmp_path)
    text = "def f(x):\n    return 'é'"
    assert tokenizer.encode(text) == auto.encode(text, add_special_tokens=False) == [b + 3 for b in text.encode()]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id, tokenizer.unit) == (384, 1, 0, "token")
    assert HFTokenizer.from_folder(tmp_path).fingerprint() == tokenizer.fingerprint()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    assert HFTokenizer.from_folder(tmp_path).fingerprint() != tokenizer.fingerprint()  # another file: another key


def test_cli_refuses_a_bad_folder_in_one_line_before_building_anything(tmp_path, capsys):
    source = _folder(tmp_path / "src")
    capsys.readouterr()
    argv = job_argv("train", tmp_path / "runs", f"model.source={source}", "data.seq_len=600", base=BASE)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("d9dfn: error: model.source: ")
    assert "set --set data.seq_len=512" in err
    assert not (tmp_path / "runs").exists()  # refused before the run directory


def test_sharded_untied_folder_loads_through_its_index(tmp_path):
    source = _folder(tmp_path / "src", tie=False, shard="30KB")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert "lm_head.weight" in index["weight_map"]
    hf = json.loads((source / "config.json").read_text())
    config = from_hf_config(hf, max_seq_len=32)
    model = Qwen3LM(config)
    load_initial_weights(model, source, lambda s: from_hf_state(s, config), lambda f: check_hf_config(config, f))
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, 320, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)["logits"], reference(input_ids=ids).logits, rtol=0, atol=0)
    (source / shards[-1]).rename(tmp_path / shards[-1])  # a shard the index names is gone
    with pytest.raises(FileNotFoundError, match=rf"names shard\(s\) \['{shards[-1]}'\] that are not in "):
        load_initial_weights(model, source, lambda s: from_hf_state(s, config))


def test_a_folder_fine_tunes_in_pipeline_stages_as_on_one_stage(tmp_path):
    # model.source with trainer.pipelining was refused ("initial weights are not loaded into pipeline stages"): each
    # stage now takes its own tensors of the folder's files. 2 stages under 1F1B in one process are bitwise the
    # one-stage step in float32, so the losses from the same folder are the same numbers.
    source = _folder(tmp_path / "src", tie=False)
    sets = (f"model.source={source}", "trainer.total_steps=3", "trainer.checkpointing.period_steps=3")
    sets = (*sets, "trainer.batching.global_batch_size=4", "trainer.batching.microbatch_size=2")
    pipelined = 'trainer.pipelining={"schedule": {"schedule": "1f1b"}}'
    losses = {}
    for name, extra in (("one", ()), ("stages", (pipelined,))):
        assert main(job_argv("train", tmp_path / name, *sets, *extra, base=BASE)) == 0
        records = (tmp_path / name / "stdlib-lm" / "metrics.jsonl").read_text().splitlines()
        losses[name] = [json.loads(line)["loss"] for line in records if '"loss"' in line]
    assert len(losses["one"]) == 3
    assert losses["stages"] == losses["one"]  # the stages' own seeded initialization would give other losses


def test_a_pipeline_stage_loads_its_tensors_and_refuses_ones_no_stage_has(tmp_path):
    source = _folder(tmp_path / "src", tie=False, num_hidden_layers=3)
    config = from_hf_config(json.loads((source / "config.json").read_text()), max_seq_len=32)
    whole = Qwen3LM(config)
    stage = Qwen3LM(config, PipelineStageInfo(current_stage=1, num_stages=2))
    mapper = lambda s: from_hf_state(s, config)  # noqa: E731
    load_initial_weights(stage, source, mapper, whole=whole.state_dict().keys())
    load_initial_weights(whole, source, mapper)
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, whole.state_dict()[name]), name
    assert "embed_tokens.weight" not in stage.state_dict()  # the first stage's
    with pytest.raises(ValueError, match=r"unexpected \['embed_tokens.weight', 'layers.0.input_layernorm.weight'"):
        load_initial_weights(stage, source, mapper)  # without the whole model's names: the other stage's are extra
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.mlp.down_proj.weight'\]"):  # in no stage
        load_initial_weights(stage, source, mapper, whole=set(whole.state_dict()) - {"layers.0.mlp.down_proj.weight"})


def test_exported_config_is_the_sources_but_for_the_dtype():
    source = {
        **to_hf_config(from_hf_config({"model_type": "llama", "rope_theta": 5e5}, max_seq_len=64)),
        "max_position_embeddings": 131_072,  # more than the 32 positions trained on
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128_000,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    model = from_hf_config(source, max_seq_len=32)
    plain = to_hf_config(model)
    assert plain["max_position_embeddings"] == 32  # without the source: the positions trained on
    exported = to_hf_config(model, "llama", source=source)
    differ = {key for key in source.keys() | exported.keys() if source.get(key) != exported.get(key)}
    assert differ == {"dtype", "torch_dtype"}
    assert exported["dtype"] == exported["torch_dtype"] == "float32"
    with pytest.raises(ValueError, match=r"num_hidden_layers is 3 there but 32 here"):
        to_hf_config(model, source={**source, "num_hidden_layers": 3})


@pytest.mark.slow
def test_journey_source_folder_trains_exports_and_transformers_gives_the_same_logits(tmp_path, capsys):
    source = _folder(tmp_path / "src")
    sets = (f"model.source={source}", "trainer.total_steps=30", "trainer.checkpointing.period_steps=30")
    sets = (*sets, "trainer.batching.global_batch_size=4", "trainer.batching.microbatch_size=4")
    assert main(job_argv("train", tmp_path / "runs", *sets, base=BASE)) == 0
    trained = capsys.readouterr().out
    assert "nats/token over" in trained
    run_dir = tmp_path / "runs" / "stdlib-lm"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # the loss falls

    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (source, out))
    assert ours == theirs  # float32 in and out: the source's file, key by key
    assert (ours["max_position_embeddings"], ours["rope_parameters"], ours["tie_word_embeddings"]) == (
        512,
        theirs["rope_parameters"],
        True,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([hf_tokenizer.encode("def decode(self, s):\n    return s")])
    assert ids.max() >= 256  # the tokenizer's ids, not bytes
    model = load_model(run_dir)
    with torch.no_grad():
        expected, got = hf_model(input_ids=ids).logits, model(ids)["logits"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # bitwise, float32 on the CPU
    start = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        assert not torch.equal(start(input_ids=ids).logits, expected)  # the export holds the trained weights

    assert main(job_argv("infer", tmp_path / "runs", *sets, base=BASE)) == 0
    sample = capsys.readouterr().out.split("d9dfn: sample:\n", 1)[1]
    assert sample.startswith("def ")  # the prompt, decoded by the tokenizer
    # Evaluated as the byte model (no model.source), the run is refused, naming the folder to give.
    assert main(job_argv("infer", tmp_path / "runs", *sets[1:], base=BASE)) == 2
    assert f'(--set model.source="{source}", or drop those --set)' in capsys.readouterr().err


def _function_records(num: int) -> list[dict]:
    """Prompt/completion records of Python: the prompt a ``def`` line, the completion (the loss) its one-line body."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [{"prompt": f"def {words[i % 8]}_{i}(self, s):\n", "completion": "    return s\n"} for i in range(num)]


@pytest.mark.slow
def test_journey_source_folder_on_your_files_through_the_cli_exports_what_transformers_reads(
    tmp_path, capsys, monkeypatch
):
    """Issue 43's must-show: a tied Qwen3 folder with its BPE, trained by ``d9dfn train`` on a prompt/completion
    JSONL; the loss falls, ``d9dfn export --format hf`` gives transformers' logits and an ``AutoTokenizer``, and
    ``d9dfn infer`` reports per token of the folder's tokenizer and decodes its sample with it."""
    source = _folder(tmp_path / "src")
    monkeypatch.chdir(tmp_path)  # data.files is relative to the working directory
    _jsonl(tmp_path / "train.jsonl", _function_records(400))
    sets = (
        *TINY_TRAINER,
        f"model.source={source}",
        'data.files=["train.jsonl"]',
        "data.seq_len=32",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.total_steps=30",
        "trainer.checkpointing.period_steps=30",
        "trainer.batching.global_batch_size=4",
        "trainer.batching.microbatch_size=4",
        "eval_batches=100",  # the whole validation split
        "sample.num_bytes=6",
        "sample.temperature=1e-4",  # greedy, so transformers can say which tokens come
    )
    assert main(job_argv("train", tmp_path / "runs", *sets, base=())) == 0
    trained = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "stdlib-lm"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses  # the loss falls
    job = json.loads((run_dir / "job.json").read_text())
    assert (job["data"]["files"], job["model"]["hidden_size"]) == (["train.jsonl"], 32)

    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = HFTokenizer.from_folder(source)
    text = "def omega_1(self, s):\n    return s\n"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf_tokenizer.eos_token_id == ours.eos_id is not None
    ids = torch.tensor([ours.encode(text)])
    assert ids.max() >= 256  # the tokenizer's ids, not bytes
    with torch.no_grad():
        expected, got = hf_model(input_ids=ids).logits, load_model(run_dir)(ids)["logits"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # bitwise, float32 on the CPU
    start = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        assert not torch.equal(start(input_ids=ids).logits, expected)  # the export holds the trained weights

    capsys.readouterr()
    (run_dir / "evaluation.json").unlink()  # infer evaluates the files itself (train stored its evaluation)
    assert main(job_argv("infer", tmp_path / "runs", *sets, base=())) == 0
    said = capsys.readouterr().out
    # Perplexity per token of the folder's tokenizer: every label of the validation split, counted in its tokens.
    provider = FilesProvider(
        FilesConfig.model_validate(job["data"]), ours, vocab_size=320, max_positions=32, say=lambda line: None
    )
    validation = provider.datasets["validation"]
    num_labels = sum(int((validation[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(validation)))
    line = next(line for line in said.splitlines() if "validation perplexity" in line)
    assert f"nats/token over {num_labels} tokens" in line, line
    assert line in trained  # the evaluation after training said the same
    # The sample: greedy tokens after the prompt, as transformers picks them, decoded by the folder's tokenizer.
    greedy = hf_tokenizer.encode("def ", add_special_tokens=False)
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(hf_model(input_ids=torch.tensor([greedy])).logits[0, -1].argmax()))
    sample = said.split("d9dfn: sample:\n", 1)[1].removesuffix("\n")
    assert sample == hf_tokenizer.decode(greedy, skip_special_tokens=False), (sample, greedy)
    assert sample == ours.decode(greedy)
