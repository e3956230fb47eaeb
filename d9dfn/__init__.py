"""d9dfn: a functional training and inference loop on torch.func, torch.compile and DTensor."""

from d9dfn import prng
from d9dfn._pytree import field, format_path, pytree_dataclass

__all__ = ["field", "format_path", "prng", "pytree_dataclass"]
