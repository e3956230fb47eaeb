"""Tests for d9dfn.config._periods: the step-action grammar and should_do_action."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from d9dfn.config import StepActionPeriod, should_do_action, validate_period

periods = st.one_of(st.integers(1, 40), st.sampled_from(["last_step", "disable"]))


def _reference_fire_steps(period: int | str, total_steps: int, on_last_step: bool) -> set[int]:
    """The steps at which an action fires, written as sets rather than per-step tests."""
    if period == "disable":
        return set()
    if period == "last_step":
        return {total_steps}
    multiples = set(range(period, total_steps + 1, period))
    return multiples | ({total_steps} if on_last_step else set())


def _d9d_stepper_fire_steps(period: int | str, total_steps: int, on_last_step: bool, post: bool) -> set[int]:
    """d9d's Stepper, with its counter counting optimizer steps: pre tests step+1, post tests step after it moves."""
    fired = set()
    current = 0
    while current < total_steps:
        if not post and should_do_action(period, step=current + 1, total_steps=total_steps, on_last_step=on_last_step):
            fired.add(current + 1)
        current += 1
        if post and should_do_action(period, step=current, total_steps=total_steps, on_last_step=on_last_step):
            fired.add(current)
    return fired


@given(period=periods, total_steps=st.integers(1, 120), on_last_step=st.booleans())
def test_should_do_action_matches_reference(period: int | str, total_steps: int, on_last_step: bool) -> None:
    fired = {
        step
        for step in range(1, total_steps + 1)
        if should_do_action(period, step=step, total_steps=total_steps, on_last_step=on_last_step)
    }
    assert fired == _reference_fire_steps(period, total_steps, on_last_step)


@given(period=periods, total_steps=st.integers(1, 60), on_last_step=st.booleans(), post=st.booleans())
def test_should_do_action_pre_and_post_positions_agree(
    period: int | str, total_steps: int, on_last_step: bool, post: bool
) -> None:
    # d9d's "pre" (step + 1 before the counter moves) and "post" (step after it) name the same position.
    assert _d9d_stepper_fire_steps(period, total_steps, on_last_step, post) == _reference_fire_steps(
        period, total_steps, on_last_step
    )


@given(period=st.integers(1, 40), total_steps=st.integers(1, 120))
def test_should_do_action_fire_count_with_last_step(period: int, total_steps: int) -> None:
    count = sum(
        should_do_action(period, step=s, total_steps=total_steps, on_last_step=True) for s in range(1, total_steps + 1)
    )
    assert count == total_steps // period + (total_steps % period != 0)


@pytest.mark.parametrize("on_last_step", [True, False])
def test_should_do_action_last_step_fires_once_at_the_end(on_last_step: bool) -> None:
    # d9d's stepper counted microbatches, so under gradient accumulation "last_step" never fired.
    fired = [s for s in range(1, 5) if should_do_action("last_step", step=s, total_steps=4, on_last_step=on_last_step)]
    assert fired == [4]


def test_should_do_action_disable_never_fires() -> None:
    assert not any(should_do_action("disable", step=s, total_steps=5, on_last_step=True) for s in range(1, 6))


def test_should_do_action_int_without_last_step_flag_skips_the_end() -> None:
    fired = [s for s in range(1, 8) if should_do_action(3, step=s, total_steps=7, on_last_step=False)]
    assert fired == [3, 6]


@pytest.mark.parametrize("period", [0, -3, True, "never", 2.0, None])
def test_should_do_action_rejects_bad_period(period: object) -> None:
    with pytest.raises(ValueError, match=r"should_do_action: period .* is not a positive"):
        should_do_action(period, step=1, total_steps=3, on_last_step=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("step", "total_steps"), [(0, 3), (4, 3), (-1, 3), (True, 3)])
def test_should_do_action_rejects_step_outside_the_job(step: int, total_steps: int) -> None:
    with pytest.raises(ValueError, match=r"should_do_action: step=.* is outside \[1, total_steps=3\]"):
        should_do_action(2, step=step, total_steps=total_steps, on_last_step=True)


@pytest.mark.parametrize("total_steps", [0, -1, None, 2.5])
def test_should_do_action_rejects_bad_total_steps(total_steps: object) -> None:
    with pytest.raises(ValueError, match=r"should_do_action: total_steps=.* must be an int >= 1"):
        should_do_action(2, step=1, total_steps=total_steps, on_last_step=True)  # type: ignore[arg-type]


def test_validate_period_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"^logging\.period_steps: period 0 is not a positive number of steps"):
        validate_period(0, where="logging.period_steps")


@given(period=periods)
def test_step_action_period_validates_good_values(period: int | str) -> None:
    assert TypeAdapter(StepActionPeriod).validate_python(period) == period


@pytest.mark.parametrize("bad", [0, -1, True, False, "5", 2.0, "Last_Step", None, [1]])
def test_step_action_period_rejects_bad_values_with_one_clear_error(bad: object) -> None:
    with pytest.raises(ValidationError) as info:
        TypeAdapter(StepActionPeriod).validate_python(bad)
    errors = info.value.errors()
    assert len(errors) == 1
    assert '"last_step" or "disable"' in errors[0]["msg"]


def test_step_action_period_round_trips_through_json() -> None:
    adapter = TypeAdapter(StepActionPeriod)
    for value in (7, "last_step", "disable"):
        assert adapter.validate_json(adapter.dump_json(value)) == value
