"""benchmarks/moe.py run tiny: its counts are the ones the MoE code must produce (host syncs, all-to-all bytes against
the real copies, experts per rank), its speeds and compile times are numbers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _load():
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("moe")


def test_active_params_of_the_dense_baseline_match_the_moe_model() -> None:
    moe = _load()
    args = moe.parse_args(["--quick"])
    sparse, dense = moe.moe_config(args), moe.dense_config(args)
    # The same attention and head; the MLP as wide as the top-k experts; the router the only difference.
    router = sparse.num_layers * sparse.hidden_size * sparse.num_experts
    assert moe.active_params_per_token(sparse) - moe.active_params_per_token(dense) == router


@pytest.mark.slow
@pytest.mark.ranks
def test_moe_benchmark_runs_tiny_and_counts_what_the_code_must_do(capsys: pytest.CaptureFixture[str]) -> None:
    moe = _load()
    result = moe.main(["--quick", "--backend", "aot_eager"])
    args = moe.parse_args(["--quick"])
    layers, num_experts = args.layers, args.experts
    speed = result["speed"]
    assert all(rate > 0 for rate in speed["tokens_per_s"].values())
    syncs = speed["host_syncs_per_step"]
    # The grouped path and the dense model: no host sync in an eager step, nor between the compiled pieces; the
    # reference path: one data-dependent torch.where per expert and MoE layer (the forward; its backward adds none).
    for name in ("moe_grouped_eager", "moe_grouped_compiled", "dense_eager", "dense_compiled"):
        assert syncs[name]["total"] == 0, (name, syncs[name])
    assert syncs["moe_loop_eager"] == {"total": layers * num_experts, "nonzero": layers * num_experts}
    assert set(result["compile_s"]) == set(args.compile_experts)
    for per_rank in result["ranks"]:
        ep1, ep2 = per_rank["ep1"], per_rank["ep2"]
        assert ep1["host_syncs_eager"] == ep2["host_syncs_eager"] == 0
        assert ep2["state_bytes"] < ep1["state_bytes"]  # half the experts and their moments
        a2a = ep2["all_to_all"]
        # Per MoE layer: the counts, then dispatch and combine forward and their adjoints backward.
        assert a2a["calls"] == 5 * layers
        # The static slots: n·C rows per exchange where T·k are real (C = T·min(k, E/n) = T·k here): 2x, plus the
        # counts (E int64 per layer).
        assert a2a["payload_bytes"] == 2 * a2a["real_copy_bytes"] + layers * num_experts * 8
        assert 0 < a2a["remote_copy_bytes"] < a2a["real_copy_bytes"]
    assert "| moe_loop_eager |" in capsys.readouterr().out
