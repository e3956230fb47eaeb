"""Your files as the dataset (``data.files``): packing on against off, and the token cache's second start.

1. Packing, one process: the default job's model and batch (compiled) on the same documents (``--files``, default: the
   Python standard library's sources cut at blank lines into JSONL records, ``--max-mb`` of them) with
   ``data.packing`` true and false. Reported per mode: the padding fraction of a whole epoch (positions that hold no
   document), and of the timed batches, and the tokens/s of real (non-padding) positions over ``--steps`` steps,
   timed after every batch shape among them has compiled (with packing off a batch is padded to one of at most 4
   lengths), in ``--rounds`` alternating blocks (the median is reported).
2. The token cache: ``--pairs`` times, a fresh process starts the job (``trainer.total_steps=1``) with an empty cache,
   then another with the cache it left (medians reported): the time from the start of ``train_lm`` to
   ``train.ready`` (reading or tokenizing the files, packing, building the model), and the first step's
   (``timings.jsonl``). Eager by default (``--compile`` to compile), so that the compile cache does not blur the
   data's share. 3. The same data's share with a BPE tokenizer (trained on the files), ``FilesProvider`` alone.

Run: ``OMP_NUM_THREADS=2 python benchmarks/data_files.py [--steps 10 --rounds 3 --seq-len 128 --max-mb 4 --threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from d9dfn.config import DeviceMeshParameters, load_config
from d9dfn.data import BufferSortedDataset, PackedDataset
from d9dfn.jobs import LMJobConfig, Qwen3Provider, data_provider, default_job, train_lm
from d9dfn.jobs._files import pad_multiple, static_shapes
from d9dfn.loop import TrainingConfigurator
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask


def stdlib_records(out: Path, max_bytes: int) -> Path:
    """The stdlib's ``*.py`` files (sorted), cut at blank lines, as ``{"text": ...}`` records, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    written = 0
    with out.open("w") as file:
        for path in sorted(root.glob("**/*.py")):
            if "test" in path.parts or "site-packages" in path.parts:
                continue
            for paragraph in path.read_text(errors="replace").split("\n\n"):
                if paragraph.strip() and written < max_bytes:
                    line = json.dumps({"text": paragraph}) + "\n"
                    file.write(line)
                    written += len(line)
    return out


def _job(files: list[str], save_dir: str, *sets: str) -> LMJobConfig:
    overrides = [f"data.files={json.dumps(files)}", f"trainer.checkpointing.save_dir={save_dir}"]
    overrides += [f"data.cache_dir={save_dir}/data-cache", *sets]  # the user's ~/.cache left alone
    return load_config(LMJobConfig, None, overrides, default=default_job())


def epoch_pad_fraction(dataset: Any, batch_size: int, seq_len: int) -> float:
    """Padding positions over all positions of one epoch: packed rows as built, or the padded batches of the
    length-bucketed order (each padded to its longest item rounded up to ``pad_multiple``)."""
    if isinstance(dataset, PackedDataset):
        return dataset.num_pad() / (len(dataset) * seq_len)
    assert isinstance(dataset, BufferSortedDataset)
    multiple, pad, total = pad_multiple(seq_len), 0, 0
    for start in range(0, len(dataset) - batch_size + 1, batch_size):
        lengths = [dataset.sort_key(i) for i in range(start, start + batch_size)]
        size = min(-(-max(lengths) // multiple) * multiple, seq_len)
        pad, total = pad + size * batch_size - sum(lengths), total + size * batch_size
    return pad / total


def packing(files: list[str], args: argparse.Namespace) -> None:
    modes: dict[bool, dict[str, Any]] = {}
    for packed in (True, False):
        save_dir = tempfile.mkdtemp()
        job = _job(files, save_dir, f"data.seq_len={args.seq_len}", f"data.packing={json.dumps(packed)}")
        qwen3 = job.model.to_qwen3(job.data.seq_len)
        trainer = TrainingConfigurator(
            mesh=DeviceMeshParameters(),
            parameters=job.trainer,
            task_provider=CausalLMTask,
            model_provider=Qwen3Provider(qwen3, job.model.family),
            data_provider=data_provider(job.data, qwen3),
        ).configure()
        batch_size = job.trainer.batching.global_batch_size
        batches = [next(trainer.data) for _ in range(args.steps)]
        shapes: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        for batch in batches:
            shapes.setdefault(tuple(batch["input_ids"].shape), batch)
        state = trainer.initial_state()
        started = time.perf_counter()
        with static_shapes(job.data):  # as train_lm compiles them
            for batch in shapes.values():  # compile every shape before timing
                _, output = trainer.step_fn(state, batch)
        float(output.loss)
        modes[packed] = {
            "job": job,
            "trainer": trainer,
            "state": state,
            "batches": batches,
            "shapes": sorted(shape[1] for shape in shapes),
            "compile_s": time.perf_counter() - started,
            "epoch_pad": epoch_pad_fraction(trainer.data.dataset, batch_size, args.seq_len),
            "seconds": [],
        }
    for _ in range(args.rounds):  # alternating blocks: a shared machine's load falls on both modes
        for mode in modes.values():
            state = mode["state"]
            with static_shapes(mode["job"].data):
                started = time.perf_counter()
                for batch in mode["batches"]:
                    state, output = mode["trainer"].step_fn(state, batch)
                float(output.loss)  # wait for the last step
            mode["seconds"].append(time.perf_counter() - started)
    for packed, mode in modes.items():
        batches, seconds = mode["batches"], statistics.median(mode["seconds"])
        positions = sum(b["labels"].numel() for b in batches)
        real = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)  # plain text: every label counts
        print(
            f"packing={'on ' if packed else 'off'}: pad {mode['epoch_pad']:.2%} of an epoch's positions "
            f"({1 - real / positions:.2%} of the timed batches); {real / seconds:,.0f} tokens/s of real tokens "
            f"({positions / seconds:,.0f} positions/s), median of {args.rounds} blocks of {args.steps} steps of "
            f"{len(batches[0]['labels'])} rows, lengths {mode['shapes']} (compiled in {mode['compile_s']:.1f} s)",
            flush=True,
        )


def start(args: argparse.Namespace) -> None:
    """One start of the job (the child process of :func:`cache`): a JSON line of its timings."""
    started = time.perf_counter()
    ready: list[float] = []
    sets = ["trainer.total_steps=1", f"data.cache_dir={args.cache_dir}", f"trainer.run.name={args.run_name}"]
    sets += [f"data.seq_len={args.seq_len}", f"trainer.compile={json.dumps(args.compile)}"]
    job = _job(args.files, args.save_dir, *sets)
    result = train_lm(job, on_ready=lambda: ready.append(time.perf_counter() - started))
    timings = [json.loads(line) for line in (result.run_dir / "timings.jsonl").read_text().splitlines()]
    print(json.dumps({"ready_s": ready[0], "first_step_s": timings[-1]["first_step_s"]}))


def cache(files: list[str], args: argparse.Namespace) -> None:
    results: dict[str, list[dict[str, Any]]] = {"first start (empty cache)": [], "second start (cache)": []}
    for _ in range(args.pairs):  # a fresh cache per pair; a shared machine's load falls on both starts
        with tempfile.TemporaryDirectory() as work:
            for number, name in enumerate(results):
                command = [sys.executable, __file__, "--start", "--files", *files, "--cache-dir", f"{work}/cache"]
                command += ["--save-dir", f"{work}/runs", "--run-name", f"run{number}", "--seq-len", str(args.seq_len)]
                command += ["--compile"] if args.compile else []
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                timing = json.loads(done.stdout.strip().splitlines()[-1])
                said = [line for line in done.stderr.splitlines() if line.startswith("d9dfn: data: ")]
                results[name].append({**timing, "said": said[0].removeprefix("d9dfn: data: ")})
    for name, runs in results.items():
        ready = statistics.median(run["ready_s"] for run in runs)
        first = statistics.median(run["first_step_s"] for run in runs)
        end = statistics.median(run["ready_s"] + run["first_step_s"] for run in runs)
        print(
            f"{name}: train.ready after {ready:.2f} s, first step {first:.2f} s, to the first step's end {end:.2f} s "
            f"(medians of {len(runs)}); {runs[-1]['said'].split('; cached')[0]}",
            flush=True,
        )


def bpe_cache(files: list[str], args: argparse.Namespace) -> None:
    """The data's share of a start with a BPE tokenizer (trained here on the files: ``--bpe-vocab`` ids), where
    tokenizing costs more than bytes do: ``FilesProvider`` alone (the job's model takes 256 byte ids), cold then
    warm, ``--pairs`` times."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from d9dfn.data import HFTokenizer
    from d9dfn.jobs import FilesProvider

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.bpe_vocab, special_tokens=["<unk>", "</s>"], show_progress=False)
    texts = [json.loads(line)["text"] for file in files for line in Path(file).read_text().splitlines()]
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = HFTokenizer(bpe, eos_token="</s>")
    seconds: dict[str, list[float]] = {"cold": [], "warm": []}
    for _ in range(args.pairs):
        with tempfile.TemporaryDirectory() as work:
            job = _job(files, work, f"data.seq_len={args.seq_len}")
            for name in seconds:
                started = time.perf_counter()
                FilesProvider(
                    job.data, tokenizer, vocab_size=tokenizer.vocab_size, max_positions=args.seq_len, say=lambda _: None
                )
                seconds[name].append(time.perf_counter() - started)
    cold, warm = (statistics.median(values) for values in seconds.values())
    print(
        f"BPE tokenizer ({tokenizer.vocab_size} ids): the data ready (read, tokenized or mapped, cut, split, packed) "
        f"in {cold:.2f} s with an empty cache, {warm:.2f} s with the cache (medians of {args.pairs})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="*", help="data.files (default: stdlib paragraphs as JSONL)")
    parser.add_argument("--max-mb", type=float, default=4.0, help="MB of stdlib records when --files is not given")
    parser.add_argument("--seq-len", type=int, default=128, help="data.seq_len")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per packing mode (alternating)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--compile", action="store_true", help="compile the cache starts' step too")
    parser.add_argument("--pairs", type=int, default=3, help="cold and warm starts, each with a fresh cache")
    parser.add_argument("--bpe-vocab", type=int, default=8192, help="ids of the BPE tokenizer of part 3")
    parser.add_argument("--skip", nargs="*", choices=("packing", "cache", "bpe"), default=(), help="parts left out")
    parser.add_argument("--start", action="store_true", help=argparse.SUPPRESS)  # a child of the cache part
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.start:
        start(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        files = args.files or [str(stdlib_records(Path(folder) / "stdlib.jsonl", int(args.max_mb * 1e6)))]
        print(f"data: {files} ({sum(Path(f).stat().st_size for f in files) / 1e6:.1f} MB)", flush=True)
        if "packing" not in args.skip:
            packing(files, args)
        if "cache" not in args.skip:
            cache(files, args)
        if "bpe" not in args.skip:
            bpe_cache(files, args)


if __name__ == "__main__":
    main()
