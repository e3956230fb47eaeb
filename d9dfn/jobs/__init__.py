"""Complete applications of the library. The default job, ``d9dfn train`` with no arguments: a byte-level
Qwen3-style LM on the Python standard library's own sources (``d9dfn infer``, ``d9dfn export``), or on your files
(``--set 'data.files=[...]'``: :class:`FilesConfig`, :class:`FilesProvider`); with ``model.source``, a Hugging Face
folder's model and tokenizer (a :class:`d9dfn.data.HFTokenizer`; the job's text goes through a
:class:`d9dfn.data.Tokenizer`, bytes by default). A classifier on labelled records: a config with
``"job": "classification"`` (:class:`ClassificationJobConfig`, :func:`train_classifier`).
"""

from d9dfn.jobs._classify import (
    ClassificationDataConfig,
    ClassificationJobConfig,
    ClassificationProvider,
    ClassifierProvider,
    HeadConfig,
    LabelledTexts,
    classifier_run_dir,
    default_classification_job,
    read_labelled,
    train_classifier,
)
from d9dfn.jobs._config import (
    CorpusConfig,
    DataConfig,
    LMJobConfig,
    LMTrainerConfig,
    ModelConfig,
    MoEConfig,
    SampleConfig,
    default_job,
    default_trainer,
)
from d9dfn.jobs._corpus import (
    VOCAB_SIZE,
    ByteWindowDataset,
    Corpus,
    TokenWindowDataset,
    decode_bytes,
    stdlib_corpus,
    stdlib_source_files,
    token_stream,
)
from d9dfn.jobs._files import FilesConfig, FilesProvider
from d9dfn.jobs._hf_folder import TOKENIZER_FILES
from d9dfn.jobs._lm import (
    EXPORT_FORMATS,
    evaluate_lm,
    export_lm,
    inference_mesh,
    load_model,
    run_dir_of,
    train_lm,
)
from d9dfn.jobs._providers import CorpusProvider, Qwen3Provider, check_source_config, data_provider
from d9dfn.jobs._sample import generate_pipelined
from d9dfn.jobs._source import resolve_source

__all__ = [
    "EXPORT_FORMATS",
    "TOKENIZER_FILES",
    "VOCAB_SIZE",
    "ByteWindowDataset",
    "ClassificationDataConfig",
    "ClassificationJobConfig",
    "ClassificationProvider",
    "ClassifierProvider",
    "Corpus",
    "CorpusConfig",
    "CorpusProvider",
    "DataConfig",
    "FilesConfig",
    "FilesProvider",
    "HeadConfig",
    "LabelledTexts",
    "LMJobConfig",
    "LMTrainerConfig",
    "ModelConfig",
    "MoEConfig",
    "Qwen3Provider",
    "SampleConfig",
    "TokenWindowDataset",
    "check_source_config",
    "classifier_run_dir",
    "data_provider",
    "decode_bytes",
    "default_classification_job",
    "default_job",
    "default_trainer",
    "evaluate_lm",
    "export_lm",
    "generate_pipelined",
    "inference_mesh",
    "load_model",
    "read_labelled",
    "resolve_source",
    "run_dir_of",
    "stdlib_corpus",
    "stdlib_source_files",
    "token_stream",
    "train_classifier",
    "train_lm",
]
