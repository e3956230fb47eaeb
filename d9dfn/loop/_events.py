"""A typed, synchronous event bus and the catalogue of loop events (26 of d9d's ids: 13 train, 4 sleep, 9 inference).

Events are how code outside the loop (tasks, model providers, user callbacks) hears about the job's
lifecycle: the loop calls :meth:`EventBus.trigger` at fixed points, and every handler subscribed to that
:class:`Event` runs, in registration order, before the loop goes on. Nothing calls back up the stack any
other way (see ``docs/design/events.md``).

An :class:`Event` is a typed key: ``Event[EventStepContext]("train.step.pre")`` carries the type of the
context its handlers receive, so a type checker can match handlers to events. Two events with the same
``id`` are the same key. User code may define its own events with new ids and trigger them on the same bus.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

from d9dfn._types import Schedule, Transform

__all__ = [
    "EVENT_INFERENCE_CONFIGURATION_DATA_LOADER",
    "EVENT_INFERENCE_CONFIGURATION_MODEL_STAGES",
    "EVENT_INFERENCE_CONFIGURATION_START",
    "EVENT_INFERENCE_FINISHED",
    "EVENT_INFERENCE_FORWARD_POST",
    "EVENT_INFERENCE_FORWARD_PRE",
    "EVENT_INFERENCE_READY",
    "EVENT_INFERENCE_STEP_POST",
    "EVENT_INFERENCE_STEP_PRE",
    "EVENT_TRAIN_CONFIGURATION_DATA_LOADER",
    "EVENT_TRAIN_CONFIGURATION_LR_SCHEDULER",
    "EVENT_TRAIN_CONFIGURATION_MODEL_STAGES",
    "EVENT_TRAIN_CONFIGURATION_OPTIMIZER",
    "EVENT_TRAIN_CONFIGURATION_START",
    "EVENT_TRAIN_FINISHED",
    "EVENT_TRAIN_FORWARD_BACKWARD_POST",
    "EVENT_TRAIN_FORWARD_BACKWARD_PRE",
    "EVENT_TRAIN_OPTIMIZER_STEP_POST",
    "EVENT_TRAIN_OPTIMIZER_STEP_PRE",
    "EVENT_TRAIN_READY",
    "EVENT_TRAIN_SLEEP_POST",
    "EVENT_TRAIN_SLEEP_PRE",
    "EVENT_TRAIN_STEP_POST",
    "EVENT_TRAIN_STEP_PRE",
    "EVENT_TRAIN_WAKE_POST",
    "EVENT_TRAIN_WAKE_PRE",
    "INFERENCE_EVENTS",
    "SLEEP_EVENTS",
    "TRAIN_EVENTS",
    "Event",
    "EventBus",
    "EventConfigurationStartedContext",
    "EventDataLoaderReadyContext",
    "EventInferenceFinishedContext",
    "EventInferenceReadyContext",
    "EventLRSchedulerReadyContext",
    "EventModelStagesReadyContext",
    "EventOptimizerReadyContext",
    "EventSleepContext",
    "EventStepContext",
    "EventTrainFinishedContext",
    "EventTrainReadyContext",
    "Handler",
    "subscribe",
    "subscribe_annotated",
]

TContext = TypeVar("TContext")

Handler = Callable[[Any], None]
"""A subscriber: called with the event's context; its return value is ignored."""

_MARK = "__d9dfn_subscriptions__"


@dataclasses.dataclass(frozen=True)
class Event(Generic[TContext]):
    """A named, typed event; the object is the bus's dict key, equal to any event with the same ``id``.

    >>> Event[int]("my.event") == Event("my.event")
    True
    """

    id: str
    """A dotted name, unique per meaning (``"train.step.pre"``); user events pick their own."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise TypeError(f"Event: id must be a non-empty str such as 'my_project.eval.done', got {self.id!r}")


def _handler_name(handler: Handler) -> str:
    return getattr(handler, "__qualname__", None) or repr(handler)


class EventBus:
    """Delivers each triggered event to its handlers, synchronously, in registration order, fail-fast.

    A handler's exception stops the delivery (later handlers of that event do not run) and propagates to
    the caller of :meth:`trigger` with a note naming the event id and the handler.

    >>> bus = EventBus()
    >>> seen = []
    >>> bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: seen.append(ctx.step))
    >>> bus.trigger(EVENT_TRAIN_STEP_PRE, EventStepContext(step=1, total_steps=3))
    >>> seen
    [1]
    """

    def __init__(self) -> None:
        self._handlers: dict[Event[Any], list[Handler]] = {}

    def subscribe(self, event: Event[TContext], handler: Callable[[TContext], None]) -> None:
        """Add ``handler`` to ``event``'s handlers; it runs after those subscribed before it.

        Subscribing the same handler twice makes it run twice.

        Raises:
            TypeError: ``event`` is not an :class:`Event` or ``handler`` is not callable.
        """
        if not isinstance(event, Event):
            raise TypeError(
                f"EventBus.subscribe: expected an Event as the first argument, got {type(event).__name__}; "
                f"pass one of the EVENT_* constants or Event[YourContext]('your.id')"
            )
        if not callable(handler):
            raise TypeError(
                f"EventBus.subscribe: handler for {event.id!r} must be callable, got {type(handler).__name__}"
            )
        self._handlers.setdefault(event, []).append(handler)

    def handlers(self, event: Event[Any]) -> tuple[Handler, ...]:
        """The handlers of ``event``, in the order they will run."""
        return tuple(self._handlers.get(event, ()))

    def trigger(self, event: Event[TContext], ctx: TContext) -> None:
        """Call every handler of ``event`` with ``ctx``, in registration order; stop at the first error.

        Handlers subscribed while the event is being delivered run from the next trigger on.

        Raises:
            Exception: whatever a handler raised, with a note naming the event id and the handler.
        """
        for handler in tuple(self._handlers.get(event, ())):
            try:
                handler(ctx)
            except Exception as error:
                error.add_note(f"while handling event {event.id!r} in handler {_handler_name(handler)}")
                raise

    @contextlib.contextmanager
    def bounded(self, pre: Event[TContext], post: Event[TContext], ctx: TContext) -> Iterator[None]:
        """Trigger ``pre``, run the block, then trigger ``post`` — only if the block completed.

        If the block raises, ``post`` does **not** fire and the error propagates unchanged: a post event
        means "this phase finished", and its handlers may rely on that (read the updated state, log the
        step). Cleanup that must run on failure belongs in a ``try/finally`` or context manager around the
        loop, not in a post handler. If a ``pre`` handler raises, the block does not run.

        >>> bus, seen = EventBus(), []
        >>> bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: seen.append("post"))
        >>> with bus.bounded(EVENT_TRAIN_STEP_PRE, EVENT_TRAIN_STEP_POST, EventStepContext(step=1, total_steps=1)):
        ...     seen.append("body")
        >>> seen
        ['body', 'post']
        """
        self.trigger(pre, ctx)
        yield  # an exception from the block propagates from here, skipping `post`
        self.trigger(post, ctx)


def subscribe(event: Event[Any]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a method as a handler of ``event``; :func:`subscribe_annotated` registers marked methods.

    The method is returned unchanged (it can still be called directly). Stacking the decorator
    subscribes one method to several events.

    Raises:
        TypeError: ``event`` is not an :class:`Event` (e.g. ``@subscribe`` was used without an argument).
    """
    if not isinstance(event, Event):
        raise TypeError(
            f"subscribe: expected an Event, got {type(event).__name__}; write @subscribe(EVENT_TRAIN_STEP_POST), "
            f"not @subscribe"
        )

    def mark(method: Callable[..., None]) -> Callable[..., None]:
        target = method.__func__ if isinstance(method, (staticmethod, classmethod)) else method
        events = (*getattr(target, _MARK, ()), event)
        setattr(target, _MARK, events)
        return method

    return mark


def subscribe_annotated(bus: EventBus, obj: object) -> int:
    """Subscribe every ``@subscribe``-marked method of ``obj`` (bound to ``obj``) to ``bus``.

    Methods register in definition order, base classes first; a method overridden in a subclass counts
    once, with the subclass's marks (an unmarked override is not subscribed). A method marked for several
    events registers for each, in the order the decorators were applied (innermost first).

    Returns:
        The number of (event, handler) subscriptions made.

    >>> class Printer:
    ...     @subscribe(EVENT_TRAIN_FINISHED)
    ...     def done(self, ctx):
    ...         print("finished")
    >>> bus = EventBus()
    >>> subscribe_annotated(bus, Printer())
    1
    >>> bus.trigger(EVENT_TRAIN_FINISHED, EventTrainFinishedContext())
    finished
    """
    names: dict[str, None] = {}
    for cls in reversed(type(obj).__mro__):
        names.update(dict.fromkeys(vars(cls)))
    count = 0
    for name in names:
        attr = inspect.getattr_static(obj, name)
        target = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        for event in getattr(target, _MARK, ()) if callable(target) else ():
            bus.subscribe(event, getattr(obj, name))
            count += 1
    return count


# --- Contexts. Frozen, so a handler cannot change what the next handler sees. ---


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventConfigurationStartedContext:
    """Configuration began: the process group, seeds and timeouts are set; tasks and providers registered."""

    config: Any
    """The validated job config (``TrainerConfig`` or ``InferenceConfig``)."""
    mesh: Any
    """The ``DeviceMeshParameters`` the job runs with (one process: all degrees 1)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventDataLoaderReadyContext:
    """The data iterator is built (its position is part of the checkpoint)."""

    data_loader: Any
    """The loop's stateful data iterator over (per-rank) batches."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventModelStagesReadyContext:
    """The model is materialized (and parallelized, and loaded from ``source_checkpoint`` if configured)."""

    modules: tuple[torch.nn.Module, ...]
    """The local pipeline stages' modules (one without pipelining); their params also live in the state."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventOptimizerReadyContext:
    """The optimizer transform is built."""

    optimizer: Transform
    """The ``Transform(init, update)`` the step applies."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventLRSchedulerReadyContext:
    """The learning-rate schedule is built (fires right after the optimizer event)."""

    lr_schedule: Schedule
    """The learning-rate multiplier the LR provider returned (a pure function of a 0-d step tensor); the rate
    each update used is in the optimizer state (``d9dfn.optim.learning_rate``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventTrainReadyContext:
    """The checkpoint (if any) is loaded and the loop's contexts entered; the first step is next."""

    run: Any
    """The ``Tracker`` (``d9dfn.loop``) that receives this job's metric records."""
    step: int
    """Optimizer steps already completed (non-zero after a resume)."""
    total_steps: int
    """Optimizer steps in the whole job."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventStepContext:
    """Where the loop is, for the per-step events (``*.step.*``, ``*.forward_backward.*``, ``*.forward.*``...)."""

    step: int
    """The 1-based position of the current optimizer (or inference) step, as in ``should_do_action``."""
    total_steps: int
    """Steps in the whole job."""
    state: Any = None
    """The train state as of this event (before the step on ``pre``, after it on ``post``), if attached. The loop's
    step is donating (``make_train_step(donate=True)``): a ``pre`` event's state is consumed by the step, so read its
    params and optimizer state during the event, not after the step (they then raise)."""
    output: Any = None
    """The step's outputs (loss, grad norm, learning rate...) on ``post`` events, if attached; else ``None``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventSleepContext:
    """``Trainer.sleep`` / ``wake`` (d9d's ``EventSleepContext``): what is released or restored, and when."""

    tags: frozenset[str]
    """What sleeps or wakes (``d9dfn.loop.SleepTag`` values: ``tensor_states``)."""
    step: int | None = None
    """Optimizer steps completed when it happened (``None`` before the run's state exists)."""
    num_bytes: int | None = None
    """Bytes moved, on ``post`` events (``None`` on ``pre``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventTrainFinishedContext:
    """Training ended: ``task.finalize()`` ran (also when the job was already fully trained)."""

    state: Any = None
    """The final train state, if attached."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventInferenceReadyContext:
    """Inference is configured and the checkpoint loaded; the first step is next."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventInferenceFinishedContext:
    """Inference ended: ``task.finalize()`` ran."""


# --- The catalogue. ---

EVENT_TRAIN_CONFIGURATION_START = Event[EventConfigurationStartedContext]("train.configuration.start")
"""Configuration began (after distributed setup, seeds, timeouts, task creation and event registration)."""
EVENT_TRAIN_CONFIGURATION_DATA_LOADER = Event[EventDataLoaderReadyContext]("train.configuration.data_loader")
"""The data iterator is built."""
EVENT_TRAIN_CONFIGURATION_MODEL_STAGES = Event[EventModelStagesReadyContext]("train.configuration.model_stages")
"""The model stages are materialized, parallelized and loaded."""
EVENT_TRAIN_CONFIGURATION_OPTIMIZER = Event[EventOptimizerReadyContext]("train.configuration.optimizer")
"""The optimizer transform is built."""
EVENT_TRAIN_CONFIGURATION_LR_SCHEDULER = Event[EventLRSchedulerReadyContext]("train.configuration.lr_scheduler")
"""The learning-rate schedule is built."""
EVENT_TRAIN_READY = Event[EventTrainReadyContext]("train.ready")
"""The checkpoint is loaded and the loop is about to run its first step."""
EVENT_TRAIN_STEP_PRE = Event[EventStepContext]("train.step.pre")
"""An optimizer step starts."""
EVENT_TRAIN_STEP_POST = Event[EventStepContext]("train.step.post")
"""An optimizer step ended (before the step counter moves on and the checkpoint check)."""
EVENT_TRAIN_FORWARD_BACKWARD_PRE = Event[EventStepContext]("train.forward_backward.pre")
"""The forward and backward passes over all microbatches of the step start."""
EVENT_TRAIN_FORWARD_BACKWARD_POST = Event[EventStepContext]("train.forward_backward.post")
"""The forward and backward passes over all microbatches of the step ended."""
EVENT_TRAIN_OPTIMIZER_STEP_PRE = Event[EventStepContext]("train.optimizer_step.pre")
"""Gradients are reduced, scaled and clipped; the optimizer update is next."""
EVENT_TRAIN_OPTIMIZER_STEP_POST = Event[EventStepContext]("train.optimizer_step.post")
"""The optimizer update is applied."""
EVENT_TRAIN_FINISHED = Event[EventTrainFinishedContext]("train.finished")
"""Training ended, after ``task.finalize()``."""
EVENT_TRAIN_SLEEP_PRE = Event[EventSleepContext]("train.sleep.pre")
"""``Trainer.sleep()`` is about to move the run's tensors to host memory."""
EVENT_TRAIN_SLEEP_POST = Event[EventSleepContext]("train.sleep.post")
"""The run's tensors are in host memory (on a GPU, the device memory is given back)."""
EVENT_TRAIN_WAKE_PRE = Event[EventSleepContext]("train.wake.pre")
"""``Trainer.wake()`` is about to bring the run's tensors back to the device."""
EVENT_TRAIN_WAKE_POST = Event[EventSleepContext]("train.wake.post")
"""The run's tensors are back on the device; the next step runs without a recompile."""

EVENT_INFERENCE_CONFIGURATION_START = Event[EventConfigurationStartedContext]("inference.configuration.start")
"""Inference configuration began."""
EVENT_INFERENCE_CONFIGURATION_DATA_LOADER = Event[EventDataLoaderReadyContext]("inference.configuration.data_loader")
"""The inference data iterator is built."""
EVENT_INFERENCE_CONFIGURATION_MODEL_STAGES = Event[EventModelStagesReadyContext]("inference.configuration.model_stages")
"""The inference model stages are materialized and loaded."""
EVENT_INFERENCE_READY = Event[EventInferenceReadyContext]("inference.ready")
"""Inference is about to run its first step."""
EVENT_INFERENCE_STEP_PRE = Event[EventStepContext]("inference.step.pre")
"""An inference step starts."""
EVENT_INFERENCE_STEP_POST = Event[EventStepContext]("inference.step.post")
"""An inference step ended."""
EVENT_INFERENCE_FORWARD_PRE = Event[EventStepContext]("inference.forward.pre")
"""The forward passes over all microbatches of the step start."""
EVENT_INFERENCE_FORWARD_POST = Event[EventStepContext]("inference.forward.post")
"""The forward passes over all microbatches of the step ended."""
EVENT_INFERENCE_FINISHED = Event[EventInferenceFinishedContext]("inference.finished")
"""Inference ended, after ``task.finalize()``."""

TRAIN_EVENTS: tuple[Event[Any], ...] = (
    EVENT_TRAIN_CONFIGURATION_START,
    EVENT_TRAIN_CONFIGURATION_DATA_LOADER,
    EVENT_TRAIN_CONFIGURATION_MODEL_STAGES,
    EVENT_TRAIN_CONFIGURATION_OPTIMIZER,
    EVENT_TRAIN_CONFIGURATION_LR_SCHEDULER,
    EVENT_TRAIN_READY,
    EVENT_TRAIN_STEP_PRE,
    EVENT_TRAIN_STEP_POST,
    EVENT_TRAIN_FORWARD_BACKWARD_PRE,
    EVENT_TRAIN_FORWARD_BACKWARD_POST,
    EVENT_TRAIN_OPTIMIZER_STEP_PRE,
    EVENT_TRAIN_OPTIMIZER_STEP_POST,
    EVENT_TRAIN_FINISHED,
)
"""The 13 built-in training events (each fires in every training run)."""

INFERENCE_EVENTS: tuple[Event[Any], ...] = (
    EVENT_INFERENCE_CONFIGURATION_START,
    EVENT_INFERENCE_CONFIGURATION_DATA_LOADER,
    EVENT_INFERENCE_CONFIGURATION_MODEL_STAGES,
    EVENT_INFERENCE_READY,
    EVENT_INFERENCE_STEP_PRE,
    EVENT_INFERENCE_STEP_POST,
    EVENT_INFERENCE_FORWARD_PRE,
    EVENT_INFERENCE_FORWARD_POST,
    EVENT_INFERENCE_FINISHED,
)
"""The 9 built-in inference events (each fires in every inference run)."""

SLEEP_EVENTS: tuple[Event[Any], ...] = (
    EVENT_TRAIN_SLEEP_PRE,
    EVENT_TRAIN_SLEEP_POST,
    EVENT_TRAIN_WAKE_PRE,
    EVENT_TRAIN_WAKE_POST,
)
"""d9d's 4 sleep/wake events: fired by ``Trainer.sleep()`` and ``wake()`` only, so not in every run."""
