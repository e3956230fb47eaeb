"""The main job: a byte-level Qwen3-style LM trained on the Python standard library's own sources.

``d9dfn train`` with no arguments runs :func:`default_job`; ``d9dfn infer`` evaluates the latest
checkpoint's validation perplexity and prints a generated sample. Every machine with Python has this
corpus, so the job needs no download. A job is one JSON document (:class:`LMJobConfig`); the run
directory keeps a copy (``job.json``) so ``infer`` and ``export`` find the model that was trained.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from d9dfn import BuildForwardInputsResult, InferenceState, InferenceTask, PipelineState, make_inference_step
from d9dfn.checkpoint import export_safetensors, load_weights
from d9dfn.config import (
    AdamWConfig,
    BatchingConfig,
    CheckpointingConfig,
    CosineCurveConfig,
    DeterminismConfig,
    DeviceMeshParameters,
    FrozenConfig,
    GradientClippingConfig,
    InferenceCheckpointingConfig,
    InferenceConfig,
    LinearCurveConfig,
    LoggingConfig,
    PercentagePhaseConfig,
    PiecewiseLRSchedulerConfig,
    PiecewiseSchedulerConfig,
    RestPhaseConfig,
    RunConfig,
    TrainerConfig,
)
from d9dfn.jobs._corpus import ByteWindowDataset, decode_bytes, stdlib_corpus
from d9dfn.loop import (
    EVENT_INFERENCE_READY,
    EVENT_TRAIN_READY,
    TIMINGS_FILE,
    Inference,
    InferenceConfigurator,
    InitializeDatasetContext,
    InitializeDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    PrepareLoadModelStageResult,
    ResumeFrom,
    TrainingConfigurator,
    TrainResult,
    append_jsonl,
    atomic_write,
    is_main_process,
    launched_world_size,
    materialize_model,
)
from d9dfn.loop import load_model as load_provider_model
from d9dfn.models import (
    HF_FAMILIES,
    HF_FIELDS,
    Qwen3Config,
    Qwen3LM,
    check_hf_config,
    from_hf_state,
    to_hf_config,
    to_hf_state,
)
from d9dfn.pipeline import PipelineStageInfo
from d9dfn.step._precision import cast_params_tree
from d9dfn.tasks import CausalLMTask, PerplexityTask

__all__ = [
    "CorpusConfig",
    "CorpusProvider",
    "LMJobConfig",
    "ModelConfig",
    "Qwen3Provider",
    "SampleConfig",
    "default_job",
    "default_trainer",
    "EXPORT_FORMATS",
    "check_source_config",
    "evaluate_lm",
    "export_lm",
    "generate_pipelined",
    "inference_mesh",
    "load_model",
    "run_dir_of",
    "train_lm",
]


class _Config(FrozenConfig):
    """The job's sections: frozen, unknown keys refused, strict ints and bools (``d9dfn.config.FrozenConfig``)."""


class ModelConfig(_Config):
    """The reference model's family and size (``d9dfn.models.Qwen3Config``)."""

    family: Literal["qwen3", "llama", "mistral", "qwen2"] = "qwen3"
    """The decoder family (``d9dfn.models.HF_FAMILIES``): qwen3 normalizes queries and keys per head, qwen2 has
    q/k/v biases, llama and mistral neither; ``d9dfn export --format hf`` writes that family's HF class, and a
    Hugging Face source checkpoint must be of it."""
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
        """The model config for sequences up to ``max_seq_len`` (the family's switches, without attention bias).

        >>> ModelConfig(family="qwen2").to_qwen3(64).qkv_bias
        True
        """
        switches: dict[str, Any] = HF_FAMILIES[self.family].switches()
        return Qwen3Config(**self.model_dump(exclude={"family"}), **switches, max_seq_len=max_seq_len)


class CorpusConfig(_Config):
    """Which bytes of the stdlib the job reads, and how it cuts them."""

    max_bytes: int = Field(2_000_000, ge=1000)
    """Bytes read in all (train + validation)."""
    validation_every: int = Field(10, ge=2)
    """About one file in this many is validation."""
    seq_len: int = Field(128, ge=2)
    """Tokens (bytes) per training sequence."""


class SampleConfig(_Config):
    """The text ``d9dfn infer`` generates from the trained model."""

    prompt: str = "def "
    """Where generation starts."""
    num_bytes: int = Field(160, ge=0)
    """How many bytes to generate."""
    temperature: float = Field(0.8, gt=0.0)
    """Softmax temperature."""


def default_trainer() -> TrainerConfig:
    """The embedded default trainer: a few hundred steps, a few minutes on two CPU cores."""
    return TrainerConfig(
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

    trainer: TrainerConfig = Field(default_factory=default_trainer)
    """The training loop (d9d's ``TrainerConfig``)."""
    mesh: DeviceMeshParameters | None = None
    """How the processes split the work; ``None``: plain data parallelism (``data_parallel_replicate``) over
    however many processes ``torchrun`` started (1 without it). ``{"data_parallel_shard": 2}`` shards params
    and optimizer state over 2 processes (FSDP-style)."""
    model: ModelConfig = ModelConfig()
    """The reference model's size."""
    data: CorpusConfig = CorpusConfig()
    """The corpus."""
    eval_batches: int = Field(32, ge=1)
    """Validation batches (of trainer.batching.global_batch_size sequences) for perplexity."""
    sample: SampleConfig = SampleConfig()
    """Generation after evaluation."""


def default_job() -> LMJobConfig:
    """The embedded default job (``d9dfn train`` with no arguments)."""
    return LMJobConfig()


class Qwen3Provider(ModelProvider):
    """Builds the reference model from its config; ``family`` (an ``HF_FAMILIES`` key, ``model.family``) is the
    Hugging Face family a source checkpoint must be of."""

    def __init__(self, config: Qwen3Config, family: str = "qwen3") -> None:
        self.config = config
        self.family = family

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        """The whole model, or stage ``context.stage_index`` of ``context.num_stages`` (full param names)."""
        if context.num_stages > 1 and self.config.tie_word_embeddings:
            raise ValueError(
                f"Qwen3Provider: trainer.pipelining splits the model into {context.num_stages} stages, but "
                "model.tie_word_embeddings=true shares the embedding (first stage) with the LM head (last stage); "
                "set model.tie_word_embeddings=false (--set model.tie_word_embeddings=false)"
            )
        stage = PipelineStageInfo(current_stage=context.stage_index, num_stages=context.num_stages)
        return InitializeModelStageResult(model=Qwen3LM(self.config, stage))

    def prepare_load_model_stage(self, context: InitializeModelStageContext) -> PrepareLoadModelStageResult:
        """Reads ``d9dfn export`` folders (either format) and Hugging Face folders of the family, checking their
        config."""
        config, family = self.config, self.family
        return PrepareLoadModelStageResult(
            state_mapper=lambda state: from_hf_state(state, config),
            check_config=lambda found: check_source_config(config, found, family=family),
        )

    def dump_hparams(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self.config)}

    def memory_hint(self, model: torch.nn.Module) -> str:
        """The ``model.*`` setting whose default would shrink the model most, with the size it would have then."""
        defaults = ModelConfig()
        smaller: dict[str, int] = {}  # setting -> parameters with it at its default
        for name in _SIZE_FIELDS:
            if getattr(self.config, name) > getattr(defaults, name):
                try:
                    smaller[name] = _num_params(dataclasses.replace(self.config, **{name: getattr(defaults, name)}))
                except ValueError:  # e.g. num_heads back at 4 with num_kv_heads=3: not a model
                    continue
        if not smaller:
            return f"lower {', '.join(f'model.{name}' for name in _SIZE_FIELDS)} (--set), or shard the model (mesh)"
        name = min(smaller, key=smaller.__getitem__)
        return (
            f"lower model.{name} (it is {getattr(self.config, name)}; with the default {getattr(defaults, name)} the "
            f"model has {smaller[name]:.3g} parameters), e.g. --set model.{name}={getattr(defaults, name)}"
        )


_SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
"""The ``model.*`` settings that size the model's tensors."""


def _num_params(config: Qwen3Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3LM(config).parameters())


class CorpusProvider:
    """The stdlib corpus as windows of ``seq_len + 1`` bytes (inputs and next-byte labels)."""

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def __call__(self, context: InitializeDatasetContext) -> InitializeDatasetResult:
        corpus = stdlib_corpus(max_bytes=self.config.max_bytes, validation_every=self.config.validation_every)
        data = corpus.train if context.split == "train" else corpus.validation
        return InitializeDatasetResult(dataset=ByteWindowDataset(data, self.config.seq_len), collator=_collate)


def _collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _rng_kwarg(job: LMJobConfig) -> str | None:
    return "dropout_key" if job.model.dropout > 0 else None


def train_lm(
    job: LMJobConfig, on_ready: Callable[[], None] | None = None, *, resume_from: ResumeFrom = "latest"
) -> TrainResult:
    """Train the job's model; the run directory gets ``job.json`` beside checkpoints and logs.

    Args:
        job: the whole job.
        on_ready: called once set-up is done (config checked, model built, checkpoint restored), just before
            the first step (``train.ready``); the CLI uses it to tell bad input from a failing run.
        resume_from: which checkpoint to resume from (``Trainer.restore_latest``): ``"latest"``,
            ``"newest-intact"`` or a step.
    """
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    trainer = TrainingConfigurator(
        mesh=mesh_of(job),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(qwen3, job.model.family),
        data_provider=CorpusProvider(job.data),
        rng_kwarg=_rng_kwarg(job),
    ).configure()
    if trainer.main_process:
        # Once the resume check has passed (train.ready fires after the restore), so a refused resume leaves
        # the run's job.json, and with it `d9dfn export`, as they were; atomic, under the run directory's lock.
        def write_job(context: object) -> None:
            atomic_write(trainer.run_dir / "job.json", job.model_dump_json(indent=2))

        trainer.bus.subscribe(EVENT_TRAIN_READY, write_job)
    if on_ready is not None:
        trainer.bus.subscribe(EVENT_TRAIN_READY, lambda context: on_ready())
    return trainer.train(resume_from)


def mesh_of(job: LMJobConfig) -> DeviceMeshParameters:
    """The job's mesh: as configured, else data parallelism over the processes ``torchrun`` started."""
    return job.mesh or DeviceMeshParameters(data_parallel_replicate=launched_world_size())


def run_dir_of(job: LMJobConfig) -> Path:
    """Where the job's run lives: ``trainer.checkpointing.save_dir / trainer.run.name``."""
    return Path(job.trainer.run_dir)


EVALUATION_FILE = "evaluation.json"
"""Where ``evaluate_lm`` stores its result in the run directory, with what it depends on (``reuse``)."""


def evaluate_lm(
    job: LMJobConfig,
    run_dir: Path | None = None,
    on_ready: Callable[[], None] | None = None,
    *,
    step: int | Literal["newest-intact"] | None = None,
    reuse: bool = False,
) -> dict[str, Any]:
    """Validation perplexity of one of the run's checkpoints (``d9dfn infer``), and a generated sample.

    ``step`` picks the checkpoint (``d9dfn.checkpoint.load_weights``): ``None``, the newest; ``"newest-intact"``,
    the newest that is not corrupted; or a saved step. The report's ``checkpoint_step`` says which was read.

    On one process the result is stored in ``run_dir/evaluation.json`` with the checkpoint it read (its step and
    the modification time of its folder) and the settings it depends on (model, data, ``eval_batches``, batching,
    precision, compilation, device, determinism). With ``reuse``, a stored result that matches all of these is
    returned without evaluating again (``report["stored"]`` is then its path; the sample is generated anew from
    the checkpoint): ``d9dfn train`` followed by ``d9dfn infer`` evaluates once. A pipeline mesh always evaluates.

    ``on_ready`` is called once the checkpoint is loaded, before the first batch (``inference.ready``; with a
    stored result, before the sample). Only the newest step's evaluation is reused (``step`` ``None`` or its number).
    """
    run_dir = run_dir or run_dir_of(job)
    checkpoints = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []
    if not steps:
        raise FileNotFoundError(
            f"evaluate_lm: no checkpoint under {run_dir}; train first (`d9dfn train` with the same config), or point "
            "trainer.checkpointing.save_dir and trainer.run.name at a trained run"
        )
    mesh = inference_mesh(job)
    newest = step is None or step == steps[-1]
    key = None if mesh.is_distributed or not newest else _evaluation_key(job, checkpoints / str(steps[-1]))
    stored = _stored_evaluation(run_dir, key) if reuse and key is not None else None
    if stored is not None:
        model = load_model(run_dir, step=steps[-1], device=job.trainer.run.device)
        if on_ready is not None:
            on_ready()
        params = cast_params_tree(dict(model.named_parameters()), job.trainer.precision.policy().param_dtype)
        sample = generate(model, params, dict(model.named_buffers()), job.sample, seq_len=job.data.seq_len)
        return {**stored, "sample": sample, "stored": run_dir / EVALUATION_FILE}
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    inference = InferenceConfigurator(
        mesh=mesh,
        parameters=InferenceConfig.from_trainer(
            job.trainer, checkpointing=InferenceCheckpointingConfig(load_dir=run_dir, step=step)
        ),
        task_provider=PerplexityTask,
        model_provider=Qwen3Provider(qwen3, job.model.family),
        data_provider=CorpusProvider(job.data),
        split="validation",
        max_batches=job.eval_batches,
    ).configure()
    if on_ready is not None:
        inference.bus.subscribe(EVENT_INFERENCE_READY, lambda context: on_ready())
    result = inference.infer()
    report = {**result.task_result, "checkpoint_step": result.checkpoint_step}
    if key is not None and is_main_process():
        atomic_write(run_dir / EVALUATION_FILE, json.dumps({"key": key, "report": report}, indent=2))
    if is_main_process() and result.first_step_s is not None:
        timing = {"command": "evaluate", "checkpoint_step": result.checkpoint_step, "batches": result.num_batches}
        append_jsonl(run_dir / TIMINGS_FILE, {**timing, "first_step_s": round(result.first_step_s, 3)})
    if inference.pipeline is None:
        sample = generate(inference.skeleton, inference.params, inference.buffers, job.sample, seq_len=job.data.seq_len)
    else:
        sample = generate_pipelined(inference, job.sample, seq_len=job.data.seq_len)
    report["sample"] = sample
    return report


def _evaluation_key(job: LMJobConfig, checkpoint: Path) -> dict[str, Any]:
    """What a stored evaluation must match to be reused: the checkpoint read and every setting the numbers depend on."""
    trainer = job.trainer
    return {
        "checkpoint_step": int(checkpoint.name),
        "checkpoint_mtime_ns": checkpoint.stat().st_mtime_ns,  # a run trained again from scratch differs here
        "settings": {
            "model": job.model.model_dump(mode="json"),
            "data": job.data.model_dump(mode="json"),
            "eval_batches": job.eval_batches,
            **trainer.model_dump(
                mode="json", include={"batching", "precision", "compile", "repeated_blocks", "determinism"}
            ),
            "device": trainer.run.device,
        },
    }


def _stored_evaluation(run_dir: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The report stored in ``run_dir/evaluation.json`` if it was made with ``key``; else ``None``."""
    try:
        stored = json.loads((run_dir / EVALUATION_FILE).read_text())
    except (OSError, ValueError):
        return None  # none stored, or unreadable: evaluate again
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("report"), dict):
        return None
    return stored["report"]


def load_model(run_dir: str | Path, *, step: int | None = None, device: str = "cpu") -> Qwen3LM:
    """The model of a ``d9dfn train`` run (its ``job.json``) with the checkpoint's weights, in eval mode.

    Args:
        run_dir: the run's directory, e.g. ``runs/stdlib-lm``.
        step: the checkpoint's step; ``None``: the newest.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``job.json`` or no checkpoint (or not that step).

    >>> import tempfile
    >>> from d9dfn.config import load_config
    >>> tiny = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    ...         "model.head_dim=8", "model.intermediate_size=32", "data.max_bytes=20000", "data.seq_len=16",
    ...         "trainer.batching.global_batch_size=2", "trainer.batching.microbatch_size=2",
    ...         "trainer.lr_scheduler=null", "trainer.compile=false", "trainer.total_steps=2",
    ...         f"trainer.checkpointing.save_dir={tempfile.mkdtemp()}"]
    >>> result = train_lm(load_config(LMJobConfig, None, tiny, default=default_job()))
    >>> model = load_model(result.run_dir)
    >>> logits = model(torch.tensor([list(b"def ")]))["logits"]  # (1, 4, 256): next-byte scores
    >>> tuple(logits.shape), model.training
    ((1, 4, 256), False)
    """
    run_dir = Path(run_dir)
    job_file = run_dir / "job.json"
    if not job_file.is_file():
        raise FileNotFoundError(f"load_model: {job_file} is missing; pass the directory of a `d9dfn train` run")
    job = LMJobConfig.model_validate_json(job_file.read_text())
    provider = Qwen3Provider(job.model.to_qwen3(job.data.seq_len))
    model = load_provider_model(provider, run_dir, step=step, device=device)
    assert isinstance(model, Qwen3LM)
    return model


def inference_mesh(job: LMJobConfig) -> DeviceMeshParameters:
    """The mesh ``evaluate_lm`` runs on: the job's own with a pipeline (every rank evaluates its stage), else one
    process (any checkpoint restores onto one; ``d9dfn train`` under plain data parallelism evaluates on rank 0).

    >>> inference_mesh(LMJobConfig(mesh=DeviceMeshParameters(data_parallel_replicate=2))).is_distributed
    False
    """
    if job.mesh is not None and job.mesh.pipeline_parallel > 1:
        return job.mesh
    return DeviceMeshParameters()


@torch.no_grad()
def generate(model: torch.nn.Module, params: dict, buffers: dict, config: SampleConfig, *, seq_len: int) -> str:
    """Sample ``config.num_bytes`` bytes after ``config.prompt`` (edge code: a seeded torch generator)."""
    generator = torch.Generator().manual_seed(0)
    device = next(iter(params.values())).device
    ids = list(config.prompt.encode())
    for _ in range(config.num_bytes):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.int64, device=device)
        logits = torch.func.functional_call(model, (params, buffers), (context,))["logits"][0, -1]
        probs = torch.softmax(logits.float().cpu() / config.temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return decode_bytes(ids)


class _NextByteLogits(InferenceTask[dict[str, torch.Tensor]]):
    """The sampler's task: the last position's logits of a one-row batch become the task state."""

    def build_forward_inputs(
        self, batch: dict[str, torch.Tensor], state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state

    def process_outputs(self, task_state: Any, outputs: Any, state: PipelineState) -> torch.Tensor:
        return outputs["logits"][0, -1]  # (1, T, V) -> (V,)


@torch.no_grad()
def generate_pipelined(inference: Inference, config: SampleConfig, *, seq_len: int) -> str:
    """:func:`generate` through the pipeline: every rank runs its stage once per new byte; the last stage's rank
    samples (the same seeded generator, so the same bytes as one process) and broadcasts the byte over ``pp``.

    Every rank of the ``pp`` group must call it; each returns the whole sample.
    """
    rank_pipeline = inference.one_microbatch_pipeline()
    assert rank_pipeline is not None, "generate_pipelined: the inference runs on one process; call generate"
    program, group = rank_pipeline.program, rank_pipeline.group
    sampler = program.stage_to_rank[program.num_stages - 1] == rank_pipeline.rank
    source = torch.distributed.get_global_rank(group, program.stage_to_rank[program.num_stages - 1])
    # Eager (one shape per context length) and without a precision policy, as `generate` calls the model.
    step = make_inference_step(inference.skeleton, _NextByteLogits(), executor=rank_pipeline, compile=False)
    generator = torch.Generator().manual_seed(0)
    device = next(iter(inference.params.values())).device
    state = InferenceState(
        params=inference.params,
        buffers=inference.buffers,
        step=torch.zeros((), dtype=torch.int64, device=device),
        rng=torch.zeros((), dtype=torch.int64, device=device),
    )
    ids = list(config.prompt.encode())
    for _ in range(config.num_bytes):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.int64, device=device)
        logits = step(state, {"input_ids": context}).task_state  # None off the sampling rank
        token = torch.zeros((), dtype=torch.int64, device=device)
        if sampler:
            probs = torch.softmax(logits.float().cpu() / config.temperature, dim=-1)
            token.fill_(int(torch.multinomial(probs, 1, generator=generator)))
        torch.distributed.broadcast(token, src=source, group=group)
        ids.append(int(token))
    return decode_bytes(ids)


EXPORT_FORMATS = ("d9dfn", "hf")
"""``d9dfn export --format``: d9dfn's names and ``Qwen3Config`` fields, or a Hugging Face folder of the job's
``model.family`` (``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (and d9dfn too, as a source checkpoint)."""


def export_lm(
    run_dir: Path, out_dir: Path, format: str = "d9dfn", *, step: int | Literal["newest-intact"] | None = None
) -> Path:
    """Write the weights of one of the run's checkpoints as ``out_dir/model.safetensors`` plus ``config.json``.

    ``step`` picks the checkpoint as in :func:`evaluate_lm` (default: the newest); a corrupted one is refused
    (``CheckpointCorruptedError``), a skipped one logged as a warning.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"d9dfn export: format={format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    job_file = run_dir / "job.json"
    if not job_file.is_file():
        raise FileNotFoundError(f"d9dfn export: {job_file} is missing; pass the directory of a `d9dfn train` run")
    job = LMJobConfig.model_validate_json(job_file.read_text())
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    provider = Qwen3Provider(qwen3, job.model.family)
    skeleton, model = materialize_model(provider, InitializeModelStageContext(), torch.device("cpu"))
    params, buffers, _ = load_weights(run_dir, model, step)
    if format == "hf":
        path = export_safetensors(skeleton, params, buffers, out_dir, lambda state: to_hf_state(state, qwen3))
        config_json = to_hf_config(qwen3, job.model.family)
    else:
        path = export_safetensors(skeleton, params, buffers, out_dir)
        config_json = dataclasses.asdict(qwen3)
    atomic_write(out_dir / "config.json", json.dumps(config_json, indent=2))
    return path


def check_source_config(config: Qwen3Config, found: dict[str, Any], *, family: str = "qwen3") -> None:
    """Raise unless a source checkpoint's ``config.json`` describes the model ``config`` builds; every message
    names the job's ``--set`` path that fixes it.

    An HF folder (``model_type`` present) must be of ``family`` (the job's ``model.family``) and is checked by
    :func:`d9dfn.models.check_hf_config`; d9dfn's own format (``Qwen3Config`` fields) field by field, on the
    fields that change what the model computes.

    >>> check_source_config(Qwen3Config(), {"model_type": "llama"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the HF config.json is a LlamaForCausalLM (...) but this job's ...; set --set model.family=llama
    """
    if "model_type" in found:
        model_type = found["model_type"]
        if model_type != family and model_type in HF_FAMILIES:
            raise ValueError(
                f"the HF config.json is a {HF_FAMILIES[model_type].architecture} (model_type {model_type!r}) but this "
                f"job's model.family is {family!r}; set --set model.family={model_type}"
            )
        check_hf_config(config, found, fix=_job_fix)
        return
    for name in HF_FIELDS:
        if name in found and found[name] != getattr(config, name):
            raise ValueError(
                f"the checkpoint's model has {name}={found[name]!r} but this job's has {getattr(config, name)!r}; "
                f"{_job_fix(name, found[name])}, or load a checkpoint of this model"
            )
    # Exports before model.family carry no switches: their names and shapes still have to fit (q_norm, biases).
    switches = {name: found[name] for name in HF_FAMILIES[family].switches() if name in found}
    ours = {name: getattr(config, name) for name in switches}
    if switches != ours:
        families = [name for name, spec in HF_FAMILIES.items() if switches.items() <= spec.switches().items()]
        fix = (
            f"set --set model.family={' or '.join(families)}"
            if families
            else "no model.family builds that: load it in Python (d9dfn.models.Qwen3LM with its config.json's fields)"
        )
        raise ValueError(
            f"the checkpoint's model has {_fields(switches)} but this job's has {_fields(ours)}; {fix}, or load a "
            "checkpoint of this model"
        )


def _fields(values: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in values.items())


def _job_fix(name: str, value: Any) -> str:
    """How the job sets ``Qwen3Config`` field ``name`` to ``value``: its ``--set`` path, or why it cannot."""
    if name == "max_seq_len":
        return f"set --set data.seq_len={value}"
    if name in ModelConfig.model_fields:
        return f"set --set model.{name}={json.dumps(value)}"
    reason = "its vocabulary is the 256 byte values" if name == "vocab_size" else "it has no setting for it"
    return (
        f"this job cannot build {name}={value!r} ({reason}): load the folder in Python instead "
        "(d9dfn.models.from_hf_config builds the matching Qwen3Config)"
    )
