"""Where a run's compiled graphs are cached: in the run directory, one directory per rank (pytorch/pytorch#188390).

torch keeps what a compile produces on disk under ``TORCHINDUCTOR_CACHE_DIR``: the FX graph cache (inductor's
compiled graphs and their C++ kernels, built ``.so`` files included) and the AOTAutograd cache (the joint graph's
forward and backward). :func:`run_compile_cache` points them at ``<run_dir>/compile_cache/<cpu>/rank_<rank>``, so
a resume after a kill, ``d9dfn infer`` of the run, the evaluation after training and every rank of a restarted
``torchrun`` find the run's graphs compiled (``docs/design/step.md``, "Cold start"). dynamo itself traces again in
every process (no cache covers it); a changed model or config traces a different graph, whose key misses.

Inductor's FX-graph cache and the AOTAutograd cache live under ``TORCHINDUCTOR_CACHE_DIR``, and torch
2.13 keys a DTensor input by its spec (mesh, placements, global shape) and ``requires_grad`` only: every
rank of a mesh computes the same key. With several ranks on one host sharing the default directory, a
warm cache can hand rank 1 the graph rank 0 compiled — on CPU even the later upstream fix (which adds
the local tensor's device, ``cpu`` for every rank) does not separate them. A directory per rank does.

This is an edge function (it sets an environment variable of the process): call it once per process,
after the rank is known and before the first compiled step runs.
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile

__all__ = ["host_cpu", "per_rank_compile_cache", "run_compile_cache"]

_ENV = "TORCHINDUCTOR_CACHE_DIR"
_SET_HERE: set[str] = set()  # the values run_compile_cache gave _ENV


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


def _users_own(directory: str | None) -> bool:
    """Whether ``directory`` (``TORCHINDUCTOR_CACHE_DIR``'s value) was chosen by the user: neither set here, nor
    torch's default or a rank directory under it (torch writes its default into the variable when it first needs
    the cache)."""
    if directory is None or directory in _SET_HERE:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    here = os.path.abspath(directory)
    return here != default and os.path.dirname(here) != default


def host_cpu() -> str:
    """This host's CPU as a short name: its architecture and a hash of the instruction-set flags it reports.

    Inductor builds C++ kernels with ``-march=native``, and torch 2.13's cache keys for CPU graphs hold no device
    information, so a kernel built on one CPU may not run on another (an illegal instruction); the run's cache is
    kept per CPU. Read from ``/proc/cpuinfo`` where there is one, else from ``platform.processor()``.

    >>> host_cpu().startswith(platform.machine())
    True
    """
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), flags)
    except OSError:
        pass
    return f"{platform.machine()}-{hashlib.sha1(flags.encode()).hexdigest()[:10]}"


def run_compile_cache(run_dir: str | os.PathLike[str], rank: int = 0, *, distributed: bool = False) -> str | None:
    """Point this process's compile caches at ``<run_dir>/compile_cache/<cpu>/rank_<rank>`` (``<cpu>``:
    :func:`host_cpu`) and return that path.

    ``TORCHINDUCTOR_CACHE_DIR`` set by the user (not by this function) wins: one process keeps it as it is, each
    rank of several gets ``rank_<rank>`` under it (:func:`per_rank_compile_cache`), and the run directory holds no
    cache. A run directory that cannot be written (a read-only copy given to ``d9dfn infer``) also leaves torch's
    default directory in place. The vector-ISA check that inductor compiles once per cache directory (a handful
    of C++ builds, seconds) is made first against the current directory, where a previous job has usually left
    it, and kept for the process.

    Args:
        run_dir: the run's directory (``trainer.checkpointing.save_dir / trainer.run.name``, or what
            ``d9dfn infer`` loads).
        rank: this process's global rank.
        distributed: whether several processes run (decides how a user's ``TORCHINDUCTOR_CACHE_DIR`` is split).

    Returns:
        The cache directory now in use, or ``None`` when torch's default or the user's own is kept unchanged.
    """
    if _users_own(os.environ.get(_ENV)):
        return per_rank_compile_cache(rank) if distributed else None
    directory = os.path.abspath(os.path.join(os.fspath(run_dir), "compile_cache", host_cpu(), f"rank_{rank}"))
    if os.environ.get(_ENV) == directory:
        return directory
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError:
        return per_rank_compile_cache(rank) if distributed else None
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.utils import clear_caches

    valid_vec_isa_list()  # functools.cache'd for the process, and not cleared by clear_caches
    os.environ[_ENV] = directory
    _SET_HERE.add(directory)
    clear_caches()
    return directory
