"""Timing a program: a list-scheduling simulator, a text timeline and a PNG timeline.

The model is the one behind the pipeline papers' bubble formulas (GPipe, 1F1B, zero bubble; ``docs/design/
pipeline.md``, "Simulator and pictures"): each rank runs its compute actions in program order; an action starts
at ``max(rank free, inputs ready)``, where ``F(s,i)`` needs ``F(s−1,i)``, ``B|I(s,i)`` needs ``F(s,i)`` and
``B|I(s+1,i)``, and ``W(s,i)`` needs ``I(s,i)``; an input that crosses ranks arrives ``comm`` later. Sends and
receives of a lowered program take no rank time (they are asynchronous on the device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from d9dfn.pipeline._program import Action, Program

__all__ = ["Costs", "Timeline", "render", "simulate"]


class Costs(NamedTuple):
    """The time of one action per kind; a float for every stage, or a tuple with one value per stage (uneven
    stages, e.g. a first stage with the embedding). ``comm`` is the latency of a cross-rank input.

    The defaults are the papers' unit costs: ``F=1``, ``B=2`` (= ``I`` + ``W``), ``I=1``, ``W=1``, ``comm=0``.
    """

    F: float | tuple[float, ...] = 1.0
    B: float | tuple[float, ...] = 2.0
    I: float | tuple[float, ...] = 1.0  # noqa: E741  (torch's name for the input-gradient backward)
    W: float | tuple[float, ...] = 1.0
    comm: float = 0.0

    def of(self, action: Action) -> float:
        """The time ``action`` takes."""
        cost = getattr(self, action.kind)
        return float(cost[action.stage] if isinstance(cost, tuple) else cost)


class Timeline(NamedTuple):
    """What :func:`simulate` found. Times are in the costs' units; ``peak_activations[r]`` counts
    (stage, microbatch) activations live at once on rank ``r`` (from the start of ``F`` until its ``B`` or ``W``
    ends; in a forward-only program, until the ``F`` ends), so divide by ``stages_per_rank`` for the papers'
    rank units."""

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    """Idle share of all ranks' time: ``Σ idle / (num_ranks · makespan)``."""
    peak_activations: tuple[int, ...]
    intervals: tuple[tuple[tuple[float, float, Action], ...], ...]
    """Per rank, ``(start, end, action)`` for each compute action, in program order."""


def _inputs(program: Program, action: Action) -> list[Action]:
    stage, mb = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(stage - 1, "F", mb)] if stage > 0 else []
    if action.kind == "W":
        return [Action(stage, "I", mb)]
    needs = [Action(stage, "F", mb)]
    if stage < program.num_stages - 1:
        needs.append(Action(stage + 1, "B", mb))  # or its I: see simulate
    return needs


def simulate(program: Program, costs: Costs | None = None) -> Timeline:
    """Time ``program``'s compute actions under ``costs`` (default :class:`Costs`).

    Raises:
        ValueError: the ranks wait on each other in a cycle (the program would deadlock).

    >>> from d9dfn.pipeline import gpipe
    >>> timeline = simulate(gpipe(2, 1, 2))
    >>> timeline.makespan, round(timeline.bubble_fraction, 3), timeline.peak_activations
    (9.0, 0.333, (2, 2))
    """
    costs = Costs() if costs is None else costs
    program = program.compute_only()
    end: dict[Action, float] = {}
    pointers, free = [0] * program.num_ranks, [0.0] * program.num_ranks
    intervals: list[list[tuple[float, float, Action]]] = [[] for _ in program.ranks]
    remaining = sum(map(len, program.ranks))
    while remaining:
        progress = False
        for rank, actions in enumerate(program.ranks):
            while pointers[rank] < len(actions):
                action = actions[pointers[rank]]
                ready = free[rank]
                for need in _inputs(program, action):
                    if need.kind == "B" and need not in end:
                        need = need._replace(kind="I")
                    if need not in end:
                        break
                    crosses = program.stage_to_rank[need.stage] != rank
                    ready = max(ready, end[need] + (costs.comm if crosses else 0.0))
                else:
                    finish = ready + costs.of(action)
                    end[action] = finish
                    intervals[rank].append((ready, finish, action))
                    free[rank], pointers[rank] = finish, pointers[rank] + 1
                    remaining, progress = remaining - 1, True
                    continue
                break
        if not progress:
            waits = "; ".join(
                f"rank {rank} at {program.ranks[rank][i]}"
                for rank, i in enumerate(pointers)
                if i < len(program.ranks[rank])
            )
            raise ValueError(f"simulate: the ranks wait on each other in a cycle ({waits}); check it with dry_run")
    makespan = max(free, default=0.0)
    busy = tuple(sum(e - s for s, e, _ in row) for row in intervals)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (program.num_ranks * makespan) if makespan else 0.0
    return Timeline(
        makespan,
        busy,
        idle,
        bubble,
        tuple(_peak(row, end) for row in intervals),
        tuple(tuple(row) for row in intervals),
    )


def _peak(row: Sequence[tuple[float, float, Action]], end: dict[Action, float]) -> int:
    events = []
    for start, finish, action in row:
        if action.kind != "F":
            continue
        full, weight = action._replace(kind="B"), action._replace(kind="W")
        release = end.get(full, end.get(weight, finish))
        events += [(start, 1), (release, -1)]
    live = peak = 0
    for _, delta in sorted(events):  # at equal times the release (−1) sorts first
        live += delta
        peak = max(peak, live)
    return peak


def render(program: Program, costs: Costs | None = None) -> str:
    """A text timeline of ``program`` under ``costs``: one row per rank, one column per time unit; an action's
    label (``F3``, ``B3``; ``4F3`` when a rank holds several stages) in its first column, ``~`` in the rest,
    ``.`` for idle. Exact for integer costs; other costs are rounded to the column grid.

    >>> from d9dfn.pipeline import one_f_one_b
    >>> print(render(one_f_one_b(2, 1, 2)))
    r0 F0 F1  .  . B0  ~  . B1  ~
    r1  . F0 B0  ~ F1 B1  ~  .  .
    """
    timeline = simulate(program, costs)
    several = any(len(program.stages_of(rank)) > 1 for rank in range(program.num_ranks))
    columns = math.ceil(timeline.makespan - 1e-9)
    grid = [["."] * columns for _ in program.ranks]
    for rank, row in enumerate(timeline.intervals):
        for start, finish, action in row:
            first, last = round(start), max(round(finish), round(start) + 1)
            label = str(action) if several else f"{action.kind}{action.microbatch}"
            grid[rank][first:last] = [label] + ["~"] * (last - first - 1)
    width = max((len(cell) for row in grid for cell in row), default=1)
    return "\n".join(
        f"r{rank} " + " ".join(cell.rjust(width) for cell in row[:columns]) for rank, row in enumerate(grid)
    )
