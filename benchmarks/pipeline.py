"""Pipeline schedules on real CPU gloo ranks: each rank's measured idle fraction beside the simulator's prediction.

For every schedule of ``d9dfn.pipeline.SCHEDULES`` (with one and, where the schedule takes them, two stages per
rank) on p = 2 and 4 forked gloo ranks (one intra-op thread each), the benchmark runs the real multi-rank step
(``make_train_step(executor=PipelineRank(...))``; the ``inference`` schedule through ``make_eval_step``) on a
Qwen3LM cut into ``p·v`` equal stages, with the executor's trace hook on (``PipelineRank(trace=[])``: every
action's ``time.perf_counter()`` interval; a compute action's own time excludes the wait for its input). Per
step and rank:

- **measured idle** = 1 − (time in this rank's compute actions) / makespan, where the makespan runs from the
  first compute action's start on any rank to the last one's end (``perf_counter`` is the machine's monotonic
  clock, shared by the processes); the median over the timed steps;
- **predicted idle** = ``simulate(program, Costs(...))``'s idle / makespan for this rank, with the F, B, I, W
  costs the same run measured: per stage, the mean over the timed steps (``comm=0``).

What separates the two: the executor's own time between actions (Python, posting sends and receives, copying
activations) counts as idle in the measurement and does not exist in the model; so does the latency of a
message; and with more ranks than cores (4 ranks on this 2-core machine) ranks share cores, so a compute action
stretches when another rank computes at the same time and the measured costs already include that sharing.

Run: ``python benchmarks/pipeline.py [--ranks 2,4] [--schedules gpipe,one_f_one_b] [--steps 5] [--json PATH]``;
``--quick`` is a tiny model and one step (a smoke run: the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import d9dfn.optim as optim
from d9dfn import init_train_state, make_eval_step, make_train_step
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.pipeline import SCHEDULES, Costs, PipelineRank, Program, build_stages, parse_action, simulate
from d9dfn.tasks import CausalLMTask

CASES = (
    ("inference", 1),
    ("gpipe", 1),
    ("one_f_one_b", 1),
    ("one_f_one_b", 2),
    ("looped_bfs", 2),
    ("zero_bubble_1f1b", 1),
    ("zero_bubble_1f1b", 2),
    ("zero_bubble_v", 2),
    ("dual_pipe_v", 2),
)
"""(schedule, stages per rank): every schedule, with two stages per rank where it takes several."""
COMPUTE = ("F", "B", "I", "W")


# --- the analysis (pure: traces in, fractions out) ------------------------------------------------------------------


Trace = list[tuple[str, float, float]]
"""One rank's actions in one step: ``(action in torch's notation, start, end)`` in seconds."""


def measured_idle(traces: Sequence[Trace]) -> tuple[float, list[float]]:
    """``(makespan, idle fraction per rank)`` of one step from every rank's trace (compute actions only)."""
    compute = [[(start, end) for name, start, end in trace if parse_action(name).kind in COMPUTE] for trace in traces]
    first = min(start for rows in compute for start, _ in rows)
    last = max(end for rows in compute for _, end in rows)
    makespan = last - first
    return makespan, [1.0 - sum(end - start for start, end in rows) / makespan for rows in compute]


def idle_breakdown(traces: Sequence[Trace]) -> list[tuple[float, float]]:
    """Per rank, two shares of the makespan that the measured idle time holds: ``(receive wait, executor)``.

    *Receive wait*: waiting for a receive (a ``RECV``'s second trace entry; the first is its posting), clipped
    to the span of all ranks' compute actions. *Executor*: the rest of the time between this rank's own first
    compute start and last compute end that is neither compute nor a receive wait: posting sends and receives,
    the interpreter's Python between actions. The simulator models neither (``comm=0``, no per-action cost);
    the remaining idle time is before the rank's first action or after its last (the schedule's own bubble).
    """
    spans = [[(start, end) for name, start, end in trace if parse_action(name).kind in COMPUTE] for trace in traces]
    first = min(start for rows in spans for start, _ in rows)
    last = max(end for rows in spans for _, end in rows)
    makespan = last - first
    shares = []
    for trace, rows in zip(traces, spans, strict=True):
        own_first, own_last = min(start for start, _ in rows), max(end for _, end in rows)
        seen: set[str] = set()
        waited = inside = 0.0
        for name, start, end in trace:
            if parse_action(name).kind.startswith("RECV"):
                if name in seen:
                    waited += max(0.0, min(end, last) - max(start, first))
                    inside += max(0.0, min(end, own_last) - max(start, own_first))
                seen.add(name)
        busy = sum(end - start for start, end in rows)
        shares.append((waited / makespan, max(0.0, own_last - own_first - busy - inside) / makespan))
    return shares


def measured_costs(program: Program, steps: Sequence[Sequence[Trace]]) -> tuple[Costs, dict[str, float]]:
    """Per-stage mean cost of each compute kind over ``steps`` (each a trace per rank), as :class:`Costs`, and
    each kind's mean over all stages. A kind the program lacks gets the papers' relation (``B = I + W``,
    ``I = W = B/2``); it does not affect the simulation."""
    durations: dict[tuple[str, int], list[float]] = {}
    for traces in steps:
        for trace in traces:
            for name, start, end in trace:
                action = parse_action(name)
                if action.kind in COMPUTE:
                    durations.setdefault((action.kind, action.stage), []).append(end - start)
    stages = range(program.num_stages)
    mean = {key: statistics.fmean(values) for key, values in durations.items()}
    per_kind: dict[str, tuple[float, ...] | None] = {}
    for kind in COMPUTE:
        values = [mean.get((kind, s)) for s in stages]
        per_kind[kind] = tuple(v for v in values if v is not None) if all(v is not None for v in values) else None
    forward = per_kind["F"]
    assert forward is not None, "every program runs a forward of every stage"
    split = per_kind["I"] is not None and per_kind["W"] is not None
    if per_kind["B"] is None:  # a program with only I/W backwards (or none: inference)
        per_kind["B"] = (
            tuple(i + w for i, w in zip(per_kind["I"], per_kind["W"], strict=True))  # type: ignore[arg-type]
            if split
            else tuple(2 * f for f in forward)
        )
    full = per_kind["B"]
    assert full is not None
    if not split:
        per_kind["I"] = per_kind["W"] = tuple(b / 2 for b in full)
    costs = Costs(F=forward, B=full, I=per_kind["I"], W=per_kind["W"])  # type: ignore[arg-type]
    means = {kind: statistics.fmean(v for (k, _), v in mean.items() if k == kind) for kind, _ in mean}
    return costs, means


def predicted_idle(program: Program, costs: Costs) -> tuple[float, list[float]]:
    """``(makespan, idle fraction per rank)`` the simulator predicts under ``costs``."""
    timeline = simulate(program, costs)
    return timeline.makespan, [idle / timeline.makespan for idle in timeline.idle]


# --- the model, the batch and one case on this rank -----------------------------------------------------------------


def _config(args: argparse.Namespace, num_chunks: int) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=args.hidden,
        num_layers=num_chunks * args.layers_per_chunk,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=3 * args.hidden,
        max_seq_len=args.seq,
        tie_word_embeddings=False,
    )


def _batch(config: Qwen3Config, rows: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (rows, seq + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def run_case(
    name: str, stages_per_rank: int, args: argparse.Namespace, rank: int, group: Any
) -> tuple[list[Trace], list[float]]:
    """This rank's traces and step times (ms) over the timed steps of one schedule; a collective call."""
    import torch.distributed as dist

    num_ranks = dist.get_world_size(group)
    num_microbatches = args.microbatches or 2 * num_ranks
    program = SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches)
    # The same model for every schedule at this p: 2p chunks of `layers_per_chunk` layers, so that a stage
    # with v=2 is one chunk and a stage with v=1 two; the LM head (256 bytes of vocabulary) is cheap.
    config = _config(args, 2 * num_ranks)
    torch.manual_seed(0)
    model, task, opt = Qwen3LM(config), CausalLMTask(), optim.adamw(1e-3, weight_decay=1e-2)
    stages = build_stages(lambda info: Qwen3LM(config, stage=info, last_stage_cost=0), program.num_stages)
    trace: list[tuple[Any, float, float]] = []
    ranked = PipelineRank(program, stages, rank, group, trace=trace)
    whole = init_train_state(model, opt, task=task)
    params = {n: p for s in ranked.local_stages for n, p in s.select_params(whole.params).items()}
    buffers = {n: b for s in ranked.local_stages for n, b in s.select_buffers(whole.buffers).items()}
    state = whole.replace(params=params, buffers=buffers, opt_state=opt.init(params))
    del whole
    batch = _batch(config, num_microbatches * args.microbatch_rows, args.seq)
    options = {"num_microbatches": num_microbatches, "executor": ranked, "compile": False}
    run: Callable[[], None]
    if name == "inference":
        eval_step = make_eval_step(model, task, **options)
        metrics = state.metric_state

        def run() -> None:
            _, out = eval_step(state, metrics, batch)
            out.loss.item()

    else:
        train_step = make_train_step(model, task, opt, max_grad_norm=1.0, **options)
        holder = [state]

        def run() -> None:
            holder[0], out = train_step(holder[0], batch)
            out.loss.item()  # a host sync: the tail's collectives have finished

    traces, times = [], []
    for index in range(args.warmup + args.steps):
        trace.clear()
        dist.barrier(group)
        start = time.perf_counter()
        run()
        elapsed = (time.perf_counter() - start) * 1e3
        if index >= args.warmup:
            traces.append([(str(action), begin, end) for action, begin, end in trace])
            times.append(elapsed)
    return traces, times


def _summarise(name: str, stages_per_rank: int, traces: list[list[Trace]], times: list[list[float]]) -> dict:
    """One case's rows from every rank's traces (``traces[rank][step]``) and step times."""
    num_ranks, num_steps = len(traces), len(traces[0])
    steps = [[traces[r][i] for r in range(num_ranks)] for i in range(num_steps)]
    num_microbatches = 1 + max(parse_action(n).microbatch for trace in steps[0] for n, _, _ in trace)
    program = SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches)
    measured = [measured_idle(step) for step in steps]
    costs, means = measured_costs(program, steps)
    predicted_makespan, predicted = predicted_idle(program, costs)
    rows = [
        {
            "schedule": name,
            "p": num_ranks,
            "v": stages_per_rank,
            "m": num_microbatches,
            "rank": rank,
            "measured_idle": statistics.median(idle[rank] for _, idle in measured),
            "receive_wait": statistics.median(idle_breakdown(step)[rank][0] for step in steps),
            "executor": statistics.median(idle_breakdown(step)[rank][1] for step in steps),
            "predicted_idle": predicted[rank],
            "step_ms": statistics.median(times[rank]),
        }
        for rank in range(num_ranks)
    ]
    return {
        "schedule": name,
        "p": num_ranks,
        "v": stages_per_rank,
        "m": num_microbatches,
        "rows": rows,
        "makespan_ms": statistics.median(makespan for makespan, _ in measured) * 1e3,
        "predicted_makespan_ms": predicted_makespan * 1e3,
        "step_ms": max(statistics.median(t) for t in times),
        "mean_cost_ms": {kind: value * 1e3 for kind, value in means.items()},
        "costs_ms": {kind: [c * 1e3 for c in getattr(costs, kind)] for kind in COMPUTE},
    }


# --- the ranks ------------------------------------------------------------------------------------------------------


def _rank_worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank; a forked child must not enter the parent's OpenMP pool
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        results = []
        for name, stages_per_rank in args.cases:
            traces, times = run_case(name, stages_per_rank, args, rank, dist.group.WORLD)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, (traces, times))
            if rank == 0:
                results.append(_summarise(name, stages_per_rank, [g[0] for g in gathered], [g[1] for g in gathered]))
        if rank == 0:
            Path(out_dir, f"world_{world_size}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, args: argparse.Namespace, timeout_s: float = 3600.0) -> list[dict]:
    """Fork ``world_size`` gloo ranks that run every case of ``args``; the summaries rank 0 wrote."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="pipeline_bench_") as tmp:
        # fork: forked ranks start at once (spawned ones re-import torch, ~15 s on a 2-core machine)
        context = mp.start_processes(
            _rank_worker,
            args=(world_size, str(Path(tmp, "store")), args, tmp),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0, grace_period=2.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"run_ranks: {world_size} ranks did not finish within {timeout_s} s")
        return list(json.loads(Path(tmp, f"world_{world_size}.json").read_text()))


# --- the report -----------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="pipeline degrees to run, e.g. 2 or 2,4")
    parser.add_argument("--schedules", default=None, help="comma-separated names (default: every schedule)")
    parser.add_argument("--microbatches", type=int, default=0, help="per step (default: 2p)")
    parser.add_argument("--microbatch-rows", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers-per-chunk", type=int, default=1, help="layers per stage at v=2 (2x at v=1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the I/W split traces here)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one step: a smoke run")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--quick`` applied and the cases filled in."""
    args = _parser().parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.kv_heads, args.seq, args.microbatch_rows = 32, 4, 2, 16, 1
        args.warmup, args.steps = 1, 1
    names = args.schedules.split(",") if args.schedules else list(SCHEDULES)
    unknown = sorted(set(names) - set(SCHEDULES))
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; choose from {sorted(SCHEDULES)}")
    args.cases = [case for case in CASES if case[0] in names]
    args.ranks = [int(r) for r in str(args.ranks).split(",")]
    return args


def table(summaries: Sequence[dict]) -> str:
    """The markdown table: one row per (schedule, p, v, m, rank); *recv wait* and *executor* are parts of the
    measured idle (:func:`idle_breakdown`)."""
    lines = [
        "| schedule | p | v | m | rank | measured idle | predicted idle | recv wait | executor | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for summary in summaries:
        for row in summary["rows"]:
            lines.append(
                f"| {row['schedule']} | {row['p']} | {row['v']} | {row['m']} | {row['rank']} | "
                f"{row['measured_idle']:.3f} | {row['predicted_idle']:.3f} | {row['receive_wait']:.3f} | "
                f"{row['executor']:.3f} | {row['step_ms']:.0f} |"
            )
    return "\n".join(lines)


def costs_table(summaries: Sequence[dict]) -> str:
    """Per case: the measured makespan beside the predicted one, and the mean measured costs."""
    lines = [
        "| schedule | p | v | m | makespan ms | predicted ms | F ms | B ms | I ms | W ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        cost = {kind: f"{s['mean_cost_ms'][kind]:.1f}" if kind in s["mean_cost_ms"] else "-" for kind in COMPUTE}
        lines.append(
            f"| {s['schedule']} | {s['p']} | {s['v']} | {s['m']} | {s['makespan_ms']:.0f} | "
            f"{s['predicted_makespan_ms']:.0f} | {cost['F']} | {cost['B']} | {cost['I']} | {cost['W']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    summaries = [summary for world_size in args.ranks for summary in run_ranks(world_size, args)]
    cores = os.cpu_count() or 1
    notes = [
        f"{cores} CPU cores, 1 thread per rank; torch {torch.__version__}; wall {time.perf_counter() - start:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f}",
    ]
    if max(args.ranks) > cores:
        notes.append(
            f"{max(args.ranks)} ranks on {cores} cores oversubscribe: ranks share cores, so a compute action "
            "stretches while another rank computes, and the measured costs include that sharing"
        )
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summaries": summaries,
        "notes": notes,
    }
    print(table(summaries))
    print()
    print(costs_table(summaries))
    print()
    for note in notes:
        print(f"note: {note}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
