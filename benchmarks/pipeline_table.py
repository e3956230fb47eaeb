"""Every d9dfn schedule beside the papers' formulas and torch's own program, simulated under unit costs.

For p ranks, m microbatches (v=2 stages per rank where a schedule takes several) the table gives, per schedule:
the simulated bubble fraction and the formula's (``../shared/reference/pipeline.md`` §5), the peak in-flight
activations per rank (simulated, and the formula's), and the makespan of d9dfn's program beside torch 2.13's
program for the same (p, v, m) (built with mocked stages, as ``_schedule_visualizer.get_schedule_ops`` does, and
timed by the same simulator). Costs per stage chunk: F=1, B=2, I=1, W=1, no communication latency. Activations
are counted in (stage, microbatch) units; divide by v for the papers' rank units.

A ``—`` in the torch column: torch has no program (inference), refuses the count (DualPipeV with m < 2p,
interleaved schedules with m % max(1, m // p) ≠ 0), or its program is invalid: for ``one_f_one_b`` at v=1,
``Schedule1F1B.pipeline_order`` is invalid in torch 2.13 (§1.8).

Run: ``python benchmarks/pipeline_table.py [--ranks 4] [--microbatches 8]``.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import NamedTuple
from unittest import mock

from d9dfn.pipeline import SCHEDULES, Costs, Program, from_torch, simulate

# (schedule, stages per rank, torch's class name or None)
CASES = (
    ("inference", 1, None),
    ("gpipe", 1, "GPipe"),
    ("looped_bfs", 2, "LoopedBFS"),
    ("one_f_one_b", 1, None),
    ("one_f_one_b", 2, "Interleaved1F1B"),
    ("zero_bubble_1f1b", 1, "InterleavedZeroBubble"),
    ("zero_bubble_1f1b", 2, "InterleavedZeroBubble"),
    ("zero_bubble_v", 2, "ZBVZeroBubble"),
    ("dual_pipe_v", 2, "DualPipeV"),
)


class Row(NamedTuple):
    schedule: str
    num_ranks: int
    stages_per_rank: int
    num_microbatches: int
    bubble: float
    formula_bubble: float
    peaks: tuple[int, ...]
    formula_peaks: tuple[int, ...] | None
    makespan: float
    torch_makespan: float | None


def torch_program(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """torch's own program for ``get_schedule_class(name)``, built with mocked stages (no process group).

    Unlike ``get_schedule_ops`` this also builds the multi-stage classes with one stage per rank (ZB-H1 is
    ``ScheduleInterleavedZeroBubble`` with one local stage).
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    cls = get_schedule_class(name)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, num_ranks, None
    stage.num_stages = num_ranks * stages_per_rank
    stages = stage if issubclass(cls, PipelineScheduleSingle) else [stage] * stages_per_rank
    schedule = cls(stages, num_microbatches)
    return from_torch(schedule.pipeline_order, num_microbatches)


def formula_bubble(name: str, p: int, v: int, m: int, costs: Costs) -> float:
    """§5's bubble as a fraction of the makespan; ``T_X = v·t_X`` is a rank's time for one microbatch."""
    t_f, t_b, t_i, t_w = (float(c) for c in (costs.F, costs.B, costs.I, costs.W))
    big_f, big_b, big_i, big_w = v * t_f, v * t_b, v * t_i, v * t_w
    if name == "inference":
        bubble, ideal = (p - 1) * big_f / v, m * big_f
    elif name in ("gpipe", "one_f_one_b", "looped_bfs"):
        bubble, ideal = (p - 1) * (big_f + big_b) / v, m * (big_f + big_b)
    elif name == "zero_bubble_1f1b":
        bubble, ideal = (p - 1) * (big_f + max(0.0, big_i - big_w)) / v, m * (big_f + big_i + big_w)
    elif name == "zero_bubble_v":  # measured (p−1)(t_F + max(0, t_I − t_W)); the paper's (p−1)t at equal costs
        bubble, ideal = (p - 1) * (t_f + max(0.0, t_i - t_w)), m * (big_f + big_i + big_w)
    elif name == "dual_pipe_v":
        # (F;B) pairs run one after the other (torch's and d9d's runtimes, and d9dfn's program): (p−1)·t_F at
        # equal costs. DeepSeek's (PP/2−1)(F&B + B − 3W) needs real overlap; it is an upper bound here.
        bubble = (p - 1) * t_f
        ideal = m * (big_f + big_i + big_w)
    else:
        raise ValueError(f"formula_bubble: no formula for {name!r}")
    return bubble / (bubble + ideal)


def formula_peaks(name: str, p: int, v: int, m: int) -> tuple[int, ...] | None:
    """§5's peak in-flight activations per rank, in (stage, microbatch) units, where it has one."""
    match name:
        case "gpipe" | "looped_bfs":
            return (m * v,) * p
        case "one_f_one_b" if v == 1:
            return tuple(min(p - r, m) for r in range(p))
        case "one_f_one_b" if m >= p:
            return tuple(min((v - 1) * p + 2 * (p - 1 - r) + 1, m * v) for r in range(p))
        case "zero_bubble_1f1b" | "zero_bubble_v" if m >= p:
            return (p * v,) * p
        case "dual_pipe_v" if m >= 2 * p:
            return (2 * p + 1,) * p
    return None


def rows(num_ranks: int = 4, num_microbatches: int = 8, costs: Costs | None = None) -> list[Row]:
    costs = Costs() if costs is None else costs
    out = []
    for name, v, torch_name in CASES:
        timeline = simulate(SCHEDULES[name](num_ranks, v, num_microbatches), costs)
        torch_makespan = None
        if torch_name is not None:
            # torch refuses some counts (DualPipeV m < 2p; interleaved m % rounds): no column then
            with contextlib.suppress(ValueError):
                torch_makespan = simulate(torch_program(torch_name, num_ranks, v, num_microbatches), costs).makespan
        out.append(
            Row(
                name,
                num_ranks,
                v,
                num_microbatches,
                timeline.bubble_fraction,
                formula_bubble(name, num_ranks, v, num_microbatches, costs),
                timeline.peak_activations,
                formula_peaks(name, num_ranks, v, num_microbatches),
                timeline.makespan,
                torch_makespan,
            )
        )
    return out


def format_table(table: list[Row]) -> str:
    header = ("schedule", "p", "v", "m", "bubble", "formula", "peak act./rank", "formula peak", "makespan", "torch")
    lines = [header]
    for row in table:
        lines.append(
            (
                row.schedule,
                str(row.num_ranks),
                str(row.stages_per_rank),
                str(row.num_microbatches),
                f"{row.bubble:.3f}",
                f"{row.formula_bubble:.3f}",
                ",".join(map(str, row.peaks)),
                "—" if row.formula_peaks is None else ",".join(map(str, row.formula_peaks)),
                f"{row.makespan:g}",
                "—" if row.torch_makespan is None else f"{row.torch_makespan:g}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    print(format_table(rows(args.ranks, args.microbatches)))


if __name__ == "__main__":
    main()
