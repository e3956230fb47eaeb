"""benchmarks/_memory.py: the tracker's bytes on steps small enough to count by hand, the allocator agreeing with
its total; benchmarks/memory.py: unknown variants are refused with the choices."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from _ranks import _init, _run_ranks
from torch import nn

import d9dfn.optim as optim
from d9dfn import BuildForwardInputsResult, ComputeLossResult, Precision, TrainTask, init_train_state, make_train_step

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")

B, D, H = 16, 8, 32  # rows, model width, hidden width
P = 2 * D * H * 4  # bytes of the two float32 weights


def _load(name: str):
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module(name)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"y": self.down(torch.relu(self.up(x)))}


class _SquareSum(TrainTask):
    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"x": batch}), state

    def compute_loss(self, outputs, state, step):
        return ComputeLossResult(loss=outputs["y"].square().sum())


def _tracked(precision: Precision | None = None, mesh=None, data_parallel=None):
    """One eager step of the MLP under the tracker (after a first step: Adam's moments exist), and the allocator's
    peak of the same step."""
    memory_module = _load("_memory")
    torch.manual_seed(0)
    model, opt = _Mlp(), optim.adamw(1e-3, fused=False)  # the foreach tail, whose tensors are counted below
    state = init_train_state(model, opt, mesh=mesh)
    from d9dfn import parallel

    plan = None if mesh is None else parallel.plan_for(state.params, mesh)
    step = make_train_step(
        model, _SquareSum(), opt, compile=False, precision=precision, plan=plan, data_parallel=data_parallel
    )
    x = torch.randn(B, D)
    state, _ = step(state, x)
    _, _, memory = memory_module.track_step(step, state, x)
    with memory_module.allocator_peak("cpu") as allocated:
        step(state, x)
    return memory, allocated["peak"]


def test_memory_tracker_counts_a_hand_computed_step() -> None:
    memory, allocator_peak = _tracked()
    assert memory.num_backwards == 1
    # At rest: the two weights; AdamW's count (int64), its last rate (float32) and its two moments.
    assert memory.before["params"] == P
    assert memory.before["optimizer"] == 8 + 4 + 2 * P
    # A functional step returns new params and state while the caller holds the old ones.
    assert memory.peaks["params"] == 2 * P
    assert memory.peaks["optimizer"] >= 2 * memory.before["optimizer"]
    assert memory.peaks["gathered"] == 0  # plain float32 params: the model reads them as they are
    # The gradient sums, their 1/Σw-scaled copies and the two leaves' norms.
    assert memory.peaks["grads"] == 2 * P + 2 * 4
    # Saved for backward: relu's output (relu's backward and down's weight gradient read it), y (square's backward),
    # the loss weight w (wℓ's backward) and autograd's seed ones_like(wℓ). The batch x is saved too, but it existed
    # before the step.
    assert memory.peaks["activations"] == B * H * 4 + B * D * 4 + 4 + 4
    # Every byte the allocator handed out during the step, the tracker saw.
    assert memory.peak - sum(memory.before.values()) == allocator_peak
    assert memory.peak == sum(memory.at_peak.values())
    assert sum(memory.peaks.values()) >= memory.peak


def _fused_step(donate: bool):
    """One eager step of the MLP with the fused AdamW tail under the tracker (after a first step), and the
    allocator's peak of the next."""
    memory_module = _load("_memory")
    torch.manual_seed(0)
    model, opt = _Mlp(), optim.adamw(1e-3, fused=True)
    state = init_train_state(model, opt)
    step = make_train_step(model, _SquareSum(), opt, compile=False, donate=donate)
    x = torch.randn(B, D)
    state, _ = step(state, x)
    state, _, memory = memory_module.track_step(step, state, x)
    with memory_module.allocator_peak("cpu") as allocated:
        step(state, x)
    return memory, allocated["peak"]


def test_memory_tracker_counts_one_state_in_a_donating_step() -> None:
    memory, allocator_peak = _fused_step(donate=True)
    moments = 2 * P
    assert memory.before["params"] == P
    assert memory.before["optimizer"] == 8 + 4 + moments
    # The kernel updates the params and moments where they are: the step never holds a second copy; only the state's
    # scalars are new (the count, int64, and the rate, float32).
    assert memory.peaks["params"] == P
    assert memory.peaks["optimizer"] == 8 + 4 + moments + 8 + 4
    assert memory.peak - sum(memory.before.values()) == allocator_peak
    pure, _ = _fused_step(donate=False)  # the same step, pure: the kernel's copies of params and moments
    assert pure.peaks["params"] == 2 * P
    assert pure.peaks["optimizer"] >= 2 * moments


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return {"y": x}


@pytest.mark.slow  # two inductor compiles (about a minute on two loaded cores)
@pytest.mark.compiled
def test_a_donating_step_compiled_by_inductor_writes_the_state_in_place() -> None:
    """The compiled whole-tree tail copies its new params and moments into the state's tensors (inputs of its graph):
    inductor then stores the update into them directly, so the step holds no second state (measured 5 → 2
    param-sizes above the resident state; ``aot_eager`` runs the copies after the update, and holds both)."""
    memory_module = _load("_memory")
    x = torch.randn(8, 256)
    peaks = {}
    for donate in (False, True):
        torch.manual_seed(0)
        model, opt = _Wide(), optim.adamw(1e-3, fused=False)
        state = init_train_state(model, opt)
        step = make_train_step(model, _SquareSum(), opt, compile=True, donate=donate, max_grad_norm=1.0)
        for _ in range(2):
            state, _ = step(state, x)
        with memory_module.allocator_peak("cpu") as allocated:
            state, out = step(state, x)
            out.loss.item()
        peaks[donate] = allocated["peak"]
    size = sum(p.numel() * p.element_size() for p in state.params.values())
    assert peaks[True] <= peaks[False] - 2 * size, (peaks, size)


def test_memory_tracker_counts_compute_dtype_casts_as_gathered() -> None:
    memory, allocator_peak = _tracked(Precision(param_dtype=torch.float32, compute_dtype=torch.bfloat16))
    assert memory.before["params"] == P
    assert memory.peaks["gathered"] == P // 2  # both weights cast to bfloat16 for the model
    # Now in bfloat16: relu's output and y, and the cast input x, which the up projection saves; w and the seed stay
    # float32.
    assert memory.peaks["activations"] == (B * H + B * D + B * D) * 2 + 4 + 4
    assert memory.peak - sum(memory.before.values()) == allocator_peak


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Mlp(), _Mlp()])

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            x = block(x)["y"]
        return {"y": x}


@pytest.mark.slow  # compiles (aot_eager)
def test_memory_tracker_sees_a_compiled_per_block_step() -> None:
    # Per-block regions: autograd runs the compiled backward, so the tracker sees it and every op of the aot_eager
    # graphs (the regions' subgraphs included); the compiled step frees each value after its last use, so its peak
    # is lower than the eager step's, and the allocator agrees with the tracker on both.
    import torch._functorch.config  # d9dfn/step/_blocks.py patches it without importing it (eager runs fail alone)

    memory_module = _load("_memory")
    x = torch.randn(B, D)
    peaks = {}
    for compile in (False, "aot_eager"):
        torch.manual_seed(0)
        model, opt = _Blocks(), optim.adamw(1e-3, fused=False)  # the compiled tail: its ops are tracked
        state = init_train_state(model, opt)
        step = make_train_step(model, _SquareSum(), opt, compile=compile, repeated_blocks=(_Mlp,))
        state, _ = step(state, x)
        _, _, memory = memory_module.track_step(step, state, x)
        with memory_module.allocator_peak("cpu") as allocated:
            step(state, x)
        assert memory.num_backwards == 1
        assert memory.peak - sum(memory.before.values()) == allocated["peak"]
        # Saved per block: relu's output and the block's output (the next block's input, or y for square).
        assert memory.peaks["activations"] == 2 * (B * H * 4 + B * D * 4) + 4 + 4
        assert memory.peaks["grads"] >= 2 * 2 * P
        peaks[compile] = memory.peak
    assert peaks["aot_eager"] < peaks[False]


def _shard_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        from d9dfn import parallel
        from d9dfn.loop import init_data_parallel_mesh

        mesh = init_data_parallel_mesh(1, world_size, device_type="cpu")
        memory, allocator_peak = _tracked(mesh=mesh, data_parallel=parallel.data_parallel(mesh, rank))
        assert memory.before["params"] == P // world_size  # this rank's rows of each weight
        assert memory.before["optimizer"] == 8 + 4 + 2 * P // world_size
        assert memory.peaks["gathered"] == P  # today's shard: every weight all-gathered whole for the step
        # The allocator sometimes sees one more shard-sized buffer (P / world_size bytes) than the tracker: made off
        # the tracked thread while the collectives run (dispatch modes are per thread). Seen in 2 of about 6
        # full-suite runs, never alone; its exact origin is not pinned down, so the bound is that one buffer. Once
        # (a full CI run, 2026-11-27) the allocator saw 8 bytes less than the tracker (one 0-d int64 or float64
        # freed sooner in the untracked second call, which the peak is read from): the lower bound allows that one.
        tracked = memory.peak - sum(memory.before.values())
        assert tracked - 8 <= allocator_peak <= tracked + P // world_size, (tracked, allocator_peak)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # forked ranks (~9 s on a loaded 2-core machine)
@pytest.mark.ranks
def test_memory_tracker_counts_all_gathered_shards_as_gathered(tmp_path) -> None:
    _run_ranks(_shard_worker, 2, tmp_path, timeout_s=60, clean=True)


def _communication_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        import torch.distributed._functional_collectives as funcol

        bench = _load("memory")
        x = torch.ones(1 << 16)

        def collectives() -> None:
            for _ in range(4):
                funcol.all_reduce(x, "sum", dist.group.WORLD).wait()

        quiet = bench.communication(lambda: torch.mm(torch.ones(64, 64), torch.ones(64, 64)), steps=2)
        assert (quiet["comm_ms"], quiet["wait_ms"]) == (0, 0), quiet
        busy = bench.communication(collectives, steps=2)
        # Every all-reduce ran on gloo's threads, and the step thread waited for each (issued and waited at once).
        assert 0 < busy["comm_ms"] <= busy["profiled_ms"], busy
        assert 0 < busy["wait_ms"] <= busy["profiled_ms"], busy
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # forked ranks
@pytest.mark.ranks
def test_memory_benchmark_measures_communication_and_the_wait_for_it(tmp_path) -> None:
    """``memory.communication``: gloo's time in collectives and the step's time waiting for them, from the profiler;
    zero for a step without collectives."""
    _run_ranks(_communication_worker, 2, tmp_path, timeout_s=60)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ac", "everything"], r"--ac everything: unknown; choose from none, full, selective"),
        (["--variants", "ddp"], r"--variants ddp: unknown; choose from replicate, shard, block-shard"),
        (["--donation", "keep"], r"--donation keep: unknown; choose from donate, pure"),
    ],
)
def test_memory_benchmark_refuses_unknown_variants(argv, message, capsys) -> None:
    bench = _load("memory")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
