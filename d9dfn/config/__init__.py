"""Configs: frozen pydantic models at the edge, the config-driven optimizers and schedules, and loading.

Every model is frozen and rejects unknown keys. Union-typed sections are discriminated by a tag key
(``name`` for optimizers and schedulers, ``provider`` for trackers, ``schedule`` for pipeline schedules,
``mode`` for schedule phases, ``type`` for curves) and turned into d9dfn objects by an exhaustive
``match`` in a ``build_*`` function; the pure core never sees a config object.

A config is loaded by :func:`load_config` from a JSON (or YAML) file plus ``a.b.c=value`` overrides; any
mistake becomes one :class:`ConfigError` that names each bad field's path, what was wrong and the fix.
"""

from d9dfn.config._base import (
    ConfigError,
    FrozenConfig,
)
from d9dfn.config._jobs import InferenceConfig, JobConfig, TrainerConfig
from d9dfn.config._load import config_value, load_config
from d9dfn.config._mesh import (
    BatchMaths,
    DeviceMeshParameters,
    batch_maths,
)
from d9dfn.config._optim import (
    AdamConfig,
    AdamWConfig,
    AnyCurveConfig,
    AnyPhaseConfig,
    AutoLRSchedulerConfig,
    AutoOptimizerConfig,
    CosineCurveConfig,
    ExponentialCurveConfig,
    LinearCurveConfig,
    PercentagePhaseConfig,
    PiecewiseLRSchedulerConfig,
    PiecewiseSchedulerConfig,
    PolyCurveConfig,
    RestPhaseConfig,
    SGDConfig,
    StepsPhaseConfig,
    StochasticAdamWConfig,
    build_lr_schedule,
    build_optimizer,
)
from d9dfn.config._peft import AnyPeftConfig, FullTuneConfig, LoRAConfig, build_peft
from d9dfn.config._periods import (
    StepActionPeriod,
    StepActionSpecial,
    should_do_action,
    validate_period,
)
from d9dfn.config._pipelining import (
    SCHEDULE_CONFIGS,
    AnyPipelineScheduleConfig,
    PipelineScheduleConfig,
    PipeliningConfig,
)
from d9dfn.config._sections import (
    ActivationCheckpointingConfig,
    AnyTrackerConfig,
    BatchingConfig,
    CheckpointingConfig,
    DataLoadingConfig,
    DeterminismConfig,
    EvaluationConfig,
    GarbageCollectionConfig,
    GradientClippingConfig,
    InferenceCheckpointingConfig,
    JsonlTrackerConfig,
    LoggingConfig,
    ModelStageFactoryConfig,
    NullTrackerConfig,
    PrecisionConfig,
    ProfilingConfig,
    RunConfig,
    TensorBoardTrackerConfig,
    TimeoutConfig,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "SCHEDULE_CONFIGS",
    "AdamConfig",
    "AdamWConfig",
    "AnyCurveConfig",
    "AnyPeftConfig",
    "AnyPhaseConfig",
    "AnyPipelineScheduleConfig",
    "AnyTrackerConfig",
    "AutoLRSchedulerConfig",
    "AutoOptimizerConfig",
    "BatchMaths",
    "BatchingConfig",
    "CheckpointingConfig",
    "ConfigError",
    "CosineCurveConfig",
    "DataLoadingConfig",
    "DeterminismConfig",
    "DeviceMeshParameters",
    "EvaluationConfig",
    "ExponentialCurveConfig",
    "FrozenConfig",
    "FullTuneConfig",
    "GarbageCollectionConfig",
    "GradientClippingConfig",
    "InferenceCheckpointingConfig",
    "InferenceConfig",
    "JobConfig",
    "JsonlTrackerConfig",
    "LinearCurveConfig",
    "LoRAConfig",
    "LoggingConfig",
    "ModelStageFactoryConfig",
    "NullTrackerConfig",
    "PercentagePhaseConfig",
    "PiecewiseLRSchedulerConfig",
    "PiecewiseSchedulerConfig",
    "PipelineScheduleConfig",
    "PipeliningConfig",
    "PrecisionConfig",
    "PolyCurveConfig",
    "ProfilingConfig",
    "RestPhaseConfig",
    "RunConfig",
    "SGDConfig",
    "StepActionPeriod",
    "StepActionSpecial",
    "StepsPhaseConfig",
    "StochasticAdamWConfig",
    "TensorBoardTrackerConfig",
    "TimeoutConfig",
    "TrainerConfig",
    "batch_maths",
    "build_lr_schedule",
    "build_optimizer",
    "build_peft",
    "config_value",
    "load_config",
    "should_do_action",
    "validate_period",
]
