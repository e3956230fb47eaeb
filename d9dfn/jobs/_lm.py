"""The main job: a byte-level Qwen3-style LM trained on the Python standard library's own sources.

``d9dfn train`` with no arguments runs :func:`default_job`; ``d9dfn infer`` evaluates the latest
checkpoint's validation perplexity and prints a generated sample. Every machine with Python has this
corpus, so the job needs no download. A job is one JSON document (:class:`LMJobConfig`); the run
directory keeps a copy (``job.json``) so ``infer`` and ``export`` find the model that was trained.

With ``model.source`` (a Hugging Face folder) the model is that folder's, started from its weights, and the
corpus's text goes through its tokenizer (``jobs/_source.py``); ``d9dfn export --format hf`` writes the folder's
``config.json`` and tokenizer files beside the trained weights. The folder is read again by ``infer`` and
``export``: keep it where the run's ``job.json`` says.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from d9dfn.checkpoint import CheckpointMismatchError, export_safetensors, load_weights
from d9dfn.config import (
    DeviceMeshParameters,
    InferenceCheckpointingConfig,
    InferenceConfig,
    TrainerConfig,
    build_peft,
)
from d9dfn.data import Tokenizer
from d9dfn.jobs._checks import (
    check_batching,
    check_context_degree,
    check_experts,
    check_run_model,
    check_run_source,
    check_tensor_degree,
    read_run_job,
    record_run_job,
)
from d9dfn.jobs._config import LMJobConfig
from d9dfn.jobs._files import FilesProvider, static_shapes
from d9dfn.jobs._hf_folder import copy_tokenizer_files, read_source_config
from d9dfn.jobs._peft_export import check_peft_export, export_adapter
from d9dfn.jobs._providers import CorpusProvider, Qwen3Provider, data_provider
from d9dfn.jobs._sample import generate, generate_pipelined
from d9dfn.jobs._source import resolve_source
from d9dfn.loop import (
    EVENT_INFERENCE_READY,
    TIMINGS_FILE,
    InferenceConfigurator,
    InitializeModelStageContext,
    ResumeFrom,
    TrainingConfigurator,
    TrainResult,
    append_jsonl,
    atomic_write,
    check_writable,
    is_main_process,
    launched_world_size,
    load_source_checkpoint,
    materialize_model,
)
from d9dfn.loop import load_model as load_provider_model
from d9dfn.models import (
    FAMILIES,
    Qwen3LM,
    check_targets,
    lora_modules,
    merge_lora,
    to_hf_config,
)
from d9dfn.step._precision import cast_params_tree
from d9dfn.tasks import CausalLMTask, PerplexityTask

__all__ = [
    "EXPORT_FORMATS",
    "evaluate_lm",
    "export_lm",
    "inference_mesh",
    "load_model",
    "mesh_of",
    "run_dir_of",
    "train_lm",
]


def _rng_kwarg(job: LMJobConfig) -> str | None:
    adapters = any(getattr(method, "dropout", 0.0) > 0 for method in job.trainer.peft)  # LoRA's dropout
    return "dropout_key" if job.model.dropout > 0 or adapters else None


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
    job, tokenizer = resolve_source(job)  # model.source: the folder's model and tokenizer, checked first
    mesh = mesh_of(job)
    check_batching(job, mesh.data_parallel_size)  # in the job's --set paths, before anything is built
    check_experts(job, mesh)
    check_tensor_degree(job, mesh)
    check_context_degree(job, mesh)
    check_run_model(job, run_dir_of(job), "train")
    data = _data_provider(job, tokenizer)  # your files are read and checked here, before anything is built
    trainer = TrainingConfigurator(
        mesh=mesh,
        parameters=_trainer_with_source(job),
        task_provider=_task_provider(job),
        model_provider=_model_provider(job),
        data_provider=data,
        rng_kwarg=_rng_kwarg(job),
    ).configure()
    record_run_job(trainer, job, on_ready)
    with static_shapes(job.data):
        return trainer.train(resume_from)


def _task_provider(job: LMJobConfig) -> Callable[[], CausalLMTask]:
    """The causal-LM task; for an MoE model, its load-balancing loss weighted in by ``router_aux_loss_coef`` and its
    per-expert counts in the metrics."""
    config = job.model.to_qwen3(job.data.seq_len)
    num_experts = getattr(config, "num_experts", None)
    if num_experts is None:
        return CausalLMTask
    return functools.partial(CausalLMTask, aux_loss_weight=config.router_aux_loss_coef, num_experts=num_experts)  # type: ignore[attr-defined]


def _data_provider(job: LMJobConfig, tokenizer: Tokenizer) -> CorpusProvider | FilesProvider:
    """The job's data through ``tokenizer`` (``model.source``'s, else UTF-8 bytes): your files (``data.files``: read,
    tokenized and checked now, before anything is built), or the stdlib corpus."""
    return data_provider(job.data, job.model.to_qwen3(job.data.seq_len), tokenizer)


def _model_provider(job: LMJobConfig) -> Qwen3Provider:
    """The job's model provider; ``trainer.peft``'s targets are checked here against the whole model (on the meta
    device), so a regex that matches nothing is one line naming it before anything is built."""
    config = job.model.to_qwen3(job.data.seq_len)
    peft = build_peft(job.trainer.peft)
    if peft:
        with torch.device("meta"):
            whole = FAMILIES[job.model.family].model(config, None)
        try:
            check_targets(whole, peft)
        except ValueError as error:
            raise ValueError(f"trainer.peft{str(error).removeprefix('methods')}") from None
    return Qwen3Provider(config, job.model.family, source=job.model.source, peft=peft)


def _trainer_with_source(job: LMJobConfig) -> TrainerConfig:
    """The trainer's settings, with ``model.source``'s weights as the initial ones (unless
    ``trainer.model_stage_factory.source_checkpoint`` names other weights, which the folder's config must fit)."""
    trainer, source = job.trainer, job.model.source
    if source is None:
        return trainer
    if trainer.pipelining is not None and trainer.peft:
        raise ValueError(
            f"model.source={str(source)!r} with trainer.pipelining and trainer.peft: a trainer.peft run's "
            "checkpoints leave the frozen base out (only the folder gives it back), which pipeline stages do not read "
            "at a resume yet; train it without pipelining (--set trainer.pipelining=null)"
        )
    if trainer.model_stage_factory.source_checkpoint is not None:
        return trainer
    factory = trainer.model_stage_factory.model_copy(update={"source_checkpoint": source})
    return trainer.model_copy(update={"model_stage_factory": factory})


def mesh_of(job: LMJobConfig) -> DeviceMeshParameters:
    """The job's mesh: as configured, else data parallelism over the processes ``torchrun`` started (also when only
    ``mesh.expert_parallel`` is set: the experts carved out of those processes)."""
    if job.mesh is None:
        return DeviceMeshParameters(data_parallel_replicate=launched_world_size())
    if job.mesh.world_size == 1 and job.mesh.expert_parallel > 1:  # experts over data parallelism of every process
        return job.mesh.model_copy(update={"data_parallel_replicate": launched_world_size()})
    return job.mesh


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
    job, tokenizer = resolve_source(job)
    check_run_model(job, run_dir, "infer")
    mesh = inference_mesh(job)
    newest = step is None or step == steps[-1]
    key = None if mesh.is_distributed or not newest else _evaluation_key(job, checkpoints / str(steps[-1]))
    stored = _stored_evaluation(run_dir, key) if reuse and key is not None else None
    if stored is not None:
        model = load_model(run_dir, step=steps[-1], device=job.trainer.run.device)
        if on_ready is not None:
            on_ready()
        params = cast_params_tree(dict(model.named_parameters()), job.trainer.precision.policy().param_dtype)
        sample = generate(
            model, params, dict(model.named_buffers()), job.sample, seq_len=job.data.seq_len, tokenizer=tokenizer
        )
        return {**stored, "sample": sample, "stored": run_dir / EVALUATION_FILE}
    inference = InferenceConfigurator(
        mesh=mesh,
        parameters=InferenceConfig.from_trainer(
            job.trainer, checkpointing=InferenceCheckpointingConfig(load_dir=run_dir, step=step)
        ),
        task_provider=PerplexityTask,
        model_provider=_model_provider(job),
        data_provider=_data_provider(job, tokenizer),
        split="validation",
        max_batches=job.eval_batches,
    ).configure()
    if on_ready is not None:
        inference.bus.subscribe(EVENT_INFERENCE_READY, lambda context: on_ready())
    with static_shapes(job.data):
        result = inference.infer()
    report = {**result.task_result, "checkpoint_step": result.checkpoint_step, "unit": tokenizer.unit}
    if key is not None and is_main_process():
        atomic_write(run_dir / EVALUATION_FILE, json.dumps({"key": key, "report": report}, indent=2))
    if is_main_process() and result.first_step_s is not None:
        timing = {"command": "evaluate", "checkpoint_step": result.checkpoint_step, "batches": result.num_batches}
        append_jsonl(run_dir / TIMINGS_FILE, {**timing, "first_step_s": round(result.first_step_s, 3)})
    if inference.pipeline is None:
        sample = generate(
            inference.skeleton,
            inference.params,
            inference.buffers,
            job.sample,
            seq_len=job.data.seq_len,
            tokenizer=tokenizer,
        )
    else:
        sample = generate_pipelined(inference, job.sample, seq_len=job.data.seq_len, tokenizer=tokenizer)
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
    >>> from d9dfn.jobs import default_job
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
    job = read_run_job(run_dir, "load_model")
    check_run_source(job, run_dir, "load_model")
    model = load_provider_model(_model_provider(job), run_dir, step=step, device=device)
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


EXPORT_FORMATS = ("d9dfn", "hf", "peft")
"""``d9dfn export --format``: d9dfn's names and ``Qwen3Config`` fields, or a Hugging Face folder of the job's
``model.family`` (``Qwen3ForCausalLM``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``) that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (and d9dfn too, as a source checkpoint); for a
``model.source`` run, with that folder's ``config.json`` and tokenizer files (``AutoTokenizer`` loads it too). A
``trainer.peft`` run exports its adapters merged into the base weights in both; ``peft`` writes the LoRA adapters
alone in the PEFT library's format (``adapter_config.json``, ``adapter_model.safetensors``), which
``peft.PeftModel.from_pretrained`` puts on the base model (``jobs/_peft_export.py``)."""


def _check_export_folder(run_dir: Path, out_dir: Path) -> None:
    """Refuse, before reading anything, an export folder that is a file (or lies under one), lies inside the run's
    checkpoints (the export would add files to a saved step, which its file list then refuses), or cannot be written.
    Nothing is created here: a refused export leaves no empty folder behind."""
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())  # `out_dir` or the folder it goes in
    if not existing.is_dir():
        what = "is a file" if existing == out_dir else f"lies under {existing}, a file"
        raise ValueError(
            f"d9dfn export: OUT_DIR {out_dir} {what}, not a folder; pass a folder (created if missing) for "
            "model.safetensors and config.json"
        )
    checkpoints = (run_dir / "checkpoints").resolve()
    if out_dir.resolve().is_relative_to(checkpoints):
        raise ValueError(
            f"d9dfn export: OUT_DIR {out_dir} is inside the run's checkpoints ({run_dir / 'checkpoints'}), whose "
            "steps must stay as they were saved; pass a folder outside it"
        )
    check_writable(existing, "OUT_DIR (d9dfn export's second argument)")  # a test file, removed at once


def export_lm(
    run_dir: Path, out_dir: Path, format: str = "d9dfn", *, step: int | Literal["newest-intact"] | None = None
) -> Path:
    """Write the weights of one of the run's checkpoints as ``out_dir/model.safetensors`` plus ``config.json``.

    ``step`` picks the checkpoint as in :func:`evaluate_lm` (default: the newest); a corrupted one is refused
    (``CheckpointCorruptedError``), a skipped one logged as a warning. A ``model.source`` run exported as ``hf``
    gets the source's ``config.json`` as it is but for ``dtype`` (``d9dfn.models.to_hf_config``'s ``source``) and
    its tokenizer files (``TOKENIZER_FILES``). The weights keep the dtype the run saved them in
    (``trainer.precision.param_dtype``: a pure-bf16 run exports bfloat16; LoRA adapters are merged in float32, then
    rounded to it), and ``hf``'s ``config.json`` names it.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"d9dfn export: format={format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    job = read_run_job(run_dir, "d9dfn export")
    check_run_source(job, run_dir, "d9dfn export")
    _check_export_folder(run_dir, out_dir)
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    provider = _model_provider(job)
    if format == "peft":
        check_peft_export(provider.peft, "d9dfn export --format peft")
    context = InitializeModelStageContext()
    skeleton, model = materialize_model(provider, context, torch.device("cpu"))
    try:
        params, buffers, _ = load_weights(
            run_dir,
            model,
            step,
            load_base=lambda module, folder: load_source_checkpoint(provider, context, module, folder),
        )
    except CheckpointMismatchError as error:
        raise ValueError(
            f"d9dfn export: {run_dir / 'job.json'} describes another model than checkpoint {error.which} holds "
            f"({error.difference()}); the file was edited or replaced: restore the run's own job.json"
        ) from None
    if format == "peft":
        return export_adapter(model, params, out_dir, job.model.family, qwen3, source=job.model.source)
    adapted = lora_modules(model)
    if adapted:  # the base model with the adapters folded in: what transformers (or d9dfn without peft) loads
        params = merge_lora(params, {name: m.scaling for name, m in adapted.items()})
        with torch.device("meta"):
            skeleton = FAMILIES[job.model.family].model(qwen3, None)
    if format == "hf":
        source = None if job.model.source is None else read_source_config(job.model.source)
        to_hf_state = FAMILIES[job.model.family].to_hf_state
        dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
        # First: a model the family's HF class cannot express (an MoE shared expert) is refused before any file.
        config_json = to_hf_config(qwen3, job.model.family, source=source, dtype=dtype)
        path = export_safetensors(skeleton, params, buffers, out_dir, lambda state: to_hf_state(state, qwen3))
        if job.model.source is not None:
            copy_tokenizer_files(job.model.source, out_dir)
    else:
        path = export_safetensors(skeleton, params, buffers, out_dir)
        config_json = dataclasses.asdict(qwen3)
    atomic_write(out_dir / "config.json", json.dumps(config_json, indent=2))
    return path
