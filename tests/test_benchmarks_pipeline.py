"""benchmarks/pipeline.py: its idle analysis agrees with the simulator on the simulator's own timeline, and a
quick run on 2 forked gloo ranks produces a row per rank with fractions in range."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from d9dfn import pipeline

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("pipeline_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "stages_per_rank"), [("one_f_one_b", 1), ("zero_bubble_v", 2), ("inference", 1)])
def test_measured_idle_of_the_simulated_timeline_is_the_prediction(name: str, stages_per_rank: int) -> None:
    bench = _load()
    program = pipeline.SCHEDULES[name](3, stages_per_rank, 4)
    costs = pipeline.Costs(F=(1.0, 1.5, 1.0, 1.0, 1.0, 2.0)[: program.num_stages], B=2.5, I=1.0, W=1.5)
    timeline = pipeline.simulate(program, costs)
    # The simulated intervals as a trace, offset as perf_counter would be, with a receive wait that must not count.
    traces = [
        [("0RECV_F0", 99.0, 100.0)] + [(str(action), 100 + start, 100 + end) for start, end, action in row]
        for row in timeline.intervals
    ]
    makespan, measured = bench.measured_idle(traces)
    predicted_makespan, predicted = bench.predicted_idle(program, costs)
    assert makespan == pytest.approx(predicted_makespan)
    assert measured == pytest.approx(predicted)
    assert [wait for wait, _ in bench.idle_breakdown(traces)] == [0.0] * 3  # the wait lies before every action
    assert max(predicted) > 0.05  # a real bubble, not all zeros

    # Costs measured from that trace are the costs the simulator used (per stage), so the prediction round-trips.
    measured_costs, means = bench.measured_costs(program, [traces, traces])
    assert tuple(measured_costs.F) == pytest.approx(costs.F)
    assert set(means) == {a.kind for row in program.ranks for a in row}
    assert bench.predicted_idle(program, measured_costs)[1] == pytest.approx(predicted)


def test_idle_breakdown_splits_receive_waits_from_the_executors_own_time() -> None:
    bench = _load()
    traces = [
        [("0F0", 0.0, 1.0), ("0SEND_F0", 1.0, 1.1), ("0F1", 1.2, 2.2), ("0SEND_F1", 2.2, 2.25)],
        # each receive: posted, then waited for by its F
        [
            *[("1RECV_F0", 0.0, 0.0), ("1RECV_F0", 0.0, 1.3), ("1F0", 1.3, 2.3)],
            *[("1RECV_F1", 2.3, 2.3), ("1RECV_F1", 2.3, 2.5), ("1F1", 2.5, 3.5)],
        ],
    ]
    makespan, idle = bench.measured_idle(traces)
    assert makespan == pytest.approx(3.5)
    assert idle == pytest.approx([1.5 / 3.5, 1.5 / 3.5])
    (wait0, executor0), (wait1, executor1) = bench.idle_breakdown(traces)
    assert (wait0, executor0) == (0.0, pytest.approx(0.2 / 3.5))  # the send's posting and the gap after it
    assert (wait1, executor1) == (pytest.approx(1.5 / 3.5), pytest.approx(0.0, abs=1e-12))


# Not slow (two forked ranks, a tiny model, two programs: ~10 s), so that the benchmark cannot rot.
@pytest.mark.ranks
def test_quick_run_on_two_ranks_gives_a_row_per_rank(tmp_path: Path) -> None:
    bench = _load()
    out = tmp_path / "pipeline.json"
    report = bench.main(["--quick", "--ranks", "2", "--schedules", "one_f_one_b", "--json", str(out)])
    summaries = report["summaries"]
    assert [(s["schedule"], s["p"], s["v"], s["m"]) for s in summaries] == [
        ("one_f_one_b", 2, 1, 4),
        ("one_f_one_b", 2, 2, 4),
    ]
    for summary in summaries:
        assert [row["rank"] for row in summary["rows"]] == [0, 1]
        for row in summary["rows"]:
            assert 0.0 <= row["measured_idle"] < 1.0
            assert 0.0 <= row["predicted_idle"] < 1.0
            assert 0.0 <= row["receive_wait"] <= row["measured_idle"]
            assert 0.0 <= row["executor"] <= row["measured_idle"]
            assert row["step_ms"] > 0
        assert set(summary["mean_cost_ms"]) == {"F", "B"}
        assert all(c > 0 for c in summary["costs_ms"]["F"])
        assert len(summary["costs_ms"]["F"]) == 2 * summary["v"]
        assert summary["makespan_ms"] > 0
    assert json.loads(out.read_text())["summaries"] == summaries
    assert "| one_f_one_b | 2 | 2 | 4 | 1 |" in bench.table(summaries)
