"""Pipeline schedules as pure functions ``(num_ranks, stages_per_rank, num_microbatches) -> Program``, and the
registry of the schedules a JSON config selects (:data:`SCHEDULE_OPTIONS`).

d9d's catalogue (``d9d/pipelining/factory/config.py``), ported from torch 2.13's program builders
(``torch/distributed/pipelining/schedules.py``) with three deliberate differences:

- every builder emits each stage's backwards (``B``, or ``I`` and ``W``) in increasing microbatch order, which
  makes the pipelined gradient sum bitwise equal to the sequential one. torch's ``ScheduleGPipe`` does the same
  (its ``_step_microbatches`` runs ``backward_one_chunk(i)`` for ``i`` in ``range(n_microbatches)``); torch's
  ``ScheduleLoopedBFS`` runs each stage's backwards in reverse microbatch order, and so do d9d's ``gpipe`` and
  ``looped_bfs`` (both are d9d's ``LoopedBFSPipelineProgramBuilder``,
  ``d9d/pipelining/infra/schedule/program/bfs.py``); the makespan is the same either way;
- ``one_f_one_b`` with one stage per rank is classic 1F1B (warm-up ``p−1−r`` forwards, so ``min(p−r, m)``
  activations on rank ``r``), not d9d's interleaved warm-up (``2(p−1−r)+1``);
- no ``None`` idle slots, and microbatch counts torch refuses are accepted: a builder that needs a rounder
  count plans for the next one it accepts and drops the extra microbatches' actions, which keeps every rank's
  order dependency-consistent (removing a microbatch removes only its own dependencies).

Adding a schedule that a JSON config can select touches this module only: its builder (and a :data:`SCHEDULES`
entry), a frozen dataclass of its JSON options with a ``program(num_ranks, num_microbatches)`` method, and a
:data:`SCHEDULE_OPTIONS` entry under its JSON name. ``d9dfn.config`` generates the config model from the
dataclass (``trainer.pipelining.schedule``) and ``d9dfn.loop`` builds the program through ``program``.
"""

from __future__ import annotations

import dataclasses
import types
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

from d9dfn.pipeline._program import Action, Program, loop_placement, v_placement

__all__ = [
    "SCHEDULES",
    "SCHEDULE_OPTIONS",
    "ScheduleOptions",
    "dual_pipe_v",
    "gpipe",
    "inference",
    "looped_bfs",
    "one_f_one_b",
    "zero_bubble_1f1b",
    "zero_bubble_v",
]


def _check(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> None:
    for arg, value in (("num_ranks", num_ranks), ("stages_per_rank", stages_per_rank)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {arg}={value!r} must be a positive int")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"{name}: num_microbatches={num_microbatches!r} must be a positive int")


def _need_v2(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 2:
        raise ValueError(
            f"{name}: stages_per_rank={stages_per_rank}, but the V placement holds exactly 2 stages per rank "
            f"(stages r and 2p−1−r); pass stages_per_rank=2, or use one_f_one_b / zero_bubble_1f1b for "
            f"{stages_per_rank} stages per rank"
        )


def _program(rows: list[list[Action]], num_microbatches: int, stage_to_rank: tuple[int, ...]) -> Program:
    # Drop the actions of microbatches beyond the requested count (see the module docstring).
    ranks = tuple(tuple(a for a in row if a.microbatch < num_microbatches) for row in rows)
    return Program(ranks, num_microbatches, stage_to_rank)


def inference(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """Forwards only: each rank runs its stages in increasing order, every microbatch of one before the next.

    >>> print(inference(2, 1, 2))
    r0: 0F0 0F1
    r1: 1F0 1F1
    """
    _check("inference", num_ranks, stages_per_rank, num_microbatches)
    placement = loop_placement(num_ranks, stages_per_rank)
    rows = [
        [Action(s, "F", i) for s in range(r, len(placement), num_ranks) for i in range(num_microbatches)]
        for r in range(num_ranks)
    ]
    return _program(rows, num_microbatches, placement)


def looped_bfs(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """Breadth-first (Lamy-Poirier 2022, arXiv 2211.05953): all forwards of each local stage, then the
    backwards stage by stage in reverse, each stage's microbatches in increasing order.

    >>> print(looped_bfs(1, 2, 2))
    r0: 0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1
    """
    _check("looped_bfs", num_ranks, stages_per_rank, num_microbatches)
    placement = loop_placement(num_ranks, stages_per_rank)
    rows = []
    for r in range(num_ranks):
        local = range(r, len(placement), num_ranks)
        row = [Action(s, "F", i) for s in local for i in range(num_microbatches)]
        row += [Action(s, "B", i) for s in reversed(local) for i in range(num_microbatches)]
        rows.append(row)
    return _program(rows, num_microbatches, placement)


def gpipe(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """GPipe (Huang et al. 2019): every forward, then every backward in increasing microbatch order (as torch's
    ``ScheduleGPipe``; d9d's ``gpipe`` runs the backwards in reverse).

    Raises:
        ValueError: ``stages_per_rank`` is not 1 (looped BFS is GPipe with several stages per rank).

    >>> print(gpipe(2, 1, 2))
    r0: 0F0 0F1 0B0 0B1
    r1: 1F0 1F1 1B0 1B1
    """
    _check("gpipe", num_ranks, stages_per_rank, num_microbatches)
    if stages_per_rank != 1:
        raise ValueError(
            f"gpipe: stages_per_rank={stages_per_rank}, but GPipe runs one stage per rank; pass "
            f"stages_per_rank=1, or use looped_bfs for the same order over several stages per rank"
        )
    return looped_bfs(num_ranks, 1, num_microbatches)


def _rounds_microbatches(num_ranks: int, num_microbatches: int) -> tuple[int, int]:
    # torch's flexible interleaving: rounds = max(1, m // p), microbatches per round = m // rounds, and it
    # needs m % rounds == 0. Plan for the next count that satisfies that; _program drops the extras.
    planned = num_microbatches
    while planned % max(1, planned // num_ranks):
        planned += 1
    return planned, planned // max(1, planned // num_ranks)


def _interleaved(
    num_ranks: int, stages_per_rank: int, num_microbatches: int, *, zero_bubble: bool
) -> list[list[Action]]:
    """torch's ``_get_1f1b_rank_ops`` without idle slots (Interleaved 1F1B, or ZB1P with ``zero_bubble``)."""
    p, v = num_ranks, stages_per_rank
    m, per_round = _rounds_microbatches(p, num_microbatches)
    rows = []
    for r in range(p):
        # Warm-up forwards: (v−1) rounds, plus 2 (1 for ZB1P) per hop from the last rank; capped at all of them.
        warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
        total = m * v  # as many 1F1B + cool-down steps as forwards

        def fwd_stage(step: int, r: int = r) -> int:
            return ((step // per_round) % v) * p + r

        def bwd_stage(step: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * p + r

        next_mb: dict[tuple[str, int], int] = defaultdict(int)
        pending_w: deque[int] = deque()  # stages whose W is owed, in I order (FIFO)
        row: list[Action] = []

        def emit(kind: str, stage: int, row: list[Action] = row, next_mb: dict[tuple[str, int], int] = next_mb) -> None:
            row.append(Action(stage, kind, next_mb[kind, stage]))  # type: ignore[arg-type]
            next_mb[kind, stage] += 1

        for step in range(total + warmup):
            if step < total:
                emit("F", fwd_stage(step))
            if step >= warmup:
                stage = bwd_stage(step)
                emit("I" if zero_bubble else "B", stage)
                pending_w.append(stage)
                # ZB1P: rank r defers its W by r backwards, which fills the warm-up bubble of the ranks below.
                if zero_bubble and step - warmup >= r:
                    emit("W", pending_w.popleft())
        while zero_bubble and pending_w:
            emit("W", pending_w.popleft())
        rows.append(row)
    return rows


def one_f_one_b(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1); interleaved 1F1B (ibid. §2.2.2) when
    ``stages_per_rank > 1``.

    With one stage per rank, rank ``r`` warms up with ``min(p−1−r, m)`` forwards, then alternates one forward
    and one backward, then drains: at most ``min(p−r, m)`` activations in flight. With several, the order is
    torch's ``ScheduleInterleaved1F1B`` (any ``m``; see the module docstring).

    >>> print(one_f_one_b(2, 1, 3))
    r0: 0F0 0F1 0B0 0F2 0B1 0B2
    r1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    _check("one_f_one_b", num_ranks, stages_per_rank, num_microbatches)
    placement = loop_placement(num_ranks, stages_per_rank)
    if stages_per_rank > 1:
        rows = _interleaved(num_ranks, stages_per_rank, num_microbatches, zero_bubble=False)
        return _program(rows, num_microbatches, placement)
    m, rows = num_microbatches, []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, m)
        row = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action(r, "F", warmup + i), Action(r, "B", i)]
        row += [Action(r, "B", i) for i in range(m - warmup, m)]
        rows.append(row)
    return _program(rows, m, placement)


def zero_bubble_1f1b(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """Zero-bubble 1F1B with the backward split into ``I`` and ``W``: ZB-H1 (Qi et al. 2024, arXiv 2401.10241
    §2.1) with one stage per rank, torch's ``ScheduleInterleavedZeroBubble`` (ZB1P) with several.

    Warm-up ``(v−1)·mpr + p−1−r`` forwards; rank ``r`` then runs ``F, I`` pairs and starts emitting the
    owed ``W``s (oldest first) after ``r`` of them.

    >>> print(zero_bubble_1f1b(2, 1, 2))
    r0: 0F0 0F1 0I0 0W0 0I1 0W1
    r1: 1F0 1I0 1F1 1I1 1W0 1W1
    """
    _check("zero_bubble_1f1b", num_ranks, stages_per_rank, num_microbatches)
    rows = _interleaved(num_ranks, stages_per_rank, num_microbatches, zero_bubble=True)
    return _program(rows, num_microbatches, loop_placement(num_ranks, stages_per_rank))


def zero_bubble_v(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """ZB-V (Qi et al. 2024 §6; torch's ``ScheduleZBVZeroBubble``): two stages per rank in a V, I/W split.

    Planned for ``max(2p−1, m)`` microbatches (the ones beyond ``m`` are dropped), as torch does.

    Raises:
        ValueError: ``stages_per_rank`` is not 2.

    >>> print(zero_bubble_v(1, 2, 2))
    r0: 0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1
    """
    _check("zero_bubble_v", num_ranks, stages_per_rank, num_microbatches)
    _need_v2("zero_bubble_v", stages_per_rank)
    p = num_ranks
    m = max(2 * p - 1, num_microbatches)
    rows = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r  # the rank's two stages: going down the V, and coming back up
        count: dict[tuple[str, int], int] = defaultdict(int)
        row: list[Action] = []

        def emit(kind: str, stage: int, row: list[Action] = row, count: dict[tuple[str, int], int] = count) -> None:
            row.append(Action(stage, kind, count[kind, stage]))  # type: ignore[arg-type]
            count[kind, stage] += 1

        for _ in range(2 * (p - r) - 1):
            emit("F", first)
        for _ in range(r):
            emit("F", second)
            emit("F", first)
        for _ in range(p - r):
            emit("F", second)
            emit("I", second)
            emit("W", second)
        while count["F", second] < count["F", first] or count["F", first] < m:
            if count["F", first] < m:
                emit("F", first)
            emit("I", first)
            emit("W", first)
            emit("F", second)
            emit("I", second)
            emit("W", second)
        for _ in range(r):
            emit("I", first)
            emit("I", second)
        for _ in range(p - r):
            emit("I", first)
            emit("W", first)
        while count["W", second] < count["I", second]:
            emit("W", second)
        while count["W", first] < count["I", first]:
            emit("W", first)
        rows.append(row)
    return _program(rows, num_microbatches, v_placement(p))


def dual_pipe_v(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> Program:
    """DualPipeV (DeepSeek-V3, arXiv 2412.19437 §3.2.1; torch's ``ScheduleDualPipeV``), V placement.

    The order is torch's eight steps, planned for ``max(m, 2p)`` microbatches (torch refuses ``m < 2p``; the
    extra ones are dropped). Each overlapped ``(F; B)`` pair is written as the ``F`` followed by the ``B``:
    programs have no pair action yet, and torch's and d9d's runtimes run the pair's halves one after the other
    anyway. Real F/B overlap (two streams, or a fused piece) is executor work.

    Raises:
        ValueError: ``stages_per_rank`` is not 2.

    >>> print(dual_pipe_v(1, 2, 2))
    r0: 0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1
    """
    _check("dual_pipe_v", num_ranks, stages_per_rank, num_microbatches)
    _need_v2("dual_pipe_v", stages_per_rank)
    p = num_ranks
    m = max(num_microbatches, 2 * p)
    rows = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        count: dict[tuple[str, int], int] = defaultdict(int)  # next microbatch per (F or backward, stage)
        owed_w: deque[tuple[int, int]] = deque()
        row: list[Action] = []

        def emit(
            kind: str,
            stage: int,
            row: list[Action] = row,
            count: dict[tuple[str, int], int] = count,
            owed_w: deque[tuple[int, int]] = owed_w,
        ) -> None:
            key = ("F" if kind == "F" else "back", stage)
            row.append(Action(stage, kind, count[key]))  # type: ignore[arg-type]
            if kind == "I":
                owed_w.append((stage, count[key]))
            count[key] += 1

        def emit_w(row: list[Action] = row, owed_w: deque[tuple[int, int]] = owed_w) -> None:
            if owed_w:
                stage, mb = owed_w.popleft()
                row.append(Action(stage, "W", mb))

        for _ in range((p - r - 1) * 2):  # 1: F on the first stage
            emit("F", first)
        for _ in range(r + 1):  # 2: F F
            emit("F", first)
            emit("F", second)
        for _ in range(p - r - 1):  # 3: I W F, zero-bubble on the second stage
            emit("I", second)
            emit_w()
            emit("F", second)
        for _ in range(m - 2 * p + r + 1):  # 4: the main loop, (F;B) pairs
            emit("F", first)
            emit("B", second)
            emit("F", second)
            emit("B", first)
        for _ in range(p - r - 1):  # 5: B, then an (F;B) pair
            emit("B", second)
            emit("F", second)
            emit("B", first)
        zero_bubble = False
        for i in range(r + 1):  # 6: B B; the second half uses I (W later)
            if i == (r + 1) // 2 and r % 2 == 1:
                zero_bubble = True
            emit("I" if zero_bubble else "B", second)
            if i == (r + 1) // 2 and r % 2 == 0:
                zero_bubble = True
            emit("I" if zero_bubble else "B", first)
        for _ in range(p - r - 1):  # 7: W, B
            emit_w()
            emit("I" if zero_bubble else "B", first)
        for _ in range(r + 1):  # 8: the owed W
            emit_w()
        rows.append(row)
    return _program(rows, num_microbatches, v_placement(p))


SCHEDULES: Mapping[str, Callable[[int, int, int], Program]] = types.MappingProxyType(
    {
        "inference": inference,
        "gpipe": gpipe,
        "looped_bfs": looped_bfs,
        "one_f_one_b": one_f_one_b,
        "zero_bubble_1f1b": zero_bubble_1f1b,
        "zero_bubble_v": zero_bubble_v,
        "dual_pipe_v": dual_pipe_v,
    }
)
"""Every builder by name; each is ``(num_ranks, stages_per_rank, num_microbatches) -> Program``."""


# --- The schedules a JSON config selects ---------------------------------------------------------------------


class ScheduleOptions(Protocol):
    """A training schedule's JSON options (``trainer.pipelining.schedule``): a frozen dataclass whose fields are the
    options (each with a default and a docstring; ``__post_init__`` refuses bad values naming the field), and the
    program they select."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """The training program on ``num_ranks`` pipeline ranks for ``num_microbatches`` microbatches per step."""
        ...


def _positive(options: object, name: str) -> None:
    value = getattr(options, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(options).__name__}: {name}={value!r} must be a positive int; pass 1 or more")


@dataclasses.dataclass(frozen=True)
class GPipe:
    """GPipe: all forwards, then all backwards in increasing microbatch order; one stage per rank."""

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """:func:`gpipe` with one stage per rank."""
        return gpipe(num_ranks, 1, num_microbatches)


@dataclasses.dataclass(frozen=True)
class LoopedBFS:
    """Looped breadth-first: several stages per rank, stage s on rank s mod pp."""

    num_stages_per_rank: int = 1
    """Model stages each pipeline rank holds."""

    def __post_init__(self) -> None:
        _positive(self, "num_stages_per_rank")

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """:func:`looped_bfs` with ``num_stages_per_rank``."""
        return looped_bfs(num_ranks, self.num_stages_per_rank, num_microbatches)


@dataclasses.dataclass(frozen=True)
class Interleaved1F1B:
    """Interleaved one-forward-one-backward (classic 1F1B with one stage per rank), optionally zero-bubble."""

    num_stages_per_rank: int = 1
    """Model stages each pipeline rank holds."""
    zero_bubble: bool = False
    """Split backward into input and weight gradients and defer the latter into bubbles (ZB1P)."""

    def __post_init__(self) -> None:
        _positive(self, "num_stages_per_rank")

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """:func:`zero_bubble_1f1b` with ``zero_bubble``, else :func:`one_f_one_b`.

        >>> print(Interleaved1F1B(zero_bubble=True).program(2, 2))
        r0: 0F0 0F1 0I0 0W0 0I1 0W1
        r1: 1F0 1I0 1F1 1I1 1W0 1W1
        """
        build = zero_bubble_1f1b if self.zero_bubble else one_f_one_b
        return build(num_ranks, self.num_stages_per_rank, num_microbatches)


@dataclasses.dataclass(frozen=True)
class ZeroBubbleV:
    """Zero-bubble V: two stages per rank in a V (zig-zag) layout."""

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """:func:`zero_bubble_v` (two stages per rank)."""
        return zero_bubble_v(num_ranks, 2, num_microbatches)


@dataclasses.dataclass(frozen=True)
class DualPipeV:
    """DualPipeV: two stages per rank, overlapped forward/backward pairs."""

    def program(self, num_ranks: int, num_microbatches: int) -> Program:
        """:func:`dual_pipe_v` (two stages per rank)."""
        return dual_pipe_v(num_ranks, 2, num_microbatches)


SCHEDULE_OPTIONS: Mapping[str, type[ScheduleOptions]] = types.MappingProxyType(
    {
        "gpipe": GPipe,
        "looped_bfs": LoopedBFS,
        "1f1b": Interleaved1F1B,
        "zero_bubble_v": ZeroBubbleV,
        "dual_pipe_v": DualPipeV,
    }
)
"""The training schedules a JSON config selects, by the name it writes (``{"schedule": "1f1b", ...}``): each
entry's fields are the JSON options, and its ``program(num_ranks, num_microbatches)`` the program they select.

>>> print(SCHEDULE_OPTIONS["looped_bfs"](num_stages_per_rank=2).program(1, 2))
r0: 0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1
"""
