"""When a periodic loop action (log, checkpoint, GC, grad-norm log, profile) runs: d9d's step-action grammar.

A period is a positive ``int`` ("every p optimizer steps"), ``"last_step"`` (only once, at the end) or
``"disable"`` (never). The loop asks :func:`should_do_action` with the **position** of the current
optimizer step: the 1-based index of the step being run, which is also the number of optimizer steps
completed once it finishes. The first step of a job is position 1 and its last is ``total_steps``.

d9d asked a ``Stepper`` that counted *batches of microbatches* and tested ``step + 1`` before its
counter moved ("pre" actions) or ``step`` after it ("post" actions); both are this position. Its counter
ran ``GA`` times too far when gradient accumulation was on, so ``last_step`` never fired.
d9dfn counts optimizer steps, whatever the number of microbatches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BeforeValidator

__all__ = ["StepActionPeriod", "StepActionSpecial", "should_do_action", "validate_period"]

StepActionSpecial: TypeAlias = Literal["last_step", "disable"]
"""The two named periods: ``"last_step"`` runs once, at ``total_steps``; ``"disable"`` never runs."""

_SPECIALS: tuple[str, ...] = ("last_step", "disable")


def validate_period(period: Any, *, where: str = "period") -> int | StepActionSpecial:
    """Check that ``period`` is a positive ``int``, ``"last_step"`` or ``"disable"``, and return it.

    Args:
        period: the value to check (from a config file or a caller).
        where: how the value is named in the error message (a config field path).

    Raises:
        ValueError: ``period`` is a ``bool``, an ``int`` below 1, an unknown string or another type.

    >>> validate_period(10), validate_period("last_step")
    (10, 'last_step')
    """
    problem = _period_problem(period)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return period


def _period_problem(period: Any) -> str | None:
    # bool is an int subclass: `true` in a config file would otherwise mean "every step".
    if isinstance(period, int) and not isinstance(period, bool):
        if period >= 1:
            return None
        return f'period {period} is not a positive number of steps; write an int >= 1, "last_step" or "disable"'
    if isinstance(period, str) and period in _SPECIALS:
        return None
    return (
        f'period {period!r} is not a positive int, "last_step" or "disable"; write e.g. 100 (every 100 optimizer '
        f'steps), "last_step" (only at the end) or "disable" (never)'
    )


def _pydantic_period(value: Any) -> Any:
    # The field's path is in the error's location already; say only what is wrong.
    problem = _period_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


StepActionPeriod: TypeAlias = Annotated[int | StepActionSpecial, BeforeValidator(_pydantic_period)]
"""``int`` ≥ 1 (every that many optimizer steps), ``"last_step"`` or ``"disable"``; validated in configs."""


def should_do_action(period: int | StepActionSpecial, *, step: int, total_steps: int, on_last_step: bool) -> bool:
    """Whether a periodic action runs at optimizer step position ``step`` of ``total_steps``.

    ``step`` is the 1-based position of the current optimizer step (equivalently, the number of optimizer
    steps completed once it finishes): 1 for the first step, ``total_steps`` for the last. Microbatches
    do not count. The rules (d9d's):

    * ``"disable"``: never;
    * ``"last_step"``: only when ``step == total_steps``;
    * ``int p``: when ``step % p == 0``, and also when ``step == total_steps`` if ``on_last_step``.

    This is host-side scheduling, called between compiled steps with plain ints.

    Args:
        period: the action's period (see :data:`StepActionPeriod`).
        step: the position of the current optimizer step, in ``[1, total_steps]``.
        total_steps: the number of optimizer steps in the job, ≥ 1.
        on_last_step: whether an ``int`` period also fires on the last step (checkpoints and logs do,
            GC does not).

    Raises:
        ValueError: an invalid ``period``, ``total_steps < 1`` or ``step`` outside ``[1, total_steps]``.

    >>> [s for s in range(1, 8) if should_do_action(3, step=s, total_steps=7, on_last_step=True)]
    [3, 6, 7]
    >>> should_do_action("last_step", step=7, total_steps=7, on_last_step=False)
    True
    """
    period = validate_period(period, where="should_do_action")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(
            f"should_do_action: total_steps={total_steps!r} must be an int >= 1; pass the job's number of "
            f"optimizer steps (resolve a None total_steps from the data first)"
        )
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= total_steps:
        raise ValueError(
            f"should_do_action: step={step!r} is outside [1, total_steps={total_steps}]; pass the 1-based "
            f"position of the current optimizer step (completed steps + 1 before it runs, completed steps after)"
        )
    is_last = step == total_steps
    if period == "disable":
        return False
    if period == "last_step":
        return is_last
    return step % period == 0 or (on_last_step and is_last)
