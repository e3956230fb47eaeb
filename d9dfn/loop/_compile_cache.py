"""One compile cache directory per rank (pytorch/pytorch#188390).

Inductor's FX-graph cache and the AOTAutograd cache live under ``TORCHINDUCTOR_CACHE_DIR``, and torch
2.13 keys a DTensor input by its spec (mesh, placements, global shape) and ``requires_grad`` only: every
rank of a mesh computes the same key. With several ranks on one host sharing the default directory, a
warm cache can hand rank 1 the graph rank 0 compiled — on CPU even the later upstream fix (which adds
the local tensor's device, ``cpu`` for every rank) does not separate them. A directory per rank does.

This is an edge function (it sets an environment variable of the process): call it once per process,
after the rank is known and before the first compiled step runs.
"""

from __future__ import annotations

import os

__all__ = ["per_rank_compile_cache"]


def per_rank_compile_cache(rank: int, root: str | os.PathLike[str] | None = None) -> str:
    """Point this process's inductor / AOTAutograd caches at ``<root>/rank_<rank>`` and return that path.

    torch reads ``TORCHINDUCTOR_CACHE_DIR`` whenever it looks up or writes a compiled artifact, so setting
    it before the first compile is enough; the in-memory caches a forked process inherits are cleared
    too, so nothing compiled under the old directory is reused. ``TRITON_CACHE_DIR`` (GPU kernels, keyed
    by their source and device) is left alone when set, and otherwise follows the new directory.

    Args:
        rank: this process's global rank (``torch.distributed.get_rank()``).
        root: the shared parent directory; default: the current inductor cache directory (the one
            ``TORCHINDUCTOR_CACHE_DIR`` names, else torch's ``/tmp/torchinductor_<user>``), so repeated runs
            on one host reuse each rank's own warm cache.

    Returns:
        The rank's cache directory (created).

    Raises:
        ValueError: a negative rank.
    """
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(
            f"per_rank_compile_cache: rank={rank!r}; pass this process's global rank, a non-negative int "
            "(torch.distributed.get_rank())"
        )
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import clear_caches

    if root is not None:
        base = os.fspath(root)
    else:
        base = os.path.normpath(cache_dir())
        if os.path.basename(base).startswith("rank_"):  # called again: stay under the shared root
            base = os.path.dirname(base)
    directory = os.path.abspath(os.path.join(base, f"rank_{rank}"))
    os.makedirs(directory, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    clear_caches()
    return directory
