"""Bad input through the command line (issue 22 items 4 and 5): exit 2 with exactly one ``d9dfn: error:`` line.

The property test throws wrong values, non-finite numbers, negative counts, unknown keys, malformed JSON and bad
paths at ``d9dfn.cli.main`` (in process), by ``--set`` and in a config file, and checks the exit code, the one
line, the path it names, and that nothing was compiled. The other tests cover what used to get through: an
infinite learning rate, a model too large for the machine, a short run of the default job, a pipeline schedule on
one process, and a full disk (its summary is the last line; background threads' tracebacks go to ``error.log``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _jobs import TINY, TINY_DATA, TINY_MODEL, job_argv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from d9dfn import init_train_state, optim
from d9dfn.checkpoint import CheckpointStore
from d9dfn.cli import main
from d9dfn.config import build_lr_schedule, load_config
from d9dfn.jobs import LMJobConfig, default_job
from d9dfn.loop import check_memory, estimate_memory
from d9dfn.models import Qwen3Config, Qwen3LM

ROOT = Path(__file__).resolve().parents[1]
EAGER = ("trainer.compile=false", "trainer.batching.global_batch_size=2", "trainer.batching.microbatch_size=2")
"""Eager steps of 2 sequences; the default job's learning-rate schedule stays."""


def _run(argv: list[str]) -> tuple[int, list[str], str]:
    """``main(argv)`` in process: the exit code, stderr's lines and stdout."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue().splitlines(), out.getvalue()


def _one_error_line(argv: list[str]) -> str:
    code, lines, _ = _run(argv)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("d9dfn: error: "), lines
    return lines[0]


# --- the property: any bad input is one line, exit 2, before anything is compiled ---------------------------


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, (*prefix, key))]
    if isinstance(tree, list):
        return [leaf for index, value in enumerate(tree) for leaf in _leaves(value, (*prefix, str(index)))]
    return [(prefix, tree)]


def _sections(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    if not isinstance(tree, dict):
        return []
    return [(prefix, tree)] + [s for key, value in tree.items() for s in _sections(value, (*prefix, key))]


DEFAULT = default_job().model_dump(mode="json")
LEAVES = [(path, value) for path, value in _leaves(DEFAULT) if path[:3] != ("trainer", "run", "hparams")]
NON_FINITE = ["Infinity", "-Infinity", "NaN", "1e400", "-1e999"]
WRONG = {  # a value that no field of this kind accepts, as --set text
    int: [*NON_FINITE, "true", '"12"', "1.5", "[1]", '{"a": 1}', "abc", "1e20"],
    float: [*NON_FINITE, "false", '"0.5"', "[0.5]", '{"a": 1}', "abc"],
    bool: [*NON_FINITE, "1", '"yes"', "[true]", "abc"],
}
COUNTS = [  # int settings that must be positive (or >= 0): a negative count is refused
    "trainer.total_steps",
    "trainer.batching.global_batch_size",
    "trainer.checkpointing.num_to_keep",
    "trainer.timeout.step_timeout",
    "model.num_layers",
    "model.hidden_size",
    "data.seq_len",
    "eval_batches",
    "sample.num_bytes",
]
OBJECTS = ["trainer.optimizer", "trainer.lr_scheduler", "trainer.pipelining", "mesh", "model", "trainer.batching"]
MALFORMED = ['{"name": "sgd", "lr": }', "{name: sgd}", '{"schedule": {"schedule": "1f1b"}', "[1, 2", "{'a': 1}"]


def _wrong_value() -> st.SearchStrategy[tuple[str, str, str]]:
    """``(path, value, what the message must name)``: a leaf set to a value of the wrong kind."""
    typed = [(path, type(value)) for path, value in LEAVES if type(value) in WRONG]
    pairs = st.sampled_from(typed).flatmap(lambda leaf: st.tuples(st.just(leaf[0]), st.sampled_from(WRONG[leaf[1]])))
    return pairs.map(lambda pair: (".".join(pair[0]), pair[1], _named(pair[0])))


def _named(path: tuple[str, ...]) -> str:
    # A union's tag (optimizer.name, curve.type, phases' mode) is reported at the section it selects.
    return ".".join(path[:-1]) if path[-1] in ("name", "type", "mode", "provider", "schedule") else ".".join(path)


def _negative_count() -> st.SearchStrategy[tuple[str, str, str]]:
    return st.tuples(st.sampled_from(COUNTS), st.integers(-(10**6), -1)).map(lambda t: (t[0], str(t[1]), t[0]))


def _unknown_key() -> st.SearchStrategy[tuple[str, str, str]]:
    names = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True)
    sections = st.sampled_from([(path, section) for path, section in _sections(DEFAULT) if "hparams" not in path])
    return (
        st.tuples(sections, names, st.sampled_from(["1", "true", '"x"', "[]"]))
        .filter(lambda t: t[1] not in t[0][1])
        .map(lambda t: (".".join((*t[0][0], t[1])), t[2], ".".join((*t[0][0], t[1]))))
    )


def _malformed_json() -> st.SearchStrategy[tuple[str, str, str]]:
    return st.tuples(st.sampled_from(OBJECTS), st.sampled_from(MALFORMED)).map(lambda t: (t[0], t[1], t[0]))


def _bad_path() -> st.SearchStrategy[tuple[str, str, str]]:
    """Overrides whose key cannot be applied: into a scalar, past a list's end, not a.b=value at all."""
    return st.sampled_from(
        [
            ("trainer.total_steps.x", "1", "trainer.total_steps"),
            ("trainer.lr_scheduler.scheduler.phases.7.steps", "1", "trainer.lr_scheduler.scheduler.phases"),
            ("trainer.lr_scheduler.scheduler.phases.first", "1", "trainer.lr_scheduler.scheduler.phases"),
            ("trainer..total_steps", "1", "trainer..total_steps"),
            ("", "1", "a.b.c=value"),
        ]
    )


BAD = st.one_of(_wrong_value(), _negative_count(), _unknown_key(), _malformed_json(), _bad_path())
GOOD = st.lists(st.sampled_from(["trainer.total_steps=20", "model.num_layers=2", "trainer.optimizer.lr=0.001"]))


# The examples take milliseconds each (load_config refuses them), so 2.5 times the profile's are cheap: 500 under
# the ci profile (about 10 s on a shared CPU), 125 under dev. monkeypatch is used through monkeypatch.context(),
# undone after each example.
@settings(max_examples=settings().max_examples * 5 // 2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bads=st.lists(BAD, min_size=1, max_size=3), good=GOOD, in_file=st.booleans())
def test_any_bad_input_exits_2_with_one_line_naming_it_before_anything_compiles(bads, good, in_file, monkeypatch):
    compiled = []
    with monkeypatch.context() as patch, tempfile.TemporaryDirectory() as tmp:
        patch.setattr(torch, "compile", lambda *args, **kwargs: compiled.append(args) or pytest.fail("compiled"))
        sets = [*good, f"trainer.checkpointing.save_dir={tmp}"]
        config = load_config(LMJobConfig, None, sets, default=default_job()).model_dump(mode="json")
        overrides = []
        for path, value, _ in bads:
            # In a JSON config file where a key path leads there (a value that is not JSON is a string there too),
            # else by --set, after the good overrides so that none replaces it.
            if not (in_file and _set(config, path.split("."), _parse(value))):
                overrides.append(f"{path}={value}" if path else value)
        argv = ["train"]
        if in_file:  # the good settings are in the file too: by --set they would replace a bad value there
            file = Path(tmp) / "job.json"
            file.write_text(json.dumps(config))
            argv.append(str(file))
        else:
            overrides = [*sets, *overrides]
        argv += [arg for override in overrides for arg in ("--set", override)]
        line = _one_error_line(argv)
    named = [named for _, _, named in bads]
    # One bad input is named; of several, a later one may replace an earlier one (a section set to a string).
    assert named[0] in line if len(bads) == 1 else any(name in line for name in named)
    assert not compiled


def _parse(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _set(tree: Any, path: list[str], value: Any) -> bool:
    """Put ``value`` at ``path`` in a config's JSON, making missing sections; ``False`` where no key path leads."""
    if not all(path):
        return False
    for key in path[:-1]:
        if isinstance(tree, dict):
            tree = tree.setdefault(key, {})
        elif isinstance(tree, list) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        else:
            return False
    if isinstance(tree, dict):
        tree[path[-1]] = value
        return True
    if isinstance(tree, list) and path[-1].isdigit() and int(path[-1]) < len(tree):
        tree[int(path[-1])] = value
        return True
    return False


# --- what used to get through --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["Infinity", "1e400", "NaN", "-Infinity"])
def test_a_non_finite_learning_rate_is_refused_naming_the_set_path(tmp_path, value):
    line = _one_error_line(job_argv("train", tmp_path, f"trainer.optimizer.lr={value}"))
    assert line.startswith("d9dfn: error: load_config: trainer.optimizer.lr: ")
    assert "is not a finite number" in line
    assert "--set trainer.optimizer.lr=VALUE" in line


def test_a_whole_float_is_an_int_and_a_fraction_is_refused():
    job = load_config(LMJobConfig, None, ["model.intermediate_size=1e3"], default=default_job())
    assert job.model.intermediate_size == 1000
    assert isinstance(job.model.intermediate_size, int)
    with pytest.raises(
        ValueError,
        match=r"model.intermediate_size=1.5: Input should be a valid integer, got a number with a fractional part",
    ):
        load_config(LMJobConfig, None, ["model.intermediate_size=1.5"], default=default_job())


def test_a_model_too_large_for_memory_is_refused_before_allocating_naming_the_field(tmp_path):
    line = _one_error_line(job_argv("train", tmp_path, "model.intermediate_size=1e9"))
    # 1.5e12 parameters x 4 bytes x (weights, gradients, AdamW's two moments): no machine here has 24.6 TB.
    assert line.startswith("d9dfn: error: TrainingConfigurator: the model's ")
    assert "parameters need at least" in line
    assert "optimizer state" in line
    assert "more than this host's memory (" in line
    assert "lower model.intermediate_size (it is 1000000000; with the default 384" in line
    assert "--set model.intermediate_size=384" in line


def test_estimate_memory_counts_what_a_train_state_holds():
    torch.manual_seed(0)
    model = Qwen3LM(Qwen3Config.tiny(vocab_size=256))
    with torch.device("meta"):
        skeleton = Qwen3LM(Qwen3Config.tiny(vocab_size=256))
    for optimizer in (optim.adamw(1e-3), optim.sgd(0.1, momentum=0.9), optim.sgd(0.1)):
        state = init_train_state(model, optimizer)
        held = sum(
            t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state.opt_state) if t is not None
        )
        estimate = estimate_memory(dict(skeleton.named_parameters()), optimizer, param_dtype=torch.float32)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert (estimate.params, estimate.grads, estimate.optimizer) == (weights, weights, held)
    half = estimate_memory(dict(skeleton.named_parameters()), None, param_dtype=torch.bfloat16, gradients=False)
    assert (half.params, half.grads, half.optimizer) == (weights // 2, 0, 0)


def test_check_memory_refuses_only_what_cannot_fit_counting_shards_and_processes(monkeypatch):
    import d9dfn.loop._memory as memory

    weights = {"w": torch.nn.Parameter(torch.empty(1000, 1000, device="meta"))}
    estimate = estimate_memory(weights, optim.adamw(1e-3), param_dtype=torch.float32)  # 16 MB
    monkeypatch.setattr(memory, "device_memory", lambda device: 10_000_000)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^who: the model's 1e\+06 parameters need at least 16.0 MB .* \(10.0 MB in"):
        check_memory(estimate, cpu, who="who", fix="lower x")
    check_memory(estimate, cpu, who="who", fix="lower x", shards=2)  # 8 MB on each of 2 processes: fits
    with pytest.raises(ValueError, match=r"split 2 way\(s\), 2 process\(es\) on this cpu hold 16.0 MB"):
        check_memory(estimate, cpu, who="who", fix="lower x", shards=2, processes=2)
    monkeypatch.setattr(memory, "device_memory", lambda device: None)
    check_memory(estimate, cpu, who="who", fix="lower x")  # unknown memory: no check


def test_the_default_jobs_warm_up_fits_a_ten_step_run(tmp_path):
    code, lines, _ = _run(job_argv("train", tmp_path, "trainer.total_steps=10", base=(*EAGER, *TINY_MODEL, *TINY_DATA)))
    assert code == 0, lines
    records = [json.loads(line) for line in (tmp_path / "stdlib-lm" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["lr"] for r in records if "lr" in r]
    job = default_job()
    multiplier = build_lr_schedule(job.trainer.lr_scheduler, 10)(torch.arange(10))  # step k updates with k - 1
    assert logged == pytest.approx((job.trainer.optimizer.lr * multiplier).tolist())
    assert max(logged) == pytest.approx(job.trainer.optimizer.lr)  # warmed up (at 10% of 10 steps), then decayed


# --- pipelining on one process: what the README says --------------------------------------------------------

PIPELINE = (*EAGER, *TINY_MODEL, *TINY_DATA, "model.num_layers=3", "trainer.total_steps=3")


def test_pipelining_on_one_process_runs_the_reference_executor_through_the_cli(tmp_path):
    def train(name: str, schedule: str, *sets: str) -> str:
        save = tmp_path / name
        schedule_set = f'trainer.pipelining={{"schedule": {schedule}}}'
        code, lines, out = _run(
            job_argv("train", save, "model.tie_word_embeddings=false", schedule_set, *sets, base=PIPELINE)
        )
        assert code == 0, lines
        assert "d9dfn: trained 3 steps" in out
        return (save / "stdlib-lm" / "metrics.jsonl").read_text()

    one_f_one_b = '{"schedule": "1f1b", "num_stages_per_rank": 2}'
    v = train("v", '{"schedule": "zero_bubble_v"}')  # traced whole (its I/W split), whatever repeated_blocks says
    # Two stages on one process, two programs, both stages traced: the same ops and sums, bitwise, on any CPU.
    assert train("traced", one_f_one_b, "trainer.repeated_blocks=[]") == v
    # The default (repeated_blocks=null) runs 1F1B's decoder layers as regions with autograd's first-order backward
    # formulas (silu_backward), the traced stages torch.func's (sigmoid, mul, add): equal to rounding only, bitwise
    # where ATen's kernels are scalar (ATEN_CPU_CAPABILITY=default), not on AVX2/AVX-512 (docs/design/pipeline.md,
    # "Which backward formulas"; step 3's grad_norm differed in the last bit here).
    blocks = [json.loads(line) for line in train("blocks", one_f_one_b).splitlines()]
    traced = [json.loads(line) for line in v.splitlines()]
    assert [r.keys() for r in blocks] == [r.keys() for r in traced]
    assert blocks == [pytest.approx(r, rel=1e-5) for r in traced]
    # Two stages cannot share the embedding with the head: refused in one line that names the setting.
    line = _one_error_line(
        job_argv(
            "train", tmp_path / "tied", 'trainer.pipelining={"schedule": {"schedule": "zero_bubble_v"}}', base=PIPELINE
        )
    )
    assert "set model.tie_word_embeddings=false" in line


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ('{"schedule": "chimera"}', "trainer.pipelining.schedule: schedule='chimera' is not a known kind; set "),
        (
            '{"schedule": "1f1b", "num_stages_per_rank": 0}',
            "trainer.pipelining.schedule.num_stages_per_rank: Interleaved1F1B: num_stages_per_rank=0 must be a "
            "positive int",
        ),
        ('{"schedule": "1f1b", "zero_bubbles": true}', "trainer.pipelining.schedule.zero_bubbles: unknown key; did "),
    ],
)
def test_a_bad_pipeline_schedule_is_one_line_naming_the_set_path(tmp_path, schedule, expected):
    line = _one_error_line(job_argv("train", tmp_path, f'trainer.pipelining={{"schedule": {schedule}}}'))
    assert line.startswith(f"d9dfn: error: load_config: {expected}")


# --- a full disk: the summary is the last line, threads' tracebacks go to error.log ----------------------------


def _full_disk_during_save(monkeypatch) -> None:
    """``CheckpointStore.save`` fails as orbax does on a full disk: its writer threads log the error with a
    traceback (absl) and one dies of it, then the save raises ENOSPC."""

    def save(self, step, state, metadata=None):
        def writer() -> None:
            try:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / "writing"))
            except OSError:
                logging.getLogger("absl").exception("_SignalingThread.run() raised an exception")
            raise OSError(errno.ENOSPC, "No space left on device")

        thread = threading.Thread(target=writer, name="np_type_handler")
        thread.start()
        thread.join()
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / f"{step}.orbax-checkpoint-tmp"))

    monkeypatch.setattr(CheckpointStore, "save", save)


def test_a_full_disk_ends_with_the_summary_and_keeps_thread_tracebacks_in_error_log(tmp_path, monkeypatch):
    _full_disk_during_save(monkeypatch)
    code, lines, _ = _run(job_argv("train", tmp_path, "trainer.total_steps=2", base=(*EAGER, *TINY_MODEL, *TINY_DATA)))
    assert code == 1
    run = tmp_path / "stdlib-lm"
    summary = (
        f"d9dfn: error: OSError: [Errno 28] No space left on device: '{run}/checkpoints/2.orbax-checkpoint-tmp' "
        f"[{run}: no checkpoint saved yet; free space on the disk of {run} (it is full), then rerun the same command "
        "to start over]"
    )
    errors = [i for i, line in enumerate(lines) if line.startswith("d9dfn: error:")]
    assert [lines[i] for i in errors] == [summary, f"{summary} (2 error(s) of background threads in {run}/error.log)"]
    assert errors[1] == len(lines) - 1  # what the user sees last
    assert lines[errors[0] + 1] == "Traceback (most recent call last):"
    assert not any("Exception in thread" in line or "ERROR:absl" in line for line in lines)
    log = (run / "error.log").read_text()
    assert "ERROR:absl:_SignalingThread.run() raised an exception" in log
    assert "Exception in thread np_type_handler:" in log
    assert log.count("No space left on device") >= 2


def test_thread_tracebacks_go_to_stderr_when_error_log_cannot_be_written(tmp_path, monkeypatch):
    _full_disk_during_save(monkeypatch)
    (tmp_path / "stdlib-lm" / "error.log").mkdir(parents=True)  # not a file: it cannot be opened to append
    code, lines, _ = _run(job_argv("train", tmp_path, "trainer.total_steps=2", base=(*EAGER, *TINY_MODEL, *TINY_DATA)))
    assert code == 1
    assert "Exception in thread np_type_handler:" in lines
    assert lines[-1].startswith("d9dfn: error: OSError: [Errno 28] No space left on device")
    assert "(2 error(s) of background threads above: " in lines[-1]
    assert lines.index("Exception in thread np_type_handler:") < len(lines) - 1


def test_a_timings_line_the_full_disk_refuses_too_does_not_hide_the_save_error(tmp_path, monkeypatch):
    # The trainer writes timings.jsonl on its way out; on a full disk that write fails as well. The run's own error is
    # what is shown, one traceback with nothing chained onto it (CI saw three tracebacks chained).
    _full_disk_during_save(monkeypatch)
    (tmp_path / "stdlib-lm" / "timings.jsonl").mkdir(parents=True)  # not a file: appending to it raises an OSError
    code, lines, _ = _run(job_argv("train", tmp_path, "trainer.total_steps=2", base=(*EAGER, *TINY_MODEL, *TINY_DATA)))
    assert code == 1
    assert lines[-1].startswith("d9dfn: error: OSError: [Errno 28] No space left on device: ")
    assert ".orbax-checkpoint-tmp" in lines[-1]
    assert sum(line.startswith("Traceback") for line in lines) == 1
    assert not any("During handling of the above exception" in line for line in lines)


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1M tmpfs {tmp}"], capture_output=True, check=False
        )
    return probe.returncode == 0


FULL_DISK_RUN_S = 900.0
"""The full-disk child's limit: 8-9 s at load 3 on 2 cores here (5.2 s of it CPU time, the rest waiting on imports' file
reads and the save's threads), yet past the earlier 300 s once in the README's suite at load 5-35 (a 2-core machine
at load 35 gives a process about 1/17 of a core, and the disk is shared too). Only a failure waits this long, and it
shows the child's stacks (:func:`_run_showing_stacks`), so a hang is told apart from a slow machine."""


def _run_showing_stacks(argv: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)``, except that a child still running after
    ``timeout_s`` gets SIGABRT, so that faulthandler (``PYTHONFAULTHANDLER=1`` in its environment; ``argv`` must exec
    Python in its own process) prints every thread's stack into the failure: a hang shows where it is."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as child:
        try:
            out, err = child.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            try:
                out, err = child.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # the signal did not end it: what it wrote so far
                child.kill()
                out, err = child.communicate()
            timed_out = True
    if timed_out:
        pytest.fail(f"the child ran past {timeout_s:.0f} s; its threads at that moment:\n{err[-30000:]}")
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm to mount a small tmpfs (user namespaces)")
def test_a_real_full_disk_ends_with_the_summary_line(tmp_path):
    # A 3 MB tmpfs in a private mount namespace: the default model's first checkpoint (about 10 MB) does not fit.
    disk = tmp_path / "disk"
    disk.mkdir()
    sets = [*EAGER, *TINY_DATA, "trainer.total_steps=2", f"trainer.checkpointing.save_dir={disk}"]
    command = " ".join([sys.executable, "-m", "d9dfn", "train", *(f"--set '{s}'" for s in sets)])
    done = _run_showing_stacks(  # unshare and sh exec: the child's process is Python's
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=3M tmpfs {disk} && exec {command}"],
        FULL_DISK_RUN_S,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONFAULTHANDLER": "1"},
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert lines[-1].startswith("d9dfn: error: ")
    assert "No space left on device" in lines[-1]
    assert "free space on the disk of" in lines[-1]
    assert "Event loop is closed" not in done.stderr  # the failed write's event loop is drained (issue 22)
    # Ours, one chain of one traceback: the timings line the trainer writes on its way out fails on the full disk too,
    # and must not chain its own traceback onto the run's. The save's threads' tracebacks go to error.log, unless the
    # full disk refuses that file too (it depends on how full the save left it): then they are on stderr, counted.
    tracebacks = sum(line.startswith("Traceback") for line in lines)
    if "could not be written" in lines[-1]:
        threads = int(lines[-1].split("(")[-1].split(" error(s) of background threads")[0])
        assert threads >= 1, done.stderr
        assert tracebacks == 1 + threads, done.stderr
    else:
        assert tracebacks == 1, done.stderr
        assert f"background threads in {disk / 'stdlib-lm' / 'error.log'})" in lines[-1]  # the tmpfs is gone now
    assert "During handling of the above exception" not in done.stderr.split("d9dfn: error: ")[1], done.stderr


# --- issue 44: the job against its run, every input check before anything heavy ---------------------------------

TWO_LAYERS = (*TINY, "model.num_layers=2", "trainer.total_steps=2", "trainer.checkpointing.period_steps=1")
"""The tiny job with 2 layers, 2 steps, both saved."""


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained 2-layer run's save_dir (its run directory is ``stdlib-lm`` under it); copied by each test."""
    root = tmp_path_factory.mktemp("two-layers")
    assert _run(job_argv("train", root, base=TWO_LAYERS))[0] == 0
    return root


def _copy_run(two_layers: Path, to: Path) -> Path:
    shutil.copytree(two_layers, to, dirs_exist_ok=True)
    return to / "stdlib-lm"


def test_infer_refuses_model_settings_other_than_the_runs(two_layers, tmp_path):
    # Issue 44 point 3: a 1-layer job used to evaluate the first layer of the 2-layer checkpoint, exit 0.
    run = _copy_run(two_layers, tmp_path)
    line = _one_error_line(job_argv("infer", tmp_path, "model.num_layers=1", base=TWO_LAYERS))
    assert line == (
        f"d9dfn: error: this run ({run}) was trained with model.num_layers=2 (its job.json) but this job has "
        "model.num_layers=1, and a checkpoint evaluated as another model reports that model's numbers; evaluate it "
        "with its settings (--set model.num_layers=2, or drop those --set), or point trainer.run.name at a run "
        "trained with these"
    )
    # Dropout is no model setting of an evaluation: the run's numbers, as without it.
    code, _, out = _run(job_argv("infer", tmp_path, "model.dropout=0.1", base=TWO_LAYERS))
    assert code == 0
    assert "checkpoint step 2)" in out


def test_train_on_an_existing_run_names_its_setting_and_a_new_run_name(two_layers, tmp_path):
    # Issue 44 point 9: was "CheckpointStore.restore: step 2 does not fit the template: ... pass like= ... or
    # strict=False", a Python API the command line cannot pass.
    run = _copy_run(two_layers, tmp_path)
    line = _one_error_line(job_argv("train", tmp_path, "model.num_layers=3", "model.hidden_size=24", base=TWO_LAYERS))
    assert line == (
        f"d9dfn: error: this run ({run}) was trained with model.hidden_size=16, model.num_layers=2 (its job.json) but "
        "this job has model.hidden_size=24, model.num_layers=3; to resume it, keep its settings (--set "
        "model.hidden_size=16 --set model.num_layers=2, or drop those --set); to train the new settings, give them a "
        "new run: --set trainer.run.name=stdlib-lm-new"
    )
    assert not (run / "checkpoints" / "3").exists()


def test_without_the_runs_job_json_the_checkpoint_itself_refuses_another_model(two_layers, tmp_path):
    run = _copy_run(two_layers, tmp_path)
    (run / "job.json").unlink()  # a run of the library's Trainer, or an older one: no settings to compare
    line = _one_error_line(job_argv("train", tmp_path, "model.num_layers=3", base=TWO_LAYERS))
    assert line.startswith(f"d9dfn: error: Trainer: checkpoint step 2 in {run / 'checkpoints'} holds another model ")
    assert "the model has ['params']['layers.2." in line
    assert "start a new run under another run.name (--set trainer.run.name=NAME in a job)" in line
    assert "like=" not in line
    assert "strict=False" not in line
    # infer restores the whole model strictly: a checkpoint with more layers than the job is refused, not cut.
    line = _one_error_line(job_argv("infer", tmp_path, "model.num_layers=1", base=TWO_LAYERS))
    assert line.startswith(f"d9dfn: error: load_weights: checkpoint step 2 in {run / 'checkpoints'} holds another ")
    assert "the checkpoint has params/layers.1." in line


def test_export_refuses_a_job_json_that_does_not_fit_the_checkpoint(two_layers, tmp_path):
    run = _copy_run(two_layers, tmp_path)
    job = json.loads((run / "job.json").read_text())
    job["model"]["num_layers"] = 1
    (run / "job.json").write_text(json.dumps(job))
    line = _one_error_line(["export", str(run), str(tmp_path / "out")])
    assert line.startswith(f"d9dfn: error: d9dfn export: {run / 'job.json'} describes another model than checkpoint ")
    assert "the checkpoint has params/layers.1." in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("afile", "OUT_DIR {out} is a file, not a folder; pass a folder (created if missing)"),
        ("afile/inside", "OUT_DIR {out} lies under {tmp}/afile, a file, not a folder"),
        ("stdlib-lm/checkpoints/2", "OUT_DIR {out} is inside the run's checkpoints ({run}/checkpoints)"),
    ],
)
def test_export_refuses_a_folder_it_cannot_or_must_not_write(two_layers, tmp_path, out, expected):
    # Issue 44 point 7: a file was a FileExistsError with a traceback (exit 1); a step's folder took the export.
    run = _copy_run(two_layers, tmp_path)
    (tmp_path / "afile").write_text("mine")
    step = run / "checkpoints" / "2"
    before = sorted(p.name for p in step.iterdir())
    line = _one_error_line(["export", str(run), str(tmp_path / out)])
    assert line.startswith("d9dfn: error: d9dfn export: " + expected.format(out=tmp_path / out, tmp=tmp_path, run=run))
    assert sorted(p.name for p in step.iterdir()) == before
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("command", ["train", "infer", "export"])
def test_a_step_that_is_not_saved_is_named_in_the_commands_terms(two_layers, tmp_path, command):
    # Was "CheckpointStore.restore: no step 7 in ... pass one of them, or None for the newest".
    run = _copy_run(two_layers, tmp_path)
    option = "--resume-from" if command == "train" else "--step"
    argv = (
        ["export", str(run), str(tmp_path / "out")]
        if command == "export"
        else job_argv(command, tmp_path, base=TWO_LAYERS)
    )
    line = _one_error_line([*argv, option, "7"])
    assert line.startswith(f"d9dfn: error: {option} 7: {run / 'checkpoints'} holds no step 7 (saved steps: [1, 2]); ")
    assert f"or leave {option} out to " in line


def test_a_model_too_large_is_refused_from_its_settings_before_the_lock_and_any_module(
    two_layers, tmp_path, monkeypatch
):
    # Issue 44 point 5: 100,000 layers took 15 minutes to build (module by module, on meta) before the estimate.
    from d9dfn.jobs import Qwen3Provider

    run = _copy_run(two_layers, tmp_path / "trained")
    (run / "job.json").unlink()  # else infer refuses the other model settings first
    monkeypatch.setattr(Qwen3Provider, "initialize_model_stage", lambda *args: pytest.fail("a module was built"))
    for command, save_dir in (("train", tmp_path / "new"), ("infer", tmp_path / "trained")):
        line = _one_error_line(job_argv(command, save_dir, "model.num_layers=100000", base=(*EAGER, *TINY_DATA)))
        who = "TrainingConfigurator" if command == "train" else "InferenceConfigurator"
        assert line.startswith(f"d9dfn: error: {who}: the model's 1.97e+10 parameters need at least ")
        assert "more than this host's memory" in line
        assert line.endswith("--set model.num_layers=4")
    assert not (tmp_path / "new").exists()  # refused before the run directory was locked (or made)


def test_the_early_memory_estimate_is_the_skeletons():
    from d9dfn.loop import estimate_memory_of_count

    with torch.device("meta"):
        skeleton = Qwen3LM(Qwen3Config.tiny(vocab_size=256))
    params = dict(skeleton.named_parameters())
    count = sum(p.numel() for p in params.values())
    for optimizer in (optim.adamw(1e-3), optim.sgd(0.1, momentum=0.9), optim.sgd(0.1), None):
        for dtype in (torch.float32, torch.bfloat16):
            estimate = estimate_memory(params, optimizer, param_dtype=dtype)
            # Per-leaf scalars (a count per optimizer, not per leaf) aside, the same bytes.
            early = estimate_memory_of_count(count, optimizer, param_dtype=dtype)
            assert (early.params, early.grads) == (estimate.params, estimate.grads)
            assert abs(early.optimizer - estimate.optimizer) <= 8 * len(params)


@pytest.mark.parametrize(
    ("argv_tail", "expected"),
    [
        (["--set", "trainer.determinism.seed=-1"], "trainer.determinism.seed=-1: Input should be greater than or"),
        (["--set", f"trainer.determinism.seed={10**24}"], f"trainer.determinism.seed={10**24}: Input should be less"),
        (["--set", 'trainer.checkpointing.save_dir="runs\\u0000x"'], 'trainer.checkpointing.save_dir: "runs\\u0000x"'),
        (["--set", 'trainer.run.name="a\\u0000b"'], "trainer.run.name: run.name 'a\\x00b' must be a non-empty name"),
        (["--set", "trainer.run.hparams.x=" + "[" * 100_000 + "]" * 100_000], "override 'trainer.run.hparams.x'"),
    ],
)
def test_point_7_overrides_are_one_line_naming_the_field(tmp_path, argv_tail, expected):
    # Were: a traceback (exit 1) for seed=-1 and a deep value; "Overflow when unpacking long long"; "embedded null
    # byte".
    line = _one_error_line([*job_argv("train", tmp_path), *argv_tail])
    assert line.startswith(f"d9dfn: error: load_config: {expected}")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "{file!r} nests lists and objects more than Python's parser"),
        (
            b'{"trainer": {"run": {"hparams": {"x": ' + b"[" * 500 + b"]" * 500 + b"}}}}",
            "{file}: trainer.run.hparams.x",
        ),
        (bytes(range(256)), "config file {file!r} is not UTF-8 text (byte 0x80 at offset 128); pass a JSON or YAML"),
        (b"", "config file {file!r} is empty; pass a JSON or YAML file"),
    ],
    ids=["nested-100000-deep", "nested-500-deep-in-hparams", "binary", "empty"],
)
def test_point_7_config_files_are_one_line_naming_the_file(tmp_path, content, expected):
    file = tmp_path / "job.json"
    file.write_bytes(content)
    line = _one_error_line(["train", str(file)])
    assert line.startswith("d9dfn: error: load_config: " + expected.format(file=str(file)))


def test_dev_null_is_an_empty_config_not_a_missing_one():
    # Was "config file '/dev/null' does not exist": it exists, and reads as empty (as a pipe, <(...), reads).
    assert _one_error_line(["train", "/dev/null"]) == (
        "d9dfn: error: load_config: config file '/dev/null' is empty; pass a JSON or YAML file whose top level is an "
        'object of sections such as {"trainer": {...}}'
    )


def test_the_largest_seed_trains_and_resumes(tmp_path):
    seed = f"trainer.determinism.seed={2**64 - 1}"
    assert _run(job_argv("train", tmp_path, seed, "trainer.total_steps=1", base=TINY))[0] == 0
    assert _run(job_argv("train", tmp_path, seed, "trainer.total_steps=2", base=TINY))[0] == 0


def test_a_batching_error_names_the_set_path(tmp_path):
    # Issue 44 point 9: "set batching.global_batch_size" is no --set path of a job; refused before anything is built.
    line = _one_error_line(job_argv("train", tmp_path, 'mesh={"data_parallel_replicate": 2}'))
    assert line == (
        "d9dfn: error: batch_maths: trainer.batching.global_batch_size=2 is not a multiple of data_parallel_size=2 x "
        "trainer.batching.microbatch_size=2 = 4; set trainer.batching.global_batch_size to a multiple of 4 (--set "
        "trainer.batching.global_batch_size=4) or reduce trainer.batching.microbatch_size"
    )


def test_under_torchrun_the_line_goes_to_torchrun_once_rank_0_first(tmp_path, monkeypatch, capsys):
    import time

    from d9dfn.cli import _errors

    monkeypatch.setattr(_errors, "LATE_RANK_S", 0.2)
    for rank in ("0", "1"):
        file = tmp_path / f"error{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(file))
        monkeypatch.setenv("RANK", rank)
        started = time.monotonic()
        assert _errors.bad_input("bad input") == 2
        waited = time.monotonic() - started
        assert capsys.readouterr().err == ""  # not printed by the worker: torchrun prints it, last
        assert json.loads(file.read_text())["message"] == "d9dfn: error: bad input"
        assert (waited >= 0.2) is (rank == "1")  # the others leave rank 0 the time to fail alike
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert _errors.bad_input("bad input") == 2  # not under torchrun: printed
    assert capsys.readouterr().err == "d9dfn: error: bad input\n"


@pytest.mark.slow
@pytest.mark.cli
def test_under_torchrun_a_bad_input_is_one_line_printed_once_and_last(tmp_path):
    # Issue 44 point 9: each rank printed the line, then torchrun's ChildFailedError block (about 40 lines) buried
    # it. Now torchrun's block shows it, last: its first failure's `traceback :` field is the line.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "d9dfn"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [*command, *job_argv("train", tmp_path)], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert done.returncode == 1  # torchrun's own code for a failed worker (the worker exited 2)
    lines = (done.stdout + done.stderr).splitlines()
    errors = [line for line in lines if "d9dfn: error:" in line]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("  traceback : d9dfn: error: batch_maths: trainer.batching.global_batch_size=2 ")
    assert lines[-2:] == [errors[0], "=" * 60]  # the last line but torchrun's closing rule
    assert "exitcode  : 2 " in done.stderr
