"""The run's compile cache (``d9dfn.loop.run_compile_cache``, issue 25 item 3): where it goes, what overrides it, the
host's cache behind it (``host_compile_cache``, ``publish_compile_cache``), and that a second start or a new run of
the same job reads them while a changed model or config misses and computes what a cold compile does."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest
import torch
from torch import nn

import d9dfn.optim as optim
from d9dfn import Precision, init_train_state, make_train_step
from d9dfn._torch._vec_isa import check_best_vec_isa_only
from d9dfn.loop import host_compile_cache, publish_compile_cache, run_compile_cache
from d9dfn.loop._cache_seal import cache_files, seal
from d9dfn.loop._compile_cache import host_cpu
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

ENV = "TORCHINDUCTOR_CACHE_DIR"
HOST = "D9DFN_COMPILE_CACHE"
VOCAB, SEQ = 16, 6


@pytest.fixture
def clean_env(monkeypatch: Any) -> Any:
    """No ``TORCHINDUCTOR_CACHE_DIR`` from the user and no host cache (a test that wants one sets its own); whatever a
    test sets is undone afterwards."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv(HOST, "off")
    return monkeypatch


@pytest.fixture
def no_isa_check(clean_env: Any) -> Any:
    """The vector-ISA check replaced by a no-op (seconds of C++ builds and probes) where a test never compiles."""
    import torch._inductor.cpu_vec_isa

    check_best_vec_isa_only()  # installed first (once per process), so that it does not wrap the no-op below
    clean_env.setattr(torch._inductor.cpu_vec_isa, "valid_vec_isa_list", lambda: [])
    return clean_env


def test_run_compile_cache_puts_each_rank_in_the_run_directory(tmp_path: Any, no_isa_check: Any) -> None:
    run, cpu = tmp_path / "runs" / "demo", host_cpu()
    assert run_compile_cache(run) == str(run / "compile_cache" / cpu / "rank_0") == os.environ[ENV]
    assert os.path.isdir(run / "compile_cache" / cpu / "rank_0")
    assert run_compile_cache(run) == str(run / "compile_cache" / cpu / "rank_0")  # called again: unchanged
    # Another run in the same process (a test session, train then infer of another run) moves with it.
    other = run_compile_cache(tmp_path / "other", 3, distributed=True)
    assert other == str(tmp_path / "other" / "compile_cache" / cpu / "rank_3")


def test_a_new_run_starts_from_the_hosts_cache_and_gives_back_what_it_compiled(
    tmp_path: Any, no_isa_check: Any
) -> None:
    no_isa_check.setenv(HOST, str(tmp_path / "host"))
    host = host_compile_cache(2)
    assert host == str(tmp_path / "host" / host_cpu() / "rank_2")
    entry = os.path.join(host, "fxgraph", "ab", "fabc", "entry")
    os.makedirs(os.path.dirname(entry))
    for path in (entry, os.path.join(host, "ab", "cabc.so")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            file.write(path)
    seal(host)  # what a run published: checked, then sealed
    os.makedirs(os.path.join(host, "locks"))
    for path in (os.path.join(host, "locks", "cabc.lock"), os.path.join(host, "ab", "tmpx1y2")):
        with open(path, "w") as file:
            file.write("")

    run = run_compile_cache(tmp_path / "run", 2, distributed=True)
    assert run is not None
    assert cache_files(run) == ["ab/cabc.so", "fxgraph/ab/fabc/entry"]  # no lock, no temporary file
    assert os.path.samefile(os.path.join(run, "fxgraph", "ab", "fabc", "entry"), entry)  # a link, not a copy

    compiled = os.path.join(run, "cd", "ccd.py")  # what this run compiled goes back to the host after its first step
    os.makedirs(os.path.dirname(compiled))
    with open(compiled, "w") as file:
        file.write("graph")
    assert publish_compile_cache() == 1
    assert os.path.samefile(os.path.join(host, "cd", "ccd.py"), compiled)
    assert publish_compile_cache() == 0  # nothing new


def test_no_host_cache_when_it_is_turned_off(tmp_path: Any, no_isa_check: Any) -> None:
    for value in ("off", "0", "none", ""):
        no_isa_check.setenv(HOST, value)
        assert host_compile_cache() is None
    run = run_compile_cache(tmp_path / "run")
    assert run is not None
    with open(os.path.join(run, "graph.py"), "w") as file:
        file.write("graph")
    assert publish_compile_cache() == 0  # no host: nothing given back, nothing written outside the run


def test_a_host_cache_that_cannot_be_written_costs_nothing_but_the_sharing(tmp_path: Any, no_isa_check: Any) -> None:
    (tmp_path / "host").write_text("a file where the host cache would go")
    no_isa_check.setenv(HOST, str(tmp_path / "host"))
    run = run_compile_cache(tmp_path / "run")  # seeding from it fails quietly: nothing to seed
    assert run is not None
    assert cache_files(run) == []
    with open(os.path.join(run, "graph.py"), "w") as file:
        file.write("graph")
    assert publish_compile_cache() == 0  # logged, not raised


def test_host_cpu_names_the_architecture_and_the_instruction_set(monkeypatch: Any) -> None:
    import platform

    name = host_cpu()
    assert name == host_cpu()
    assert name.startswith(f"{platform.machine()}-")
    real_open = open

    def other_cpu(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/proc/cpuinfo":
            import io

            return io.StringIO("processor : 0\nflags : fpu sse2 avx2\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", other_cpu)
    assert host_cpu() != name  # another set of instructions: another cache directory


def test_run_compile_cache_leaves_a_users_directory_alone(tmp_path: Any, no_isa_check: Any) -> None:
    no_isa_check.setenv(ENV, str(tmp_path / "mine"))
    assert run_compile_cache(tmp_path / "run") is None  # one process: the user's directory as it is
    assert os.environ[ENV] == str(tmp_path / "mine")
    assert run_compile_cache(tmp_path / "run", 1, distributed=True) == str(tmp_path / "mine" / "rank_1")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_run_compile_cache_keeps_the_default_for_a_read_only_run(tmp_path: Any, no_isa_check: Any) -> None:
    run = tmp_path / "published"
    run.mkdir()
    run.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert run_compile_cache(run) is None
        assert ENV not in os.environ
    finally:
        run.chmod(stat.S_IRWXU)


def test_run_compile_cache_keeps_the_default_when_the_cache_cannot_be_written(tmp_path: Any, no_isa_check: Any) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "compile_cache").write_text("a file where the cache folder would go")
    assert run_compile_cache(run) is None
    assert ENV not in os.environ


# --- a second start reads the run's cache; a changed model or config misses it -----------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    """(B, T) ids -> (B, T, V) logits through two identical blocks (what ``repeated_blocks="auto"`` finds)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return {"logits": self.head(x)}


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _start(width: int = 8, precision: Precision | None = None, blocks: Any = (), compile: bool = True) -> Any:
    """A new process's first two steps, as far as torch's caches can tell: dynamo reset, counters cleared."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, opt = Stack(width), optim.sgd(0.1, momentum=0.9)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, precision=precision, repeated_blocks=blocks, compile=compile)
    outs = []
    for _ in range(2):
        state, out = step(state, _batch())
        outs.append(out.loss)
    # Inductor's graphs (FX graph cache) and AOTAutograd's (the forward and backward of each joint graph, and the
    # head, whose views alone give inductor nothing to compile: cached whole, StepOptions.compiled_head) found or
    # compiled again.
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return (state.params, state.opt_state, outs), hits, misses


@pytest.mark.slow
def test_a_second_start_reads_the_run_cache_and_a_changed_config_misses_it(tmp_path: Any, clean_env: Any) -> None:
    # No compile workers for one small test (config.patch: monkeypatch's undo would delete the config entry).
    with torch._inductor.config.patch(compile_threads=1):
        _second_start_and_changed_configs(tmp_path)


def _second_start_and_changed_configs(tmp_path: Any) -> None:
    os.environ[HOST] = str(tmp_path / "host")  # clean_env's monkeypatch restores it
    run_compile_cache(tmp_path / "run")
    cold, hits, misses = _start()
    assert (hits, misses > 0) == (0, True)
    warm, hits, misses = _start()  # the same job again: every graph from the run's cache, the same numbers
    assert (hits > 0, misses) == (True, 0)
    assert_trees_close(warm, cold, rtol=0, atol=0)
    assert publish_compile_cache() > 0
    run_compile_cache(tmp_path / "next")  # a new run of the same job on this host: the graphs from the host's cache
    warm, hits, misses = _start()
    assert (hits > 0, misses) == (True, 0)
    assert_trees_close(warm, cold, rtol=0, atol=0)

    # A changed model, precision or per-block compilation: new graphs (misses), and the eager step's numbers (the
    # cold compile above computes the same job's bitwise, so a wrong graph from the cache would show here).
    bf16 = Precision.bf16_mixed()
    for options, tolerance in (({"width": 12}, 1e-5), ({"precision": bf16}, 1e-2), ({"blocks": "auto"}, 1e-5)):
        got, hits, misses = _start(**options)
        assert misses > 0, options
        expected, _, _ = _start(**options, compile=False)
        assert_trees_close(got, expected, rtol=tolerance, atol=tolerance)
