"""benchmarks/scaling.py at a small size: the bytes per rank under tensor and context parallelism are the shards' exact
sizes, and the collectives of a step are :func:`scaling.theory`'s, count and bytes (rank 0 of a fake process group:
no forked ranks, a few seconds)."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

_BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
ARGV = [
    "--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--intermediate", "64",
    "--vocab", "64", "--rows", "2", "--seq", "8", "--microbatches", "2",
]  # fmt: skip


def _load():
    if _BENCHMARKS not in sys.path:
        sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("scaling")


@pytest.fixture(scope="module")
def measured():
    scaling = _load()
    _, shape, _ = scaling.parse_args(ARGV)
    return (
        scaling,
        shape,
        {name: scaling.measure(scaling.CELLS[name], shape) for name in ("tp1", "tp2", "tp2-sp", "cp2")},
    )


def test_scaling_counts_the_shards_bytes_per_rank_exactly(measured) -> None:
    _, shape, rows = measured
    config = shape.config
    one, tp2, sp2, cp2 = rows["tp1"], rows["tp2"], rows["tp2-sp"], rows["cp2"]
    # Every rank computes the RMSNorms whole (per block the two norms of width D and q/k's of head_dim, then the final
    # one); tp splits everything else, so a rank holds half of the rest beside them.
    norms = 4 * (config.num_layers * 2 * (config.hidden_size + config.head_dim) + config.hidden_size)
    assert tp2["replicated"] == sp2["replicated"] == norms
    assert one["replicated"] == cp2["replicated"] == one["params"]
    assert tp2["params"] == sp2["params"] == (one["params"] - norms) // 2 + norms
    # AdamW's two moments per param, its count (int64) and its rate (float32); gradients as the params.
    for row in (one, tp2, sp2, cp2):
        assert row["optim"] == 2 * row["params"] + 8 + 4, row["cell"]
        assert row["grads"] == row["params"], row["cell"]
    assert cp2["params"] == one["params"]  # replicated over cp
    # cp's gradients are whole on every rank: their peak (the microbatches' sum and the new microbatch's) as one
    # process's.
    assert cp2["grads_peak"] == one["grads_peak"] >= 2 * one["params"]


def test_scaling_activations_shrink_except_what_is_gathered(measured) -> None:
    _, shape, rows = measured
    config, m = shape.config, shape.microbatches
    b, seq = shape.rows // m, shape.seq
    one, tp2, sp2, cp2 = rows["tp1"], rows["tp2"], rows["tp2-sp"], rows["cp2"]
    assert one["activations"] > tp2["activations"] > sp2["activations"]
    assert one["activations"] > cp2["activations"]

    # What is gathered is saved whole on every rank, summed over the microbatches: cp's keys and values of all T
    # positions per block; sp's residual stream before each column-parallel pair and the final norm. (The gather's
    # output, or with more than one row its copy into sequence order, aten.clone, which the gather's output is then
    # freed for; the tp2 cell gathers nothing.)
    def gathered(row):
        ops = row["activations_by_op"]
        return ops.get("_c10d_functional.all_gather_into_tensor.default", 0) + ops.get("aten.clone.default", 0)

    kv = 2 * b * config.num_kv_heads * seq * config.head_dim * 4
    assert gathered(cp2) == m * config.num_layers * kv
    stream = b * seq * config.hidden_size * 4
    assert gathered(sp2) == m * (2 * config.num_layers + 1) * stream
    assert gathered(tp2) == gathered(one) == 0


def test_scaling_collectives_are_the_derived_theory(measured) -> None:
    scaling, shape, rows = measured
    for name, row in rows.items():
        expected = scaling.theory(scaling.CELLS[name], shape)
        assert scaling.counts(row["collectives"]) == scaling.counts(expected), name
        assert scaling.sent(row["collectives"]) == scaling.sent(expected), name
    assert rows["tp1"]["collectives"] == []
    m, layers = shape.microbatches, shape.config.num_layers
    # The formulas' leading terms, by hand: per microbatch 4 all-reduces per block (tp), 4 all-gathers and 4
    # reduce-scatters per block (sp), 1 all-gather per block (cp).
    assert scaling.counts(rows["tp2"]["collectives"])["all_reduce"] == m * (4 * layers + 6) + 3
    assert scaling.counts(rows["tp2-sp"]["collectives"])["all_gather"] == m * (4 * layers + 2)
    assert scaling.counts(rows["cp2"]["collectives"])["all_gather"] == m * layers


def test_scaling_refuses_an_unknown_cell(capsys) -> None:
    scaling = _load()
    with pytest.raises(SystemExit):
        scaling.parse_args(["--cells", "tp3"])
    assert re.search(r"--cells tp3: unknown; choose from tp1, tp2, tp2-sp", capsys.readouterr().err)
