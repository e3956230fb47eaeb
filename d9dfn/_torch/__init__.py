"""Torch internals behind one seam: every patch of torch's private API d9dfn makes, a row of one table
(:data:`PATCHES`), behind one switch (``D9DFN_TORCH_PATCHES``) and a version gate (``docs/design/torch-internals.md``).

The ground floor of the core: imports nothing of d9dfn. Callers turn rows on with :func:`install` (process-wide rows;
idempotent) and use the scoped ones through the functions re-exported here; nothing else in d9dfn imports torch's
private modules for these.
"""

from d9dfn._torch._atomic_builds import atomic_cpp_builds, rebuild_unloadable_libraries
from d9dfn._torch._caches import (
    bundled_autograd_cache,
    clear_inductor_caches,
    inductor_cache_dir,
    inductor_default_cache_dir,
)
from d9dfn._torch._compiled import compile_piece, own_code
from d9dfn._torch._cpp_builds import backward_compiled_early
from d9dfn._torch._gate import CPP_BUILDS_ENV, ENV, Patch, chosen, enabled, install, installed, uninstall, verdict
from d9dfn._torch._graph_passes import aot_eager_with, post_grad_pass
from d9dfn._torch._regions import REGION_INDUCTOR_OPTIONS, activation_memory_budget, region_tracing, static_shapes
from d9dfn._torch._table import PATCHES, PINNED, row
from d9dfn._torch._vec_isa import check_vec_isas_early, check_vec_isas_now

__all__ = [
    "CPP_BUILDS_ENV",
    "COMPILE_CACHE_ROWS",
    "ENV",
    "INDUCTOR_ROWS",
    "PATCHES",
    "PINNED",
    "REGION_INDUCTOR_OPTIONS",
    "Patch",
    "activation_memory_budget",
    "aot_eager_with",
    "atomic_cpp_builds",
    "backward_compiled_early",
    "bundled_autograd_cache",
    "check_vec_isas_early",
    "check_vec_isas_now",
    "chosen",
    "clear_inductor_caches",
    "compile_piece",
    "enabled",
    "inductor_cache_dir",
    "inductor_default_cache_dir",
    "install",
    "installed",
    "own_code",
    "post_grad_pass",
    "rebuild_unloadable_libraries",
    "region_tracing",
    "static_shapes",
    "row",
    "uninstall",
    "verdict",
]

INDUCTOR_ROWS = (
    "cpp_builds_atomic",
    "libraries_rebuilt",
    "cpp_builds_batched",
    "compile_pool_off",
    "vec_isa_probes_remembered",
    "vec_isa_best_first",
)
"""The process-wide rows a step builder with an inductor backend installs (``d9dfn/step/_options.py``)."""

COMPILE_CACHE_ROWS = ("cpp_builds_atomic", "libraries_rebuilt", "vec_isa_probes_remembered", "vec_isa_best_first")
"""The process-wide rows ``run_compile_cache`` installs before the vector-ISA check it runs
(``d9dfn/loop/_compile_cache.py``)."""
