"""Checkpoints: the orbax-backed ``CheckpointStore`` (atomic steps, rank staging, resharding restore),
the base a checkpoint leaves out (a LoRA run's frozen weights, read from its folder again), and the loading of
initial weights from safetensors (``docs/design/checkpoints.md``).
"""

from d9dfn.checkpoint._base import BASE_KEY, base_record, check_base, fingerprint, left_out
from d9dfn.checkpoint._integrity import CheckpointCorruptedError
from d9dfn.checkpoint._layout import AS_SAVED, CheckpointMismatchError
from d9dfn.checkpoint._store import FORMAT, FORMAT_VERSION, CheckpointStore
from d9dfn.checkpoint._weights import export_safetensors, load_initial_weights, load_weights

__all__ = [
    "AS_SAVED",
    "BASE_KEY",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointCorruptedError",
    "CheckpointMismatchError",
    "CheckpointStore",
    "base_record",
    "check_base",
    "export_safetensors",
    "fingerprint",
    "left_out",
    "load_initial_weights",
    "load_weights",
]
