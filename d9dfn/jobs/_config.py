"""The default job's config: one JSON document (:class:`LMJobConfig`): trainer, model, corpus and sampling."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from d9dfn.config import (
    AdamWConfig,
    AnyPeftConfig,
    BatchingConfig,
    CheckpointingConfig,
    CosineCurveConfig,
    DeterminismConfig,
    DeviceMeshParameters,
    FrozenConfig,
    GradientClippingConfig,
    LinearCurveConfig,
    LoggingConfig,
    PercentagePhaseConfig,
    PiecewiseLRSchedulerConfig,
    PiecewiseSchedulerConfig,
    RestPhaseConfig,
    RunConfig,
    TrainerConfig,
)
from d9dfn.jobs._files import FilesConfig
from d9dfn.jobs._hf_folder import source_model_config
from d9dfn.models import FAMILIES, Qwen3Config

__all__ = [
    "CorpusConfig",
    "DataConfig",
    "LMJobConfig",
    "LMTrainerConfig",
    "MoEConfig",
    "ModelConfig",
    "SampleConfig",
    "default_job",
    "default_trainer",
]


class _Config(FrozenConfig):
    """The job's sections: frozen, unknown keys refused, strict ints and bools (``d9dfn.config.FrozenConfig``)."""


class MoEConfig(_Config):
    """The experts of a mixture-of-experts family (``model.family=qwen3_moe``; ``d9dfn.models.Qwen3MoeConfig``)."""

    TRAINING: ClassVar[tuple[str, ...]] = ("load_balance_bias_rate", "capacity_factor")
    """How the experts are trained, not what they are: with ``model.source`` the job's own (the rest is the
    folder's)."""

    num_experts: int = Field(4, ge=1)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = Field(2, ge=1)
    """Experts each token goes to (top-k); at most num_experts."""
    moe_intermediate_size: int = Field(64, ge=1)
    """Each expert's SwiGLU hidden width."""
    norm_topk_prob: bool = True
    """Renormalize the top-k routing weights to sum to one."""
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts (Qwen3-MoE) or sigmoid per expert (no Hugging Face export)."""
    decoder_sparse_step: int = Field(1, ge=1)
    """Every this many layers is an MoE layer (HF's rule: layer i when (i + 1) % step == 0)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layer indices that keep a dense MLP (of model.intermediate_size)."""
    shared_expert_intermediate_size: int = Field(0, ge=0)
    """Width of a gated shared expert every token goes through; 0: none (no Hugging Face export otherwise)."""
    router_aux_loss_coef: float = Field(0.001, ge=0.0)
    """Weight of the auxiliary load-balancing loss in the training loss (Hugging Face's definition)."""
    load_balance_bias_rate: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Step size of the auxiliary-loss-free balancing bias (DeepSeek-V3): a per-expert bias in the train state, used to
    choose experts only, moved by this much toward balance after every step; 0: none (no Hugging Face export else)."""
    capacity_factor: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """Each expert takes at most ceil(capacity_factor * tokens * top_k / num_experts) token copies per layer call, the
    rest dropped (zero expert output, the residual kept); null: dropless (no Hugging Face export else)."""

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.moe.num_experts_per_tok={self.num_experts_per_tok} is more than model.moe.num_experts="
                f"{self.num_experts}; set model.moe.num_experts_per_tok to at most {self.num_experts}"
            )
        return self


def _has_experts(family: str) -> bool:
    """Whether ``family``'s config has experts (reads ``model.moe``)."""
    return "num_experts" in getattr(FAMILIES[family].config_type, "__dataclass_fields__", {})


class ModelConfig(_Config):
    """The reference model's family and size (``d9dfn.models.Qwen3Config``), or a Hugging Face folder's model."""

    source: Path | None = None
    """A Hugging Face model folder (``config.json``, ``model.safetensors`` or a sharded index, ``tokenizer.json``
    or the files ``AutoTokenizer`` reads): the model of its family and size, its weights and its tokenizer (the
    ``hf`` extra). The family and size settings below then come from the folder (one set to another value is
    refused); the vocabulary is the folder's. ``None``: the byte-level model these settings describe."""
    family: str = "qwen3"
    """The model family, a name in ``d9dfn.models.FAMILIES`` (qwen3, llama, mistral, qwen2, qwen3_moe): qwen3
    normalizes queries and keys per head, qwen2 has q/k/v biases, llama and mistral neither; qwen3_moe is qwen3 with
    mixture-of-experts MLPs (model.moe); ``d9dfn export --format hf`` writes that family's HF class, and a Hugging
    Face source checkpoint must be of it."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Decoder blocks."""
    num_heads: int = Field(4, ge=1)
    """Query heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int = Field(32, ge=2)
    """Width of one head."""
    intermediate_size: int = Field(384, ge=1)
    """SwiGLU hidden width."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability (pure: masks come from the step's key)."""
    rope_theta: float = Field(10_000.0, gt=0.0)
    """The rotary base frequency (a source checkpoint's ``config.json`` must agree)."""
    rms_norm_eps: float = Field(1e-6, gt=0.0)
    """Epsilon of every RMSNorm (a source checkpoint's ``config.json`` must agree)."""
    tie_word_embeddings: bool = True
    """Share the embedding table with the LM head; set false to pipeline the model (trainer.pipelining)."""
    moe: MoEConfig | None = None
    """The experts of an MoE family (qwen3_moe); ``None``: its defaults (4 experts, top-2). Refused for a dense
    family."""

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str) -> str:
        if family not in FAMILIES:
            raise ValueError(
                f"{family!r} is not a model family; set model.family to one of {', '.join(FAMILIES)} (the names in "
                "d9dfn.models.FAMILIES)"
            )
        return family

    @model_validator(mode="after")
    def _moe_only_for_experts(self) -> ModelConfig:
        # With a source the family is the folder's: resolve_source checks model.moe against it.
        if self.moe is not None and self.source is None and not _has_experts(self.family):
            moe = [name for name in FAMILIES if _has_experts(name)]
            raise ValueError(
                f"model.moe is set but model.family={self.family} has no experts; set model.family to "
                f"{' or '.join(moe)}, or drop model.moe"
            )
        return self

    @model_validator(mode="after")
    def _kv_heads_divide_heads(self) -> ModelConfig:
        # Checked here (not only by Qwen3Config) so the message carries the job's own key names.
        if self.num_heads % self.num_kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}; set "
                f"model.num_kv_heads to a divisor of model.num_heads: {', '.join(map(str, divisors))}"
            )
        return self

    def to_qwen3(self, max_seq_len: int) -> Qwen3Config:
        """The model config for sequences up to ``max_seq_len`` (the family's switches, without attention bias); with
        ``source``, the folder's ``config.json``'s model (``d9dfn.models.from_hf_config``), checked against
        ``max_seq_len`` (``data.seq_len``).

        >>> ModelConfig(family="qwen2").to_qwen3(64).qkv_bias
        True
        """
        if self.source is not None:
            found = source_model_config(self.source, max_seq_len, dropout=self.dropout)
            training = {
                name: getattr(self.moe, name)
                for name in MoEConfig.TRAINING
                if self.moe and name in self.moe.model_fields_set
            }
            return dataclasses.replace(found, **training) if training and hasattr(found, "num_experts") else found
        fields = self.model_dump(exclude={"family", "source", "moe"})
        if _has_experts(self.family):
            fields.update((self.moe or MoEConfig()).model_dump())
        config: Qwen3Config = FAMILIES[self.family].config(**fields, max_seq_len=max_seq_len)
        return config


class CorpusConfig(_Config):
    """Which bytes of the stdlib the job reads, and how it cuts them."""

    max_bytes: int = Field(2_000_000, ge=1000)
    """Bytes read in all (train + validation)."""
    validation_every: int = Field(10, ge=2)
    """About one file in this many is validation."""
    seq_len: int = Field(128, ge=2)
    """Tokens (bytes) per training sequence."""


def _data_kind(value: Any) -> str:
    """Which data section ``value`` is: your files when it names ``files``, else the stdlib corpus."""
    if isinstance(value, dict):
        return "files" if "files" in value else "corpus"
    return "files" if isinstance(value, FilesConfig) else "corpus"


DataConfig = Annotated[
    Annotated[CorpusConfig, Tag("corpus")] | Annotated[FilesConfig, Tag("files")], Discriminator(_data_kind)
]
"""The job's data: the stdlib corpus (the default), or your files (``data.files``)."""


class SampleConfig(_Config):
    """The text ``d9dfn infer`` generates from the trained model."""

    prompt: str = "def "
    """Where generation starts."""
    num_bytes: int = Field(160, ge=0)
    """How many bytes to generate (tokens of the tokenizer with ``model.source``)."""
    temperature: float = Field(0.8, gt=0.0)
    """Softmax temperature."""


class LMTrainerConfig(TrainerConfig):
    """The LM job's training loop: d9d's ``TrainerConfig`` and the job's fine-tuning methods."""

    peft: tuple[AnyPeftConfig, ...] = ()
    """Parameter-efficient fine-tuning, stacked in order (d9d's ``PeftStackConfig``): ``{"method": "lora", "targets":
    "q_proj|v_proj", "rank": 16, "alpha": 32, "dropout": 0.05}`` adds adapters, ``{"method": "full", "targets":
    "norm"}`` trains those modules as they are; every other param is frozen (no gradient, no optimizer state).
    Empty: every param trains."""


def default_trainer() -> LMTrainerConfig:
    """The embedded default trainer: a few hundred steps, a few minutes on two CPU cores."""
    return LMTrainerConfig(
        run=RunConfig(name="stdlib-lm", description="byte-level LM on the Python standard library"),
        batching=BatchingConfig(global_batch_size=16, microbatch_size=16),
        logging=LoggingConfig(period_steps=10),
        checkpointing=CheckpointingConfig(save_dir=Path("runs"), period_steps=100, num_to_keep=2),
        gradient_clipping=GradientClippingConfig(max_norm=1.0),
        optimizer=AdamWConfig(name="adamw", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        lr_scheduler=PiecewiseLRSchedulerConfig(
            name="piecewise",
            scheduler=PiecewiseSchedulerConfig(
                initial_multiplier=0.01,
                # Warm-up over the first 10% of the run (30 of the 300 steps), so that a shorter run
                # (--set trainer.total_steps=10) keeps its shape instead of being refused.
                phases=(
                    PercentagePhaseConfig(
                        mode="percentage", percentage=0.1, target_multiplier=1.0, curve=LinearCurveConfig(type="linear")
                    ),
                    RestPhaseConfig(mode="rest", target_multiplier=0.1, curve=CosineCurveConfig(type="cosine")),
                ),
            ),
        ),
        # Bitwise-repeatable compiled steps: on CPU, inductor otherwise sums the embedding gradient with atomic
        # adds in a parallel loop (README "Reproducibility"; benchmarks/determinism.py measures the cost).
        determinism=DeterminismConfig(deterministic_algorithms=True),
        total_steps=300,
    )


class LMJobConfig(_Config):
    """A whole language-model job: the trainer, the model, the corpus, evaluation and sampling."""

    trainer: LMTrainerConfig = Field(default_factory=default_trainer)
    """The training loop (d9d's ``TrainerConfig``) and the fine-tuning methods (``peft``)."""
    mesh: DeviceMeshParameters | None = None
    """How the processes split the work; ``None``: plain data parallelism (``data_parallel_replicate``) over
    however many processes ``torchrun`` started (1 without it). ``{"data_parallel_shard": 2}`` shards params
    and optimizer state over 2 processes (FSDP-style)."""
    model: ModelConfig = ModelConfig()
    """The reference model's size."""
    data: DataConfig = CorpusConfig()
    """The data: the stdlib corpus (max_bytes, validation_every, seq_len), or your files (files, ...: FilesConfig),
    chosen by whether ``files`` is set."""
    eval_batches: int = Field(32, ge=1)
    """Validation batches (of trainer.batching.global_batch_size sequences) for perplexity."""
    sample: SampleConfig = SampleConfig()
    """Generation after evaluation."""

    @field_validator("data", mode="before")
    @classmethod
    def _files_replace_the_corpus(cls, value: Any) -> Any:
        # `--set data.files=[...]` on the default job adds `files` to the corpus's settings: those left at their
        # defaults go, one set otherwise would be ignored, so it is refused.
        if not isinstance(value, dict) or "files" not in value:
            return value
        defaults = CorpusConfig()
        kept = dict(value)
        for name in set(CorpusConfig.model_fields) - set(FilesConfig.model_fields):
            if name in kept and kept.pop(name) != getattr(defaults, name):
                raise ValueError(
                    f"data.{name}={value[name]!r} is a setting of the stdlib corpus, which data.files replaces; "
                    f"remove data.{name}"
                )
        return kept


def default_job() -> LMJobConfig:
    """The embedded default job (``d9dfn train`` with no arguments)."""
    return LMJobConfig()
