"""``trainer.pipelining``: the schedule configs, generated from the pure core's registry of schedules.

A schedule is registered once, in ``d9dfn/pipeline/_schedules.py`` (``SCHEDULE_OPTIONS``: its JSON name → a
frozen stdlib dataclass of its options, whose ``program(num_ranks, num_microbatches)`` builds the program). Each
entry becomes a :class:`PipelineScheduleConfig` model here, with the dataclass's fields (their types, defaults
and docstrings) plus the ``schedule`` tag, so the JSON keeps its shape (``{"schedule": "1f1b",
"num_stages_per_rank": 2, "zero_bubble": true}``), every ``FrozenConfig`` rule holds (unknown keys, lax scalars),
and a value the dataclass refuses is reported at its field's path. Nothing here names a schedule but the default.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, create_model, model_validator

from d9dfn.config._base import FrozenConfig
from d9dfn.pipeline import SCHEDULE_OPTIONS, ScheduleOptions

__all__ = ["SCHEDULE_CONFIGS", "AnyPipelineScheduleConfig", "PipelineScheduleConfig", "PipeliningConfig"]


class PipelineScheduleConfig(FrozenConfig):
    """A pipeline schedule's options; one generated subclass per ``d9dfn.pipeline.SCHEDULE_OPTIONS`` entry.

    >>> config = SCHEDULE_CONFIGS["1f1b"](num_stages_per_rank=2, zero_bubble=True)
    >>> config.options()
    Interleaved1F1B(num_stages_per_rank=2, zero_bubble=True)
    """

    schedule: str
    """The schedule's name in ``d9dfn.pipeline.SCHEDULE_OPTIONS``."""

    def options(self) -> ScheduleOptions:
        """The pure core's options value, whose ``program(num_ranks, num_microbatches)`` builds the program."""
        options = SCHEDULE_OPTIONS[self.schedule]
        return options(**{field.name: getattr(self, field.name) for field in dataclasses.fields(options)})

    @model_validator(mode="after")
    def _options_hold_together(self) -> PipelineScheduleConfig:
        self.options()  # each field was checked alone (its path named); this checks them together
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # The generated classes are not module attributes, so pickle (a config sent to a spawned rank) rebuilds
        # the model from its JSON through the registry instead of looking its class up by name.
        return (_rebuild, (self.model_dump(mode="json"),))


def _rebuild(data: dict[str, Any]) -> PipelineScheduleConfig:
    return SCHEDULE_CONFIGS[data["schedule"]].model_validate(data)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls``'s body (what pydantic's ``use_attribute_docstrings``
    reads for a model written in source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _check_alone(options: type[ScheduleOptions], name: str, value: Any) -> Any:
    """``value`` for the field ``name``, once the dataclass accepts it with its other fields at their defaults (a
    ``ValueError`` from its ``__post_init__`` is then reported at this field's path)."""
    options(**{name: value})
    return value


def _schedule_config(name: str, options: type[ScheduleOptions]) -> type[PipelineScheduleConfig]:
    """The config model of the schedule registered as ``name``: ``options``' fields and the ``schedule`` tag."""
    docs = _attribute_docs(options)
    hints = typing.get_type_hints(options)
    fields: dict[str, Any] = {"schedule": (Literal[name], Field(name, description="The schedule kind."))}
    for field in dataclasses.fields(options):
        if field.default is dataclasses.MISSING or field.name not in docs:
            raise TypeError(
                f"SCHEDULE_OPTIONS[{name!r}]: {options.__name__}.{field.name} needs a default and a docstring under "
                f'it, so that {{"schedule": {name!r}}} alone is a valid config and the field is documented'
            )
        check = AfterValidator(functools.partial(_check_alone, options, field.name))
        fields[field.name] = (Annotated[hints[field.name], check], Field(field.default, description=docs[field.name]))
    model: type[PipelineScheduleConfig] = create_model(
        f"{options.__name__}ScheduleConfig",
        __base__=PipelineScheduleConfig,
        __module__=__name__,
        __doc__=options.__doc__,
        **fields,
    )
    return model


SCHEDULE_CONFIGS: Mapping[str, type[PipelineScheduleConfig]] = types.MappingProxyType(
    {name: _schedule_config(name, options) for name, options in SCHEDULE_OPTIONS.items()}
)
"""The config model of every schedule in ``d9dfn.pipeline.SCHEDULE_OPTIONS``, by the same name."""

if TYPE_CHECKING:
    AnyPipelineScheduleConfig = PipelineScheduleConfig
else:
    AnyPipelineScheduleConfig = Annotated[
        functools.reduce(operator.or_, SCHEDULE_CONFIGS.values()), Field(discriminator="schedule")
    ]
"""A pipeline schedule, chosen by ``schedule``."""


class PipeliningConfig(FrozenConfig):
    """Pipeline parallelism; leave the whole section out (``null``) for none."""

    schedule: AnyPipelineScheduleConfig = SCHEDULE_CONFIGS["gpipe"](schedule="gpipe")
    """The pipeline schedule."""
