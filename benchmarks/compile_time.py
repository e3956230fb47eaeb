"""Cold compile time, warm step time and where the first step's time goes, for the train step of a Qwen3-style LM.

Each (variant, layers, microbatches) row runs in its own subprocess with a fresh, empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in a temporary directory), so every first step is a cold compile. Variants:

- ``program``: the traced step (``make_train_step(..., repeated_blocks=())``: head, one per-microbatch
  forward+backward+accumulate piece, tail), the library's default;
- ``blocks``: each decoder layer compiled once (``repeated_blocks="auto"``, the loop's default): gradients by
  autograd, and the tail updates each layer's leaves through one region (automatic with a leafwise optimizer);
- ``unrolled``: the whole step as one graph (``executor=d9dfn.Sequential(unroll=True)``);
- ``infer`` / ``infer_blocks``: the forward-only inference step the job's evaluation runs, without / with blocks;
- ``fwbw`` / ``regions`` / ``regions_reuse``: probes of torch's ``nested_compile_region`` on the model's loss
  alone (not d9dfn steps; ``docs/design/step.md``), each reporting its largest gradient error against eager
  ``grad_and_value`` (``grad_err``).

The step: AdamW (weight decay 0.01) with clipping at ``--max-grad-norm`` (default 1.0), ``--microbatches`` per
step; ``--fused false`` compiles the optimizer into the step's tail instead of running AdamW's fused kernel (the
default for CPU params; ``--fused auto`` also runs code from before the option, through ``--code``). Reported per
row: graphs compiled, the first step (compile + one run, wall), the second step, and with ``--warm-calls N`` the
median of N warm steps. ``--second-start`` runs every row's subprocess again on the same
cache directory (what a resume, ``d9dfn infer`` or a second rank on one host finds) and reports that first step
and the caches' hits and misses.

``--breakdown`` prints, for every row, torch's own timers (``torch._dynamo.utils.compilation_time_metrics``, the
ones ``torch._dynamo.utils.compile_times()`` prints; inclusive seconds summed over calls) grouped as dynamo,
AOTAutograd, inductor (lowering, scheduling, kernel code generation, loading) and the C++ compiler, with the
kernels generated (``torch._inductor.metrics``) and the cache counters (``torch._dynamo.utils.counters``). With
more than one compile thread (inductor's default: one per core), C++ compiles run in parallel threads, so their
summed seconds may exceed their wall time; ``async_compile.wait`` is the wall time the main thread waited for them.

``--code DIR`` runs the subprocesses on another checkout of d9dfn (``PYTHONPATH=DIR``), e.g. an exported ``main``
for before/after tables in one run; on code before the ``d9dfn.step`` API, ``blocks`` passes
``repeated_blocks=(Qwen3DecoderLayer,), blockwise_optimizer=True`` and ``unrolled`` passes ``unroll=True``.
``--env NAME=VALUE`` (repeatable) sets an environment variable in the subprocesses (``TORCHINDUCTOR_*`` settings),
``--inductor NAME=JSON`` a ``torch._inductor.config`` setting (``--inductor cpp.max_horizontal_fusion_size=64``).

Run: ``OMP_NUM_THREADS=2 python benchmarks/compile_time.py --layers 4,16 --microbatches 1 --variants program,blocks
--warm-calls 9 [--breakdown] [--second-start] [--json PATH]``. The default job's model and step shape:
``--hidden 128 --seq 128 --batch 16 --deterministic``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_VARIANTS = ("program", "blocks", "unrolled", "infer", "infer_blocks", "fwbw", "regions", "regions_reuse")


def _child(variant: str, num_microbatches: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import d9dfn.optim as optim
    from d9dfn import BuildForwardInputsResult, ComputeLossResult, TrainTask, init_train_state, make_train_step
    from d9dfn.models import Qwen3Config, Qwen3LM

    bypasses = _record_cache_bypasses()
    for item in args.inductor:  # torch._inductor.config settings (dotted names: cpp.max_horizontal_fusion_size)
        name, value = item.split("=", 1)
        owner = torch._inductor.config
        *parents, leaf = name.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, leaf, json.loads(value))
    if args.deterministic:
        torch.use_deterministic_algorithms(True)

    class NextToken(TrainTask):
        def build_forward_inputs(self, batch, state):
            return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state.set(
                "labels", batch["labels"]
            )

        def compute_loss(self, outputs, state, step):
            labels = state["labels"]
            loss = F.cross_entropy(outputs["logits"].flatten(0, 1).float(), labels.flatten())
            return ComputeLossResult(loss=loss, loss_weight=torch.tensor(float(labels.numel())))

    config = Qwen3Config(
        hidden_size=args.hidden,
        num_layers=int(args.layers),
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        intermediate_size=args.hidden * 3,
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    model = Qwen3LM(config)
    fused = {} if args.fused == "auto" else {"fused": args.fused == "true"}  # auto: the default (and older code)
    optimizer = optim.adamw(1e-3, weight_decay=1e-2, **fused)
    state = init_train_state(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if variant in ("fwbw", "regions", "regions_reuse"):
        row = _probe_regions(variant, model, NextToken(), state, batch, args)
    elif variant in ("infer", "infer_blocks"):
        row = _inference(variant, model, state, batch, num_microbatches, args)
    else:
        step = make_train_step(
            model,
            NextToken(),
            optimizer,
            num_microbatches=num_microbatches,
            max_grad_norm=args.max_grad_norm or None,
            **_step_options(make_train_step, variant),
        )

        def call() -> None:
            nonlocal state
            state, out = step(state, batch)
            float(out.loss)

        row = _timed(call, args.warm_calls)
    return {
        "variant": variant,
        "microbatches": num_microbatches,
        "layers": int(args.layers),
        **row,
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        **_compile_report(bypasses),
    }


def _step_options(builder, variant: str) -> dict:
    """The builder's keywords for ``variant``, on the ``d9dfn.step`` API or the one before it (``--code``)."""
    new_api = "executor" in inspect.signature(builder).parameters
    if variant in ("blocks", "infer_blocks"):
        if new_api:
            return {"repeated_blocks": "auto"}
        from d9dfn.models._decoder import Qwen3DecoderLayer

        old = {"repeated_blocks": (Qwen3DecoderLayer,)}
        return old if variant == "infer_blocks" else {**old, "blockwise_optimizer": True}
    if variant == "unrolled":
        if new_api:
            from d9dfn import Sequential

            return {"executor": Sequential(unroll=True)}
        return {"unroll": True}
    return {}


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process (every thread) and its finished children (the C++ compiler)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(call, warm_calls: int) -> dict:
    """The first call (cold compile + one run), the second, and the median of ``warm_calls`` more, in seconds / ms;
    and the CPU seconds of the first call (less sensitive than wall time to other jobs on a shared machine)."""
    times = []
    for index in range(2 + warm_calls):
        start, cpu = time.perf_counter(), _cpu_seconds()
        call()
        times.append(time.perf_counter() - start)
        if index == 0:
            first_cpu = _cpu_seconds() - cpu
    warm = sorted(times[2:])
    return {
        "first_step_cpu_s": first_cpu,
        "first_step_s": times[0],
        "second_step_s": times[1],
        "warm_ms": 1e3 * warm[len(warm) // 2] if warm else None,
    }


def _inference(variant: str, model, state, batch, num_microbatches: int, args) -> dict:
    """The forward-only step the job's evaluation runs (``make_inference_step``, perplexity task), cold then warm."""
    import torch

    from d9dfn import InferenceState, make_inference_step
    from d9dfn.tasks import PerplexityTask

    task = PerplexityTask()
    step = make_inference_step(
        model, task, num_microbatches=num_microbatches, **_step_options(make_inference_step, variant)
    )
    inference = InferenceState(
        params=state.params, buffers=state.buffers, step=state.step, rng=state.rng, task_state=task.init_state()
    )

    def call() -> None:
        nonlocal inference
        inference = step(inference, batch)
        float(inference.task_state["nll"])

    with torch.no_grad():
        return _timed(call, args.warm_calls)


def _probe_regions(variant: str, model, task, state, batch, args: argparse.Namespace) -> dict:
    """Cold first forward+backward of the loss, compiled with or without nested compile regions (see above)."""
    import torch
    import torch._functorch.config
    from torch.func import functional_call, grad_and_value

    from d9dfn import PipelineState
    from d9dfn.models._decoder import Qwen3DecoderLayer

    try:
        from d9dfn.step._blocks import swapped_in
    except ImportError:  # before the d9dfn.step package
        from d9dfn._blocks import swapped_in  # type: ignore[no-redef]

    def loss_of(params):
        forward, pstate = task.build_forward_inputs(batch, PipelineState())
        outputs = functional_call(model, params, kwargs=forward.inputs)
        return task.compute_loss(outputs, pstate, state.step).loss

    reference, _ = grad_and_value(loss_of)(state.params)  # eager, before any region exists
    options = {}
    if variant.startswith("regions"):
        # pytorch/pytorch#193960: a reused region's backward may overwrite a donated buffer
        torch._functorch.config.donated_buffer = False
        Qwen3DecoderLayer.forward = torch.compiler.nested_compile_region(Qwen3DecoderLayer.forward)
        # Inductor turns a region's outputs that are its own inputs (saved for backward) into new buffers, so
        # the outer graph reuses the inputs' storage after their last outer use and the backward reads garbage.
        options = {"allow_buffer_reuse": variant == "regions_reuse"}
    forward, pstate = task.build_forward_inputs(batch, PipelineState())
    compiled = torch.compile(
        lambda inputs: task.compute_loss(model(**inputs), pstate, state.step).loss, fullgraph=True, options=options
    )
    leaves = {name: p.detach().requires_grad_() for name, p in state.params.items()}
    grads: list = []

    def call() -> None:
        with swapped_in(model, leaves):
            loss = compiled(forward.inputs)
        grads[:] = torch.autograd.grad(loss, list(leaves.values()))

    row = _timed(call, args.warm_calls)
    errors = ((g - reference[n]).abs().max() / reference[n].abs().max() for n, g in zip(leaves, grads, strict=True))
    return {**row, "grad_err": max(float(e) for e in errors)}


# Torch's timers (``dynamo_timed`` keys) in the breakdown: (label, key), indented by what they sit inside.
_TIMERS = (
    ("dynamo: every frame compiled (trace, guards, backend)", "_compile.compile_inner"),
    ("  dynamo's bytecode tracing", "bytecode_tracing"),
    ("  guards built", "build_guards"),
    ("  backend call (AOTAutograd + inductor forward)", "OutputGraph.call_user_compiler"),
    ("AOTAutograd: create_aot_dispatcher_function", "create_aot_dispatcher_function"),
    ("  joint graph trace", "aot_trace_joint_graph"),
    ("  joint graph passes", "_recursive_joint_graph_passes"),
    ("  partitioner (min-cut)", "min_cut_rematerialization_partition"),
    ("  AOTAutograd cache: load", "AOTAutogradCache.inductor_load"),
    ("inductor: compile_fx_inner (forward, backward, inference graphs)", "compile_fx_inner"),
    ("  lowering (GraphLowering.run)", "GraphLowering.run"),
    ("  post-grad passes", "_recursive_post_grad_passes"),
    ("  scheduling and fusion (Scheduler.__init__)", "Scheduler.__init__"),
    ("  kernel code generation (Scheduler.codegen)", "Scheduler.codegen"),
    ("  wrapper code generation", "PythonWrapperCodegen.generate"),
    ("  module load (PyCodeCache.load_by_key_path)", "PyCodeCache.load_by_key_path"),
    ("    waiting for C++ compiles (async_compile.wait)", "async_compile.wait"),
    ("C++ compiler: compile_file (seconds summed over threads)", "compile_file"),
    ("backward compile (compile_fx bw_compiler)", "compile_fx.<locals>.bw_compiler"),
)


def _compile_report(bypasses: list[str]) -> dict:
    """torch's compile timers, inductor's kernel counts and the caches' counters after this process's steps."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor import metrics

    timers = {}
    for _, key in _TIMERS:
        timers[key] = [len(compilation_time_metrics.get(key, [])), sum(compilation_time_metrics.get(key, []))]
    autotune = [k for k in compilation_time_metrics if "autotun" in k.lower() or "select_algorithm" in k.lower()]
    timers["autotuning (keys: " + (", ".join(autotune) or "none") + ")"] = [
        sum(len(compilation_time_metrics[k]) for k in autotune),
        sum(sum(compilation_time_metrics[k]) for k in autotune),
    ]
    caches = {
        name: int(counters[group][name])
        for group, names in (
            ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
            ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
        )
        for name in names
    }
    return {
        "timers": timers,
        "kernels": int(metrics.generated_kernel_count),
        "cpp_vec_kernels": int(metrics.generated_cpp_vec_kernel_count),
        "ir_nodes_pre_fusion": int(metrics.ir_nodes_pre_fusion),
        "caches": caches,
        "cache_bypass_reasons": sorted(set(bypasses)),
        "compile_threads": int(torch._inductor.config.compile_threads),
    }


def _record_cache_bypasses() -> list[str]:
    """torch's own "Bypassing ..." log lines of the FX graph and AOTAutograd caches, collected as they happen."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "Bypassing" in message:
                found.append(message[:200])

    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(Collect())
        logger.propagate = False  # keep INFO lines off the terminal
    return found


def _print_breakdown(row: dict, label: str) -> None:
    print(f"\n  breakdown of the {label} (torch's timers, inclusive s, calls):")
    timers = row["timers"]
    print(f"    {'first step (wall, compile + one run)':64s} {row['first_step_s']:8.2f}")
    print(f"    {'first step (CPU seconds: every thread, the C++ compiler)':64s} {row['first_step_cpu_s']:8.2f}")
    for name, key in _TIMERS:
        calls, seconds = timers[key]
        if calls:
            print(f"    {name:64s} {seconds:8.2f}  ({calls})")
    own = timers["_compile.compile_inner"][1] - timers["OutputGraph.call_user_compiler"][1]
    print(f"    {'dynamo alone = compile_inner - backend call':64s} {own:8.2f}")
    for name, (calls, seconds) in timers.items():
        if name.startswith("autotuning"):
            print(f"    {name:64s} {seconds:8.2f}  ({calls})")
    print(
        f"    kernels generated {row['kernels']} (C++ vectorized {row['cpp_vec_kernels']}), IR nodes before fusion "
        f"{row['ir_nodes_pre_fusion']}, compile threads {row['compile_threads']}; caches {row['caches']}"
    )
    for reason in row["cache_bypass_reasons"]:
        print(f"    cache bypass: {reason}")


def _run_child(variant: str, count: int, passthrough: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, *passthrough, "--child", variant, str(count)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"compile_time: the {variant} subprocess failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", default="2", help="decoder layers; a comma list measures each")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--variants", default="program,unrolled", help=f"comma list of {', '.join(_VARIANTS)}")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping (0: none)")
    parser.add_argument(
        "--fused",
        choices=("auto", "true", "false"),
        default="auto",
        help="AdamW's fused kernel in the step's tail (adamw(fused=...)); auto: the default, fused for CPU params",
    )
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms (the job's)")
    parser.add_argument("--warm-calls", type=int, default=0, help="time this many warm steps (median, ms)")
    parser.add_argument("--breakdown", action="store_true", help="print where each first step's time went")
    parser.add_argument("--second-start", action="store_true", help="run each row again on its warm cache")
    parser.add_argument("--code", type=Path, default=None, help="run the subprocesses on this d9dfn checkout")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="subprocess environment")
    parser.add_argument(
        "--inductor", action="append", default=[], metavar="NAME=JSON", help="torch._inductor.config setting"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MICROBATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), args)))
        return {}
    unknown = sorted(set(args.variants.split(",")) - set(_VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(_VARIANTS)}")
    extra_env = dict(item.split("=", 1) for item in args.env)
    if args.code is not None:
        extra_env["PYTHONPATH"] = str(args.code.resolve())
    load = os.getloadavg()[0]
    print(f"load average (1 min) at start: {load:.2f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)

    rows = []
    for layers in (int(n) for n in str(args.layers).split(",")):
        passthrough = ["--hidden", str(args.hidden), "--layers", str(layers), "--seq", str(args.seq)]
        passthrough += ["--batch", str(args.batch), "--warm-calls", str(args.warm_calls)]
        passthrough += ["--max-grad-norm", str(args.max_grad_norm)] + (["--deterministic"] * args.deterministic)
        passthrough += [arg for item in args.inductor for arg in ("--inductor", item)] + ["--fused", args.fused]
        for variant in args.variants.split(","):
            for count in (int(n) for n in args.microbatches.split(",")):
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, **extra_env, "TORCHINDUCTOR_CACHE_DIR": cache}
                    row = _run_child(variant, count, passthrough, env)
                    row["load_before"] = load
                    if args.second_start:
                        again = _run_child(variant, count, passthrough, env)
                        row["second_start"] = again
                load = os.getloadavg()[0]
                row["load_after"] = load
                rows.append(row)
                print(
                    f"{variant:12s} L={layers:<3d} m={count:<2d} graphs={row['graphs']:<3d} "
                    f"first step {row['first_step_s']:7.2f} s (CPU {row['first_step_cpu_s']:6.1f} s)  "
                    f"second {row['second_step_s']:6.3f} s"
                    + (f"  warm {row['warm_ms']:.1f} ms" if row.get("warm_ms") else "")
                    + (f"  grad_err {row['grad_err']:.2e}" if "grad_err" in row else "")
                    + (
                        f"  second start: first step {row['second_start']['first_step_s']:.2f} s "
                        f"{row['second_start']['caches']}"
                        if "second_start" in row
                        else ""
                    )
                    + f"  (load {row['load_before']:.1f} -> {row['load_after']:.1f})",
                    flush=True,
                )
                if args.breakdown:
                    _print_breakdown(row, "first step")
                    if "second_start" in row:
                        _print_breakdown(row["second_start"], "second start's first step")
    header = f"{'variant':12s} {'L':>3s} {'m':>3s} {'graphs':>7s} {'first s':>8s} {'CPU s':>7s} {'warm ms':>8s}"
    print(f"\n{header} {'t/t(first)':>10s}")
    for row in rows:
        base = next(r for r in rows if r["variant"] == row["variant"])  # the first (L, m) measured
        row["ratio_to_first"] = row["first_step_s"] / base["first_step_s"]
        warm = f"{row['warm_ms']:8.1f}" if row.get("warm_ms") else f"{'-':>8s}"
        print(
            f"{row['variant']:12s} {row['layers']:3d} {row['microbatches']:3d} {row['graphs']:7d} "
            f"{row['first_step_s']:8.2f} {row['first_step_cpu_s']:7.1f} {warm} {row['ratio_to_first']:10.3f}"
        )
    report = {"config": {k: str(v) for k, v in vars(args).items() if k not in ("json", "child")}, "results": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
