"""Complete applications of the library. The default job, ``d9dfn train`` with no arguments: a byte-level
Qwen3-style LM on the Python standard library's own sources (``d9dfn infer``, ``d9dfn export``), or on your files
(``--set 'data.files=[...]'``: :class:`FilesConfig`, :class:`FilesProvider`); with ``model.source``, a Hugging Face
folder's model and tokenizer.
"""

from d9dfn.jobs._config import (
    CorpusConfig,
    DataConfig,
    LMJobConfig,
    ModelConfig,
    SampleConfig,
    default_job,
    default_trainer,
)
from d9dfn.jobs._corpus import (
    VOCAB_SIZE,
    ByteWindowDataset,
    Corpus,
    decode_bytes,
    stdlib_corpus,
    stdlib_source_files,
)
from d9dfn.jobs._files import FilesConfig, FilesProvider
from d9dfn.jobs._hf_folder import TOKENIZER_FILES, load_tokenizer
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
from d9dfn.jobs._tokens import BYTES, Codec, TokenWindowDataset, token_stream

__all__ = [
    "BYTES",
    "EXPORT_FORMATS",
    "TOKENIZER_FILES",
    "VOCAB_SIZE",
    "ByteWindowDataset",
    "Codec",
    "Corpus",
    "CorpusConfig",
    "CorpusProvider",
    "DataConfig",
    "FilesConfig",
    "FilesProvider",
    "LMJobConfig",
    "ModelConfig",
    "Qwen3Provider",
    "SampleConfig",
    "TokenWindowDataset",
    "check_source_config",
    "data_provider",
    "decode_bytes",
    "default_job",
    "default_trainer",
    "evaluate_lm",
    "export_lm",
    "generate_pipelined",
    "inference_mesh",
    "load_model",
    "load_tokenizer",
    "resolve_source",
    "run_dir_of",
    "stdlib_corpus",
    "stdlib_source_files",
    "token_stream",
    "train_lm",
]
