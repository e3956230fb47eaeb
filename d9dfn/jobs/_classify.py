"""The classification job: a decoder family with a classification head (``d9dfn.models.SequenceClassifier``) trained
on your labelled records (``d9dfn train CONFIG`` with ``"job": "classification"``).

A record is a JSONL line (or a Parquet / ``datasets`` row) with a text field and an integer label field. Every record
is read, checked and tokenized when the job starts, before anything is built: a record without the label field,
a label outside ``[0, num_labels)`` or a text that is not a string is one line naming the file and the line (exit 2).
Each text becomes at most ``data.seq_len`` tokens (longer ones are cut, the log says how many), right-padded to
``data.seq_len`` (one static shape: the step compiles once); the head pools the last non-pad token by default
(Hugging Face's rule), so the pad id is the model's ``pad_token_id``.

A job of its own rather than a ``model.head`` setting of the language-model job: what that job's settings and
commands mean (next-token data formats, loss masks, packing, perplexity and sampling in ``d9dfn infer``, a causal LM
in ``d9dfn export``) does not apply to a classifier, and each setting of a job must be live.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from d9dfn.config import (
    DeviceMeshParameters,
    FrozenConfig,
    RunConfig,
    TrainerConfig,
)
from d9dfn.data import ByteTokenizer, DataError, Tokenizer, expand_files, read_records
from d9dfn.jobs._checks import record_run_job
from d9dfn.jobs._config import ModelConfig, default_trainer
from d9dfn.jobs._hf_folder import read_source_config
from d9dfn.jobs._providers import check_source_config
from d9dfn.jobs._source import resolve_source
from d9dfn.loop import (
    InitializeDatasetContext,
    InitializeDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    PrepareLoadModelStageResult,
    ResumeFrom,
    TrainingConfigurator,
    TrainResult,
    is_main_process,
    launched_world_size,
)
from d9dfn.models import (
    FAMILIES,
    Qwen3Config,
    SequenceClassifier,
    classifier_from_hf_state,
    from_hf_classifier_config,
    num_parameters,
)
from d9dfn.tasks import ClassificationTask

__all__ = [
    "ClassificationDataConfig",
    "ClassificationJobConfig",
    "ClassificationProvider",
    "ClassifierProvider",
    "HeadConfig",
    "LabelledTexts",
    "classifier_run_dir",
    "default_classification_job",
    "read_labelled",
    "train_classifier",
]


class HeadConfig(FrozenConfig):
    """The classification head on the model's final hidden states."""

    num_labels: int = Field(2, ge=2)
    """The classes; labels are integers in [0, num_labels)."""
    pooling: Literal["last", "first", "mean"] = "last"
    """Which token's scores classify the text: the last non-pad token (Hugging Face's *ForSequenceClassification),
    the first, or the mean over the non-pad tokens."""


class ClassificationDataConfig(FrozenConfig):
    """Your labelled records: JSONL lines (Parquet rows, a datasets folder) with a text field and a label field."""

    files: tuple[str, ...] = Field(min_length=1)
    """Paths or globs of the training records (``**`` crosses folders)."""
    validation_files: tuple[str, ...] | None = None
    """Records for validation (trainer.evaluation); ``None``: no validation split."""
    text_field: str = "text"
    """The field holding the text to classify."""
    label_field: str = "label"
    """The field holding the label: an integer in [0, head.num_labels)."""
    seq_len: int = Field(128, ge=2)
    """Tokens per text: longer texts are cut to it, shorter ones padded to it."""


def _default_classification_trainer() -> TrainerConfig:
    trainer = default_trainer()
    run = RunConfig(name="classify", description="sequence classification on your labelled records")
    return trainer.model_copy(update={"run": run})


class ClassificationJobConfig(FrozenConfig):
    """A whole classification job: the trainer, the model with its head, and the labelled records."""

    job: Literal["classification"]
    """Which job this config is: ``classification`` (the CLI picks the job by it; without it, the language model)."""
    trainer: TrainerConfig = Field(default_factory=_default_classification_trainer)
    """The training loop (d9d's ``TrainerConfig``)."""
    mesh: DeviceMeshParameters | None = None
    """How the processes split the work; ``None``: data parallelism over the processes ``torchrun`` started."""
    model: ModelConfig = ModelConfig()
    """The backbone's family and size; ``model.source``: a Hugging Face folder's (its weights and tokenizer)."""
    head: HeadConfig = HeadConfig()
    """The classification head (on a ``*ForSequenceClassification`` folder, the folder's score: its labels)."""
    data: ClassificationDataConfig
    """The labelled records."""


@dataclasses.dataclass(frozen=True)
class LabelledTexts:
    """Tokenized, padded texts and their labels: ``input_ids`` (N, seq_len), ``labels`` (N,)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    num_cut: int
    """How many texts were longer than ``seq_len`` and cut."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def read_labelled(
    files: Sequence[str],
    tokenizer: Tokenizer,
    *,
    text_field: str,
    label_field: str,
    num_labels: int,
    seq_len: int,
    pad_id: int,
    setting: str = "data.files",
) -> LabelledTexts:
    """Every record of ``files`` as ``seq_len`` token ids (cut, right-padded with ``pad_id``) and its label.

    Raises:
        DataError: a missing or empty file, a record without the text or the label field, a text that is not a
            string or tokenizes to nothing, a label that is not an integer in ``[0, num_labels)``: one line naming
            the file, the line and the fix.
    """
    rows: list[list[int]] = []
    labels: list[int] = []
    num_cut = 0
    for path in expand_files(files, setting=setting):
        for where, record in read_records(path, setting=setting):
            for field in (text_field, label_field):
                if record.get(field) is None:
                    fields = ", ".join(sorted(str(key) for key, value in record.items() if value is not None))
                    which = "data.text_field" if field == text_field else "data.label_field"
                    raise DataError(
                        f"{where}: the record has no {field!r} field (it has: {fields or 'none'}); give every record "
                        f"that field, or set {which} to the field that holds it"
                    )
            text, label = record[text_field], record[label_field]
            if not isinstance(text, str):
                raise DataError(
                    f"{where}: field {text_field!r} is a {type(text).__name__}, not a string; write it as text"
                )
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
                raise DataError(
                    f"{where}: label {label!r} (field {label_field!r}) is not an integer in [0, {num_labels}); "
                    "write the class index, or raise head.num_labels"
                )
            ids = list(tokenizer.encode(text))
            if not ids:
                raise DataError(f"{where}: field {text_field!r} is empty (no token to classify); remove the record")
            if len(ids) > seq_len:
                ids, num_cut = ids[:seq_len], num_cut + 1
            rows.append(ids + [pad_id] * (seq_len - len(ids)))
            labels.append(label)
    return LabelledTexts(torch.tensor(rows, dtype=torch.long), torch.tensor(labels, dtype=torch.long), num_cut)


def _collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _say(line: str) -> None:
    if is_main_process():
        print(f"d9dfn: data: {line}", file=sys.stderr, flush=True)


class ClassificationProvider:
    """The job's dataset: the records read, checked and tokenized when made (bad data is refused before anything is
    built), then the train or validation split on each call."""

    def __init__(
        self,
        config: ClassificationDataConfig,
        head: HeadConfig,
        tokenizer: Tokenizer | None = None,
        *,
        pad_id: int | None = None,
        say: Callable[[str], None] = _say,
    ) -> None:
        tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.pad_id = pad_id if pad_id is not None else 0 if pad is None else pad
        """The id texts are padded with, which the ``last`` pooling skips: ``pad_id`` (a folder's ``pad_token_id``),
        else the tokenizer's pad, else its end of text, else 0."""

        def read(files: Sequence[str], setting: str) -> LabelledTexts:
            texts = read_labelled(
                files,
                tokenizer,
                text_field=config.text_field,
                label_field=config.label_field,
                num_labels=head.num_labels,
                seq_len=config.seq_len,
                pad_id=self.pad_id,
                setting=setting,
            )
            counts = torch.bincount(texts.labels, minlength=head.num_labels).tolist()
            cut = f"; {texts.num_cut} longer than data.seq_len={config.seq_len} cut" if texts.num_cut else ""
            say(f"{len(texts)} labelled records of {setting} (per label: {counts}){cut}")
            return texts

        self.splits = {"train": read(config.files, "data.files")}
        if config.validation_files is not None:
            self.splits["validation"] = read(config.validation_files, "data.validation_files")

    def __call__(self, context: InitializeDatasetContext) -> InitializeDatasetResult:
        split = "train" if context.split == "train" else "validation"
        if split not in self.splits:
            raise ValueError(
                "ClassificationProvider: trainer.evaluation asks for a validation split but data.validation_files is "
                'not set; set it, or trainer.evaluation.period_steps="disable"'
            )
        return InitializeDatasetResult(dataset=self.splits[split], collator=_collate)


class ClassifierProvider(ModelProvider):
    """Builds ``family``'s backbone with a classification head (:class:`~d9dfn.models.SequenceClassifier`); with
    ``source`` (a Hugging Face folder: ``model.source``) its weights are read through Hugging Face's names: a
    ``*ForCausalLM`` folder gives the backbone (its LM head is dropped, the score starts from its init), a
    ``*ForSequenceClassification`` folder (``score_in_source``) the score too."""

    def __init__(
        self,
        config: Qwen3Config,
        family: str,
        head: HeadConfig,
        pad_token_id: int,
        *,
        source: Path | None = None,
        score_in_source: bool = False,
    ) -> None:
        self.config, self.family, self.head, self.pad_token_id = config, family, head, pad_token_id
        self.source, self.score_in_source = source, score_in_source

    def prepare_load_model_stage(self, context: InitializeModelStageContext) -> PrepareLoadModelStageResult:
        """Hugging Face names to the classifier's (``d9dfn.models.classifier_from_hf_state``) when the job has a
        ``model.source``, its ``config.json`` checked against the model; else the names as they are."""
        if self.source is None:
            return PrepareLoadModelStageResult()
        config, family = self.config, self.family
        return PrepareLoadModelStageResult(
            state_mapper=lambda state: classifier_from_hf_state(state, FAMILIES[family], config),
            check_config=lambda found: check_source_config(config, found, family=family),
            not_in_source=None if self.score_in_source else _is_score,
        )

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        if context.num_stages > 1:
            raise ValueError(
                f"ClassifierProvider: trainer.pipelining splits the model into {context.num_stages} stages, but a "
                "classification head is built whole (its pooling reads the input ids); set trainer.pipelining=null"
            )
        model = SequenceClassifier(
            FAMILIES[self.family],
            self.config,
            self.head.num_labels,
            pooling=self.head.pooling,
            pad_token_id=self.pad_token_id,
        )
        return InitializeModelStageResult(model=model)

    def dump_hparams(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self.config), **self.head.model_dump()}

    def num_params(self) -> int:
        """The backbone's parameters without the LM head, plus the score."""
        lm_head = 0 if self.config.tie_word_embeddings else self.config.vocab_size * self.config.hidden_size
        return num_parameters(self.config) - lm_head + self.config.hidden_size * self.head.num_labels


def _is_score(name: str) -> bool:
    return name.startswith("score.")


def resolve_head(job: ClassificationJobConfig, tokenizer: Tokenizer) -> tuple[ClassificationJobConfig, int | None]:
    """``job`` with ``head.num_labels`` from a ``*ForSequenceClassification`` ``model.source`` folder (its score has
    that many rows), and the pad id the folder's ``config.json`` gives (``pad_token_id``; ``None``: the tokenizer's).

    Raises:
        ValueError: ``head.num_labels`` set explicitly to another count than the folder's score has; a pad id that
            the tokenizer's vocabulary does not hold.
    """
    if job.model.source is None:
        return job, None
    hf = read_source_config(job.model.source)
    file = job.model.source / "config.json"
    pad = hf.get("pad_token_id")
    if pad is not None and not (isinstance(pad, int) and 0 <= pad < tokenizer.vocab_size):
        raise ValueError(
            f"model.source: {file} gives pad_token_id={pad!r}, which is not an id of its tokenizer {tokenizer.name} "
            f"(0..{tokenizer.vocab_size - 1}); set pad_token_id in the file to the tokenizer's pad (or end-of-text) id"
        )
    architecture = str((hf.get("architectures") or [""])[0])
    if not architecture.endswith("ForSequenceClassification"):
        return job, pad
    labels = from_hf_classifier_config(hf, max_seq_len=job.data.seq_len)[1]
    if "num_labels" in job.head.model_fields_set and job.head.num_labels != labels:
        raise ValueError(
            f"head.num_labels={job.head.num_labels} contradicts model.source: {file} is a {architecture} with "
            f"{labels} labels (id2label); drop head.num_labels (the folder's score decides it), or start from the "
            "folder's causal LM, whose score starts fresh"
        )
    return job.model_copy(update={"head": job.head.model_copy(update={"num_labels": labels})}), pad


def default_classification_job() -> ClassificationJobConfig:
    """The defaults ``--set`` overrides start from when no config file is given (``d9dfn train --set
    job=classification --set 'data.files=[...]' ...``): every section at its default, ``data.files`` still to be set
    (this value is not validated; ``load_config`` validates what the overrides make of it)."""
    data = ClassificationDataConfig.model_construct(files=())
    return ClassificationJobConfig.model_construct(job="classification", data=data)


def train_classifier(
    job: ClassificationJobConfig, on_ready: Callable[[], None] | None = None, *, resume_from: ResumeFrom = "latest"
) -> TrainResult:
    """Train the job's classifier; the run directory gets ``job.json`` beside checkpoints and logs (``metrics.jsonl``
    holds loss, accuracy, F1 and AUROC per logging period). ``on_ready`` and ``resume_from`` as in
    :func:`~d9dfn.jobs.train_lm`.

    Raises:
        ValueError: bad settings or data (one line each), before anything is built.
    """
    job, tokenizer = resolve_source(job)  # model.source: the folder's model and tokenizer, checked first
    job, pad_id = resolve_head(job, tokenizer)
    data = ClassificationProvider(job.data, job.head, tokenizer, pad_id=pad_id)
    config = job.model.to_qwen3(job.data.seq_len)
    if data.pad_id >= config.vocab_size:
        raise DataError(f"data: the pad id {data.pad_id} is outside the model's {config.vocab_size} embedding rows")
    mesh = job.mesh or DeviceMeshParameters(data_parallel_replicate=launched_world_size())
    parameters, source = job.trainer, job.model.source
    if source is not None and parameters.model_stage_factory.source_checkpoint is None:
        factory = parameters.model_stage_factory.model_copy(update={"source_checkpoint": source})
        parameters = parameters.model_copy(update={"model_stage_factory": factory})
    architecture = "" if source is None else str((read_source_config(source).get("architectures") or [""])[0])
    trainer = TrainingConfigurator(
        mesh=mesh,
        parameters=parameters,
        task_provider=lambda: ClassificationTask(job.head.num_labels),
        model_provider=ClassifierProvider(
            config,
            job.model.family,
            job.head,
            data.pad_id,
            source=source,
            score_in_source=architecture.endswith("ForSequenceClassification"),
        ),
        data_provider=data,
        rng_kwarg="dropout_key" if job.model.dropout > 0 else None,
    ).configure()
    record_run_job(trainer, job, on_ready)
    return trainer.train(resume_from)


def classifier_run_dir(job: ClassificationJobConfig) -> Path:
    """Where the job's run lives: ``trainer.checkpointing.save_dir / trainer.run.name``."""
    return Path(job.trainer.run_dir)
