"""Tests for d9dfn.loop._events: the event bus, @subscribe, and the catalogue of loop events."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_train import tiny_job

from d9dfn.config import DeviceMeshParameters, InferenceCheckpointingConfig, InferenceConfig
from d9dfn.jobs import CorpusProvider, Qwen3Provider
from d9dfn.loop import (
    EVENT_INFERENCE_FINISHED,
    EVENT_TRAIN_FINISHED,
    EVENT_TRAIN_OPTIMIZER_STEP_POST,
    EVENT_TRAIN_STEP_POST,
    EVENT_TRAIN_STEP_PRE,
    INFERENCE_EVENTS,
    SLEEP_EVENTS,
    TRAIN_EVENTS,
    Event,
    EventBus,
    EventStepContext,
    EventTrainFinishedContext,
    InferenceConfigurator,
    TrainingConfigurator,
    subscribe,
    subscribe_annotated,
)
from d9dfn.loop import _events as events
from d9dfn.tasks import CausalLMTask, PerplexityTask

CTX = EventStepContext(step=1, total_steps=3)


def test_trigger_calls_handlers_in_registration_order() -> None:
    bus, calls = EventBus(), []
    for name in "abc":
        bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx, name=name: calls.append((name, ctx.step)))
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert calls == [("a", 1), ("b", 1), ("c", 1)]


def test_trigger_without_handlers_does_nothing() -> None:
    EventBus().trigger(EVENT_TRAIN_STEP_PRE, CTX)


def test_trigger_only_reaches_the_triggered_event() -> None:
    bus, calls = EventBus(), []
    bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: calls.append("pre"))
    bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: calls.append("post"))
    bus.trigger(EVENT_TRAIN_STEP_POST, CTX)
    assert calls == ["post"]


def test_trigger_fails_fast_and_names_the_event_and_handler() -> None:
    bus, calls = EventBus(), []

    def broken(ctx: EventStepContext) -> None:
        raise RuntimeError("disk full")

    bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: calls.append("first"))
    bus.subscribe(EVENT_TRAIN_STEP_PRE, broken)
    bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: calls.append("third"))
    with pytest.raises(RuntimeError, match="disk full") as info:
        bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert calls == ["first"]
    assert any("'train.step.pre'" in note and "broken" in note for note in info.value.__notes__)


def test_subscribe_same_handler_twice_runs_twice() -> None:
    bus, calls = EventBus(), []

    def handler(ctx: Any) -> None:
        calls.append(ctx.step)

    bus.subscribe(EVENT_TRAIN_STEP_PRE, handler)
    bus.subscribe(EVENT_TRAIN_STEP_PRE, handler)
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert calls == [1, 1]
    assert bus.handlers(EVENT_TRAIN_STEP_PRE) == (handler, handler)


def test_trigger_handler_subscribed_during_delivery_runs_next_time() -> None:
    bus, calls = EventBus(), []

    def late(ctx: Any) -> None:
        calls.append("late")

    def first(ctx: Any) -> None:
        calls.append("first")
        bus.subscribe(EVENT_TRAIN_STEP_PRE, late)

    bus.subscribe(EVENT_TRAIN_STEP_PRE, first)
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert calls == ["first"]
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert calls == ["first", "first", "late"]


def test_subscribe_rejects_non_events_and_non_callables() -> None:
    bus = EventBus()
    with pytest.raises(TypeError, match=r"EventBus.subscribe: expected an Event .* got str"):
        bus.subscribe("train.step.pre", print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"handler for 'train.step.pre' must be callable, got int"):
        bus.subscribe(EVENT_TRAIN_STEP_PRE, 3)  # type: ignore[arg-type]


def test_bounded_fires_pre_body_post_in_order() -> None:
    bus, calls = EventBus(), []
    bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: calls.append("pre"))
    bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: calls.append("post"))
    with bus.bounded(EVENT_TRAIN_STEP_PRE, EVENT_TRAIN_STEP_POST, CTX):
        calls.append("body")
    assert calls == ["pre", "body", "post"]


def _run_bounded(bus: EventBus, body: Any) -> None:
    with bus.bounded(EVENT_TRAIN_STEP_PRE, EVENT_TRAIN_STEP_POST, CTX):
        body()


def test_bounded_skips_post_when_the_block_raises() -> None:
    bus, calls = EventBus(), []
    bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: calls.append("pre"))
    bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: calls.append("post"))
    error = ValueError("loss is NaN")

    def body() -> None:
        calls.append("body")
        raise error

    with pytest.raises(ValueError, match="loss is NaN") as info:
        _run_bounded(bus, body)
    assert calls == ["pre", "body"]
    assert info.value is error
    assert not getattr(error, "__notes__", [])  # the block's own error passes through untouched


def test_bounded_skips_the_block_when_pre_raises() -> None:
    bus, calls = EventBus(), []

    def refuse(ctx: Any) -> None:
        raise RuntimeError("not ready")

    bus.subscribe(EVENT_TRAIN_STEP_PRE, refuse)
    bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: calls.append("post"))
    with pytest.raises(RuntimeError, match="not ready"):
        _run_bounded(bus, lambda: calls.append("body"))
    assert calls == []


def test_bounded_post_handler_error_propagates_after_the_block() -> None:
    bus, calls = EventBus(), []

    def fail(ctx: Any) -> None:
        raise RuntimeError("post failed")

    bus.subscribe(EVENT_TRAIN_STEP_POST, fail)
    with pytest.raises(RuntimeError, match="post failed") as info:
        _run_bounded(bus, lambda: calls.append("body"))
    assert calls == ["body"]
    assert any("'train.step.post'" in note for note in info.value.__notes__)


class _Base:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @subscribe(EVENT_TRAIN_STEP_PRE)
    def on_pre(self, ctx: EventStepContext) -> None:
        self.calls.append(f"base.pre{ctx.step}")

    @subscribe(EVENT_TRAIN_STEP_POST)
    def on_post(self, ctx: EventStepContext) -> None:
        self.calls.append("base.post")

    def not_a_handler(self, ctx: Any) -> None:
        self.calls.append("never")


class _Child(_Base):
    @subscribe(EVENT_TRAIN_STEP_POST)
    @subscribe(EVENT_TRAIN_STEP_PRE)
    def both(self, ctx: EventStepContext) -> None:
        self.calls.append("child.both")

    def on_post(self, ctx: EventStepContext) -> None:  # an unmarked override is not a handler
        self.calls.append("child.post")

    @subscribe(EVENT_TRAIN_FINISHED)
    @staticmethod
    def finished(ctx: EventTrainFinishedContext) -> None:
        _FINISHED.append("static")


_FINISHED: list[str] = []


def test_subscribe_annotated_registers_marked_methods_bound_to_the_object() -> None:
    bus, obj = EventBus(), _Base()
    assert subscribe_annotated(bus, obj) == 2
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    bus.trigger(EVENT_TRAIN_STEP_POST, CTX)
    assert obj.calls == ["base.pre1", "base.post"]


def test_subscribe_annotated_follows_overrides_and_stacked_marks() -> None:
    bus, obj = EventBus(), _Child()
    _FINISHED.clear()
    assert subscribe_annotated(bus, obj) == 4  # on_pre, both x2, finished; on_post's override is unmarked
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    bus.trigger(EVENT_TRAIN_STEP_POST, CTX)
    bus.trigger(EVENT_TRAIN_FINISHED, EventTrainFinishedContext())
    assert obj.calls == ["base.pre1", "child.both", "child.both"]
    assert _FINISHED == ["static"]


def test_subscribe_annotated_keeps_two_objects_apart() -> None:
    bus, first, second = EventBus(), _Base(), _Base()
    subscribe_annotated(bus, first)
    subscribe_annotated(bus, second)
    bus.trigger(EVENT_TRAIN_STEP_PRE, CTX)
    assert first.calls == ["base.pre1"]
    assert second.calls == ["base.pre1"]


def test_subscribe_decorator_leaves_the_method_callable() -> None:
    obj = _Base()
    obj.on_pre(EventStepContext(step=2, total_steps=2))
    assert obj.calls == ["base.pre2"]


def test_subscribe_decorator_without_event_fails_clearly() -> None:
    with pytest.raises(TypeError, match=r"write @subscribe\(EVENT_TRAIN_STEP_POST\), not @subscribe"):

        @subscribe  # type: ignore[arg-type]
        def handler(ctx: Any) -> None:
            pass


def test_user_defined_event_works_and_equals_by_id() -> None:
    @dataclasses.dataclass(frozen=True)
    class EvalDone:
        accuracy: float

    eval_done = Event[EvalDone]("my_project.eval.done")
    bus, seen = EventBus(), []
    bus.subscribe(eval_done, lambda ctx: seen.append(ctx.accuracy))
    bus.trigger(Event("my_project.eval.done"), EvalDone(0.5))
    assert seen == [0.5]
    assert hash(eval_done) == hash(Event("my_project.eval.done"))
    assert eval_done != EVENT_TRAIN_STEP_PRE


@pytest.mark.parametrize("bad", ["", 3, None])
def test_event_rejects_bad_ids(bad: Any) -> None:
    with pytest.raises(TypeError, match="Event: id must be a non-empty str"):
        Event(bad)


def test_event_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EVENT_TRAIN_STEP_PRE.id = "x"  # type: ignore[misc]


def test_catalogue_has_d9d_ids_13_train_and_9_inference() -> None:
    assert len(TRAIN_EVENTS) == 13
    assert len(INFERENCE_EVENTS) == 9
    ids = [e.id for e in TRAIN_EVENTS + INFERENCE_EVENTS]
    assert len(set(ids)) == 22
    assert all(i.startswith("train.") for i in ids[:13])
    assert all(i.startswith("inference.") for i in ids[13:])
    assert {
        "train.configuration.start",
        "train.configuration.data_loader",
        "train.configuration.model_stages",
        "train.configuration.optimizer",
        "train.configuration.lr_scheduler",
        "train.ready",
        "train.step.pre",
        "train.step.post",
        "train.forward_backward.pre",
        "train.forward_backward.post",
        "train.optimizer_step.pre",
        "train.optimizer_step.post",
        "train.finished",
        "inference.configuration.start",
        "inference.configuration.data_loader",
        "inference.configuration.model_stages",
        "inference.ready",
        "inference.step.pre",
        "inference.step.post",
        "inference.forward.pre",
        "inference.forward.post",
        "inference.finished",
    } == set(ids)


def test_catalogue_constant_names_follow_their_ids() -> None:
    constants = {name: value for name, value in vars(events).items() if name.startswith("EVENT_")}
    assert len(constants) == 26
    for name, event in constants.items():
        assert name == "EVENT_" + event.id.upper().replace(".", "_")
    assert set(constants.values()) == set(TRAIN_EVENTS + SLEEP_EVENTS + INFERENCE_EVENTS)


def test_contexts_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CTX.step = 2  # type: ignore[misc]
    context_classes = [
        obj for name, obj in vars(events).items() if name.startswith("Event") and name.endswith("Context")
    ]
    assert len(context_classes) == 11
    assert all(dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen for cls in context_classes)


_KNOWN = (EVENT_TRAIN_STEP_PRE, EVENT_TRAIN_STEP_POST, EVENT_TRAIN_OPTIMIZER_STEP_POST, EVENT_INFERENCE_FINISHED)
_actions = st.lists(
    st.one_of(
        st.tuples(st.just("subscribe"), st.integers(0, 3), st.integers(0, 99)),
        st.tuples(st.just("trigger"), st.integers(0, 3), st.integers(0, 99)),
    ),
    max_size=30,
)


@given(actions=_actions)
def test_event_bus_matches_a_reference_model(actions: list[tuple[str, int, int]]) -> None:
    bus, got = EventBus(), []
    model: dict[int, list[int]] = {}
    expected = []
    for kind, index, value in actions:
        if kind == "subscribe":
            bus.subscribe(_KNOWN[index], lambda ctx, tag=value: got.append((tag, ctx)))
            model.setdefault(index, []).append(value)
        else:
            bus.trigger(_KNOWN[index], value)
            expected.extend((tag, value) for tag in model.get(index, []))
    assert got == expected


class _RecordingTrainTask(CausalLMTask):
    def __init__(self, seen: set[str]) -> None:
        super().__init__()
        self.seen = seen

    def register_events(self, bus: EventBus) -> None:
        for event in TRAIN_EVENTS:
            bus.subscribe(event, lambda ctx, event=event: self.seen.add(event.id))


class _RecordingInferenceTask(PerplexityTask):
    def __init__(self, seen: set[str]) -> None:
        super().__init__()
        self.seen = seen

    def register_events(self, bus: EventBus) -> None:
        for event in INFERENCE_EVENTS:
            bus.subscribe(event, lambda ctx, event=event: self.seen.add(event.id))


def test_every_catalogued_event_fires_in_a_tiny_job(tmp_path) -> None:
    job = tiny_job(tmp_path, "trainer.total_steps=2")
    model_provider = Qwen3Provider(job.model.to_qwen3(job.data.seq_len))
    trained: set[str] = set()
    TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=lambda: _RecordingTrainTask(trained),
        model_provider=model_provider,
        data_provider=CorpusProvider(job.data),
    ).configure().train()
    inferred: set[str] = set()
    InferenceConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=InferenceConfig(
            batching=job.trainer.batching,
            checkpointing=InferenceCheckpointingConfig(load_dir=job.trainer.run_dir),
            compile=False,
        ),
        task_provider=lambda: _RecordingInferenceTask(inferred),
        model_provider=model_provider,
        data_provider=CorpusProvider(job.data),
        max_batches=2,
    ).configure().infer()
    assert trained == {event.id for event in TRAIN_EVENTS}
    assert inferred == {event.id for event in INFERENCE_EVENTS}


def test_loop_public_names_resolve() -> None:
    import d9dfn.loop as loop

    assert len(loop.__all__) == len(set(loop.__all__))
    for name in loop.__all__:
        assert getattr(loop, name) is not None, name
