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

Behind the run's cache stands the host's (:func:`host_compile_cache`, ``~/.cache/d9dfn/compile_cache/<cpu>/rank_<r>``
unless ``D9DFN_COMPILE_CACHE`` names another root or ``off``): a new run starts with the host's compiled graphs linked
into its own directory, and :func:`publish_compile_cache` links what the run compiled back, so the next job of the
same model on this host starts warm too. torch's keys decide every hit, in either directory; the host's only adds
entries to look up.

Neither cache can brick a run (issue 44): inductor's C++ builds are renamed into place once complete
(``d9dfn/_torch/_atomic_builds.py``); each directory's seal lists the files a process proved good (it loaded and ran
them), and at every start a file that fails its seal, or that no finished process sealed, is taken out and compiled
again (``d9dfn/loop/_cache_seal.py``); only sealed files that pass their check travel between the host's cache and a
run's. A process holds its run cache's in-use lock (shared) for its lifetime, so a second process of the same run
(``d9dfn infer`` during training) never takes out the first one's unsealed files.

These are edge functions (they set an environment variable of the process and write files): call
:func:`run_compile_cache` once per process, after the rank is known and before the first compiled step runs. What
they ask of torch's private API goes through the seam (``d9dfn._torch``: the rows ``compile_cache_dirs`` and
``COMPILE_CACHE_ROWS``; ``docs/design/torch-internals.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import tempfile
from collections.abc import Callable

from d9dfn import _torch as torch_patches
from d9dfn.loop._cache_seal import link_from_host, publish_to_host, seal, sweep

__all__ = ["host_compile_cache", "host_cpu", "per_rank_compile_cache", "publish_compile_cache", "run_compile_cache"]

_ENV = "TORCHINDUCTOR_CACHE_DIR"
_HOST_ENV = "D9DFN_COMPILE_CACHE"
_OFF = ("", "0", "off", "none")
_SET_HERE: set[str] = set()  # the values run_compile_cache gave _ENV
_BEHIND: dict[str, str] = {}  # a run's cache directory -> the host's behind it
_IN_USE: dict[str, int] = {}  # a run's cache directory -> its in-use lock file's descriptor, held shared
_IN_USE_LOCK = "d9dfn-in-use.lock"
_log = logging.getLogger(__name__)


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
    if root is not None:
        base = os.fspath(root)
    else:
        base = os.path.normpath(torch_patches.inductor_cache_dir())
        if os.path.basename(base).startswith("rank_"):  # called again: stay under the shared root
            base = os.path.dirname(base)
    directory = os.path.abspath(os.path.join(base, f"rank_{rank}"))
    os.makedirs(directory, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    torch_patches.clear_inductor_caches()
    return directory


def _users_own(directory: str | None) -> bool:
    """Whether ``directory`` (``TORCHINDUCTOR_CACHE_DIR``'s value) was chosen by the user: neither set here, nor
    torch's default or a rank directory under it (torch writes its default into the variable when it first needs
    the cache)."""
    if directory is None or directory in _SET_HERE:
        return False
    default = os.path.abspath(torch_patches.inductor_default_cache_dir())
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
    # Before the first build of the process (the vector-ISA check's included): builds renamed into place, a library
    # that fails to load built again, each ISA test library loaded in a child Python once, the best ISA only.
    torch_patches.install(torch_patches.COMPILE_CACHE_ROWS)
    torch_patches.check_vec_isas_now()  # kept for the process, and not cleared by clear_caches
    try:
        _open(directory)  # its damaged and unfinished files out, before torch looks anything up there
    except OSError as error:
        _log.warning("d9dfn: compile cache %s cannot be checked (%s); torch's default is used", directory, error)
        return per_rank_compile_cache(rank) if distributed else None
    host = host_compile_cache(rank)
    if host is not None:
        _share(link_from_host, host, directory)  # what earlier jobs on this host compiled, checked
        _BEHIND[directory] = host
    os.environ[_ENV] = directory
    _SET_HERE.add(directory)
    torch_patches.clear_inductor_caches()
    return directory


def _open(directory: str) -> None:
    """Start using ``directory``: take out what fails its seal and, unless another live process uses it too (it
    holds the in-use lock, shared), what no finished process sealed; then hold the in-use lock, shared, until the
    process ends or moves to another directory. One line says what was taken out."""
    for held in list(_IN_USE):  # this process again (a test), or another run's directory: let go of it first
        os.close(_IN_USE.pop(held))
    fd = os.open(os.path.join(directory, _IN_USE_LOCK), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        alone = _flock(fd, exclusive=True, wait=False)
        swept = sweep(directory, unsealed=alone)
        if swept:
            _log.warning(swept.line(directory))
        _flock(fd, exclusive=False, wait=True)  # after a sweep: another process's may hold it a moment
    except BaseException:
        os.close(fd)
        raise
    _IN_USE[directory] = fd


def _forget_in_use_locks() -> None:
    """In a forked child (a data-loading worker): close its copies of the in-use locks, so that they are held by
    the process that took them alone and go with it when it dies (an ``flock`` lasts while any copy is open)."""
    for fd in _IN_USE.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _IN_USE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_use_locks)


def _flock(fd: int, *, exclusive: bool, wait: bool) -> bool:
    """``flock`` on ``fd``, exclusive or shared, waiting or not; whether it is held (always, without fcntl)."""
    try:
        import fcntl
    except ImportError:
        return True
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    return True


def host_compile_cache(rank: int = 0) -> str | None:
    """The host's compile cache behind every run's, for ``rank``: ``<root>/<cpu>/rank_<rank>`` (``<cpu>``:
    :func:`host_cpu`), or ``None`` when it is turned off.

    ``<root>`` is ``D9DFN_COMPILE_CACHE`` when set (``off``, ``0``, ``none`` or empty: no host cache, each run
    compiles into its own directory alone), else ``$XDG_CACHE_HOME/d9dfn/compile_cache``, else
    ``~/.cache/d9dfn/compile_cache``.
    """
    root = _host_root(os.environ.get(_HOST_ENV), os.environ.get("XDG_CACHE_HOME"), os.path.expanduser("~"))
    return None if root is None else os.path.abspath(os.path.join(root, host_cpu(), f"rank_{rank}"))


def _host_root(setting: str | None, xdg_cache_home: str | None, home: str) -> str | None:
    """The host cache's root from ``D9DFN_COMPILE_CACHE``'s value, ``XDG_CACHE_HOME``'s and the home directory.

    >>> _host_root("/srv/cache", None, "/home/me"), _host_root("off", None, "/home/me")
    ('/srv/cache', None)
    >>> _host_root(None, None, "/home/me"), _host_root(None, "/xdg", "/home/me")
    ('/home/me/.cache/d9dfn/compile_cache', '/xdg/d9dfn/compile_cache')
    """
    if setting is not None:
        return None if setting.strip().lower() in _OFF else setting
    return os.path.join(xdg_cache_home or os.path.join(home, ".cache"), "d9dfn", "compile_cache")


def publish_compile_cache() -> int:
    """Seal what this process's run cache holds and link it into the host's (:func:`host_compile_cache`), so that
    the next job of the same model on this host starts warm; returns how many files were added to the host's.

    Call it where everything the process compiled has loaded and run (after the first train step, after the
    evaluation's first batch, at the end): a file is sealed (``d9dfn/loop/_cache_seal.py``) only there, and only
    sealed files that pass their check go to the host. A no-op (0) when the current cache is not a run's. Never
    raises: a cache that cannot be written costs the next job a compile, not this one its run (logged once per
    call)."""
    run = os.environ.get(_ENV)
    if run is None or run not in _SET_HERE:
        return 0
    _share(_seal, run, run)
    host = _BEHIND.get(run)
    return 0 if host is None else _share(publish_to_host, run, host)


def _seal(directory: str, _: str) -> int:
    return seal(directory)


def _share(link: Callable[[str, str], int], source: str, target: str) -> int:
    """``link(source, target)``, a failure logged (one line) rather than raised."""
    try:
        return link(source, target)
    except OSError as error:
        _log.warning(
            "d9dfn: the compile cache %s was not shared with %s (%s); the next job may compile again",
            source,
            target,
            error,
        )
        return 0
