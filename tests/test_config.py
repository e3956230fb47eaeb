"""Tests for d9dfn.config: the pydantic configs, build_* functions, batch maths and load_config."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from d9dfn import optim, schedules
from d9dfn.config import (
    SCHEDULE_CONFIGS,
    AdamConfig,
    AdamWConfig,
    AutoOptimizerConfig,
    BatchingConfig,
    ConfigError,
    DataLoadingConfig,
    DeviceMeshParameters,
    InferenceCheckpointingConfig,
    InferenceConfig,
    JobConfig,
    JsonlTrackerConfig,
    NullTrackerConfig,
    PiecewiseLRSchedulerConfig,
    PiecewiseSchedulerConfig,
    ProfilingConfig,
    RunConfig,
    SGDConfig,
    StochasticAdamWConfig,
    TrainerConfig,
    _jobs,
    _mesh,
    _optim,
    _pipelining,
    _sections,
    batch_maths,
    build_lr_schedule,
    build_optimizer,
    load_config,
)
from d9dfn.pipeline import SCHEDULE_OPTIONS, dry_run

ADAMW = {"name": "adamw", "lr": 1e-3}
FULL = {
    "run": {"name": "full", "description": "every section set", "hparams": {"layers": 2, "tags": ["a"]}},
    "batching": {"global_batch_size": 32, "microbatch_size": 4},
    "data_loading": {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 4},
    "logging": {"period_steps": "last_step", "tracker": {"provider": "null"}},
    "pipelining": {"schedule": {"schedule": "1f1b", "num_stages_per_rank": 2, "zero_bubble": True}},
    "model_stage_factory": {"source_checkpoint": "/weights"},
    "determinism": {"seed": 7, "deterministic_algorithms": True},
    "gc": {"period_steps": "disable"},
    "checkpointing": {"save_dir": "/ckpt", "period_steps": 50, "num_to_keep": None, "async_save": True},
    "gradient_clipping": {"max_norm": 1.0},
    "profiling": {"enabled": True, "traces_dir": "/traces", "period_steps": 10, "warmup_steps": 2, "active_steps": 3},
    "timeout": {"init_timeout": 60, "step_timeout": 30},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    "lr_scheduler": {
        "name": "piecewise",
        "scheduler": {
            "initial_multiplier": 0.0,
            "phases": [
                {"mode": "steps", "steps": 10, "target_multiplier": 1.0, "curve": {"type": "linear"}},
                {"mode": "percentage", "percentage": 0.5, "target_multiplier": 1.0, "curve": {"type": "exponential"}},
                {"mode": "rest", "target_multiplier": 0.1, "curve": {"type": "poly", "power": 3.0}},
            ],
        },
    },
    "total_steps": 200,
    "compile": False,
}


def _models() -> list[type[BaseModel]]:
    modules = (_sections, _jobs, _optim, _mesh, _pipelining)
    written = [
        obj
        for module in modules
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseModel)
        and obj.__module__ == module.__name__
        and not name.startswith("_")
    ]
    return [*written, *SCHEDULE_CONFIGS.values()]  # the schedules' models are generated from their registry


def _config_error(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# --- Models ---------------------------------------------------------------------------------------------------


def test_models_are_frozen_forbid_extra_and_document_every_field() -> None:
    models = _models()
    assert len(models) == 37 + len(SCHEDULE_CONFIGS)  # a newly registered schedule adds its model here by itself
    for model in models:
        assert model.model_config.get("frozen") is True, model.__name__
        assert model.model_config.get("extra") == "forbid", model.__name__
        assert model.__doc__, model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_trainer_config_needs_only_an_optimizer() -> None:
    config = TrainerConfig(optimizer=ADAMW)
    assert isinstance(config.optimizer, AdamWConfig)
    assert config.optimizer.betas == (0.9, 0.999)
    assert config.pipelining is None
    assert config.profiling is None
    assert config.lr_scheduler is None
    assert config.total_steps is None
    assert config.compile is True
    assert config.run_dir == Path("runs") / "d9dfn"


def test_trainer_config_is_frozen() -> None:
    config = TrainerConfig(optimizer=ADAMW)
    with pytest.raises(ValidationError, match="frozen"):
        config.compile = False  # type: ignore[misc]


def test_trainer_config_full_json_round_trip(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(FULL)
    path = tmp_path / "job.json"
    path.write_text(config.model_dump_json())
    assert load_config(TrainerConfig, path) == config
    assert config.model_dump(mode="json")["lr_scheduler"] == FULL["lr_scheduler"]


def test_inference_config_defaults_load_the_default_training_run() -> None:
    config = InferenceConfig()
    assert config.checkpointing.load_dir == TrainerConfig(optimizer=ADAMW).run_dir
    assert config.checkpointing.step is None


def test_inference_config_takes_one_source_of_weights() -> None:
    with pytest.raises(ValidationError, match="set checkpointing=null to run the source_checkpoint's weights"):
        InferenceConfig(model_stage_factory={"source_checkpoint": "/weights"})
    config = InferenceConfig(model_stage_factory={"source_checkpoint": "/weights"}, checkpointing=None)
    assert config.checkpointing is None


def test_optimizer_union_picks_the_member_by_name() -> None:
    adapter = TypeAdapter(AutoOptimizerConfig)
    assert isinstance(adapter.validate_json('{"name": "adam", "lr": 1e-4}'), AdamConfig)
    assert adapter.validate_python({"name": "adam", "lr": 1}).weight_decay == 0.0
    assert adapter.validate_python({"name": "adamw", "lr": 1}).weight_decay == 1e-2
    assert isinstance(adapter.validate_python({"name": "sgd", "lr": 1}), SGDConfig)
    sto = adapter.validate_python({"name": "stochastic_adamw", "lr": 1, "state_dtype": "bfloat16"})
    assert isinstance(sto, StochasticAdamWConfig)


def test_stochastic_adamw_requires_a_supported_state_dtype() -> None:
    adapter = TypeAdapter(AutoOptimizerConfig)
    with pytest.raises(ValidationError, match="state_dtype"):
        adapter.validate_python({"name": "stochastic_adamw", "lr": 1})
    with pytest.raises(ValidationError, match="'float16' is not supported; use one of 'float32', 'bfloat16'"):
        adapter.validate_python({"name": "stochastic_adamw", "lr": 1, "state_dtype": "float16"})


def test_sgd_nesterov_needs_momentum_without_dampening() -> None:
    with pytest.raises(ValidationError, match="nesterov=true needs momentum > 0 and dampening = 0"):
        SGDConfig(name="sgd", lr=0.1, nesterov=True)
    assert SGDConfig(name="sgd", lr=0.1, nesterov=True, momentum=0.9).nesterov


def test_batching_rejects_global_not_multiple_of_micro_naming_both_fields() -> None:
    with pytest.raises(ValidationError) as info:
        BatchingConfig(global_batch_size=10, microbatch_size=4)
    message = str(info.value)
    assert "global_batch_size=10 is not a multiple of microbatch_size=4" in message
    assert "e.g. 8" in message


@given(microbatch=st.integers(1, 16), count=st.integers(1, 16))
def test_batching_accepts_every_multiple(microbatch: int, count: int) -> None:
    config = BatchingConfig(global_batch_size=microbatch * count, microbatch_size=microbatch)
    assert config.global_batch_size // config.microbatch_size == count


def test_data_loading_persistent_workers_need_workers() -> None:
    with pytest.raises(ValidationError, match="persistent_workers=true needs num_workers > 0"):
        DataLoadingConfig(persistent_workers=True)


def test_profiling_cycle_must_fit_the_period() -> None:
    with pytest.raises(ValidationError, match=r"warmup_steps=5 \+ active_steps=6 exceed period_steps=10"):
        ProfilingConfig(period_steps=10, warmup_steps=5, active_steps=6)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b"])
def test_run_name_and_tracker_filename_must_be_one_path_component(name: str) -> None:
    with pytest.raises(ValidationError, match=r"run.name .* must be a non-empty name without '/'"):
        RunConfig(name=name)
    with pytest.raises(ValidationError, match=r"logging.tracker.filename .* must be a non-empty name .* e.g. 'metrics"):
        JsonlTrackerConfig(filename=name)


def test_gradient_clipping_zero_max_norm_is_rejected() -> None:
    with pytest.raises(ValidationError, match="greater than 0"):
        TrainerConfig(optimizer=ADAMW, gradient_clipping={"max_norm": 0})


def test_piecewise_rest_phase_must_be_last() -> None:
    rest = {"mode": "rest", "target_multiplier": 0.0, "curve": {"type": "cosine"}}
    steps = {"mode": "steps", "steps": 3, "target_multiplier": 1.0, "curve": {"type": "linear"}}
    with pytest.raises(ValidationError, match=r"phases\.0 is a 'rest' phase but 1 phase"):
        PiecewiseSchedulerConfig(initial_multiplier=0.0, phases=[rest, steps])


def test_piecewise_percentages_must_not_go_backwards() -> None:
    def phase(p: float) -> dict[str, Any]:
        return {"mode": "percentage", "percentage": p, "target_multiplier": 1.0, "curve": {"type": "linear"}}

    with pytest.raises(ValidationError, match=r"phases\.1 ends at percentage 0\.2, before an earlier phase's 0\.5"):
        PiecewiseSchedulerConfig(initial_multiplier=0.0, phases=[phase(0.5), phase(0.2)])


# --- Pipeline schedules: generated from d9dfn.pipeline.SCHEDULE_OPTIONS --------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULE_OPTIONS))
def test_every_registered_schedule_is_a_config_of_its_options_that_builds_its_program(name: str) -> None:
    options = SCHEDULE_OPTIONS[name]
    config = TrainerConfig.model_validate({"optimizer": ADAMW, "pipelining": {"schedule": {"schedule": name}}})
    schedule = config.pipelining.schedule
    assert type(schedule) is SCHEDULE_CONFIGS[name]
    assert set(type(schedule).model_fields) == {"schedule", *(field.name for field in dataclasses.fields(options))}
    assert schedule.options() == options()  # {"schedule": name} alone is the options' defaults
    assert TrainerConfig.model_validate_json(config.model_dump_json()) == config
    assert pickle.loads(pickle.dumps(config)) == config  # a generated class is rebuilt through the registry
    dry_run(schedule.options().program(3, 5))  # a program the ranks can run (raises if not)


def test_schedule_configs_carry_every_option_to_the_program() -> None:
    written = {"schedule": "1f1b", "num_stages_per_rank": 3, "zero_bubble": True}
    config = TrainerConfig.model_validate({"optimizer": ADAMW, "pipelining": {"schedule": written}})
    assert config.model_dump(mode="json")["pipelining"]["schedule"] == written  # the JSON keeps its shape
    assert config.pipelining.schedule.options() == SCHEDULE_OPTIONS["1f1b"](num_stages_per_rank=3, zero_bubble=True)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (
            {"schedule": "chimera"},
            "pipelining.schedule: schedule='chimera' is not a known kind; set pipelining.schedule.schedule to one of "
            + ", ".join(repr(name) for name in SCHEDULE_OPTIONS),
        ),
        (
            {"schedule": "1f1b", "num_stages_per_rank": 0},
            "pipelining.schedule.num_stages_per_rank: Interleaved1F1B: num_stages_per_rank=0 must be a positive int; "
            "pass 1 or more",
        ),
        (
            {"schedule": "looped_bfs", "num_stages_per_rank": True},
            "pipelining.schedule.num_stages_per_rank: true must be an int, not a bool",
        ),
        (
            {"schedule": "gpipe", "num_stages_per_rank": 2},
            "pipelining.schedule.num_stages_per_rank: unknown key; allowed keys here: schedule; remove or rename it",
        ),
    ],
)
def test_schedule_config_errors_are_one_line_naming_the_field(schedule: dict[str, Any], expected: str) -> None:
    message = _config_error(
        TrainerConfig, None, [f"optimizer={json.dumps(ADAMW)}", f"pipelining.schedule={json.dumps(schedule)}"]
    )
    assert message.startswith(f"load_config: {expected}")
    assert "\n" not in message


@dataclasses.dataclass(frozen=True)
class _Undocumented:
    """A schedule whose option has no docstring."""

    depth: int = 1

    def program(self, num_ranks: int, num_microbatches: int) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Required:
    """A schedule whose option has no default."""

    depth: int
    """How deep."""

    def program(self, num_ranks: int, num_microbatches: int) -> Any:
        raise NotImplementedError


@pytest.mark.parametrize("options", [_Undocumented, _Required])
def test_a_schedule_option_without_a_default_or_a_docstring_is_refused_at_registration(options: type) -> None:
    with pytest.raises(
        TypeError, match=rf"SCHEDULE_OPTIONS\['toy'\]: {options.__name__}.depth needs a default and a docstring"
    ):
        _pipelining._schedule_config("toy", options)


# --- Mesh and batch maths -----------------------------------------------------------------------------------------


def test_device_mesh_world_size_and_distributed() -> None:
    assert DeviceMeshParameters().world_size == 1
    assert not DeviceMeshParameters().is_distributed
    mesh = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2, tensor_parallel=2, expert_parallel=4)
    assert mesh.world_size == 8
    assert mesh.data_parallel_size == 2
    assert mesh.is_distributed


def test_device_mesh_expert_parallel_must_divide() -> None:
    with pytest.raises(ValidationError, match=r"expert_parallel=3 does not divide .* = 4"):
        DeviceMeshParameters(data_parallel_shard=4, expert_parallel=3)


def test_device_mesh_rejects_zero_degrees() -> None:
    with pytest.raises(ValidationError, match="greater than 0"):
        DeviceMeshParameters(tensor_parallel=0)


@given(microbatch=st.integers(1, 8), dp=st.integers(1, 8), count=st.integers(1, 8))
def test_batch_maths_splits_the_global_batch_exactly(microbatch: int, dp: int, count: int) -> None:
    maths = batch_maths(global_batch_size=microbatch * dp * count, microbatch_size=microbatch, data_parallel_size=dp)
    assert maths.num_microbatches == count
    assert maths.per_rank_batch_size * dp == maths.global_batch_size
    assert maths.per_rank_batch_size == maths.microbatch_size * maths.num_microbatches


@given(global_batch=st.integers(1, 64), microbatch=st.integers(1, 8), dp=st.integers(1, 8))
def test_batch_maths_rejects_exactly_the_non_multiples(global_batch: int, microbatch: int, dp: int) -> None:
    if global_batch % (microbatch * dp) == 0:
        batch_maths(global_batch_size=global_batch, microbatch_size=microbatch, data_parallel_size=dp)
    else:
        with pytest.raises(ValueError, match=rf"global_batch_size={global_batch} is not a multiple of"):
            batch_maths(global_batch_size=global_batch, microbatch_size=microbatch, data_parallel_size=dp)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_batch_maths_rejects_bad_sizes(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"batch_maths: microbatch_size=.* must be an int >= 1"):
        batch_maths(global_batch_size=8, microbatch_size=bad)


def test_job_config_batch_maths_splits_over_the_data_parallel_ranks() -> None:
    config = TrainerConfig(optimizer=ADAMW, batching={"global_batch_size": 16, "microbatch_size": 2})
    maths = config.batch_maths(
        DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=2).data_parallel_size
    )
    assert (maths.num_microbatches, maths.per_rank_batch_size) == (2, 4)
    assert config.batch_maths().num_microbatches == 8  # one rank (inference: every replica sees whole batches)
    inference = InferenceConfig(batching=config.batching, checkpointing=None)
    assert inference.batch_maths() == config.batch_maths()
    with pytest.raises(ValueError, match=r"batching\.global_batch_size to a multiple of 6"):
        config.batch_maths(3)


def test_inference_config_from_trainer_carries_every_shared_section() -> None:
    trainer = TrainerConfig.model_validate(
        {
            **FULL,
            "run": {**FULL["run"], "device": "cpu"},
            "repeated_blocks": ["Block"],
            "precision": {"compute_dtype": "bfloat16"},
        }
    )
    inference = InferenceConfig.from_trainer(trainer, checkpointing={"load_dir": "/runs/x", "step": 3})
    carried = set(JobConfig.model_fields) - {"model_stage_factory", "profiling"}
    assert carried == {name for name in JobConfig.model_fields if getattr(inference, name) == getattr(trainer, name)}
    assert all(getattr(trainer, name) != getattr(JobConfig(), name) for name in carried), (
        "FULL sets every carried section away from its default, so the comparison above can fail"
    )
    assert (inference.device, inference.checkpointing) == (
        "cpu",
        InferenceCheckpointingConfig(load_dir="/runs/x", step=3),
    )
    assert (inference.profiling, inference.model_stage_factory) == (None, JobConfig().model_stage_factory)
    # A section both configs have is declared once (JobConfig), so a new shared section is carried by itself;
    # only `checkpointing` has one name and two meanings (where a run saves; which checkpoint inference loads).
    shared = set(TrainerConfig.model_fields) & set(InferenceConfig.model_fields)
    assert shared == {*JobConfig.model_fields, "checkpointing"}


# --- build_optimizer ----------------------------------------------------------------------------------------------


def _one_update(transform: optim.Transform) -> dict[str, torch.Tensor]:
    params = {"w": torch.tensor([1.0, -2.0, 3.0])}
    grads = {"w": torch.tensor([0.5, 0.25, -1.0])}
    state = transform.init(params)
    for _ in range(2):
        updates, state = transform.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize(
    ("config", "direct"),
    [
        (
            AdamWConfig(name="adamw", lr=0.1, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.5, amsgrad=True),
            lambda lr: optim.adamw(lr, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.5, amsgrad=True),
        ),
        (
            AdamConfig(name="adam", lr=0.1, eps=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
            lambda lr: optim.adam(lr, eps=1e-2, weight_decay=0.3, decoupled_weight_decay=True, maximize=True),
        ),
        (
            SGDConfig(name="sgd", lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.2),
            lambda lr: optim.sgd(lr, momentum=0.9, dampening=0.1, weight_decay=0.2),
        ),
        (
            SGDConfig(name="sgd", lr=0.1, momentum=0.5, nesterov=True, maximize=True),
            lambda lr: optim.sgd(lr, momentum=0.5, nesterov=True, maximize=True),
        ),
    ],
)
def test_build_optimizer_passes_every_field(config: Any, direct: Any) -> None:
    built = _one_update(build_optimizer(config))
    expected = _one_update(direct(config.lr))
    torch.testing.assert_close(built, expected, rtol=0, atol=0)
    assert not torch.equal(built["w"], _one_update(direct(config.lr * 2))["w"])


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_build_optimizer_passes_fused_to_the_transform(name: str) -> None:
    config = {"adamw": AdamWConfig, "adam": AdamConfig}[name]
    auto = build_optimizer(config(name=name, lr=0.1)).fused
    assert auto is not None
    assert auto.auto  # the default: the step's choice by device
    forced = build_optimizer(config(name=name, lr=0.1, fused=True)).fused
    assert forced is not None
    assert not forced.auto
    assert build_optimizer(config(name=name, lr=0.1, fused=False)).fused is None


def test_build_optimizer_uses_a_schedule_for_lr() -> None:
    config = AdamWConfig(name="adamw", lr=0.1)
    schedule = lambda step: 0.1 / (step + 1.0)  # noqa: E731
    torch.testing.assert_close(
        _one_update(build_optimizer(config, schedule)), _one_update(optim.adamw(schedule)), rtol=0, atol=0
    )


def test_build_optimizer_stochastic_adamw_needs_a_key() -> None:
    config = StochasticAdamWConfig(name="stochastic_adamw", lr=0.1, state_dtype="bfloat16", weight_decay=0.0)
    with pytest.raises(ValueError, match=r"build_optimizer: stochastic_adamw needs a random key .* key="):
        build_optimizer(config)
    built = _one_update(build_optimizer(config, key=3))
    expected = _one_update(optim.stochastic_adamw(0.1, weight_decay=0.0, state_dtype=torch.bfloat16, key=3))
    torch.testing.assert_close(built, expected, rtol=0, atol=0)


# --- build_lr_schedule --------------------------------------------------------------------------------------------


def test_build_lr_schedule_matches_schedules_piecewise() -> None:
    config = TrainerConfig.model_validate(FULL).lr_scheduler
    multiplier = build_lr_schedule(config, total_steps=200)
    expected = schedules.piecewise(
        0.0,
        [
            schedules.steps(10, 1.0, schedules.linear()),
            schedules.percentage(0.5, 1.0, schedules.exponential()),
            schedules.rest(0.1, schedules.poly(3.0)),
        ],
        200,
    )
    steps = torch.arange(-2, 205)
    torch.testing.assert_close(multiplier(steps), expected(steps), rtol=0, atol=0)
    torch.testing.assert_close(
        build_lr_schedule(config, total_steps=200, base_lr=0.5)(steps), expected(steps) * 0.5, rtol=0, atol=0
    )


@pytest.mark.parametrize(("curve", "made"), [("linear", schedules.linear()), ("cosine", schedules.cosine())])
def test_build_lr_schedule_curves(curve: str, made: Any) -> None:
    config = PiecewiseLRSchedulerConfig.model_validate(
        {
            "name": "piecewise",
            "scheduler": {
                "initial_multiplier": 1.0,
                "phases": [{"mode": "rest", "target_multiplier": 0.0, "curve": {"type": curve}}],
            },
        }
    )
    expected = schedules.piecewise(1.0, [schedules.rest(0.0, made)], 8)
    steps = torch.arange(9)
    torch.testing.assert_close(build_lr_schedule(config, 8)(steps), expected(steps), rtol=0, atol=0)


def test_build_lr_schedule_phases_that_overshoot_total_steps_fail() -> None:
    config = TrainerConfig.model_validate(FULL).lr_scheduler
    with pytest.raises(ValueError, match=r"piecewise: phase 0 \(steps\(10\)\) ends at step 10, past total_steps=5"):
        build_lr_schedule(config, total_steps=5)


def test_build_lr_schedule_drives_build_optimizer() -> None:
    config = TrainerConfig.model_validate({**FULL, "optimizer": {"name": "sgd", "lr": 0.1}})
    lr = build_lr_schedule(config.lr_scheduler, config.total_steps, base_lr=config.optimizer.lr)
    transform = build_optimizer(config.optimizer, lr)
    params = {"w": torch.tensor([1.0])}
    state = transform.init(params)
    # Step 0 of the warmup has multiplier 0: the first update must not move the params.
    updates, state = transform.update({"w": torch.tensor([1.0])}, state, params)
    torch.testing.assert_close(updates["w"], torch.tensor([0.0]))
    updates, _ = transform.update({"w": torch.tensor([1.0])}, state, params)
    torch.testing.assert_close(updates["w"], torch.tensor([-0.01]))


# --- load_config --------------------------------------------------------------------------------------------------


def test_load_config_reads_json_and_applies_overrides_in_order(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"optimizer": ADAMW, "batching": {"global_batch_size": 16, "microbatch_size": 4}}))
    config = load_config(
        TrainerConfig,
        path,
        [
            "batching.microbatch_size=8",
            "run.name=exp-1",
            "run.description=two words",
            "optimizer.betas=[0.5, 0.6]",
            "logging.period_steps=last_step",
            'logging.tracker={"provider": "null"}',
            "total_steps=100",
            "total_steps=null",
            "profiling.active_steps=3",
            "compile=false",
        ],
    )
    assert config.batching.microbatch_size == 8
    assert config.run.name == "exp-1"
    assert config.run.description == "two words"
    assert config.optimizer.betas == (0.5, 0.6)
    assert config.logging.period_steps == "last_step"
    assert isinstance(config.logging.tracker, NullTrackerConfig)
    assert config.total_steps is None
    assert config.profiling is not None
    assert config.profiling.active_steps == 3
    assert config.compile is False


def test_load_config_number_for_a_string_field_stays_a_string() -> None:
    config = load_config(TrainerConfig, None, ["optimizer.name=sgd", "optimizer.lr=1", "run.name=123"])
    assert config.run.name == "123"


def test_load_config_overrides_list_items_by_index() -> None:
    base = TrainerConfig.model_validate(FULL)
    config = load_config(TrainerConfig, None, ["lr_scheduler.scheduler.phases.0.steps=20"], default=base)
    assert config.lr_scheduler.scheduler.phases[0].steps == 20
    assert config.lr_scheduler.scheduler.phases[1:] == base.lr_scheduler.scheduler.phases[1:]


def test_load_config_default_is_used_without_a_path_and_is_not_changed() -> None:
    default = TrainerConfig(optimizer=ADAMW, total_steps=5)
    config = load_config(TrainerConfig, None, ["total_steps=6"], default=default)
    assert (config.total_steps, default.total_steps) == (6, 5)
    assert load_config(TrainerConfig, None, [], default=default) == default


def test_load_config_reads_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "job.yaml"
    path.write_text(
        "optimizer:\n  name: adamw\n  lr: 1.0e-3\nbatching:\n  global_batch_size: 4\n  microbatch_size: 2\n"
    )
    config = load_config(TrainerConfig, path)
    assert config.batching.global_batch_size == 4
    assert config.optimizer.lr == 1e-3


def test_load_config_missing_file_names_the_path(tmp_path: Path) -> None:
    message = _config_error(TrainerConfig, tmp_path / "nope.json")
    assert f"config file '{tmp_path / 'nope.json'}' does not exist" in message
    assert "is a directory" in _config_error(TrainerConfig, tmp_path)


def test_load_config_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text('{"optimizer": {"name": "adamw",\n "lr": }}')
    assert f"'{path}' is not valid JSON: Expecting value at line 2, column 8" in _config_error(TrainerConfig, path)


def test_load_config_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text("[1, 2]")
    assert "holds a list, not an object" in _config_error(TrainerConfig, path)


def test_load_config_unknown_key_names_path_allowed_keys_and_suggestion() -> None:
    message = _config_error(TrainerConfig, None, ["optimizer.name=adamw", "optimizer.lr=1", "batching.microbach=2"])
    assert (
        "batching.microbach: unknown key; did you mean 'microbatch_size'? allowed keys here: global_batch_size, "
        "microbatch_size" in message
    )


def test_load_config_unknown_key_inside_a_union_member() -> None:
    message = _config_error(TrainerConfig, None, ['optimizer={"name": "sgd", "lr": 0.1, "betas": [0.9, 0.9]}'])
    assert "optimizer.betas: unknown key; allowed keys here: dampening, lr, maximize, momentum, name" in message


def test_load_config_switching_kinds_by_name_suggests_replacing_the_section() -> None:
    default = TrainerConfig(optimizer=ADAMW)
    message = _config_error(TrainerConfig, None, ["optimizer.name=sgd"], default=default)
    assert "optimizer.eps: unknown key" in message
    assert "(to switch kinds, replace the whole section: optimizer={...})" in message
    assert (
        load_config(TrainerConfig, None, ['optimizer={"name": "sgd", "lr": 0.1}'], default=default).optimizer.lr == 0.1
    )


def test_load_config_wrong_type_names_path_value_and_fix() -> None:
    message = _config_error(TrainerConfig, None, ["optimizer.name=adamw", "optimizer.lr=fast"])
    assert message == (
        "load_config: optimizer.lr='fast': Input should be a valid number, unable to parse string as a number; fix it "
        "in the config or with --set optimizer.lr=VALUE"
    )


def test_load_config_global_batch_not_multiple_of_microbatch() -> None:
    message = _config_error(
        TrainerConfig, None, ["optimizer.name=adamw", "optimizer.lr=1", "batching.microbatch_size=3"]
    )
    assert "batching: global_batch_size=8 is not a multiple of microbatch_size=3" in message


def test_load_config_missing_required_field_says_what_it_is() -> None:
    message = _config_error(TrainerConfig, None, [])
    assert message.startswith("load_config: optimizer: required but missing (The optimizer")
    assert "\n" not in message


def test_load_config_unknown_kind_lists_the_kinds() -> None:
    message = _config_error(TrainerConfig, None, ["optimizer.name=lion", "optimizer.lr=1"])
    assert "optimizer: name='lion' is not a known kind; set optimizer.name to one of 'adamw', 'adam', 'sgd'" in message
    message = _config_error(TrainerConfig, None, ["optimizer.lr=1"])
    assert "optimizer: no 'name'; set optimizer.name to one of 'adamw'" in message


def test_load_config_nested_union_paths_drop_the_tags() -> None:
    base = TrainerConfig.model_validate(FULL)
    message = _config_error(
        TrainerConfig,
        None,
        [
            "lr_scheduler.scheduler.phases.0.steps=0",
            "lr_scheduler.scheduler.phases.2.curve.power=-1",
            "lr_scheduler.scheduler.phases.1.curve.type=wavy",
            "pipelining.schedule.zero_bubbles=true",
        ],
        default=base,
    )
    assert message.startswith("load_config: 4 problems: ")
    assert "\n" not in message  # one line, the problems joined by " | "
    assert "| lr_scheduler.scheduler.phases.0.steps=0: Input should be greater than 0; fix it" in message
    assert "| lr_scheduler.scheduler.phases.2.curve.power=-1: Input should be greater than 0" in message
    assert "| lr_scheduler.scheduler.phases.1.curve: type='wavy' is not a known kind" in message
    assert ": pipelining.schedule.zero_bubbles: unknown key; did you mean 'zero_bubble'?" in message


def test_load_config_period_errors_name_the_field() -> None:
    message = _config_error(TrainerConfig, None, ["optimizer.name=sgd", "optimizer.lr=1", "gc.period_steps=0"])
    assert 'gc.period_steps: period 0 is not a positive number of steps; write an int >= 1, "last_step"' in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("batching", "override 'batching' is not of the form a.b.c=value"),
        ("batching..x=1", "is not of the form a.b.c=value"),
        ("=1", "is not of the form a.b.c=value"),
        ("batching.global_batch_size.x=1", "batching.global_batch_size is 32, not an object"),
        ("lr_scheduler.scheduler.phases.7.steps=1", "is a list of 3 item(s) and '7' is not an index"),
        ("lr_scheduler.scheduler.phases.first.steps=1", "'first' is not an index"),
    ],
)
def test_load_config_malformed_overrides(override: str, expected: str) -> None:
    assert expected in _config_error(TrainerConfig, None, [override], default=TrainerConfig.model_validate(FULL))


def test_load_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def _leaf_paths(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict):
        return [p for key, value in tree.items() for p in _leaf_paths(value, (*prefix, key))]
    if isinstance(tree, list):
        return [p for index, value in enumerate(tree) for p in _leaf_paths(value, (*prefix, str(index)))]
    return [prefix]


_BREAKABLE = [p for p in _leaf_paths(FULL) if p[:2] != ("run", "hparams")]


@given(path=st.sampled_from(_BREAKABLE))
def test_load_config_every_broken_leaf_is_reported_at_its_path(path: tuple[str, ...]) -> None:
    # A nested list is wrong for every leaf type; the error must name the leaf, or, for a union's tag,
    # the section the tag selects.
    dotted = ".".join(path)
    message = _config_error(TrainerConfig, None, [f"{dotted}=[[[1]]]"], default=TrainerConfig.model_validate(FULL))
    is_tag = path[-1] in ("provider", "mode", "type") or path[-2:] in (
        ("optimizer", "name"),
        ("lr_scheduler", "name"),
        ("schedule", "schedule"),
    )
    reported = ".".join(path[:-1]) if is_tag else dotted
    assert message.startswith((f"load_config: {reported}: ", f"load_config: {reported}=[[[1]]]: "))
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("total_steps=true", "total_steps: true must be an int, not a bool"),
        ("compile=1", "compile: 1 must be true or false"),
        ('skip_nonfinite="yes"', 'skip_nonfinite: "yes" must be true or false'),
        ('total_steps="40"', 'total_steps: "40" must be a JSON number, not a string'),
        ("batching.global_batch_size=false", "batching.global_batch_size: false must be an int, not a bool"),
        ("optimizer.lr=true", "optimizer.lr: true must be a number, not a bool"),
        ("optimizer.betas=[true, 0.9]", "optimizer.betas.0: true must be a number, not a bool"),
        ('optimizer.betas=[0.9, "0.99"]', 'optimizer.betas.1: "0.99" must be a JSON number, not a string'),
        ('run.hparams={"a": [1, Infinity]}', "run.hparams.a.1: inf is not a finite number"),
    ],
)
def test_load_config_refuses_lax_scalars(override, expected):
    message = _config_error(TrainerConfig, None, ["optimizer.name=adamw", "optimizer.lr=0.1", override])
    assert expected in message


def test_load_config_keeps_json_ints_floats_paths_and_lists_convenient():
    config = load_config(
        TrainerConfig,
        None,
        [
            "optimizer.name=adamw",
            "optimizer.lr=1",
            "optimizer.betas=[0.9, 0.95]",
            "total_steps=40",
            "checkpointing.save_dir=/tmp/x",
            "run.name=123",
        ],
    )
    assert config.total_steps == 40
    assert config.optimizer.lr == 1.0
    assert config.optimizer.betas == (0.9, 0.95)
    assert str(config.checkpointing.save_dir) == "/tmp/x"
    assert config.run.name == "123"


def test_trainer_config_refuses_lr_phases_longer_than_total_steps_naming_both_settings():
    from d9dfn.jobs import LMJobConfig, default_job

    warmup = '{"mode": "steps", "steps": 30, "target_multiplier": 1, "curve": {"type": "linear"}}'
    with pytest.raises(ConfigError) as error:
        load_config(
            LMJobConfig,
            None,
            [f"trainer.lr_scheduler.scheduler.phases.0={warmup}", "trainer.total_steps=20"],
            default=default_job(),
        )
    assert str(error.value) == (
        "load_config: trainer: lr_scheduler.scheduler.phases do not fit in total_steps=20: phase 0 (steps(30)) ends "
        "at step 30, past total_steps=20; shorten it to at most 20 steps, use rest(...) to fill the run, or raise "
        "total_steps"
    )


@pytest.mark.parametrize("total_steps", [1, 2, 10, 300, 1000])
def test_default_job_warms_up_over_the_first_tenth_of_any_run_length(total_steps):
    from d9dfn.jobs import LMJobConfig, default_job

    job = load_config(LMJobConfig, None, [f"trainer.total_steps={total_steps}"], default=default_job())
    schedule = build_lr_schedule(job.trainer.lr_scheduler, total_steps)
    multipliers = schedule(torch.arange(total_steps + 1))
    peak = int(total_steps * 0.1)  # 30 of the default 300 steps, as the README's numbers were made with
    assert multipliers[peak].item() == pytest.approx(1.0)
    assert multipliers[: peak + 1].tolist() == sorted(multipliers[: peak + 1].tolist())  # rising to the peak
    assert multipliers[total_steps].item() == pytest.approx(0.1)  # the cosine's end


def test_default_job_schedule_is_the_300_step_one_it_replaced():
    from d9dfn.jobs import default_job
    from d9dfn.schedules import cosine, linear, piecewise, rest, steps

    job = default_job()
    old = piecewise(0.01, [steps(30, 1.0, linear()), rest(0.1, cosine())], 300)  # the default before issue 22
    new = build_lr_schedule(job.trainer.lr_scheduler, job.trainer.total_steps)
    assert torch.equal(new(torch.arange(301)), old(torch.arange(301)))


def test_job_model_heads_error_names_the_model_fields():
    from d9dfn.jobs import LMJobConfig, default_job

    with pytest.raises(ConfigError, match=r"model\.num_heads=4 is not a multiple of model\.num_kv_heads=3"):
        load_config(LMJobConfig, None, ["model.num_kv_heads=3"], default=default_job())


def test_load_config_marks_set_only_what_the_default_set_or_an_override_reached() -> None:
    from d9dfn.jobs import LMJobConfig, default_job

    sets = [
        "model.hidden_size=64",
        "trainer.batching.global_batch_size=32",
        'trainer.optimizer={"name": "sgd", "lr": 0.1}',
    ]
    job = load_config(LMJobConfig, None, sets, default=default_job())
    assert job.model.model_fields_set == {"hidden_size"}  # model.source tells it from the default by this
    assert job.trainer.batching.model_fields_set == {"global_batch_size", "microbatch_size"}  # default_trainer's too
    assert job.trainer.optimizer.model_fields_set == {"name", "lr"}  # replaced whole: the override's own fields
    assert job.data.model_fields_set == set()
    assert load_config(LMJobConfig, None, [], default=default_job()) == default_job()
