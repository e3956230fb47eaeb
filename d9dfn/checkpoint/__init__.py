"""Checkpoints: the orbax-backed ``CheckpointStore`` (atomic steps, rank staging, resharding restore)
and the loading of initial weights from safetensors (``docs/design/checkpoints.md``).
"""

from d9dfn.checkpoint._integrity import CheckpointCorruptedError
from d9dfn.checkpoint._layout import AS_SAVED, CheckpointMismatchError
from d9dfn.checkpoint._store import FORMAT, FORMAT_VERSION, CheckpointStore
from d9dfn.checkpoint._weights import export_safetensors, load_initial_weights, load_weights

__all__ = [
    "AS_SAVED",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointCorruptedError",
    "CheckpointMismatchError",
    "CheckpointStore",
    "export_safetensors",
    "load_initial_weights",
    "load_weights",
]
