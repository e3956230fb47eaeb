"""Data-parallel scaling on CPU: bytes communicated per step against the minimum, and 1 vs 2 ranks' step time.

For each placement (``ddp-plain``: plain params and the bucketed all-reduce hook; ``replicate``: DTensor
``Replicate`` on a (2, 1) mesh; ``shard``: FSDP-style ``Shard(0)`` on a (1, 2) mesh; ``hybrid``: a (2, 2)
mesh on 4 ranks, with ``--hybrid``) the benchmark

- runs one *eager* step under a dispatch mode that records every ``_c10d_functional`` collective (what
  the compiled step traces into its graph) and prices it with the ring algorithm, per rank: all-reduce
  ``2(n-1)/n`` of its bytes, reduce-scatter ``(n-1)/n`` of its input, all-gather ``(n-1)/n`` of its
  output; and compares that with the least the placement must move (see :func:`minimum_bytes`);
- times the ``torch.compile``d step on 2 forked gloo ranks (one intra-op thread each, so they use the
  machine's 2 cores) against the same global batch on 1 rank with 1 thread (and, for honesty, 1 rank with
  2 threads). The 1-rank steps run in rank 0 while rank 1 waits in a gloo barrier; every variant is
  measured in the same run, interleaved, and the table reports medians.

Run: ``python benchmarks/dp_scaling.py [--json PATH] [--quick] [--hybrid] [--backend inductor|aot_eager]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import d9dfn.optim as optim
from d9dfn import init_train_state, make_train_step, parallel
from d9dfn.loop import init_data_parallel_mesh, per_rank_compile_cache
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.tasks import CausalLMTask

PLACEMENTS = {"ddp-plain": (2, 1), "replicate": (2, 1), "shard": (1, 2), "hybrid": (2, 2)}
"""Placement → mesh degrees ``(data_parallel_replicate, data_parallel_shard)``."""
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "isend", "irecv", "batch_p2p")
"""``_c10d_functional`` ops that move data (``wait_tensor`` and ``_wrap_tensor_autograd`` do not)."""
SCALAR_BYTES = 4  # Σwℓ, Σw and the squared-norm partial are float32 scalars


# --- counting the collectives ---------------------------------------------------------------------------------------


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value) if isinstance(value, list | tuple) else 0


def _group_size(group: Any) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group).size() if isinstance(group, str) else group.size()


class CollectiveCounter(TorchDispatchMode):
    """Records every functional collective run inside it: ``(op, group size, payload bytes, ring bytes per rank)``.

    DTensor ops are passed on (``NotImplemented``) so that DTensor desugars them into collectives on local
    tensors while this mode is still active: those collectives are the ones recorded.
    """

    supports_higher_order_operators = True  # compiled graphs call regions and checkpoint's RNG operators

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, int, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func._overloadpacket.__name__
        if namespace == "_c10d_functional" and name.startswith(_COLLECTIVES):
            n = _group_size(args[-1])
            if name.startswith("all_reduce"):
                payload, factor = _nbytes(args[0]), 2 * (n - 1) / n
            elif name.startswith("all_gather"):
                payload, factor = _nbytes(out), (n - 1) / n
            elif name.startswith(("reduce_scatter", "all_to_all")):
                payload, factor = _nbytes(args[0]), (n - 1) / n
            else:  # broadcast, send/recv: not expected in a data-parallel step; priced at their payload
                payload, factor = _nbytes(args[0]), 1.0
            self.records.append((name, n, payload, payload * factor))
        elif namespace == "c10d" and name not in ("wait", "barrier", "monitored_barrier"):
            # an eager in-place collective (dist.all_reduce): the step must not use them; recorded so it would show
            self.records.append((f"c10d.{name}", 0, _nbytes(args[0]), float(_nbytes(args[0]))))
        return out


def minimum_bytes(placement: str, param_bytes: int, degrees: tuple[int, int]) -> float:
    """The least a rank must send per step (ring algorithm) for ``placement`` with ``param_bytes`` of float32 params.

    - ``ddp-plain`` / ``replicate``: one all-reduce of every gradient and of ``Σwℓ, Σw``:
      ``2(n-1)/n · (P + 8)``; the clipping norm is then local.
    - ``shard`` (FSDP): gather the params once and reduce-scatter the gradients, ``2 · (n-1)/n · P``, plus one
      all-reduce of three scalars (``Σwℓ``, ``Σw`` and the squared norm of the local gradient shard; the norm of
      ``g/Σw`` is ``‖Σwg‖/Σw``, so they could share one collective): ``2(n-1)/n · 12``.
    - ``hybrid`` (HSDP, ``r`` replicas of ``s`` shards): gather and reduce-scatter over the shard axis, then
      all-reduce the ``P/s`` shard over the replicate axis, plus the three scalars over all ``r·s`` ranks.
    - ``block-shard`` (params gathered per block, given back after the forward): ``shard``'s, plus the second gather
      of every block for its backward, ``(n-1)/n · P`` more (this counts the gathered blocks as the whole ``P``: the
      few params outside the blocks are gathered once).
    """
    replicate, shard = degrees
    n = replicate * shard

    def ring_all_reduce(nbytes: float, size: int) -> float:
        return 2 * (size - 1) / size * nbytes

    if placement in ("ddp-plain", "replicate"):
        return ring_all_reduce(param_bytes + 2 * SCALAR_BYTES, n)
    scalars = ring_all_reduce(3 * SCALAR_BYTES, n)
    gathers = 3 if placement == "block-shard" else 2  # the second gather for the backward
    sharded = gathers * (shard - 1) / shard * param_bytes
    return sharded + ring_all_reduce(param_bytes / shard, replicate) + scalars


# --- the model, the batch and the steps -----------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=args.hidden * 3,
        max_seq_len=args.seq,
    )


def _global_batch(config: Qwen3Config, rows: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (rows, seq + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _build(
    placement: str | None, config: Qwen3Config, args: argparse.Namespace, compile: bool, rank: int = 0
) -> tuple[Callable, Any]:
    """``(step, state)``: ``placement=None`` is the single-process step on the whole batch."""
    torch.manual_seed(0)
    model, task, opt = Qwen3LM(config), CausalLMTask(), optim.adamw(1e-3, weight_decay=1e-2)
    data_parallel, mesh = None, None
    if placement == "ddp-plain":
        data_parallel = parallel.data_parallel(torch.distributed.group.WORLD, rank)
    elif placement is not None:
        replicate, shard = PLACEMENTS[placement]
        mesh = init_data_parallel_mesh(replicate, shard, device_type="cpu")
        data_parallel = parallel.data_parallel(mesh, rank)
    state = init_train_state(model, opt, task=task, mesh=mesh)
    plan = None if mesh is None else parallel.plan_for(state.params, mesh)  # the plan's own reduction and rank
    step = make_train_step(
        model,
        task,
        opt,
        max_grad_norm=1.0,  # the clip needs the global norm: a collective when params are sharded
        plan=plan,
        data_parallel=data_parallel if plan is None else None,
        compile=args.backend if compile else False,
    )
    return step, state


def _rows(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    rows = batch["input_ids"].shape[0] // world_size
    return {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}


def count_communication(placement: str, config: Qwen3Config, args: argparse.Namespace, rank: int) -> dict:
    """One eager step of ``placement`` on this rank, with its collectives recorded. A collective call: every rank."""
    world_size = torch.distributed.get_world_size()
    step, state = _build(placement, config, args, compile=False, rank=rank)
    batch = _rows(_global_batch(config, args.batch, args.seq), rank, world_size)
    step(state, batch)  # a first step outside the counter: lazily created groups and caches are not counted
    counter = CollectiveCounter()
    with counter:
        step(state, batch)
    param_bytes = sum(p.numel() * p.element_size() for p in state.params.values())
    measured = sum(record[3] for record in counter.records)
    minimum = minimum_bytes(placement, param_bytes, PLACEMENTS[placement])
    kinds: dict[str, int] = {}
    for name, *_ in counter.records:
        kinds[name] = kinds.get(name, 0) + 1
    return {
        "param_bytes": param_bytes,
        "num_params": len(state.params),
        "collectives": len(counter.records),
        "collective_kinds": kinds,
        "payload_bytes": sum(record[2] for record in counter.records),
        "bytes_measured": measured,
        "bytes_minimum": minimum,
        "ratio": measured / minimum,
    }


# --- the ranks ------------------------------------------------------------------------------------------------------


def _timed(run: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1e3


def _stepper(step: Callable, state: Any, batch: dict) -> Callable[[], None]:
    holder = [state]

    def run() -> None:
        holder[0], out = step(holder[0], batch)
        out.loss.item()  # a host sync: the step's collectives and kernels have finished

    return run


def _rank_worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank; a forked child must not enter the parent's OpenMP pool
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        placements = [p for p in args.placements if PLACEMENTS[p][0] * PLACEMENTS[p][1] == world_size]
        config = _config(args)
        result: dict[str, Any] = {"counts": {p: count_communication(p, config, args, rank) for p in placements}}
        if args.timing:
            result["timing"] = _time_ranks(placements, config, args, rank, world_size)
        if rank == 0:
            Path(out_dir, f"world_{world_size}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _time_ranks(
    placements: list[str], config: Qwen3Config, args: argparse.Namespace, rank: int, world_size: int
) -> dict:
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    per_rank_compile_cache(rank)
    inductor_config.compile_threads = 1  # no compile worker pool in a forked rank
    # The variants share make_train_step's code object with different shapes (4 rows vs 8, shards vs whole
    # params): without this dynamo would recompile them with dynamic shapes.
    torch._dynamo.config.automatic_dynamic_shapes = False
    batch = _global_batch(config, args.batch, args.seq)
    runs: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    for placement in placements:
        step, state = _build(placement, config, args, compile=True, rank=rank)
        runs[placement] = _stepper(step, state, _rows(batch, rank, world_size))
    single = ("1 rank, 1 thread", "1 rank, 2 threads") if world_size == 2 else ()
    if rank == 0 and single:  # the 1-rank baseline, run here while the other ranks wait in a barrier
        step, state = _build(None, config, args, compile=True)
        runs["1 rank, 1 thread"] = runs["1 rank, 2 threads"] = _stepper(step, state, batch)
    names = [*single, *placements]

    def run_variant(name: str, steps: int) -> tuple[float, float]:
        """(ms per step, this rank's CPU seconds during it)."""
        dist.barrier()
        cpu = time.process_time()
        ms = float("nan")
        if name not in single:
            ms = _timed(runs[name], steps)
        elif rank == 0:
            torch.set_num_threads(2 if name.endswith("2 threads") else 1)
            ms = _timed(runs[name], steps)
            torch.set_num_threads(1)
        cpu = time.process_time() - cpu
        dist.barrier()
        return ms, cpu

    # The first two calls compile; the 2-thread variant compiles its own graph (dynamo guards on the thread count).
    for name in names:
        start = time.perf_counter()
        run_variant(name, 2)
        compile_s[name] = time.perf_counter() - start
    samples: dict[str, list[float]] = {name: [] for name in names}
    idle_cpu_s, idle_wall_s = 0.0, 0.0
    for _ in range(args.repeats):
        for name in names:
            start = time.perf_counter()
            ms, cpu = run_variant(name, args.steps)
            if name in single and rank != 0:
                idle_cpu_s, idle_wall_s = idle_cpu_s + cpu, idle_wall_s + time.perf_counter() - start
            samples[name].append(ms)
    # The slowest rank's median: the ranks wait for each other in every collective, so they barely differ.
    medians = {name: statistics.median(values) for name, values in samples.items()}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (medians, idle_cpu_s / max(idle_wall_s, 1e-9)))
    # (the 1-rank variants ran on rank 0 only: the other ranks hold NaN for them)
    ms_per_step = {name: max(g[0][name] for g in gathered if not math.isnan(g[0][name])) for name in names}
    return {
        "ms_per_step": ms_per_step,
        "compile_s": compile_s,
        "idle_rank_cpu_fraction": max(g[1] for g in gathered[1:]) if world_size > 1 else 0.0,
    }


def run_ranks(
    world_size: int, args: argparse.Namespace, timeout_s: float = 600.0, worker: Callable[..., None] = _rank_worker
) -> dict:
    """Fork ``world_size`` gloo ranks that count (and, with ``args.timing``, time) the placements; rank 0's result.

    ``worker(rank, world_size, init_file, args, out_dir)`` is what each rank runs (another benchmark's): rank 0
    writes its result to ``out_dir/world_{world_size}.json``.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="dp_scaling_") as tmp:
        # fork: forked ranks start at once (spawned ones re-import torch, ~15 s on a 2-core machine)
        context = mp.start_processes(
            worker,
            args=(world_size, str(Path(tmp, "store")), args, tmp),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0, grace_period=2.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"run_ranks: {world_size} ranks did not finish within {timeout_s} s")
        return json.loads(Path(tmp, f"world_{world_size}.json").read_text())


# --- the report -----------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="rows of the global batch (split over the ranks)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--backend", default="aot_eager", help="torch.compile backend of the timed steps (inductor: ~7 min here)"
    )
    parser.add_argument("--hybrid", action="store_true", help="also 4 ranks on a 2x2 mesh (slow on 2 cores)")
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="count bytes only (eager)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 repetition: a smoke run")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--quick`` applied and the list of placements filled in."""
    args = _parser().parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.seq = 32, 2, 4, 2, 32
        args.batch, args.steps, args.repeats = 4, 1, 1
    args.placements = ["ddp-plain", "replicate", "shard"] + (["hybrid"] if args.hybrid else [])
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    worlds = {2: run_ranks(2, args)}
    if args.hybrid:
        worlds[4] = run_ranks(4, args)

    rows = []
    for world_size, result in worlds.items():
        timing = result.get("timing")
        if timing and world_size == 2:
            for name in ("1 rank, 1 thread", "1 rank, 2 threads"):
                ms, compiled_s = timing["ms_per_step"][name], timing["compile_s"][name]
                rows.append({"placement": name, "ranks": 1, "ms_per_step": ms, "compile_s": compiled_s})
        for placement, count in result["counts"].items():
            row = {"placement": placement, "ranks": world_size, "mesh": list(PLACEMENTS[placement]), **count}
            if timing:
                row["ms_per_step"] = timing["ms_per_step"][placement]
                row["compile_s"] = timing["compile_s"][placement]
            rows.append(row)
    baseline = worlds[2].get("timing", {}).get("ms_per_step", {}).get("1 rank, 1 thread")
    for row in rows:
        if baseline and "ms_per_step" in row:
            row["speedup_vs_1_rank_1_thread"] = baseline / row["ms_per_step"]
    report = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "json"},
            "json": str(args.json) if args.json else None,
            "threads_per_rank": 1,
            "torch": torch.__version__,
        },
        "rows": rows,
        "idle_rank_cpu_fraction": worlds[2].get("timing", {}).get("idle_rank_cpu_fraction"),
        "wall_s": time.perf_counter() - start,
        "load_average_1min": os.getloadavg()[0],  # other processes on the machine: the timings' noise
    }

    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    header = f"{'placement':18s} {'ranks':>5s} {'colls':>6s} {'bytes/step':>12s} {'minimum':>12s} {'ratio':>7s}"
    print(f"{header} {'ms/step':>9s} {'speed-up':>9s}")
    for row in rows:
        print(
            f"{row['placement']:18s} {row['ranks']:5d} {cell(row, 'collectives', '6d')} "
            f"{cell(row, 'bytes_measured', '12,.0f')} {cell(row, 'bytes_minimum', '12,.0f')} "
            f"{cell(row, 'ratio', '7.4f')} {cell(row, 'ms_per_step', '9.2f')} "
            f"{cell(row, 'speedup_vs_1_rank_1_thread', '9.2f')}"
        )
    if report["idle_rank_cpu_fraction"] is not None:
        print(f"rank 1 CPU use while rank 0 ran the 1-rank steps: {report['idle_rank_cpu_fraction']:.1%} of one core")
    print(
        f"backend {args.backend}; bytes per rank per step, ring algorithm; wall {report['wall_s']:.0f} s; "
        f"load average {report['load_average_1min']:.1f} on {os.cpu_count()} cores"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
