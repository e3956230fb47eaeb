"""The table: every use of torch's private API that changes what torch does, one :class:`~d9dfn._torch._gate.Patch`
a row (``docs/design/torch-internals.md`` is generated from it; ``tests/test_torch_patches.py`` tests each row).

A row's ``verified`` versions are those its tests passed on: 2.13.0, the version ``constraints.txt`` pins and CI
runs. The GPU machines' torch 2.11.0 is not among them: the CPU tests of the compiled step passed there
(``docs/design/gpu.md``), but which rows their capability checks let in there was never recorded; the gate says so in
one line per row on that torch.
"""

from __future__ import annotations

import functools

from d9dfn._torch import _atomic_builds, _caches, _compiled, _cpp_builds, _graph_passes, _regions, _vec_isa
from d9dfn._torch._gate import Patch, register

__all__ = ["PATCHES", "PINNED", "row"]

PINNED = "2.13.0"
"""The torch version CI runs (``constraints.txt``) and every row was verified on."""

_VERIFIED = (PINNED,)
_NONE = "none found"


def _gh(number: int, note: str = "") -> str:
    return f"pytorch/pytorch#{number}" + (f" ({note})" if note else "")


PATCHES: tuple[Patch, ...] = (
    Patch(
        name=_cpp_builds.BATCHED,
        kind="process",
        summary="A graph's inductor CPU kernels built as one C++ library (one g++ run per graph, not per kernel), "
        "behind the compile.",
        touches=(
            "torch._inductor.async_compile.AsyncCompile.cpp_pybinding",
            "torch._inductor.async_compile.AsyncCompile.wait",
            "torch._inductor.codecache.CppPythonBindingsCodeCache.suffix_template",
        ),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_cpp_builds.py::test_a_graphs_kernels_build_as_one_library_and_compute_bitwise_what_one_by_one_builds_do",
        module="_cpp_builds",
        capable=_cpp_builds.capable,
        install=_cpp_builds.install,
        uninstall=_cpp_builds.uninstall,
    ),
    Patch(
        name=_cpp_builds.POOL,
        kind="process",
        summary="Without a GPU, no pool of compile worker processes (compile_threads 1 unless "
        "TORCHINDUCTOR_COMPILE_THREADS is set): the batched builds do not use it, and its processes would import "
        "torch on the cores the compile needs. Pays only with cpp_builds_batched.",
        touches=("torch._inductor.config.compile_threads",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_torch_patches.py::test_a_process_row_installs_once_and_off_leaves_torch_as_it_was",
        module="_cpp_builds",
        capable=_cpp_builds.capable_pool,
        install=_cpp_builds.install_pool,
        uninstall=_cpp_builds.uninstall_pool,
    ),
    Patch(
        name=_cpp_builds.EARLY,
        kind="scoped",
        summary="Around each train step call on a host without a GPU, AOTAutograd compiles a graph's backward right "
        "after its forward, so that the forward's batched C++ build runs behind the backward's compile.",
        touches=("torch._functorch.config.force_non_lazy_backward_lowering",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_cpp_builds.py::test_the_backward_is_compiled_with_its_forward_only_inside_and_only_where_builds_run_behind",
        module="_cpp_builds",
        capable=_cpp_builds.capable_early,
        scope=_cpp_builds.backward_compiled_early,
    ),
    Patch(
        name=_vec_isa.BEST_FIRST,
        kind="process",
        summary="Inductor's vector-ISA check stops at the best instruction set that passes (the one it picks), not "
        "after every set the CPU reports; torch's own list when ATEN_CPU_CAPABILITY or cpp.simdlen is set.",
        touches=("torch._inductor.cpu_vec_isa.valid_vec_isa_list",),
        verified=_VERIFIED,
        upstream=_gh(100378, "the check's cost at every start"),
        test="tests/test_cpp_builds.py::test_torchs_pick_is_the_same_with_the_best_set_only",
        module="_vec_isa",
        capable=_vec_isa.capable_best_first,
        install=_vec_isa.install_best_first,
        uninstall=_vec_isa.uninstall_best_first,
    ),
    Patch(
        name=_vec_isa.PROBES,
        kind="process",
        summary="Each vector-ISA test library is loaded in a child Python once per library and CPU (a '.loaded-<cpu>' "
        "file beside it remembers the success), not once per process.",
        touches=("torch._inductor.cpu_vec_isa.VecISA._probe_load",),
        verified=_VERIFIED,
        upstream=_gh(100378, "the check's cost at every start"),
        test="tests/test_cpp_builds.py::test_torchs_probe_takes_the_mark_for_its_answer",
        module="_vec_isa",
        capable=_vec_isa.capable_probes,
        install=_vec_isa.install_probes,
        uninstall=_vec_isa.uninstall_probes,
    ),
    Patch(
        name=_vec_isa.EARLY,
        kind="action",
        summary="The vector-ISA check started in a background thread when an inductor step is built (no GPU), so "
        "that it runs while dynamo traces.",
        touches=(
            "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
            "torch._inductor.config.cpp.vec_isa_ok",
        ),
        verified=_VERIFIED,
        upstream=_gh(100378, "the check's cost at every start"),
        test="tests/test_torch_patches.py::test_the_early_vec_isa_check_starts_only_while_its_row_is_on",
        module="_vec_isa",
        capable=_vec_isa.capable_early,
    ),
    Patch(
        name=_atomic_builds.ATOMIC,
        kind="process",
        summary="g++ writes each library, object or precompiled header to a temporary name beside its target, renamed "
        "into place once it succeeded: a kill never leaves a partial file under the final name.",
        touches=("torch._inductor.cpp_builder.CppBuilder.build",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_atomic_builds.py::test_a_kill_while_g_plus_plus_writes_leaves_no_library_under_its_name",
        module="_atomic_builds",
        capable=_atomic_builds.supported,
        install=_atomic_builds.install_atomic,
        uninstall=_atomic_builds.uninstall_atomic,
    ),
    Patch(
        name=_atomic_builds.REBUILT,
        kind="process",
        summary="A cached C++ library that exists but fails to load is deleted and built again once, with one line "
        "saying so.",
        touches=(
            "torch._inductor.codecache.CppCodeCache._load_library",
            "torch._inductor.codecache.CppCodeCache.load_async",
        ),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_atomic_builds.py::test_a_library_that_fails_to_load_is_compiled_again",
        module="_atomic_builds",
        capable=_atomic_builds.supported,
        install=_atomic_builds.install_rebuilt,
        uninstall=_atomic_builds.uninstall_rebuilt,
    ),
    Patch(
        name=_regions.SCHEMAS,
        kind="scoped",
        summary="While a per-block step's regions are traced, a region call's schema is computed once per region and "
        "inputs' metadata, not by re-tracing the region at every call.",
        touches=("torch._higher_order_ops.invoke_subgraph.invoke_subgraph.gen_schema",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_blocks.py::test_repeated_blocks_step_equals_the_default_step_and_builds_each_regions_schema_once",
        module="_regions",
        capable=_regions.capable_schemas,
        scope=_regions.region_tracing,
    ),
    Patch(
        name=_caches.HEAD,
        kind="scoped",
        summary="Around each call of a step's compiled head (inductor), AOTAutograd's bundled cache is on, so that "
        "the head (views of the batch, nothing for inductor to compile) is cached like any graph.",
        touches=("torch._functorch.config.bundled_autograd_cache",),
        verified=_VERIFIED,
        upstream=_gh(141790, "a call-free graph is never cached; the backward's fix is #186053"),
        test="tests/test_compile_cache.py::test_a_second_start_reads_the_run_cache_and_a_changed_config_misses_it",
        module="_caches",
        capable=_caches.capable_head,
        scope=_caches.head_cache_scope,
    ),
    Patch(
        name=_compiled.OWN_CODE,
        kind="scoped",
        summary="Each compiled piece of a step is compiled under a code object of its own, so that steps built one "
        "after another in a process never reach dynamo's recompile limit (it counts entries per code object).",
        touches=("torch._dynamo.config.recompile_limit",),
        verified=_VERIFIED,
        upstream=_gh(167504, "the limit hit by compiling in a loop"),
        test="tests/test_blocks.py::test_steps_built_one_after_another_in_a_process_never_reach_dynamos_recompile_limit",
        module="_compiled",
        capable=_compiled.capable,
    ),
    Patch(
        name="region_settings",
        kind="required",
        summary="A graph holding regions is compiled without inductor's buffer reuse and traced without donated "
        "backward buffers (both give wrong gradients) and with Python floats kept constant (a region cannot take them "
        "as inputs).",
        touches=(
            "torch._functorch.config.donated_buffer",
            "torch._dynamo.config.specialize_float",
            "torch._inductor.config.allow_buffer_reuse",
        ),
        verified=_VERIFIED,
        upstream=_gh(193960, "a reused region's donated buffer overwritten"),
        test="tests/test_blocks.py::test_repeated_blocks_with_inductor_get_the_gradients_right",
        module="_regions",
        capable=_regions.capable_settings,
        scope=_regions.region_tracing,
    ),
    Patch(
        name="activation_memory_budget",
        kind="required",
        summary="The 'budget' activation-checkpointing policy is the partitioner's memory budget, set while the step "
        "compiles.",
        touches=("torch._functorch.config.activation_memory_budget",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_torch_patches.py::test_a_scoped_row_changes_torch_only_inside_its_scope",
        module="_regions",
        capable=_regions.capable_budget,
        scope=functools.partial(_regions.activation_memory_budget, 0.5),
    ),
    Patch(
        name="prefetch_pass_hooks",
        kind="required",
        summary="prefetch_gathers=True hands its graph pass to inductor as the post-grad pass, or to aot_eager's "
        "partitioned forward and backward.",
        touches=(
            "torch._inductor.config.post_grad_custom_post_pass",
            "torch._inductor.custom_graph_pass.CustomGraphPass",
            "torch._dynamo.backends.debugging.aot_eager",
            "torch._functorch.aot_autograd.make_boxed_func",
        ),
        verified=_VERIFIED,
        upstream=_gh(184225, "inductor's own overlap pass, an alternative"),
        test="tests/test_prefetch.py::test_inductor_gets_the_pass_as_its_post_grad_pass",
        module="_graph_passes",
        capable=_graph_passes.capable,
    ),
    Patch(
        name="static_shapes",
        kind="required",
        summary="With packing off, the job's few padded lengths compile as graphs of their own (no symbolic length, "
        "which the FX graph cache cannot load back).",
        touches=("torch._dynamo.config.automatic_dynamic_shapes",),
        verified=_VERIFIED,
        upstream=_NONE,
        test="tests/test_torch_patches.py::test_a_scoped_row_changes_torch_only_inside_its_scope",
        module="_regions",
        capable=_regions.capable_static_shapes,
        scope=_regions.static_shapes,
    ),
    Patch(
        name="compile_cache_dirs",
        kind="required",
        summary="The run's and the host's compile caches read inductor's cache directory and clear its in-memory "
        "caches when they move it (per rank: a DTensor's cache key is the same on every rank).",
        touches=(
            "torch._inductor.runtime.cache_dir_utils.cache_dir",
            "torch._inductor.runtime.cache_dir_utils.default_cache_dir",
            "torch._inductor.utils.clear_caches",
        ),
        verified=_VERIFIED,
        upstream=_gh(188390, "cache keys shared by the ranks"),
        test="tests/test_compile_cache.py::test_run_compile_cache_puts_each_rank_in_the_run_directory",
        module="_caches",
        capable=_caches.capable_cache_dirs,
    ),
)

for _patch in PATCHES:
    register(_patch)


def row(name: str) -> Patch:
    """The row named ``name``.

    Raises:
        ValueError: no row has that name.
    """
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise ValueError(f"row: no torch patch is named {name!r}; the rows are {', '.join(p.name for p in PATCHES)}")
