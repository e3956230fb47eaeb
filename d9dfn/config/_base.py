"""The base every loop config shares, and the one error type config mistakes become."""

from __future__ import annotations

import json
import types
from pathlib import PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["ConfigError", "FrozenConfig"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path, the problem and the fix."""


class FrozenConfig(BaseModel):
    """Shared settings: frozen, unknown keys rejected, field docstrings become descriptions, strict scalars.

    pydantic's lax mode would read JSON ``true`` as ``1`` for an int field, ``1`` or ``"yes"`` as ``true`` for a
    bool field, and ``"40"`` as ``40``; a JSON user would not expect any of these, so they are refused.
    Non-finite numbers are refused everywhere (``allow_inf_nan=False``), free-form JSON (``run.hparams``) included:
    Python's JSON reads ``Infinity``, ``NaN`` and an overflowing ``1e400`` as floats, and no setting means
    them. Everything else stays lax: a path from a string, a tuple from a list, a float from an int,
    an int from a whole float (``1e6`` is the int 1000000; ``1.5`` is refused), and ``--set`` values parsed as
    JSON (``--set trainer.total_steps=40`` is the int 40).

    >>> class Job(FrozenConfig):
    ...     total_steps: int = 1
    >>> Job.model_validate({"total_steps": True})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for Job
    total_steps
      true must be an int, not a bool; write a number such as 1 ...
    """

    # coerce_numbers_to_str: `--set run.name=123` parses 123 as JSON; a name field should still take it.
    # allow_inf_nan=False: every float field refuses inf and NaN (pydantic's error type "finite_number").
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _strict_scalars(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        errors = []
        for name, field in cls.model_fields.items():
            key = field.alias or name
            if key not in data:
                continue
            # The field itself, and the items of a tuple or list of scalars (``optimizer.betas``).
            for loc, value, annotation in [((key,), data[key], field.annotation), *_items(key, data[key], field)]:
                problem = _lax_scalar(value, _scalar_kinds(annotation))
                if problem is None and _nul_in_path(value, annotation):
                    problem = "holds a NUL character (\\0), which no file path can; write the path without it"
                if problem is not None:
                    # No context is given, so pydantic leaves the braces of a JSON value in the message alone.
                    message = f"{_json(value)} {problem}"
                    errors.append(
                        InitErrorDetails(type=PydanticCustomError("strict_scalar", message), loc=loc, input=value)
                    )
        if errors:  # a ValidationError raised here keeps each field's location (``trainer.total_steps``)
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data


def _items(key: str, value: Any, field: Any) -> list[tuple[tuple[str, int], Any, Any]]:
    """``(loc, item, its annotation)`` for each item of ``value`` when the field is a tuple or list (else none)."""
    annotation = field.annotation
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):  # ``tuple[...] | None``: the container member
        members = [a for a in get_args(annotation) if get_origin(a) in (tuple, list)]
        annotation = members[0] if len(members) == 1 else None
    if get_origin(annotation) not in (tuple, list) or not isinstance(value, list | tuple):
        return []
    args = get_args(annotation)
    if get_origin(annotation) is list or (len(args) == 2 and args[1] is Ellipsis):
        return [((key, index), item, args[0]) for index, item in enumerate(value)]
    return [((key, index), item, args[index]) for index, item in enumerate(value) if index < len(args)]


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _scalar_kinds(annotation: Any) -> set[Any]:
    """The scalar types a field accepts (``Annotated``, unions and ``Optional`` unwrapped); ``object`` for others."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _scalar_kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_scalar_kinds(arg) for arg in get_args(annotation)))
    if origin is Literal:
        return {type(value) for value in get_args(annotation)}
    if annotation in (bool, int, float, str, type(None)):
        return {annotation}
    return {object}  # a model, a path, a container, Any: not a scalar this check knows about


def _nul_in_path(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is a string with a NUL character for a field that takes a path (``os.stat`` would refuse it
    later with "embedded null byte", naming no field)."""
    return isinstance(value, str) and "\0" in value and _takes_path(annotation)


def _takes_path(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (Annotated, Union, types.UnionType):
        return any(_takes_path(arg) for arg in get_args(annotation))
    return isinstance(annotation, type) and issubclass(annotation, PurePath)


def _lax_scalar(value: Any, kinds: set[Any]) -> str | None:
    """Why ``value`` would only be accepted by a lax coercion into ``kinds``, or ``None`` when it is fine."""
    if object in kinds:
        return None
    numbers = kinds & {int, float}
    if isinstance(value, bool) and bool not in kinds and numbers:
        what = "an int" if int in numbers else "a number"
        return f"must be {what}, not a bool; write a number such as 1 (JSON true is not read as 1)"
    if bool in kinds and not isinstance(value, bool) and value is not None and not (kinds - {bool, type(None)}):
        return "must be true or false (a JSON bool), not a number or a string"
    if isinstance(value, str) and numbers and str not in kinds and _is_number(value):
        return "must be a JSON number, not a string; drop the quotes"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
