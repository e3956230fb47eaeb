"""Tiny versions of the default job for tests: the override lists and the argv/config builders they share."""

from __future__ import annotations

from pathlib import Path

from d9dfn.config import load_config
from d9dfn.jobs import LMJobConfig

TINY_MODEL = (
    "model.hidden_size=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=8",
    "model.intermediate_size=32",
)
"""A ~10k-parameter model: one layer of hidden 16."""

TINY_DATA = ("data.max_bytes=20000", "data.seq_len=16", "eval_batches=1", "sample.num_bytes=4")
"""A 20 kB corpus cut into 16-byte windows; one evaluation batch, a 4-byte sample."""

TINY_TRAINER = (
    "trainer.batching.global_batch_size=2",
    "trainer.batching.microbatch_size=2",
    "trainer.lr_scheduler=null",
    "trainer.compile=false",
)
"""Eager steps of 2 sequences, a constant learning rate."""

TINY = (*TINY_TRAINER, *TINY_MODEL, *TINY_DATA)


def job_argv(command: str, save_dir: Path, *overrides: str, base: tuple[str, ...] = TINY) -> list[str]:
    """``d9dfn COMMAND --set ...`` for the tiny job saving under ``save_dir``, with ``overrides`` last."""
    sets = [*base, f"trainer.checkpointing.save_dir={save_dir}", *overrides]
    return [command, *(arg for override in sets for arg in ("--set", override))]


def tiny_job(save_dir: Path, *overrides: str, base: tuple[str, ...] = TINY) -> LMJobConfig:
    """The tiny job as a config (what ``job_argv`` gives the CLI)."""
    sets = [*base, f"trainer.checkpointing.save_dir={save_dir}", *overrides]
    return load_config(LMJobConfig, None, sets, default=LMJobConfig())
