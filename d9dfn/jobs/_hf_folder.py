"""A Hugging Face model folder (``model.source``) read by the job: its ``config.json``, and the files an export copies
beside the weights. Its tokenizer is :meth:`d9dfn.data.HFTokenizer.from_folder`'s (``jobs/_source.py`` loads it).
Nothing here reaches the network.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from d9dfn.models import Qwen3Config, check_hf_config, from_hf_config

__all__ = ["TOKENIZER_FILES", "copy_tokenizer_files", "read_source_config", "source_model_config"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "generation_config.json",
)
"""The files of a folder that ``d9dfn export --format hf`` copies beside the weights (those it has): what
``AutoTokenizer`` reads (the tokenizer, its config and special tokens, the chat template) and the generation
defaults."""


def read_source_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json``, parsed.

    Raises:
        FileNotFoundError: the folder or its ``config.json`` is missing.
        ValueError: the file is not a JSON object.
    """
    file = folder / "config.json"
    if not file.is_file():
        what = "is not a folder" if not folder.is_dir() else "has no config.json"
        raise FileNotFoundError(
            f"model.source: {folder} {what}; point --set model.source at a Hugging Face model folder (config.json, "
            "model.safetensors, tokenizer.json)"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"model.source: {file} is not readable JSON ({error}); restore the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"model.source: {file} holds a {type(config).__name__}, not an object; restore the file")
    return config


def source_model_config(folder: Path, max_seq_len: int, *, dropout: float = 0.0) -> Qwen3Config:
    """The model ``folder/config.json`` describes, for sequences of ``max_seq_len`` (``data.seq_len``) tokens.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_source_config`; a feature ``Qwen3LM`` lacks, a ``max_seq_len``
            above the file's ``max_position_embeddings`` or its sliding window (naming the file, the field and the
            ``--set`` that fixes it).
    """
    hf = read_source_config(folder)
    try:
        # Built for one position first: the window and position checks come next, in the job's words.
        config = dataclasses.replace(from_hf_config(hf, max_seq_len=1, dropout=dropout), max_seq_len=max_seq_len)
        check_hf_config(config, hf, fix=lambda name, value: f"set --set data.seq_len={value}")
    except ValueError as error:
        raise ValueError(f"model.source: {folder / 'config.json'}: {error}") from None
    return config


def copy_tokenizer_files(folder: Path, out_dir: Path) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``folder`` has into ``out_dir``; returns their names."""
    copied = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    for name in copied:
        shutil.copyfile(folder / name, out_dir / name)
    return copied
