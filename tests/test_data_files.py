"""Your files as the dataset (issue 43 item 2): formats and loss masks, one-line errors, the token cache, packing with
document boundaries (per-document losses equal each document alone), padding in batches of similar lengths, and the
job wiring (``data.files``), down to a kill mid-epoch that resumes bitwise."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import TINY_MODEL, TINY_TRAINER
from hypothesis import example, given
from hypothesis import strategies as st

import d9dfn.loop._train as train_module
from d9dfn import init_train_state, optim
from d9dfn.cli import main
from d9dfn.config import load_config
from d9dfn.data import (
    BufferSortedDataset,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    PackedDataset,
    StatefulBatchIterator,
    collate_rows,
    cut_documents,
    encode_document,
    pack,
    read_documents,
    render_chat,
    tokenize_files,
    unpack_row,
)
from d9dfn.jobs import FilesConfig, FilesProvider, LMJobConfig, default_job, train_lm
from d9dfn.jobs._files import pad_multiple
from d9dfn.loop import InitializeDatasetContext
from d9dfn.models import Qwen3Config, Qwen3LM, document_mask
from d9dfn.step import make_train_step
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask, token_nll

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's chat template, shortened: turns are appended, the generation prompt opens an assistant turn."""

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _words_tokenizer(words: list[str], **special: str) -> HFTokenizer:
    """A word-level ``tokenizers.Tokenizer`` over ``words`` (+ ``[UNK]``, ``<s>``, ``</s>``): splits on whitespace."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {word: i for i, word in enumerate(["[UNK]", "<s>", "</s>", *words])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return HFTokenizer(tokenizer, **special)


class Counting:
    """A tokenizer that counts its ``encode`` calls (the cache must make a second start call none)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text):
        self.calls += 1
        return self.inner.encode(text)


# --- formats and loss masks -----------------------------------------------------------------------------------------


def test_read_documents_detects_each_format_and_the_loss_parts(tmp_path):
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "plain words", "id": 1}])
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2+2? ", "completion": "4"}])
    chat = _jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    plain = tmp_path / "notes.txt"
    plain.write_text("a whole file\n\nis one document\n")
    read = {
        path.name: list(read_documents(path, format="auto", chat_template=CHATML, special={}))
        for path in (text, pc, chat, plain)
    }
    assert [(d.kind, [(p.text, p.loss) for p in d.parts]) for d in read["t.jsonl"]] == [
        ("text", [("plain words", True)])
    ]
    assert [(p.text, p.loss) for p in read["pc.jsonl"][0].parts] == [("Q: 2+2? ", False), ("4", True)]
    assert read["c.jsonl"][0].kind == "chat"
    assert [(d.kind, d.parts[0].text) for d in read["notes.txt"]] == [("text", "a whole file\n\nis one document\n")]
    assert read["t.jsonl"][0].where == f"{text} line 1"


def test_render_chat_puts_loss_on_the_assistant_turns_only():
    parts = render_chat(CHAT, CHATML, {})
    whole = "".join(part.text for part in parts)
    assert whole == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!"
        "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nSee you.<|im_end|>\n"
    )
    assert [part.text for part in parts if part.loss] == ["Hello!<|im_end|>\n", "See you.<|im_end|>\n"]
    # The generation prompt ("<|im_start|>assistant\n") and every other turn carry no loss.
    assert all("<|im_start|>" in part.text for part in parts if not part.loss)


def test_encode_document_masks_the_prompt_and_wraps_in_bos_and_eos(tmp_path):
    tokenizer = _words_tokenizer(["Q", "A", "yes", "no"], bos_token="<s>", eos_token="</s>")
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q no", "completion": "A yes"}])
    (document,) = read_documents(pc, format="auto", chat_template=None, special={})
    ids, loss = encode_document(document, tokenizer)
    vocab = tokenizer.tokenizer.get_vocab()
    assert ids.tolist() == [vocab[w] for w in ("<s>", "Q", "no", "A", "yes", "</s>")]
    assert loss.tolist() == [0, 0, 0, 1, 1, 1]  # the completion and the EOS are targets
    # A chat gets what its template renders, nothing added: no BOS/EOS of the tokenizer's own.
    chat = _jsonl(
        tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]
    )
    template = "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}{% endif %}"
    (chat_document,) = read_documents(chat, format="auto", chat_template=template, special={})
    ids, loss = encode_document(chat_document, tokenizer)
    assert ids.tolist() == [vocab["Q"], vocab["A"]]
    assert loss.tolist() == [0, 1]


def test_a_set_format_overrides_detection_and_names_the_missing_field(tmp_path):
    pc = _jsonl(
        tmp_path / "pc.jsonl", [{"prompt": "p", "completion": "c", "text": "t"}, {"prompt": "p", "completion": "c"}]
    )
    documents = read_documents(pc, format="text", chat_template=None, special={})
    assert next(documents).parts[0].text == "t"
    with pytest.raises(
        DataError, match=r"pc\.jsonl line 2: the record has no 'text' field \(it has: completion, prompt\)"
    ):
        next(documents)
    # The same through the job's setting (data.format).
    config = FilesConfig(files=(str(pc),), cache_dir=tmp_path / "cache", format="text")
    with pytest.raises(DataError, match=r"pc\.jsonl line 2: the record has no 'text' field"):
        FilesProvider(config, vocab_size=256, max_positions=128)


def test_data_chat_template_renders_chats_with_loss_on_the_assistant_bytes(tmp_path):
    # Equal records fall in the same split: these differ (in the user's turn), so both splits get some.
    chats = [[*CHAT[:1], {"role": "user", "content": f"Hi {i}"}, *CHAT[2:]] for i in range(30)]
    chat = _jsonl(tmp_path / "c.jsonl", [{"messages": messages} for messages in chats])
    config = FilesConfig(files=(str(chat),), cache_dir=tmp_path / "cache", chat_template=CHATML, seq_len=256)
    provider = FilesProvider(config, vocab_size=256, max_positions=256, say=lambda line: None)
    tokenized = provider.splits["train"][0]
    first = slice(int(tokenized.offsets[0]), int(tokenized.offsets[1]))
    tokens, loss = np.asarray(tokenized.tokens[first]), np.asarray(tokenized.loss[first]).astype(bool)
    assert bytes(tokens.tolist()).decode() == "".join(part.text for part in render_chat(chats[0], CHATML, {}))
    assert bytes(tokens[loss].tolist()).decode() == "Hello!<|im_end|>\nSee you.<|im_end|>\n"
    assert list(tmp_path.joinpath("cache").iterdir()) == [tokenized.path]  # data.cache_dir holds the entry


def _save_to_disk(table, folder: Path) -> None:
    """What ``datasets.Dataset.save_to_disk`` writes: an Arrow stream, ``state.json`` and ``dataset_info.json``.
    (Written by hand: here datasets 5.2 cannot fingerprint a new table, dill failing on pyarrow's MonthDayNano.)"""
    pa = pytest.importorskip("pyarrow")
    folder.mkdir()
    with (
        pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as out,
    ):
        out.write_table(table)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0" * 16, "_split": None}
    state |= {"_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False}
    (folder / "state.json").write_text(json.dumps(state))
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))


def test_parquet_and_a_datasets_folder_read_as_their_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("datasets")
    records = [{"prompt": f"p{i} ", "completion": f"c{i}"} for i in range(5)]
    jsonl = _jsonl(tmp_path / "r.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    _save_to_disk(pa.Table.from_pylist(records), tmp_path / "saved")
    tokenizer = ByteTokenizer()
    got = {}
    for name in ("r.jsonl", "r.parquet", "saved"):
        tokenized = tokenize_files([str(tmp_path / name)], tokenizer, cache_dir=tmp_path / "cache")
        got[name] = (np.asarray(tokenized.tokens).tolist(), np.asarray(tokenized.loss).tolist())
    assert got["r.parquet"] == got["r.jsonl"] == got["saved"]
    assert jsonl.exists()
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}, {"body": "c"}]), tmp_path / "r.parquet")
    with pytest.raises(DataError, match=r"r\.parquet row 3: the record has no 'text' field"):
        tokenize_files([str(tmp_path / "r.parquet")], tokenizer, cache_dir=tmp_path / "cache")


def test_parquet_and_datasets_without_their_packages_are_one_line_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "r.parquet").write_bytes(b"PAR1")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    for module in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it raises ImportError
    for name, package in (("r.parquet", "pyarrow"), ("saved", "datasets")):
        with pytest.raises(
            DataError, match=rf"{name}: reading .* needs .*; pip install 'd9dfn\[data\]' \(or {package}\)"
        ):
            tokenize_files([str(tmp_path / name)], ByteTokenizer(), cache_dir=tmp_path / "cache")


# --- bad data: one line naming the file, the line and the fix --------------------------------------------------------

FILES_BASE = (*TINY_TRAINER, *TINY_MODEL, "eval_batches=1", "sample.num_bytes=4", "data.seq_len=16")


def _files_argv(tmp_path: Path, *overrides: str) -> list[str]:
    sets = [*FILES_BASE, f"trainer.checkpointing.save_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}"]
    return ["train", *(arg for s in (*sets, *overrides) for arg in ("--set", s))]


def _one_error_line(argv: list[str]) -> str:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    lines = err.getvalue().splitlines()
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("d9dfn: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.jsonl", None, r"data\.files: .*missing\.jsonl does not exist \(looked under .*\); fix the path"),
        ("empty.jsonl", b"", r"empty\.jsonl is empty; remove it from data\.files or give it records"),
        ("blank.jsonl", b"\n  \n", r"blank\.jsonl holds no record"),
        (
            "fields.jsonl",
            b'{"text": "ok"}\n\n{"body": "no text"}\n',
            r"fields\.jsonl line 3: the record has no 'text' field \(it has: body\).*; give every record that field",
        ),
        (
            "latin1.jsonl",
            b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
            r"latin1\.jsonl line 2: byte 0xe9 is not UTF-8.*convert",
        ),
        ("latin1.txt", b"line one\nline two caf\xe9\n", r"latin1\.txt line 2: byte 0xe9 is not UTF-8"),
        ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', r"broken\.jsonl line 2: not JSON .*; fix the line"),
        ("list.jsonl", b'["a"]\n', r"list\.jsonl line 1: a JSON list, not an object"),
        ("unknown.jsonl", b'{"body": "x"}\n', r"unknown\.jsonl line 1: the record has none of the fields .*; rename"),
        ("wrong.jsonl", b'{"text": 5}\n', r"wrong\.jsonl line 1: field 'text' is a int, not a string"),
        (
            "chat.jsonl",
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n',
            r"chat\.jsonl line 1: a chat record \(messages\) but the tokenizer has no chat template; set "
            r"data\.chat_template",
        ),
        ("array.json", b'[{"text": "a"}]', r"array\.json: \.json files are not read .*; write one object per line"),
    ],
)
def test_bad_data_is_one_line_naming_the_file_the_line_and_the_fix(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    line = _one_error_line(_files_argv(tmp_path, f'data.files=["{path}"]'))
    assert re.search(expected, line), line
    assert not (tmp_path / "runs").exists()  # refused before the run directory, the model or any compile


def test_a_glob_that_matches_nothing_and_a_folder_that_is_not_a_dataset_are_refused(tmp_path):
    line = _one_error_line(_files_argv(tmp_path, f'data.files=["{tmp_path}/*.jsonl"]'))
    assert "matches no file" in line
    assert "fix the pattern" in line
    (tmp_path / "folder").mkdir()
    line = _one_error_line(_files_argv(tmp_path, f'data.files=["{tmp_path / "folder"}"]'))
    assert "is a folder but not one written by datasets' save_to_disk" in line
    assert "folder/*.jsonl" in line


def test_corpus_settings_beside_files_and_two_validation_sources_are_refused(tmp_path):
    line = _one_error_line(_files_argv(tmp_path, 'data.files=["x"]', "data.max_bytes=5000"))
    assert "data.max_bytes=5000 is a setting of the stdlib corpus, which data.files replaces; remove" in line
    line = _one_error_line(
        _files_argv(tmp_path, 'data.files=["x"]', 'data.validation_files=["y"]', "data.validation_fraction=0.1")
    )
    assert "both set" in line
    assert "drop one of them" in line


def test_a_tokenizer_too_large_for_the_embedding_and_a_seq_len_past_the_positions_are_refused(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "a b"}])
    config = FilesConfig(files=(str(data),), cache_dir=tmp_path / "cache", seq_len=16)
    big = _words_tokenizer([f"w{i}" for i in range(300)])
    with pytest.raises(DataError, match=r"the tokenizer has 303 ids but the model's embedding has 256 rows"):
        FilesProvider(config, big, vocab_size=256, max_positions=16)
    with pytest.raises(
        DataError, match=r"data\.seq_len=16 is longer than the model's 8 positions; set --set data\.seq_len=8"
    ):
        FilesProvider(config, None, vocab_size=256, max_positions=8)
    assert not (tmp_path / "cache").exists()  # refused before reading anything


# --- the token cache -------------------------------------------------------------------------------------------------


def test_the_cache_tokenizes_once_and_misses_on_a_changed_file_or_tokenizer(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": f"document {i}"} for i in range(20)])
    cache = tmp_path / "cache"
    first = Counting(ByteTokenizer())
    built = tokenize_files([str(data)], first, cache_dir=cache)
    assert built.built
    assert first.calls == 20
    second = Counting(ByteTokenizer())
    read = tokenize_files([str(data)], second, cache_dir=cache)
    assert not read.built
    assert second.calls == 0
    assert read.key == built.key
    assert isinstance(read.tokens, np.memmap)
    assert np.array_equal(read.tokens, built.tokens)
    assert np.array_equal(read.offsets, built.offsets)

    _jsonl(data, [{"text": f"document {i}"} for i in range(19)] + [{"text": "changed"}])
    changed = Counting(ByteTokenizer())
    assert tokenize_files([str(data)], changed, cache_dir=cache).key != built.key
    assert changed.calls == 20

    words = _words_tokenizer(["document", "changed", *map(str, range(20))])
    other = Counting(words)
    tokenized = tokenize_files([str(data)], other, cache_dir=cache)
    assert tokenized.built
    assert other.calls == 20
    assert tokenized.tokens.dtype == np.uint16
    assert np.asarray(tokenized.tokens)[:2].tolist() == [
        words.tokenizer.token_to_id("document"),
        words.tokenizer.token_to_id("0"),
    ]
    retrained = Counting(_words_tokenizer(["document", "changed", *map(str, range(21))]))
    assert tokenize_files([str(data)], retrained, cache_dir=cache).built
    assert retrained.calls == 20


def test_a_truncated_cache_file_is_a_miss_and_is_rebuilt(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "x" * 50}])
    cache = tmp_path / "cache"
    built = tokenize_files([str(data)], ByteTokenizer(), cache_dir=cache)
    tokens = built.path / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:10])
    again = Counting(ByteTokenizer())
    rebuilt = tokenize_files([str(data)], again, cache_dir=cache)
    assert rebuilt.built
    assert again.calls == 1
    assert rebuilt.path == built.path
    assert np.asarray(rebuilt.tokens).tolist() == [ord("x")] * 50
    (built.path / "meta.json").write_text("{")  # a torn meta.json: a miss too
    assert tokenize_files([str(data)], ByteTokenizer(), cache_dir=cache).built


def test_a_crash_while_tokenizing_leaves_no_entry_to_read(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    cache = tmp_path / "cache"

    class Crashing(Counting):
        def encode(self, text):
            if self.calls == 5:
                raise KeyboardInterrupt  # a kill half-way through the files
            return super().encode(text)

    with pytest.raises(KeyboardInterrupt):
        tokenize_files([str(data)], Crashing(ByteTokenizer()), cache_dir=cache)
    assert [p.name for p in cache.iterdir()] == []  # neither an entry nor the temporary folder
    again = Counting(ByteTokenizer())
    assert tokenize_files([str(data)], again, cache_dir=cache).built
    assert again.calls == 10


# --- packing ---------------------------------------------------------------------------------------------------------


@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=30),
    splittable=st.lists(st.booleans(), min_size=30, max_size=30),
    seq_len=st.integers(1, 24),
    loss_seed=st.integers(0, 2**16),
)
@example(
    lengths=[2, 1], splittable=[True] + [False] * 29, seq_len=2, loss_seed=0
)  # a cut document followed by another: its last chunk ends at its own end (CI found it)
def test_packing_then_unpacking_is_the_identity_and_keeps_the_boundaries(lengths, splittable, seq_len, loss_seed):
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = np.arange(offsets[-1]) % 251 + 1  # distinct neighbours: a mixed-up piece shows
    loss = np.random.default_rng(loss_seed).integers(0, 2, offsets[-1]).astype(np.uint8)
    pieces, report = cut_documents(offsets, np.array(splittable[: len(lengths)], dtype=np.uint8), loss, seq_len)
    assert report.num_documents == len(lengths)
    dataset = PackedDataset(tokens, loss, pieces, seq_len, pad_id=0)
    # Every piece in exactly one row, rows no longer than seq_len.
    placed = sorted(int(p) for r in range(len(dataset)) for p in dataset.row(r))
    assert placed == list(range(len(pieces)))
    expected = []
    for start, stop in zip(pieces.starts.tolist(), pieces.stops.tolist(), strict=True):
        inputs, targets = tokens[start : stop - 1], tokens[start + 1 : stop]
        labels = np.where(loss[start + 1 : stop] == 1, targets, IGNORE_INDEX)
        expected.append((inputs.tolist(), labels.tolist()))
    got = []
    for r in range(len(dataset)):
        row = dataset[r]
        assert {k: tuple(v.shape) for k, v in row.items()} == dict.fromkeys(row, (seq_len,))
        unpacked = unpack_row(row)
        assert len(unpacked) == len(dataset.row(r))
        for (inputs, labels), piece in zip(unpacked, dataset.row(r).tolist(), strict=True):
            assert (inputs.tolist(), labels.tolist()) == expected[piece]
        # Attention never crosses a boundary: a position sees only its own piece's earlier positions.
        mask = document_mask(row["document_ids"])[0, 0]
        same = row["document_ids"][:, None] == row["document_ids"][None, :]
        assert not bool((mask & ~same).any())
        got.extend((inputs.tolist(), labels.tolist()) for inputs, labels in unpacked)
    assert sorted(got) == sorted(expected)
    # Cut pieces of a long plain-text document overlap by one token and cover it: every label once.
    for d, length in enumerate(lengths):
        mine = [i for i in range(len(pieces)) if pieces.documents[i] == d]
        if splittable[d] and length >= 2 and all(loss[offsets[d] + 1 : offsets[d + 1]]):
            assert [
                tokens[s + 1 : e].tolist() for s, e in zip(pieces.starts[mine], pieces.stops[mine], strict=False)
            ] == [
                # the document's labels in seq_len chunks; the last chunk stops at the document's end
                tokens[offsets[d] + 1 + k * seq_len : min(offsets[d] + 1 + (k + 1) * seq_len, offsets[d + 1])].tolist()
                for k in range(-(-(length - 1) // seq_len))
            ]


@given(st.lists(st.integers(1, 16), max_size=60), st.integers(16, 20))
def test_pack_places_every_item_once_within_capacity(lengths, capacity):
    rows = pack(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    # Best fit: no two rows could be merged into one (each row is more than half full, but one).
    sizes = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(sizes) < 2 or sizes[0] + sizes[1] > capacity


def _tiny_model(vocab: int = 256) -> Qwen3LM:
    torch.manual_seed(0)
    return Qwen3LM(Qwen3Config.tiny(vocab_size=vocab, max_seq_len=64)).eval()


def test_a_packed_rows_per_document_losses_equal_each_document_run_alone():
    """Eager float32 on CPU: the packed rows' per-document NLL sums equal each document's own, bitwise (masked keys
    add exact zeros; measured on 1 and 2 threads); without the document mask they do not (the test can fail)."""
    model = _tiny_model()
    rng = np.random.default_rng(0)
    lengths = [9, 17, 5, 30, 12, 2]
    tokens = rng.integers(0, 256, sum(lengths))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    loss = np.ones(len(tokens), np.uint8)
    loss[offsets[1] : offsets[1] + 6] = 0  # a prompt: no loss on it
    pieces, _ = cut_documents(offsets, np.zeros(len(lengths), np.uint8), loss, 32)
    packed = PackedDataset(tokens, loss, pieces, 32, pad_id=0)
    batch = collate_rows([packed[r] for r in range(len(packed))])
    assert batch["input_ids"].shape == (len(packed), 32)
    assert len(packed) < len(lengths)
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
        unmasked = model(batch["input_ids"])["logits"]
    logits = logits["logits"]
    alone, packed_nll, mixed_nll = [], [], []
    for r in range(len(packed)):
        at = 0
        for inputs, labels in unpack_row(packed[r]):
            n = len(inputs)
            with torch.no_grad():
                own = model(inputs[None])["logits"]
            alone.append(float(token_nll(own, labels[None])[0]))
            packed_nll.append(float(token_nll(logits[r : r + 1, at : at + n], labels[None])[0]))
            mixed_nll.append(float(token_nll(unmasked[r : r + 1, at : at + n], labels[None])[0]))
            at += n
    assert len(alone) == len(lengths)
    assert packed_nll == alone
    assert not np.allclose(mixed_nll, alone, rtol=1e-3)


def test_the_compiled_step_with_packing_has_no_graph_break_and_no_recompile():
    """fullgraph=True refuses a graph break; steps 2 and 3 (other rows, same shapes) run under fail_on_recompile."""
    model = Qwen3LM(Qwen3Config.tiny(vocab_size=256, max_seq_len=32))
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 30, 40)
    tokens = rng.integers(0, 256, lengths.sum())
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    pieces, _ = cut_documents(offsets, np.ones(40, np.uint8), np.ones(len(tokens), np.uint8), 32)
    packed = PackedDataset(tokens, np.ones(len(tokens), np.uint8), pieces, 32, pad_id=0)
    opt = optim.adamw(1e-3)
    step = make_train_step(model, CausalLMTask(), opt, num_microbatches=2, compile="aot_eager")
    state = init_train_state(model, opt)
    for index in range(3):
        batch = collate_rows([packed[4 * index + r] for r in range(4)])
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            state, out = step(state, batch)
        assert bool(torch.isfinite(out.loss))


# --- the job: data.files ---------------------------------------------------------------------------------------------


def _text_records(num: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))} for _ in range(num)]


def test_data_files_dispatches_the_union_and_job_json_round_trips(tmp_path):
    job = load_config(
        LMJobConfig, None, ['data.files=["a.jsonl", "b/*.txt"]', "data.packing=false"], default=default_job()
    )
    assert isinstance(job.data, FilesConfig)
    assert job.data.files == ("a.jsonl", "b/*.txt")
    assert not job.data.packing
    assert LMJobConfig.model_validate_json(job.model_dump_json()) == job
    assert type(default_job().data).__name__ == "CorpusConfig"


def test_files_provider_packs_holds_out_a_fraction_and_says_so(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", _text_records(400))
    lines: list[str] = []
    config = FilesConfig(files=(str(data),), cache_dir=tmp_path / "cache", seq_len=32, validation_fraction=0.1)
    provider = FilesProvider(config, vocab_size=256, max_positions=32, say=lines.append)
    train = provider(InitializeDatasetContext(split="train"))
    validation = provider(InitializeDatasetContext(split="validation"))
    num_train, num_validation = (len(provider.splits[s][1]) for s in ("train", "validation"))
    tokenized = provider.splits["train"][0]
    every_piece, _ = cut_documents(tokenized.offsets, tokenized.splittable, tokenized.loss, 32)
    assert num_train + num_validation == len(every_piece) > 400  # records longer than a row are cut
    assert 0.07 < num_validation / len(every_piece) < 0.13  # about a tenth
    assert isinstance(train.dataset, PackedDataset)
    assert train.shuffle
    assert len(train.dataset) < num_train
    assert set(train.dataset.state()) >= {"kind", "cache_key", "rows"}
    assert isinstance(validation.dataset, PackedDataset)
    assert lines[0].startswith("tokenized 400 documents")
    assert "of 32 (" in lines[-1]
    assert "padding" in lines[-1]
    lines.clear()
    again = FilesProvider(config, vocab_size=256, max_positions=32, say=lines.append)
    assert "nothing tokenized" in lines[0]
    assert torch.equal(again.datasets["train"][3]["input_ids"], train.dataset[3]["input_ids"])


def test_long_documents_are_cut_and_the_log_says_so(tmp_path):
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "x" * 100}, {"text": "short"}])
    pc = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "p" * 10, "completion": "c" * 50}])  # a format per file
    lines: list[str] = []
    config = FilesConfig(
        files=(str(text), str(pc)), cache_dir=tmp_path / "c", seq_len=16, validation_files=(str(text),)
    )
    FilesProvider(config, vocab_size=256, max_positions=16, say=lines.append)
    cut = next(line for line in lines if "cut into" in line)
    # 101 tokens -> ceil(100 / 16) = 7 pieces; the 60-token prompt/completion loses 60 - 17 = 43 (detected per record).
    assert "1 plain-text documents longer than seq_len=16 cut into 7 pieces" in cut
    assert "1 prompt/completion or chat documents longer than seq_len=16 truncated (43 tokens dropped)" in cut
    # data.validation_files: validation is t.jsonl's 7 + 1 pieces, training every piece of both files.
    provider = FilesProvider(config, vocab_size=256, max_positions=16, say=lines.append)
    assert len(provider.splits["validation"][1]) == 8
    assert len(provider.splits["train"][1]) == 9


def test_packing_off_batches_documents_of_similar_lengths_read_in_order(tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", _text_records(600, seed=1))
    config = FilesConfig(files=(str(data),), cache_dir=tmp_path / "cache", seq_len=128, packing=False)
    provider = FilesProvider(config, vocab_size=256, max_positions=128, say=lambda line: None)
    result = provider(InitializeDatasetContext(split="train", per_rank_batch_size=8, seed=3))
    assert isinstance(result.dataset, BufferSortedDataset)
    assert result.shuffle is False

    def pad_fraction(dataset, shuffle):
        iterator = StatefulBatchIterator(dataset, batch_size=8, collate_fn=result.collator, seed=3, shuffle=shuffle)
        batches = list(iterator)
        total = sum(b["labels"].numel() for b in batches)
        real = sum(int((b["input_ids"] != 0).sum()) for b in batches)  # bytes are never 0 here: 0 is padding
        assert all(b["input_ids"].shape[1] % pad_multiple(128) == 0 for b in batches)
        return 1 - real / total

    bucketed, shuffled = pad_fraction(result.dataset, False), pad_fraction(result.dataset.dataset, True)
    assert bucketed < 0.7 * shuffled, (bucketed, shuffled)
    # The loop honours shuffle=False: the training iterator reads the buckets in order.
    seen = {}

    def recording(*args, **kwargs):
        seen.setdefault("shuffle", kwargs.get("shuffle", True))
        raise RuntimeError("stop: the iterator's settings were seen")

    monkeypatch.setattr(train_module, "StatefulBatchIterator", recording)
    job = load_config(
        LMJobConfig,
        None,
        [
            *FILES_BASE,
            f"trainer.checkpointing.save_dir={tmp_path / 'runs'}",
            f'data.files=["{data}"]',
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.packing=false",
        ],
        default=default_job(),
    )
    with pytest.raises(RuntimeError, match="stop"):
        train_lm(job)
    assert seen == {"shuffle": False}


# --- end to end through the command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_start_reads_the_cache_and_infer_evaluates_the_files(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", _text_records(300))
    argv = _files_argv(tmp_path, f'data.files=["{data}"]', "trainer.total_steps=2")
    said = {}
    for run in ("first", "second", "infer"):
        err, out = io.StringIO(), io.StringIO()
        command = ["infer", *argv[1:]] if run == "infer" else argv
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main([*command, "--set", f"trainer.run.name={'second' if run == 'infer' else run}"])
        assert code == 0, err.getvalue()
        said[run] = [line for line in err.getvalue().splitlines() if line.startswith("d9dfn: data: ")]
    assert said["first"][0].startswith("d9dfn: data: tokenized 300 documents"), said
    assert "nothing tokenized" in said["second"][0], said  # a new run of the same files: the cache, no tokenizer
    assert "validation perplexity" in out.getvalue()
    job = json.loads((tmp_path / "runs" / "second" / "job.json").read_text())
    assert job["data"]["files"] == [str(data)]


@pytest.mark.slow
@pytest.mark.cli
def test_a_kill_mid_epoch_with_packing_resumes_bitwise(tmp_path):
    """SIGKILL inside the first epoch of a packed run, resumed: metrics.jsonl byte-identical to an uninterrupted run
    (the data position is the iterator's, in the checkpoint)."""
    from test_train import _logged_steps, _run_cli, losses

    data = _jsonl(tmp_path / "d.jsonl", _text_records(600, seed=2))
    total_steps = 12
    configs = {}
    for name in ("killed", "clean"):
        job = load_config(
            LMJobConfig,
            None,
            [
                *FILES_BASE,
                f"trainer.checkpointing.save_dir={tmp_path / name}",
                f'data.files=["{data}"]',
                f"data.cache_dir={tmp_path / 'cache'}",
                f"trainer.total_steps={total_steps}",
                "trainer.checkpointing.period_steps=3",
                "trainer.logging.period_steps=1",
                "trainer.determinism.deterministic_algorithms=true",
            ],
            default=default_job(),
        )
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(job.model_dump_json())
    rows = FilesProvider(job.data, vocab_size=256, max_positions=16, say=lambda line: None).datasets["train"]
    assert len(rows) // 2 > total_steps  # the whole run is inside the first epoch
    clean = _run_cli(configs["clean"], tmp_path / "clean.log")
    assert clean.wait(timeout=300) == 0, (tmp_path / "clean.log").read_text()
    metrics = tmp_path / "killed" / "stdlib-lm" / "metrics.jsonl"
    log = tmp_path / "killed.log"
    process = _run_cli(configs["killed"], log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and _logged_steps(metrics) < 5:
        time.sleep(0.02)
    assert process.poll() is None, f"the run ended before it could be killed:\n{log.read_text()}"
    process.kill()
    process.wait()
    assert _logged_steps(metrics) < total_steps
    resumed = _run_cli(configs["killed"], log)
    assert resumed.wait(timeout=300) == 0, log.read_text()
    assert "nothing tokenized" in log.read_text()
    assert sorted(losses(tmp_path / "killed" / "stdlib-lm")) == list(range(1, total_steps + 1))
    assert metrics.read_bytes() == (tmp_path / "clean" / "stdlib-lm" / "metrics.jsonl").read_bytes()
