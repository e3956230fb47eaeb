"""What the compile caches ask of torch: the head's graph cached whole (a scoped setting), and inductor's cache
directory (read, and its in-memory caches cleared, by ``d9dfn/loop/_compile_cache.py``).

Two rows of the torch-patch table (``d9dfn/_torch/_table.py``): ``head_bundled_cache`` (scoped, around each call of
a step's compiled head) and ``compile_cache_dirs`` (required by the loop's run and host caches; their files stay in
``d9dfn/loop/``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from d9dfn._torch._gate import enabled

__all__ = [
    "HEAD",
    "bundled_autograd_cache",
    "capable_cache_dirs",
    "capable_head",
    "clear_inductor_caches",
    "head_cache_scope",
    "inductor_cache_dir",
    "inductor_default_cache_dir",
]

HEAD = "head_bundled_cache"  # the row's name (d9dfn/_torch/_table.py)

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


@contextlib.contextmanager
def head_cache_scope() -> Iterator[None]:
    """Inside it, while the row ``head_bundled_cache`` is on, AOTAutograd's bundled cache is on: a graph inductor
    has nothing to compile for (a step's head: views of the batch, and the task's Python) is compiled to an empty
    module and stored like any graph. Without it torch caches nothing for such a graph (its compile returns the
    graph's own ``forward``, which AOTAutograd's cache cannot store; pytorch/pytorch#141790 is the same for a
    backward), and every process traced and partitioned it again, some 0.4-1 s of every start on a warm cache. Read
    at compile time only, so it is set around each call and restored after."""
    if not enabled(HEAD):
        yield
        return
    from torch._functorch import config

    before = config.bundled_autograd_cache  # set and restored: a few µs a call, config.patch's 35
    config.bundled_autograd_cache = True
    try:
        yield
    finally:
        config.bundled_autograd_cache = before


def bundled_autograd_cache(compiled: _Fn) -> _Fn:
    """``compiled`` (a ``torch.compile`` wrapper) called inside :func:`head_cache_scope`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with head_cache_scope():
            return compiled(*args, **kwargs)

    return cast(_Fn, functools.wraps(compiled)(call))  # torch.compile's wrapper's attributes, for callers


def capable_head() -> bool:
    """The capability check of ``head_bundled_cache``: AOTAutograd has the setting."""
    from torch._functorch import config

    return isinstance(getattr(config, "bundled_autograd_cache", None), bool)


def inductor_cache_dir() -> str:
    """The directory inductor's and AOTAutograd's on-disk caches use now (``TORCHINDUCTOR_CACHE_DIR``, else torch's
    default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def inductor_default_cache_dir() -> str:
    """torch's default cache directory (``/tmp/torchinductor_<user>``), whatever the environment says."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return str(default_cache_dir())


def clear_inductor_caches() -> None:
    """Forget what inductor keeps in memory of compiled artifacts, so that the next lookup reads the (new) cache
    directory."""
    from torch._inductor.utils import clear_caches

    clear_caches()


def capable_cache_dirs() -> bool:
    """The capability check of ``compile_cache_dirs``: the three functions exist."""
    try:
        from torch._inductor.runtime import cache_dir_utils
        from torch._inductor.utils import clear_caches
    except ImportError:
        return False
    return (
        callable(getattr(cache_dir_utils, "cache_dir", None))
        and callable(getattr(cache_dir_utils, "default_cache_dir", None))
        and callable(clear_caches)
    )
