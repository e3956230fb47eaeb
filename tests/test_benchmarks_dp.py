"""benchmarks/dp_scaling.py: its byte counts on 2 forked gloo ranks match the ring-algorithm formulas exactly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "dp_scaling.py"


def _load():
    spec = importlib.util.spec_from_file_location("dp_scaling", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimum_bytes_formulas() -> None:
    dp_scaling = _load()
    param_bytes = 1000
    # DDP: one all-reduce of the gradient and Σwℓ, Σw: 2(n-1)/n · (P + 8)
    assert dp_scaling.minimum_bytes("ddp-plain", param_bytes, (2, 1)) == 1008
    assert dp_scaling.minimum_bytes("replicate", param_bytes, (4, 1)) == 1.5 * 1008
    # FSDP: gather + reduce-scatter, (n-1)/n · P each, and one all-reduce of three scalars
    assert dp_scaling.minimum_bytes("shard", param_bytes, (1, 2)) == 1000 + 12
    # HSDP 2x2: shard-axis gather + reduce-scatter (1/2 · P each), the P/2 shard all-reduced over 2 replicas,
    # three scalars all-reduced over 4 ranks
    assert dp_scaling.minimum_bytes("hybrid", param_bytes, (2, 2)) == 1000 + 500 + 1.5 * 12


@pytest.mark.slow
@pytest.mark.ranks
def test_dp_scaling_counts_match_the_formulas() -> None:
    dp_scaling = _load()
    args = dp_scaling.parse_args(["--quick", "--no-timing"])
    counts = dp_scaling.run_ranks(2, args, timeout_s=120)["counts"]
    assert set(counts) == {"ddp-plain", "replicate", "shard"}
    param_bytes, num_params = counts["ddp-plain"]["param_bytes"], counts["ddp-plain"]["num_params"]
    assert param_bytes > 100_000

    # Plain params: exactly one bucketed all-reduce of every gradient plus Σwℓ and Σw, which is the minimum.
    ddp = counts["ddp-plain"]
    assert ddp["collectives"] == 1, ddp
    assert ddp["bytes_measured"] == ddp["bytes_minimum"] == param_bytes + 8

    # DTensor Replicate: the same bytes, with the gradients in one bucket (one all-reduce per mesh axis; the
    # dp_shard axis has size 1) plus one for Σwℓ, Σw.
    replicate = counts["replicate"]
    assert replicate["collectives"] <= 3, replicate
    assert replicate["bytes_measured"] == replicate["bytes_minimum"] == param_bytes + 8

    # Shard(0): (n-1)/n · P gathered + (n-1)/n · P reduce-scattered (every dim 0 of the quick model is even, so
    # no padding), 8 bytes for Σwℓ, Σw, and the clip's norm: one all-reduce of every leaf's squared shard norm
    # (d9dfn.parallel.leaf_norms, 4 bytes per leaf, so that the norm is bitwise optim.global_norm's), where one
    # float32 for all shards would be the minimum.
    shard = counts["shard"]
    assert shard["collective_kinds"]["all_gather_into_tensor"] == num_params, shard
    assert shard["collective_kinds"]["reduce_scatter_tensor"] == num_params, shard
    assert shard["collective_kinds"]["all_reduce"] == 2, shard
    assert shard["bytes_minimum"] == param_bytes + 12
    assert shard["bytes_measured"] == param_bytes + 8 + 4 * num_params, shard
