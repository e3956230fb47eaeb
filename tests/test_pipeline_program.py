"""d9dfn.pipeline's pure core: programs, schedules, lowering, the dry run and the simulator.

The property tests are ``../shared/reference/pipeline.md`` §7's oracles, over every builder × p∈[1,8] ×
v × m∈[1,32] (m < p included), each written here from the definition rather than with the library's checks.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import _validate_schedule

from d9dfn.loop import plot_pipeline
from d9dfn.pipeline import (
    COMM_KINDS,
    COMPUTE_KINDS,
    SCHEDULE_OPTIONS,
    SCHEDULES,
    Action,
    Costs,
    Program,
    dry_run,
    dual_pipe_v,
    from_torch,
    gpipe,
    inference,
    looped_bfs,
    lower,
    one_f_one_b,
    parse_action,
    render,
    simulate,
    to_torch,
    validate,
    zero_bubble_1f1b,
    zero_bubble_v,
)

V_SCHEDULES = ("zero_bubble_v", "dual_pipe_v")


@st.composite
def programs(draw: st.DrawFn) -> tuple[str, int, int, int, Program]:
    """(name, p, v, m, program) for any builder, with the stages per rank it accepts."""
    name = draw(st.sampled_from(sorted(SCHEDULES)))
    num_ranks = draw(st.integers(1, 8))
    if name in V_SCHEDULES:
        stages_per_rank = 2
    elif name == "gpipe":
        stages_per_rank = 1
    else:
        stages_per_rank = draw(st.integers(1, 3))
    num_microbatches = draw(st.integers(1, 32))
    return (
        name,
        num_ranks,
        stages_per_rank,
        num_microbatches,
        SCHEDULES[name](num_ranks, stages_per_rank, num_microbatches),
    )


def _per_stage(program: Program) -> dict[int, list[Action]]:
    """Each stage's compute actions in its rank's order."""
    stages: dict[int, list[Action]] = defaultdict(list)
    for actions in program.ranks:
        for action in actions:
            if action.is_compute:
                stages[action.stage].append(action)
    return stages


# --- programs and schedules ------------------------------------------------------------------------------------


@given(programs())
def test_schedules_emit_valid_programs(case: tuple[str, int, int, int, Program]) -> None:
    name, num_ranks, stages_per_rank, num_microbatches, program = case
    assert program.num_ranks == num_ranks
    assert program.num_stages == num_ranks * stages_per_rank
    assert program.num_microbatches == num_microbatches
    assert not program.is_lowered
    stages = _per_stage(program)
    for stage in range(program.num_stages):
        actions = stages[stage]
        # every action of a stage sits on the stage's rank
        assert all(action in program.ranks[program.stage_to_rank[stage]] for action in actions)
        counts = Counter((a.kind, a.microbatch) for a in actions)
        assert all(n == 1 for n in counts.values()), f"{name}: stage {stage} repeats an action"
        for mb in range(num_microbatches):
            assert counts["F", mb] == 1
            if name == "inference":
                assert not ({"B", "I", "W"} & {kind for kind, _ in counts})
            else:
                assert (counts["B", mb], counts["I", mb], counts["W", mb]) in ((1, 0, 0), (0, 1, 1))
        position = {action: i for i, action in enumerate(actions)}
        for action in actions:
            if action.kind in "BI":
                assert position[action._replace(kind="F")] < position[action]
            if action.kind == "W":
                assert position[action._replace(kind="I")] < position[action]
        # the bitwise condition: backwards (B or I) and W in increasing microbatch order
        backwards = [a.microbatch for a in actions if a.kind in "BI"]
        weights = [a.microbatch for a in actions if a.kind == "W"]
        assert backwards == sorted(backwards)
        assert weights == sorted(weights)
    validate(program)


@given(programs())
def test_to_torch_passes_torchs_validator_and_round_trips(case: tuple[str, int, int, int, Program]) -> None:
    name, num_ranks, _, num_microbatches, program = case
    assert from_torch(to_torch(program), num_microbatches, program.stage_to_rank) == program
    assert from_torch(to_torch(program), num_microbatches) == program
    if name != "inference":  # torch's validator insists on one backward per (stage, microbatch)
        mapping = _validate_schedule(to_torch(program), num_ranks, program.num_stages, num_microbatches)
        assert mapping == dict(enumerate(program.stage_to_rank))


@given(st.integers(0, 99), st.sampled_from(COMPUTE_KINDS + COMM_KINDS), st.integers(0, 99))
def test_parse_action_inverts_str(stage: int, kind: str, microbatch: int) -> None:
    action = Action(stage, kind, microbatch)
    assert parse_action(str(action)) == action
    assert str(to_torch(Program(((action,),), 100, (0,) * 100))[0][0]) == str(action)


@given(programs())
def test_program_strings_round_trip(case: tuple[str, int, int, int, Program]) -> None:
    _, _, _, num_microbatches, program = case
    rows = program.to_strings()
    assert Program.from_strings(rows, num_microbatches=num_microbatches, stage_to_rank=program.stage_to_rank) == program


# Shapes at p=4, m=8 from ../shared/reference/pipeline.md §1.7 (torch's get_schedule_ops), where d9dfn keeps
# torch's order; GPipe and looped BFS differ on purpose (backwards in increasing microbatch order).
def _r(text: str) -> str:
    """Expand ``0F0-3`` into ``0F0 0F1 0F2 0F3``."""
    out = []
    for item in text.split():
        if "-" in item:
            head, last = item.split("-")
            action = parse_action(head)
            out += [str(action._replace(microbatch=i)) for i in range(action.microbatch, int(last) + 1)]
        else:
            out.append(item)
    return " ".join(out)


def test_program_shapes_match_torch_at_p4_m8() -> None:
    assert one_f_one_b(4, 1, 8).to_strings()[0] == _r("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4-7")
    assert one_f_one_b(4, 2, 8).to_strings()[0] == _r(
        "0F0-3 4F0-3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4-7 0B4-7"
    )
    assert (
        zero_bubble_1f1b(4, 2, 8)
        .to_strings()[0]
        .startswith(_r("0F0-3 4F0-2 4F3 4I0 4W0 0F4 4I1 4W1 0F5 4I2 4W2 0F6 4I3 4W3 0F7 0I0 0W0 4F4 0I1 0W1"))
    )
    zbv = zero_bubble_v(4, 2, 8).to_strings()
    assert zbv[0].startswith(
        _r("0F0-6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1")
    )
    assert zbv[3].startswith("3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1")
    dual = dual_pipe_v(4, 2, 8).to_strings()[0]  # torch's (0F7;7B3) pairs, written F then B
    assert dual.startswith(_r("0F0-6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0 7B4 7F5 0B1 7B5"))
    assert dual.endswith("0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7")
    assert gpipe(4, 1, 8).to_strings()[0] == _r("0F0-7 0B0-7")
    assert looped_bfs(4, 2, 8).to_strings()[0] == _r("0F0-7 4F0-7 4B0-7 0B0-7")
    assert inference(4, 1, 8).to_strings()[2] == _r("2F0-7")


@pytest.mark.parametrize(
    ("build", "args", "needle"),
    [
        (gpipe, (2, 2, 4), "gpipe: stages_per_rank=2"),
        (zero_bubble_v, (2, 3, 4), "zero_bubble_v: stages_per_rank=3"),
        (dual_pipe_v, (2, 1, 4), "dual_pipe_v: stages_per_rank=1"),
        (one_f_one_b, (0, 1, 4), "one_f_one_b: num_ranks=0"),
        (looped_bfs, (2, 1, 0), "looped_bfs: num_microbatches=0"),
    ],
)
def test_schedules_reject_unsupported_arguments(build, args, needle) -> None:
    with pytest.raises(ValueError, match=r"must be|pass stages_per_rank") as info:
        build(*args)
    assert needle in str(info.value)


@pytest.mark.parametrize("name", ["looped_bfs", "1f1b"])
@pytest.mark.parametrize("bad", [0, -2, True, 1.0])
def test_schedule_options_refuse_a_non_positive_stage_count_naming_the_field(name: str, bad: object) -> None:
    options = SCHEDULE_OPTIONS[name]
    with pytest.raises(ValueError, match=rf"^{options.__name__}: num_stages_per_rank={bad!r} must be a positive int"):
        options(num_stages_per_rank=bad)


def test_program_rejects_misplaced_and_out_of_range_actions() -> None:
    with pytest.raises(ValueError, match="stage_to_rank puts on rank 1"):
        Program.from_strings(["1F0", "0F0"], num_microbatches=1, stage_to_rank=(0, 1))
    with pytest.raises(ValueError, match="outside 1 stages × 1 microbatches"):
        Program.from_strings(["0F1"], num_microbatches=1, stage_to_rank=(0,))
    with pytest.raises(ValueError, match="every rank"):
        Program.from_strings(["0F0"], num_microbatches=1, stage_to_rank=(1,))
    with pytest.raises(ValueError, match="parse_action: '0X1' is not an action"):
        parse_action("0X1")


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        (["0B0 0F0"], "0B0 runs before 0F0"),
        (["0F0 0W0"], "0W0 runs before 0I0"),
        (["0F0 0B0 0I0"], "repeats"),
        (["0F0 0F1 0B0"], "microbatch 1 runs"),
    ],
)
def test_validate_names_the_broken_rule(rows, needle) -> None:
    with pytest.raises(ValueError, match="validate") as info:
        validate(Program.from_strings(rows, num_microbatches=2 if "1" in rows[0] else 1, stage_to_rank=(0,)))
    assert needle in str(info.value)


# --- lowering and the dry run ------------------------------------------------------------------------------------


def _peer_stage(action: Action) -> int:
    return action.stage + {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}[action.kind]


@given(programs())
def test_lower_pairs_every_send_with_one_recv_in_fifo_order(case: tuple[str, int, int, int, Program]) -> None:
    name, num_ranks, _, num_microbatches, program = case
    lowered = lower(program)
    placement = lowered.stage_to_rank
    assert lowered.compute_only() == program  # lowering never reorders compute
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> (edge, mb, direction)
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for rank, actions in enumerate(lowered.ranks):
        position = {action: i for i, action in enumerate(actions)}
        for i, action in enumerate(actions):
            if action.is_compute:
                continue
            peer = _peer_stage(action)
            assert placement[peer] != rank, f"{action}: a send or receive between stages on one rank"
            forward = action.kind.endswith("_F")
            edge = (min(action.stage, peer), max(action.stage, peer))
            if action.kind.startswith("SEND"):
                # after the action that produced it
                producer = [a for a in (action._replace(kind="F"),) if forward] or [
                    action._replace(kind="B"),
                    action._replace(kind="I"),
                ]
                assert min(position.get(a, len(actions)) for a in producer) < i
                sends[rank, placement[peer]].append((edge, action.microbatch, forward))
            else:
                # before the action that consumes it
                consumers = [action._replace(kind="F")] if forward else [action._replace(kind=k) for k in "BI"]
                assert i < min(position.get(a, len(actions)) for a in consumers) < len(actions)
                recvs[placement[peer], rank].append((edge, action.microbatch, forward))
    assert sends == recvs  # same messages, same order per (sender, receiver): FIFO matching needs no tags
    for pair in sends:
        assert len(set(sends[pair])) == len(sends[pair])  # each message once
    # every cross-rank edge of every microbatch carries its activation (and, with backwards, its gradient)
    crossings = sum(placement[s] != placement[s + 1] for s in range(program.num_stages - 1))
    per_mb = 1 if name == "inference" else 2
    assert sum(map(len, sends.values())) == crossings * num_microbatches * per_mb
    if name != "inference":
        _validate_schedule(to_torch(lowered), num_ranks, lowered.num_stages, num_microbatches)


@given(programs())
def test_dry_run_never_deadlocks_and_respects_stage_order(case: tuple[str, int, int, int, Program]) -> None:
    _, _, _, _, program = case
    run = dry_run(lower(program))
    round_of = {}
    for rank, steps in enumerate(run.steps):
        assert len(steps) == run.num_rounds
        assert [a for a in steps if a is not None] == list(lower(program).ranks[rank])
        round_of.update({a: t for t, a in enumerate(steps) if a is not None and a.is_compute})
    last = program.num_stages - 1
    for action, t in round_of.items():
        s, mb = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            assert round_of[Action(s - 1, "F", mb)] < t
        if action.kind in "BI":
            assert round_of[Action(s, "F", mb)] < t
            if s < last:
                assert round_of.get(Action(s + 1, "B", mb), round_of.get(Action(s + 1, "I", mb))) < t
        if action.kind == "W":
            assert round_of[Action(s, "I", mb)] < t


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_dry_run_with_fewer_microbatches_than_ranks(num_ranks: int) -> None:
    # torchtitan#775: 1F1B with m < p hung in warm-up.
    for name, build in SCHEDULES.items():
        for num_microbatches in range(1, num_ranks):
            stages_per_rank = 2 if name in (*V_SCHEDULES, "looped_bfs") else 1
            assert dry_run(build(num_ranks, stages_per_rank, num_microbatches)).num_rounds > 0


def test_lower_matches_the_hand_written_two_rank_1f1b() -> None:
    # ../shared/reference/pipeline.md §6.4: the gloo prototype's order.
    lowered = lower(one_f_one_b(2, 1, 3)).to_strings()
    assert lowered[0].startswith("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2")
    assert lowered[1].startswith("1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1")


def test_lower_skips_same_rank_neighbours_in_the_v() -> None:
    lowered = lower(zero_bubble_v(2, 2, 2))
    assert lowered.stage_to_rank == (0, 1, 1, 0)  # rank 1 holds stages 1 and 2: nothing goes between them
    comms = [a for a in lowered.ranks[1] if not a.is_compute]
    assert comms
    assert all({a.stage, _peer_stage(a)} in ({0, 1}, {2, 3}) for a in comms)


def test_lower_and_dry_run_report_a_cycle() -> None:
    # rank 1 wants microbatch 1 first, but rank 0 sends it only after microbatch 0's backward comes back
    cyclic = Program.from_strings(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], num_microbatches=2, stage_to_rank=(0, 1))
    with pytest.raises(ValueError, match=r"lower: the ranks wait on each other in a cycle \(rank 0 at 0B0"):
        lower(cyclic)
    with pytest.raises(ValueError, match="lower"):
        dry_run(cyclic)
    with pytest.raises(ValueError, match="already holds sends"):
        lower(lower(gpipe(2, 1, 1)))


def test_dry_run_rejects_out_of_order_receives_and_missing_ones() -> None:
    rows = list(lower(gpipe(2, 1, 2)).to_strings())
    assert rows[1].startswith("1RECV_F0 1F0 1RECV_F1")
    swapped = rows[1].replace("1RECV_F0", "X").replace("1RECV_F1", "1RECV_F0").replace("X", "1RECV_F1")
    program = Program.from_strings([rows[0], swapped], num_microbatches=2, stage_to_rank=(0, 1))
    with pytest.raises(ValueError, match="must be in the same order"):
        dry_run(program)
    missing = Program.from_strings(
        [rows[0], rows[1].replace("1RECV_F1 ", "")], num_microbatches=2, stage_to_rank=(0, 1)
    )
    with pytest.raises(ValueError, match=r"dry_run: deadlock after \d+ rounds: rank 0 at 0SEND_F1 waits for rank 1"):
        dry_run(missing)


# --- the simulator and the pictures -----------------------------------------------------------------------------


@given(programs(), st.sampled_from([Costs(), Costs(F=1, B=3, I=2, W=1, comm=0.5), Costs(F=2, B=2, I=1, W=1)]))
def test_simulate_respects_dependencies_and_accounts_time(case, costs: Costs) -> None:
    _, num_ranks, _, num_microbatches, program = case
    timeline = simulate(program, costs)
    start, end = {}, {}
    for rank, row in enumerate(timeline.intervals):
        assert [a for _, _, a in row] == list(program.ranks[rank])  # program order
        for (_, e0, _), (s1, _, _) in itertools.pairwise(row):
            assert e0 <= s1  # one action at a time
        for s, e, action in row:
            assert e - s == costs.of(action)
            start[action], end[action] = s, e
        assert timeline.busy[rank] == pytest.approx(sum(e - s for s, e, _ in row))
    for action, t in start.items():
        s, mb = action.stage, action.microbatch

        def hop(other: int, s: int = s) -> float:
            return costs.comm if program.stage_to_rank[other] != program.stage_to_rank[s] else 0.0

        if action.kind == "F" and s > 0:
            assert t >= end[Action(s - 1, "F", mb)] + hop(s - 1)
        if action.kind in "BI":
            assert t >= end[Action(s, "F", mb)]
            if s < program.num_stages - 1:
                upstream = Action(s + 1, "B", mb) if Action(s + 1, "B", mb) in end else Action(s + 1, "I", mb)
                assert t >= end[upstream] + hop(s + 1)
        if action.kind == "W":
            assert t >= end[Action(s, "I", mb)]
    assert timeline.makespan == max(end.values())
    assert 0 <= timeline.bubble_fraction < 1
    assert all(
        1 <= peak <= num_microbatches * len(program.stages_of(r)) for r, peak in enumerate(timeline.peak_activations)
    )
    assert sum(timeline.idle) == pytest.approx(num_ranks * timeline.makespan - sum(timeline.busy))


@pytest.mark.parametrize("num_ranks", range(1, 9))
def test_one_f_one_b_holds_p_minus_r_activations(num_ranks: int) -> None:
    # The d9d regression (../shared/reference/pipeline.md §2): its 1F1B held 2(p−1−r)+1 on rank r.
    for num_microbatches in sorted({1, max(1, num_ranks - 1), num_ranks, 2 * num_ranks, 13}):
        peaks = simulate(one_f_one_b(num_ranks, 1, num_microbatches)).peak_activations
        assert peaks == tuple(min(num_ranks - r, num_microbatches) for r in range(num_ranks))


def test_render_draws_the_reference_timelines() -> None:
    # ../shared/reference/pipeline.md §5: 1F1B (T_F=1, T_B=2) and ZB-H1 (1, 1, 1) at p=3, m=4.
    assert render(one_f_one_b(3, 1, 4)).splitlines() == [
        "r0 F0 F1 F2  .  .  .  . B0  ~ F3 B1  ~  . B2  ~  . B3  ~",
        "r1  . F0 F1  .  . B0  ~ F2 B1  ~ F3 B2  ~  . B3  ~  .  .",
        "r2  .  . F0 B0  ~ F1 B1  ~ F2 B2  ~ F3 B3  ~  .  .  .  .",
    ]
    assert simulate(one_f_one_b(3, 1, 4)).makespan == 18
    assert render(zero_bubble_1f1b(3, 1, 4)).splitlines() == [
        "r0 F0 F1 F2  .  . I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "r1  . F0 F1  . I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "r2  .  . F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]
    assert render(looped_bfs(1, 2, 1)) == "r0 0F0 1F0 1B0   ~ 0B0   ~"


def test_simulate_adds_comm_latency_and_per_stage_costs() -> None:
    # F0 → 0.5 → F1, B1 → 0.5 → B0: 1 + .5 + 1 + 2 + .5 + 2
    assert simulate(one_f_one_b(2, 1, 1), Costs(comm=0.5)).makespan == 7
    # a lowered program times the same as its compute actions
    assert simulate(lower(one_f_one_b(2, 1, 1)), Costs(comm=0.5)).makespan == 7
    # a heavy last stage (the head): 1 + 3 + 6 + 2
    assert simulate(gpipe(2, 1, 1), Costs(F=(1, 3), B=(2, 6))).makespan == 12
    cyclic = Program.from_strings(["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"], num_microbatches=2, stage_to_rank=(0, 1))
    with pytest.raises(ValueError, match="simulate: the ranks wait on each other"):
        simulate(cyclic)


def test_plot_pipeline_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = plot_pipeline(zero_bubble_v(2, 2, 4), tmp_path / "zbv.png")
    assert path.read_bytes().startswith(b"\x89PNG")


def _pipeline_table():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_table.py"
    spec = importlib.util.spec_from_file_location("pipeline_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(2, 4), (4, 8), (8, 16)])
def test_table_meets_the_formulas_and_torchs_makespan(num_ranks: int, num_microbatches: int) -> None:
    # ../shared/reference/pipeline.md §5 under unit costs: the bubble fractions and peaks are exact (1e-9).
    table = _pipeline_table().rows(num_ranks, num_microbatches)
    assert len(table) == 9
    for row in table:
        assert row.bubble == pytest.approx(row.formula_bubble, abs=1e-9), row
        if row.formula_peaks is not None:
            assert row.peaks == row.formula_peaks, row
        if row.torch_makespan is not None:
            assert row.makespan <= row.torch_makespan, row
    assert sum(row.torch_makespan is not None for row in table) == 7  # all but inference and torch's broken 1F1B
