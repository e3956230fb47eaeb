"""The job's checks against its run, before anything is built: the run's own model settings and the batch arithmetic.

A run directory keeps the job that trained it (``job.json``, written once the resume check has passed). ``d9dfn
train`` resumes a run and ``d9dfn infer`` evaluates it only with the model settings it was trained with: a 2-layer
job would otherwise read the first 2 layers of a 4-layer checkpoint and report their perplexity as the run's. Each
refusal is one line naming the ``--set`` path, the run's value and the way on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from d9dfn.config import ConfigError, load_config
from d9dfn.jobs._config import LMJobConfig, ModelConfig
from d9dfn.loop import EVENT_TRAIN_READY, Trainer, atomic_write, committed_steps

__all__ = [
    "check_context_degree",
    "check_experts",
    "check_tensor_degree",
    "UNCOMPARED_MODEL_FIELDS",
    "check_batching",
    "check_run_model",
    "check_run_source",
    "read_run_job",
    "record_run_job",
    "run_model",
]

UNCOMPARED_MODEL_FIELDS = frozenset({"dropout"})
"""``model.*`` settings a run may change between its commands: dropout has no parameter and no effect on evaluation
(a resumed run may train on with another rate, as with another learning rate)."""


def read_run_job(run_dir: Path, who: str) -> LMJobConfig:
    """The job a run was trained with (``run_dir/job.json``).

    Raises:
        FileNotFoundError: the run has no ``job.json``.
        ValueError: it is not a valid job (edited, or written by another d9dfn); the message names the field.
    """
    job_file = run_dir / "job.json"
    if not job_file.is_file():
        raise FileNotFoundError(f"{who}: {job_file} is missing; pass the directory of a `d9dfn train` run")
    try:
        return load_config(LMJobConfig, job_file)
    except ConfigError as error:
        raise ValueError(f"{who}: {job_file} is not a job this d9dfn reads ({error}); restore the file") from None


def check_run_source(job: LMJobConfig, run_dir: Path, who: str) -> None:
    """Refuse, in one line, a run whose ``model.source`` folder (its ``job.json``'s) is gone: the run's model
    settings, tokenizer and, for a ``trainer.peft`` run, the frozen base its checkpoints leave out are read there.

    Raises:
        FileNotFoundError: the folder or its ``config.json`` is missing.
    """
    source = job.model.source
    if source is not None and not (source / "config.json").is_file():
        what = "is not a folder now" if not source.is_dir() else "has no config.json now"
        raise FileNotFoundError(
            f"{who}: the run's model.source {source} ({run_dir / 'job.json'}) {what}: its config, tokenizer and "
            f"weights (a trainer.peft run's frozen base) are read from there; put the model the run was trained on "
            f"back at {source}"
        )


def record_run_job(trainer: Trainer, job: BaseModel, on_ready: Callable[[], None] | None = None) -> None:
    """Write ``job`` as the run's ``job.json`` (the main process; atomic, under the run directory's lock), then call
    ``on_ready``, at ``train.ready``: it fires once the resume check has passed (after the restore), so a refused
    resume leaves the run's ``job.json``, and with it ``d9dfn export``, as they were (what :func:`read_run_job`
    reads back)."""
    if trainer.main_process:

        def write_job(context: object) -> None:
            atomic_write(trainer.run_dir / "job.json", job.model_dump_json(indent=2))

        trainer.bus.subscribe(EVENT_TRAIN_READY, write_job)
    if on_ready is not None:
        trainer.bus.subscribe(EVENT_TRAIN_READY, lambda context: on_ready())


def run_model(run_dir: Path) -> ModelConfig | None:
    """The model settings ``run_dir`` was trained with, or ``None`` when it has no readable ``job.json`` (a run of
    the library's ``Trainer``, or an older one): the checkpoint's own structure is then what is checked."""
    try:
        return read_run_job(run_dir, "").model
    except (OSError, ValueError):
        return None


def check_run_model(job: LMJobConfig, run_dir: Path, command: Literal["train", "infer"]) -> None:
    """Refuse ``job`` if its model settings differ from those ``run_dir`` was trained with (when it has a committed
    checkpoint and a readable ``job.json``), in one line naming each ``--set`` path, the run's value and the way on.

    Raises:
        ValueError: a ``model.*`` setting differs (``dropout`` aside, :data:`UNCOMPARED_MODEL_FIELDS`).
    """
    if not committed_steps(run_dir / "checkpoints"):
        return  # nothing saved: a train starts over, an infer says there is nothing to evaluate
    saved = run_model(run_dir)
    if saved is None:
        return
    theirs, ours = saved.model_dump(mode="json"), job.model.model_dump(mode="json")
    differ = [name for name in ours if name not in UNCOMPARED_MODEL_FIELDS and ours[name] != theirs.get(name)]
    if not differ:
        return
    trained = ", ".join(f"model.{name}={_json(theirs.get(name))}" for name in differ)
    given = ", ".join(f"model.{name}={_json(ours[name])}" for name in differ)
    # Another model.source: its folder decides the sizes, so naming it is the whole way back.
    keep_fields = ["source"] if "source" in differ and theirs.get("source") is not None else differ
    keep = " ".join(f"--set model.{name}={_json(theirs.get(name))}" for name in keep_fields)
    where = f"this run ({run_dir}) was trained with {trained} (its job.json) but this job has {given}"
    if command == "train":
        raise ValueError(
            f"{where}; to resume it, keep its settings ({keep}, or drop those --set); to train the new settings, "
            f"give them a new run: --set trainer.run.name={run_dir.name}-new"
        )
    raise ValueError(
        f"{where}, and a checkpoint evaluated as another model reports that model's numbers; evaluate it with its "
        f"settings ({keep}, or drop those --set), or point trainer.run.name at a run trained with these"
    )


def check_experts(job: LMJobConfig, mesh: Any) -> None:
    """``mesh.expert_parallel`` against the model's experts, refused in one line before anything is built: a model
    without experts, or an expert count the expert-parallel ranks cannot split evenly; and an MoE model pipelined
    with a compute dtype other than float32 (the expert load crossing the stages would be cast to it)."""
    num_experts = getattr(job.model.to_qwen3(job.data.seq_len), "num_experts", None)
    compute = job.trainer.precision.compute_dtype
    if num_experts is not None and job.trainer.pipelining is not None and compute != "float32":
        raise ValueError(
            f"model.family={job.model.family} with trainer.pipelining and trainer.precision.compute_dtype={compute}: "
            f"the expert counts and router probabilities that cross the stages would be cast to {compute} (counts "
            "above 256 round in bfloat16); set --set trainer.precision.compute_dtype=float32, or drop "
            "trainer.pipelining"
        )
    degree = mesh.expert_parallel
    if degree == 1:
        return
    if num_experts is None:
        raise ValueError(
            f"mesh.expert_parallel={degree} but model.family={job.model.family} has no experts; set --set "
            "mesh.expert_parallel=1, or an MoE family (--set model.family=qwen3_moe)"
        )
    if num_experts % degree:
        raise ValueError(
            f"mesh.expert_parallel={degree} does not divide model.moe.num_experts={num_experts}: each expert-parallel "
            f"rank holds the same number of experts; set --set mesh.expert_parallel to a divisor of {num_experts}, "
            f"or --set model.moe.num_experts to a multiple of {degree}"
        )


def check_tensor_degree(job: LMJobConfig, mesh: Any) -> None:
    """``mesh.tensor_parallel`` against the model, refused in one line before anything is built: a family without a
    tensor-parallel path (the MoE one), heads, kv-heads or an MLP width the degree does not
    divide (``d9dfn.models.check_tensor_parallel``); with ``mesh.vocab_parallel`` (the default) a vocabulary it does
    not divide; with ``mesh.sequence_parallel`` a ``data.seq_len`` it does not divide, or dropout."""
    from d9dfn.models import check_tensor_parallel

    degree = mesh.tensor_parallel
    if degree == 1:
        return
    if job.model.family == "qwen3_moe":
        raise ValueError(
            f"mesh.tensor_parallel={degree} but model.family=qwen3_moe has no tensor-parallel path yet (the dense "
            "decoder families have); set --set mesh.tensor_parallel=1, or use mesh.expert_parallel"
        )
    config = job.model.to_qwen3(job.data.seq_len)
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads}
    check_tensor_parallel({**sizes, "intermediate_size": config.intermediate_size}, degree)
    if mesh.vocab_parallel and config.vocab_size % degree:
        raise ValueError(
            f"mesh.tensor_parallel={degree} does not divide the model's vocab_size={config.vocab_size} (model.source's "
            "config.json, or the 256 byte values), which mesh.vocab_parallel=true splits over the tensor-parallel "
            f"ranks; set --set mesh.tensor_parallel to a divisor of {config.vocab_size}, or --set "
            "mesh.vocab_parallel=false (the embedding and the LM head then computed whole)"
        )
    if mesh.sequence_parallel and job.data.seq_len % degree:
        raise ValueError(
            f"mesh.sequence_parallel=true splits each sequence over mesh.tensor_parallel={degree} ranks, but "
            f"data.seq_len={job.data.seq_len} does not divide by it; set --set data.seq_len to a multiple of {degree}"
        )
    if mesh.sequence_parallel and config.dropout > 0:
        raise ValueError(
            f"mesh.sequence_parallel=true with model.dropout={config.dropout}: the blocks' dropout masks would be "
            "drawn per part of the sequence; set --set model.dropout=0 or mesh.sequence_parallel=false"
        )


def check_context_degree(job: LMJobConfig, mesh: Any) -> None:
    """``mesh.context_parallel_shard`` against the job, refused in one line before anything is built: what the step
    does not build with context parallelism yet (a pipeline, the MoE family, dropout) and a ``data.seq_len`` that
    ``2·cp`` chunks do not cut evenly (``d9dfn.parallel.check_context_parallel``), or with sequence parallelism beside
    (``mesh.tensor_parallel`` composes with it) whose ``seq_len / cp`` positions per rank ``mesh.tensor_parallel`` does
    not divide; with your files unpacked, a padding multiple they do not divide."""
    from d9dfn.jobs._files import pad_multiple
    from d9dfn.parallel import check_context_parallel

    degree = mesh.context_parallel_shard
    if degree == 1:
        return
    setting = f"mesh.context_parallel_shard={degree}"
    refused = [  # (setting, its value, whether refused, the way on)
        ("mesh.pipeline_parallel", mesh.pipeline_parallel, mesh.pipeline_parallel > 1, "1"),
        ("trainer.pipelining", "{...}", job.trainer.pipelining is not None, "null"),
        ("model.family", job.model.family, job.model.family == "qwen3_moe", "qwen3"),
        ("model.dropout", job.model.dropout, job.model.dropout > 0, "0"),
    ]
    for path, value, on, way in refused:
        if on:
            raise ValueError(
                f"{setting} with {path}={value} is not built yet (context parallelism runs the dense decoder, one "
                f"stage, without dropout); set --set {path}={way} or --set mesh.context_parallel_shard=1"
            )
    check_context_parallel(job.data.seq_len, degree)
    # With SP each context rank's T/cp positions are split further over tp between the blocks.
    tensor = mesh.tensor_parallel if mesh.sequence_parallel else 1
    multiple = math.lcm(2 * degree, degree * tensor)
    if job.data.seq_len % multiple:
        raise ValueError(
            f"{setting} with mesh.sequence_parallel=true splits each rank's data.seq_len/{degree}="
            f"{job.data.seq_len // degree} positions over mesh.tensor_parallel={tensor} ranks, which do not divide "
            f"them; set --set data.seq_len to a multiple of {multiple} or --set mesh.sequence_parallel=false"
        )
    unpacked = getattr(job.data, "packing", True) is False
    if unpacked and pad_multiple(job.data.seq_len) % multiple:
        split = f" (each rank's split over {tensor} sequence-parallel ranks)" if tensor > 1 else ""
        raise ValueError(
            f"{setting} cuts each sequence into {2 * degree} chunks{split}, but your files unpacked are padded to "
            f"multiples of {pad_multiple(job.data.seq_len)} (a quarter of data.seq_len={job.data.seq_len}, rounded up "
            f"to 8), which {multiple} does not divide; set --set "
            "data.packing=true or --set mesh.context_parallel_shard to a degree whose double divides it"
        )


def check_batching(job: LMJobConfig, data_parallel_size: int) -> None:
    """The batch arithmetic over ``data_parallel_size`` ranks, refused in the job's own paths (``trainer.batching``)
    before anything is built."""
    job.trainer.batch_maths(data_parallel_size, section="trainer.batching")


def _json(value: Any) -> str:
    return json.dumps(value)
