"""Eval and inference steps across real gloo pipeline ranks: every rank returns the single-process eval loss and
weight bitwise; the last stage's ranks hold the single-process logs, metrics and inference task state bitwise,
the others what they were given.

Construction consistency as in ``test_pipeline_distributed.py``: the whole tiny model is built on every rank from
one seed, each rank keeps its stages' params. With pp×dp every data-parallel replica evaluates its own rows (the
eval step reduces over ``pp`` only, as the one-process eval step does not reduce over dp either), so each is
compared bitwise with one process on the same rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks
from test_pipeline_distributed import _local_state
from test_pipeline_executor import _contiguous_split, _Regression, _setup, _SumOutputs

from d9dfn import ComputeLossResult, InferenceState, make_eval_step, make_inference_step, parallel, pipeline
from d9dfn.loop import init_pipeline_mesh
from d9dfn.testing import assert_trees_close


class _MetricRegression(_Regression):
    """``_Regression`` whose loss writes the masked errors into the state; the metric sums them and counts rows."""

    def compute_loss(self, outputs, state, step):
        result = super().compute_loss(outputs, state, step)
        error = ((outputs["hidden"] - state["y"]) ** 2).sum(-1) * state["mask"]
        return ComputeLossResult(
            loss=result.loss, loss_weight=result.loss_weight, state=state.set("error", error), logs=result.logs
        )

    def update_metrics(self, metric_state, state):
        error = state["error"]
        return {"sum": metric_state["sum"] + error.sum(), "rows": metric_state["rows"] + error.shape[0]}


def _metrics() -> dict[str, torch.Tensor]:
    return {"sum": torch.tensor(0.5), "rows": torch.tensor(3)}


def _equal(actual: Any, expected: Any) -> None:
    assert_trees_close(actual, expected, rtol=0, atol=0)


def _run(mesh: Any, name: str, stages_per_rank: int, num_microbatches: int, compile: bool) -> None:
    """Eval and inference of ``name``'s forwards on this rank vs one process on this replica's rows."""
    num_ranks = mesh.size(0)
    dp_mesh = parallel.data_parallel_submesh(mesh)
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_rank() % dp_mesh.size()
    program = pipeline.SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches)
    num_layers = program.num_stages + 1
    model, opt, state, batches = _setup(num_layers, 5, norm=True, dropout=0.25)
    stages = pipeline.split_stages(model, _contiguous_split(num_layers, program.num_stages))
    trace: list = []  # the profiling hook: every action this rank runs, with its perf_counter interval
    rank_pipeline = pipeline.PipelineRank(
        program, stages, parallel.pipeline_rank(mesh), parallel.pipeline_group(mesh), trace=trace
    )
    last = program.stage_to_rank[-1] == rank_pipeline.rank
    local = _local_state(state, opt, rank_pipeline.local_stages)
    options = {"num_microbatches": num_microbatches, "compile": "eager" if compile else False}
    task = _MetricRegression()
    reference = make_eval_step(model, task, **options)
    step = make_eval_step(model, task, executor=rank_pipeline, **options)
    infer_options = {**options, "rng_kwarg": "dropout_key"}
    infer_reference = make_inference_step(model, _SumOutputs(), **infer_options)
    infer = make_inference_step(model, _SumOutputs(), executor=rank_pipeline, **infer_options)
    rows = 8 // dp_size
    for batch in batches:
        mine = {key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch.items()}
        given = _metrics()
        want_metrics, want = reference(state, _metrics(), mine)
        trace.clear()
        got_metrics, got = step(local, given, mine)
        forwards = [a for a in program.ranks[rank_pipeline.rank] if a.kind == "F"]
        assert [a for a, _, _ in trace if a.is_compute] == forwards  # a training program's backwards skipped
        assert all(start <= end for _, start, end in trace)
        _equal(got.loss, want.loss)  # on every rank: summed over pp, zeros from the other ranks
        _equal(got.loss_weight, want.loss_weight)
        assert float(want.loss_weight) > 0
        if last:
            _equal(got.logs, want.logs)
            _equal(got_metrics, want_metrics)
            assert not torch.equal(want_metrics["sum"], given["sum"])  # the metric did change
        else:
            assert got.logs == {}
            _equal(got_metrics, given)

        start = InferenceState(
            params=state.params, buffers=state.buffers, step=state.step, rng=state.rng, task_state=torch.zeros(3)
        )
        want_inference = infer_reference(start, mine)
        got_inference = infer(start.replace(params=local.params, buffers=local.buffers), mine)
        _equal(got_inference.step, want_inference.step)
        if last:
            _equal(got_inference.task_state, want_inference.task_state)
            assert not torch.equal(want_inference.task_state, torch.zeros(3))
        else:
            _equal(got_inference.task_state, torch.zeros(3))


def _worker(rank: int, world_size: int, init_file: str, degrees: tuple[int, int], configs: list) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_pipeline_mesh(*degrees, device_type="cpu")
        for name, stages_per_rank, num_microbatches, compile in configs:
            try:
                _run(mesh, name, stages_per_rank, num_microbatches, compile)
            except Exception as error:
                raise AssertionError(f"{name} v={stages_per_rank} m={num_microbatches}: {error}") from error
    finally:
        dist.destroy_process_group()


PP2 = [
    ("inference", 1, 2, False),
    ("inference", 1, 2, True),  # the compiled tail traces the pp sum (dynamo only: backend "eager")
    ("one_f_one_b", 1, 4, False),  # a training program's forwards
    ("looped_bfs", 2, 1, False),  # two stages per rank, m < p
    ("zero_bubble_v", 2, 2, False),  # V placement: the last stage lives on rank 0; the turn stays local
]
PP4 = [("inference", 1, 2, False), ("zero_bubble_v", 2, 2, False)]


@pytest.mark.slow  # ~60 s for the three on 2 cores
@pytest.mark.parametrize(
    ("degrees", "configs"),
    [((2, 1), PP2), ((4, 1), PP4), ((2, 2), [("inference", 1, 2, False)])],
    ids=["pp2", "pp4", "pp2xdp2"],
)
@pytest.mark.ranks
def test_pipeline_eval_and_inference_on_ranks_equal_one_process_bitwise(
    tmp_path: Any, degrees: tuple[int, int], configs: list
) -> None:
    _run_ranks(_worker, degrees[0] * degrees[1], tmp_path, degrees, configs, timeout_s=170)


def test_make_eval_step_accepts_a_pipeline_rank_and_checks_its_microbatch_count() -> None:
    class _Group:
        def size(self) -> int:
            return 2

    model, _, _, _ = _setup(2, 4, norm=False, dropout=0.0)
    stages = pipeline.split_stages(model, _contiguous_split(2, 2))
    rank_pipeline = pipeline.PipelineRank(pipeline.inference(2, 1, 2), stages, 0, _Group())
    with pytest.raises(ValueError, match="program runs 2 microbatches but num_microbatches=4"):
        make_eval_step(model, _Regression(), num_microbatches=4, executor=rank_pipeline)
    with pytest.raises(ValueError, match="program runs 2 microbatches but num_microbatches=1"):
        make_inference_step(model, _SumOutputs(), num_microbatches=1, executor=rank_pipeline)
    make_inference_step(model, _SumOutputs(), executor=rank_pipeline)  # left out: the program's count
