"""Schedules: values against a plain Python reference of d9d's piecewise semantics, errors, compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from d9dfn import schedules

# --- a straightforward reference of d9d's piecewise engine (Python floats, no tensors) ------------------------


def _reference_curve(kind: str, power: float, start: float, end: float, p: float) -> float:
    if kind == "linear":
        return start + (end - start) * p
    if kind == "cosine":
        return end + (start - end) * (1 + math.cos(math.pi * p)) / 2
    if kind == "exponential":
        lo, hi = math.log(max(start, 1e-8)), math.log(max(end, 1e-8))
        return math.exp(lo + (hi - lo) * p)
    return start + (end - start) * p**power


def _reference(initial: float, phases: list[tuple], total_steps: int | None, step: int) -> float:
    """Phases are ``(mode, arg, target, kind, power)``; the value at ``step`` as d9d's engine computes it."""
    resolved, cursor, value = [], 0, initial
    for mode, arg, target, kind, power in phases:
        if mode == "steps":
            end = cursor + arg
        elif mode == "percentage":
            end = int(total_steps * arg)
        else:
            end = total_steps
        resolved.append((cursor, end, value, target, kind, power))
        cursor, value = end, target
    if step < 0:
        return resolved[0][2]
    for start, end, start_value, end_value, kind, power in resolved:
        if start <= step < end:
            return _reference_curve(kind, power, start_value, end_value, (step - start) / (end - start))
    return resolved[-1][3]


def _build(initial: float, phases: list[tuple], total_steps: int | None):
    made = []
    for mode, arg, target, kind, power in phases:
        curve = schedules.poly(power) if kind == "poly" else getattr(schedules, kind)()
        if mode == "steps":
            made.append(schedules.steps(arg, target, curve))
        elif mode == "percentage":
            made.append(schedules.percentage(arg, target, curve))
        else:
            made.append(schedules.rest(target, curve))
    return schedules.piecewise(initial, made, total_steps)


TARGETS = st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 2.0, allow_subnormal=False))
CURVES = st.tuples(st.sampled_from(["linear", "cosine", "exponential", "poly"]), st.sampled_from([0.5, 1.0, 2.0, 3.0]))


@st.composite
def valid_schedules(draw: st.DrawFn) -> tuple[float, list[tuple], int | None]:
    """A schedule that builds: phases never overshoot ``total_steps`` and percentages never go backwards."""
    steps_only = draw(st.booleans())
    total_steps = None if steps_only else draw(st.integers(1, 120))
    phases, cursor = [], 0
    for _ in range(draw(st.integers(1, 4))):
        kind, power = draw(CURVES)
        target = draw(TARGETS)
        modes = ["steps"] if steps_only else ["steps", "percentage", "rest"]
        mode = draw(st.sampled_from(modes))
        if mode == "steps" and total_steps is not None and cursor >= total_steps:
            mode = "rest"
        if mode == "steps":
            limit = 40 if total_steps is None else total_steps - cursor
            arg = draw(st.integers(1, limit))
            cursor += arg
        elif mode == "percentage":
            arg = draw(st.floats(cursor / total_steps, 1.0))
            if int(total_steps * arg) < cursor:  # float rounding right at the cursor
                arg = min(1.0, arg + 1e-9)
            cursor = max(cursor, int(total_steps * arg))
        else:
            arg = None
            cursor = total_steps
        phases.append((mode, arg, target, kind, power))
    return draw(TARGETS), phases, total_steps


@given(valid_schedules())
def test_piecewise_matches_the_reference_before_during_and_after(case):
    initial, phases, total_steps = case
    schedule = _build(initial, phases, total_steps)
    last = total_steps if total_steps is not None else sum(arg for _, arg, *_ in phases)
    step_values = torch.arange(-7, last + 12)
    values = schedule(step_values)
    assert (values.dtype, values.shape) == (torch.float32, step_values.shape)
    expected = torch.tensor(
        [_reference(initial, phases, total_steps, int(s)) for s in step_values], dtype=torch.float64
    )
    torch.testing.assert_close(values.double(), expected, rtol=1e-6, atol=1e-7)


@given(valid_schedules(), st.integers(-1000, 1000))
def test_piecewise_on_a_0d_step_equals_elementwise(case, step):
    schedule = _build(*case)
    value = schedule(torch.tensor(step))
    assert value.shape == ()
    assert torch.equal(value, schedule(torch.tensor([step]))[0])
    assert math.isclose(float(value), _reference(*case, step), rel_tol=1e-6, abs_tol=1e-7)


def test_piecewise_warmup_cosine_exponential_and_poly_examples():
    warmup_cosine = _build(
        0.0, [("percentage", 0.1, 1.0, "linear", 2.0), ("rest", None, 0.0, "cosine", 2.0)], total_steps=100
    )
    assert warmup_cosine(torch.tensor([-3, 0, 5, 10, 55, 100, 10**6])).tolist() == pytest.approx(
        [0.0, 0.0, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-7
    )
    exponential = _build(1.0, [("steps", 4, 0.0, "exponential", 2.0)], None)
    # Linear in log space from 1 to 1e-8 (0 clamped); the end value itself is the exact target 0.
    assert exponential(torch.arange(6)).tolist() == pytest.approx([1.0, 1e-2, 1e-4, 1e-6, 0.0, 0.0], rel=1e-5)
    poly = _build(2.0, [("steps", 2, 0.0, "poly", 3.0)], None)
    assert poly(torch.tensor([1])).tolist() == pytest.approx([2.0 - 2.0 * 0.5**3])


def test_piecewise_skips_zero_length_phases():
    schedule = schedules.piecewise(
        0.5,
        [
            schedules.percentage(0.0, 2.0, schedules.linear()),
            schedules.steps(4, 1.0, schedules.linear()),
            schedules.percentage(0.04, 3.0, schedules.cosine()),  # int(100 * 0.04) = 4: zero length
            schedules.rest(0.0, schedules.linear()),
        ],
        total_steps=100,
    )
    assert schedule(torch.tensor([-1, 0, 2, 4, 100])).tolist() == pytest.approx([0.5, 2.0, 1.5, 3.0, 0.0])


def test_piecewise_percentage_uses_int_of_the_product():
    schedule = schedules.piecewise(0.0, [schedules.percentage(0.333, 1.0, schedules.linear())], total_steps=10)
    # int(10 * 0.333) = 3: the phase covers steps 0, 1, 2 and reaches 1.0 at step 3.
    assert schedule(torch.arange(5)).tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0])


def test_piecewise_accepts_float_and_int32_steps():
    schedule = schedules.warmup_cosine(1.0, 10, 100)
    reference = schedule(torch.arange(0, 100))
    assert torch.equal(schedule(torch.arange(0, 100, dtype=torch.int32)), reference)
    assert torch.equal(schedule(torch.arange(0, 100).float()), reference)


# --- helpers ----------------------------------------------------------------------------------------------------


@given(st.floats(-10, 10), st.integers(-5, 50))
def test_constant_is_constant(value, step):
    out = schedules.constant(value)(torch.tensor(step))
    assert (out.dtype, out.shape) == (torch.float32, ())
    assert float(out) == float(torch.tensor(value, dtype=torch.float32))


@given(valid_schedules(), st.floats(1e-6, 10.0), st.integers(-5, 130))
def test_scale_multiplies(case, factor, step):
    base = _build(*case)
    scaled = schedules.scale(base, factor)
    assert math.isclose(
        float(scaled(torch.tensor(step))), float(base(torch.tensor(step))) * factor, rel_tol=1e-6, abs_tol=1e-30
    )


@given(st.floats(0.1, 2.0), st.integers(0, 20), st.integers(1, 100), st.floats(0.0, 0.1))
def test_warmup_cosine_is_linear_then_half_cosine(peak, warmup_steps, extra, final):
    total_steps = warmup_steps + extra
    schedule = schedules.warmup_cosine(peak, warmup_steps, total_steps, final=final)
    phases = [("rest", None, final, "cosine", 2.0)]
    if warmup_steps:
        phases.insert(0, ("steps", warmup_steps, peak, "linear", 2.0))
    initial = 0.0 if warmup_steps else peak
    for step in (-1, 0, warmup_steps // 2, warmup_steps, (warmup_steps + total_steps) // 2, total_steps):
        got = float(schedule(torch.tensor(step)))
        assert math.isclose(got, _reference(initial, phases, total_steps, step), rel_tol=1e-6, abs_tol=1e-7)


# --- compile ---------------------------------------------------------------------------------------------------


def test_piecewise_compiles_once_and_matches_eager_over_steps():
    schedule = _build(
        0.1,
        [
            ("steps", 3, 1.0, "linear", 2.0),
            ("percentage", 0.5, 0.5, "poly", 0.5),
            ("steps", 2, 0.7, "exponential", 2.0),
            ("rest", None, 0.0, "cosine", 2.0),
        ],
        total_steps=20,
    )
    torch._dynamo.reset()
    # fullgraph=True raises on any graph break; the stance raises on any recompile after the first call.
    compiled = torch.compile(schedule, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(torch.tensor(-3)), schedule(torch.tensor(-3)))
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(25):
            assert torch.equal(compiled(torch.tensor(step)), schedule(torch.tensor(step))), step


def test_schedule_inside_a_compiled_function_of_the_step():
    lr = schedules.scale(schedules.warmup_cosine(1.0, 5, 50), 3e-4)

    def step_fn(step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lr(step), step + 1

    torch._dynamo.reset()
    compiled = torch.compile(step_fn, fullgraph=True, backend="aot_eager")
    step = torch.tensor(0)
    value, step = compiled(step)
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(55):
            expected = lr(step)
            value, step = compiled(step)
            assert torch.equal(value, expected)


# --- errors ----------------------------------------------------------------------------------------------------


def test_piecewise_percentage_behind_the_cursor_names_phase_numbers_and_fix():
    with pytest.raises(
        ValueError,
        match=r"piecewise: phase 1 \(percentage\(0.1\)\) ends at step 10 = int\(100 \* 0.1\), behind the cursor at "
        r"step 30 where phase 0 ended; raise the percentage to at least 0.3",
    ):
        schedules.piecewise(
            0.0,
            [schedules.steps(30, 1.0, schedules.linear()), schedules.percentage(0.1, 0.5, schedules.linear())],
            total_steps=100,
        )


def test_piecewise_overshoot_names_phase_numbers_and_fix():
    with pytest.raises(
        ValueError,
        match=r"piecewise: phase 1 \(steps\(80\)\) ends at step 120, past total_steps=100; shorten it to at most 60",
    ):
        schedules.piecewise(
            0.0,
            [schedules.percentage(0.4, 1.0, schedules.linear()), schedules.steps(80, 0.0, schedules.cosine())],
            total_steps=100,
        )


def test_piecewise_rest_after_a_full_schedule_is_empty_not_an_error():
    schedule = schedules.piecewise(
        0.0, [schedules.steps(10, 1.0, schedules.linear()), schedules.rest(0.5, schedules.linear())], total_steps=10
    )
    assert schedule(torch.tensor([9, 10, 11])).tolist() == pytest.approx([0.9, 0.5, 0.5])


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: schedules.piecewise(1.0, []), ValueError, r"piecewise: no phases"),
        (
            lambda: schedules.piecewise(1.0, [schedules.rest(0.0, schedules.linear())]),
            ValueError,
            r"piecewise: phase 0 \(rest\(\)\) needs total_steps",
        ),
        (
            lambda: schedules.piecewise(1.0, [schedules.percentage(0.5, 0.0, schedules.linear())]),
            ValueError,
            r"piecewise: phase 0 \(percentage\(0.5\)\) needs total_steps",
        ),
        (
            lambda: schedules.piecewise(1.0, [schedules.steps(1, 0.0, schedules.linear())], total_steps=0),
            ValueError,
            r"total_steps=0 must be a positive int",
        ),
        (lambda: schedules.piecewise(1.0, ["steps"], 10), TypeError, r"phase 0 is a str"),
        (lambda: schedules.steps(0, 1.0, schedules.linear()), ValueError, r"steps: num_steps=0 must be a positive int"),
        (lambda: schedules.steps(2.5, 1.0, schedules.linear()), ValueError, r"num_steps=2.5"),
        (lambda: schedules.percentage(1.5, 1.0, schedules.linear()), ValueError, r"percentage: p=1.5 must be"),
        (
            lambda: schedules.rest(float("nan"), schedules.linear()),
            ValueError,
            r"rest: target=nan must be a finite float",
        ),
        (lambda: schedules.rest(1.0, "cosine"), TypeError, r"rest: curve is a str; pass linear\(\)"),
        (lambda: schedules.poly(0.0), ValueError, r"poly: power=0.0 must be a positive"),
        (lambda: schedules.scale(0.5, 2.0), TypeError, r"scale: schedule is a float"),
        (lambda: schedules.constant(1.0)(3), TypeError, r"constant schedule: step is a int; pass a 0-d tensor"),
        (
            lambda: schedules.warmup_cosine(1.0, 5, 10)(5),
            TypeError,
            r"piecewise schedule: step is a int; pass a 0-d tensor",
        ),
    ],
)
def test_schedule_errors_name_the_problem_and_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()
