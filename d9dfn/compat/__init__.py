"""Adapters from other training systems' shapes to d9dfn tasks; nothing in the core depends on them.

* :mod:`d9dfn.compat.megatron`: Megatron Bridge forward steps (``forward_step(state, data_iterator, model)``).
* :mod:`d9dfn.compat.timm`: timm-style ``TrainingTask`` modules (``forward(input, target) -> {"loss", ...}``).

Neither needs Megatron or timm installed.
"""

from d9dfn.compat import megatron, timm

__all__ = ["megatron", "timm"]
