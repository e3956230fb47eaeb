"""``Trainer.sleep()`` / ``wake()`` (d9d's DEP-0006): the run's tensors to host memory and back, in place; the loss
sequence with a sleep/wake between steps is bitwise that of a run without; no recompile after wake; refused mid-step.

On a CPU the "host" is the same memory: a sleep copies every storage and releases the old one (the tests see the
addresses change and the values and identities stay). The freed GPU memory is measured by the ``cuda`` test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import tiny_job

from d9dfn.config import DeviceMeshParameters
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider
from d9dfn.loop import (
    EVENT_TRAIN_FORWARD_BACKWARD_POST,
    EVENT_TRAIN_SLEEP_POST,
    EVENT_TRAIN_SLEEP_PRE,
    EVENT_TRAIN_STEP_POST,
    EVENT_TRAIN_STEP_PRE,
    EVENT_TRAIN_WAKE_POST,
    EVENT_TRAIN_WAKE_PRE,
    SLEEP_EVENTS,
    Trainer,
    TrainingConfigurator,
)
from d9dfn.loop._sleep import offload, onload
from d9dfn.tasks import CausalLMTask

STEPS = ("trainer.total_steps=5", "trainer.checkpointing.period_steps=5")


def _trainer(job: LMJobConfig) -> Trainer:
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len), job.model.family),
        data_provider=CorpusProvider(job.data),
    ).configure()


def _losses(trainer: Trainer) -> list[float]:
    losses: list[float] = []
    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: losses.append(float(ctx.output.loss)))
    return losses


def test_offload_and_onload_keep_identity_values_and_aliasing_and_move_the_storage():
    base = torch.randn(4, 3)
    view, other = base[1:3], torch.arange(5)
    before = {name: t.clone() for name, t in (("base", base), ("view", view), ("other", other))}
    pointers = (base.untyped_storage().data_ptr(), other.untyped_storage().data_ptr())
    record = offload([base, view, other, base], torch.device("cpu"), pin_memory=False)
    assert len(record.storages) == 2  # base and its view share one
    assert record.num_bytes == 4 * 3 * 4 + 5 * 8
    assert (base.untyped_storage().data_ptr(), other.untyped_storage().data_ptr()) != pointers  # released and copied
    onload(record)
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # still one storage
    assert view.storage_offset() == 3
    for name, tensor in (("base", base), ("view", view), ("other", other)):
        assert torch.equal(tensor, before[name]), name
    base[1, 0] = 100.0  # aliasing kept: the view sees a write to its base
    assert float(view[0, 0]) == 100.0


def test_sleep_wake_between_steps_gives_the_same_losses_bit_for_bit_and_fires_the_events(tmp_path):
    plain = _trainer(tiny_job(tmp_path / "plain", *STEPS))
    expected = _losses(plain)
    plain.train()

    trainer = _trainer(tiny_job(tmp_path / "slept", *STEPS))
    losses = _losses(trainer)
    fired: list[tuple[str, int | None, int | None]] = []
    for event in SLEEP_EVENTS:
        trainer.bus.subscribe(event, lambda ctx, event=event: fired.append((event.id, ctx.step, ctx.num_bytes)))
    moved: dict[str, bool] = {}

    def sleep_and_wake(ctx) -> None:
        if ctx.step != 2:
            return
        params = trainer._state.params
        name = next(iter(params))
        tensor, value, pointer = params[name], params[name].clone(), params[name].untyped_storage().data_ptr()
        trainer.sleep()
        assert trainer.is_sleeping()
        moved["storage"] = tensor.untyped_storage().data_ptr() != pointer
        trainer.sleep()  # asleep already: nothing happens
        trainer.wake()
        assert not trainer.is_sleeping()
        moved["same object, same values"] = trainer._state.params[name] is tensor and torch.equal(tensor, value)

    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, sleep_and_wake)
    trainer.train()
    assert losses == expected  # bitwise: floats compared exactly
    assert len(losses) == 5
    assert moved == {"storage": True, "same object, same values": True}
    assert [event for event, _, _ in fired] == [
        EVENT_TRAIN_SLEEP_PRE.id,
        EVENT_TRAIN_SLEEP_POST.id,
        EVENT_TRAIN_WAKE_PRE.id,
        EVENT_TRAIN_WAKE_POST.id,
    ]
    assert all(step == 2 for _, step, _ in fired)
    num_bytes = fired[1][2]
    assert num_bytes is not None
    assert num_bytes > 0
    assert fired[0][2] is None
    assert fired[3][2] == num_bytes


def test_sleep_is_refused_mid_step_and_before_the_run_and_a_step_does_not_run_asleep(tmp_path):
    trainer = _trainer(tiny_job(tmp_path / "mid", *STEPS))
    with pytest.raises(RuntimeError, match=r"Trainer.sleep: the run has no state yet \(train\(\) has not started\)"):
        trainer.sleep()
    trainer.bus.subscribe(EVENT_TRAIN_FORWARD_BACKWARD_POST, lambda ctx: trainer.sleep())
    with pytest.raises(RuntimeError, match=r"Trainer.sleep: called during step 1 .* sleep between steps"):
        trainer.train()

    asleep = _trainer(tiny_job(tmp_path / "asleep", *STEPS))
    asleep.bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: asleep.sleep() if ctx.step == 1 else None)
    with pytest.raises(RuntimeError, match=r"step 2 would run while the trainer sleeps .* call Trainer.wake\(\)"):
        asleep.train()
    with pytest.raises(ValueError, match=r"tag 'comms' .* is not implemented"):
        asleep.sleep({"comms"})
    with pytest.raises(ValueError, match=r"tags=\['naps'\]; pass d9dfn.loop.SleepTag values"):
        asleep.wake({"naps"})


def test_wake_in_the_next_step_pre_handler_lets_the_run_go_on(tmp_path):
    trainer = _trainer(tiny_job(tmp_path, *STEPS))
    losses = _losses(trainer)
    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, lambda ctx: trainer.sleep() if ctx.step == 3 else None)
    trainer.bus.subscribe(EVENT_TRAIN_STEP_PRE, lambda ctx: trainer.wake())
    trainer.train()
    assert len(losses) == 5


@pytest.mark.compiled
def test_compiled_step_after_wake_does_not_recompile_and_matches_a_run_without_sleep(tmp_path):
    compiled = (*STEPS, "trainer.compile=true")
    plain = _trainer(tiny_job(tmp_path / "plain", *compiled))
    expected = _losses(plain)
    plain.train()

    trainer = _trainer(tiny_job(tmp_path / "slept", *compiled))
    losses = _losses(trainer)
    stance: list[object] = []

    def sleep_and_wake(ctx) -> None:
        if ctx.step == 2:  # steps 1 and 2 compiled what the run needs; from here on a recompile fails the step
            trainer.sleep()
            trainer.wake()
            stance.append(torch.compiler.set_stance("fail_on_recompile"))

    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, sleep_and_wake)
    try:
        trainer.train()
    finally:
        torch.compiler.set_stance("default")
    assert stance  # the stance was set, and steps 3..5 ran under it
    assert losses == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_sleep_frees_the_device_memory_and_wake_restores_it(tmp_path: Path, capsys):
    trainer = _trainer(tiny_job(tmp_path, *STEPS, "trainer.run.device=cuda", "model.hidden_size=256"))
    measured: dict[str, int] = {}

    def sleep_and_wake(ctx) -> None:
        if ctx.step == 2:
            torch.cuda.synchronize()
            measured["awake"] = torch.cuda.memory_allocated()
            trainer.sleep()
            measured["asleep"] = torch.cuda.memory_allocated()
            measured["reserved_asleep"] = torch.cuda.memory_reserved()
            measured["moved"] = trainer._asleep.num_bytes
            trainer.wake()
            measured["woken"] = torch.cuda.memory_allocated()

    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, sleep_and_wake)
    trainer.train()
    with capsys.disabled():
        print(f"\nsleep/wake on {torch.cuda.get_device_name()}: {measured}")
    assert measured["awake"] - measured["asleep"] >= 0.9 * measured["moved"]
    assert measured["woken"] >= measured["asleep"] + 0.9 * measured["moved"]


class _Wrapped(torch.Tensor):
    """A tensor subclass that is no wrapper of plain tensors (no ``__tensor_flatten__``)."""


def test_offload_refuses_a_tensor_subclass_it_cannot_move_in_one_line():
    odd = torch.zeros(2).as_subclass(_Wrapped)
    with pytest.raises(ValueError, match=r"offload: a _Wrapped is neither a plain tensor nor a wrapper"):
        offload([odd], torch.device("cpu"), pin_memory=False)


def _sharded_sleep_worker(rank: int, world_size: int, init_file: str, save_dir: str) -> None:
    """Each rank: a run sharded over 2 ranks (params and moments are DTensors) with a sleep/wake after step 2 and the
    same run without; the losses bitwise, the DTensors the same objects with their local shards moved and back."""
    from _ranks import _init
    from torch.distributed.tensor import DTensor

    _init(rank, world_size, init_file, timeout_s=120.0)

    def trainer_of(name: str) -> Trainer:
        job = tiny_job(Path(save_dir) / name, *STEPS, "trainer.batching.global_batch_size=4")
        return TrainingConfigurator(
            mesh=DeviceMeshParameters(data_parallel_shard=2),
            parameters=job.trainer,
            task_provider=CausalLMTask,
            model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len), job.model.family),
            data_provider=CorpusProvider(job.data),
        ).configure()

    plain = trainer_of("plain")
    expected = _losses(plain)
    plain.train()
    trainer = trainer_of("slept")
    losses = _losses(trainer)
    seen: dict[str, object] = {}

    def sleep_and_wake(ctx) -> None:
        if ctx.step != 2:
            return
        name = next(iter(trainer._state.params))
        param, moment = trainer._state.params[name], trainer._state.opt_state.mu[name]
        assert isinstance(param, DTensor)
        assert isinstance(moment, DTensor)
        local = param._local_tensor  # the shard the DTensor holds (read here only to see it move)
        values, pointer = local.clone(), local.untyped_storage().data_ptr()
        moment_pointer = moment._local_tensor.untyped_storage().data_ptr()
        trainer.sleep()
        seen["moved"] = local.untyped_storage().data_ptr() != pointer
        seen["moment moved"] = moment._local_tensor.untyped_storage().data_ptr() != moment_pointer
        trainer.wake()
        seen["same"] = trainer._state.params[name] is param and param._local_tensor is local
        seen["values"] = torch.equal(local, values)

    trainer.bus.subscribe(EVENT_TRAIN_STEP_POST, sleep_and_wake)
    trainer.train()
    assert losses == expected, (losses, expected)  # bitwise
    assert len(losses) == 5
    assert seen["moved"] is True
    assert seen["moment moved"] is True
    assert seen["same"] is True
    assert seen["values"] is True
    plain.checkpoints.close()
    trainer.checkpoints.close()


@pytest.mark.slow
@pytest.mark.ranks
def test_sleep_wake_on_two_sharded_ranks_moves_the_local_shards_and_keeps_the_losses_bitwise(tmp_path):
    from _ranks import _run_ranks

    _run_ranks(_sharded_sleep_worker, 2, tmp_path, str(tmp_path / "runs"), timeout_s=300, clean=True)
