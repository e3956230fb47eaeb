"""Memory per rank of one training step, by what holds it, beside the step's time and its communication.

The table of issue 24: {placement} × {activation checkpointing} × depth × ranks, on the reference model
(:class:`d9dfn.models.Qwen3LM`, sizes from the flags) with AdamW and clipping, every rank holding ``--batch``
rows (weak scaling: activations stay the same per rank, what sharding saves shows). For each cell, on every rank:

- one **eager** step under :class:`_memory.MemoryTracker` (``benchmarks/_memory.py``): the peak live bytes split
  into params (the rank's own, and the new ones the step returns), gathered params (full copies made from shards,
  compute-dtype casts), gradients, optimizer state (input, output and the update's temporaries), activations
  (tensors a forward made and its backward read) and other; with the collectives of the same step counted and
  priced as ``benchmarks/dp_scaling.py`` does (``CollectiveCounter``, ring bytes against ``minimum_bytes``);
- the **compiled** step (``--backend``): its peak from the allocator (the profiler's allocation events on CPU,
  ``torch.cuda.max_memory_allocated`` on CUDA: compiled kernels' buffers included, no categories) and its time
  (median of ``--repeats`` runs of ``--steps`` steps, ranks in step through barriers); on CPU, the same steps once
  more under torch's profiler for the communication the step did not hide: the time gloo's threads spent in
  collectives and the time the step's thread waited for them (:func:`communication`).

Memory columns are the highest rank's (ranks differ only by uneven shards); every byte count is deterministic,
the times are not (the load average is printed beside them).

Placements, checkpointing policies and the step's form (donating, as the loop runs it, or pure) are tables of
make_train_step keywords (:data:`PLACEMENTS`, :data:`CHECKPOINTING`, :data:`DONATION`).

Run: ``python benchmarks/memory.py [--variants replicate,shard] [--ac none] [--donation donate,pure] [--depths 4,16]
[--ranks 1,2,4] [--json PATH]``; ``--quick`` for a tiny smoke run; on one GPU, the 0.6B-shaped step at a context:
``python benchmarks/memory.py --device cuda --ranks 1 --variants replicate --qwen3-0.6b --seq 4096 --backend
inductor``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, however this file is loaded

import _memory
import dp_scaling

import d9dfn.optim as optim
from d9dfn import init_train_state, make_train_step, parallel
from d9dfn.loop import init_data_parallel_mesh, per_rank_compile_cache
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.step import ActivationCheckpointing, find_repeated_blocks
from d9dfn.tasks import CausalLMTask


@dataclasses.dataclass(frozen=True)
class Placement:
    """How params and optimizer state are placed on ``n`` ranks.

    Attributes:
        name: what ``dp_scaling.minimum_bytes`` calls its communication pattern (``replicate``, ``shard``).
        degrees: ``n -> (data_parallel_replicate, data_parallel_shard)``, the mesh of ``init_train_state``.
        keywords: extra ``make_train_step`` keywords (e.g. how the step gathers sharded params).
    """

    name: str
    degrees: Callable[[int], tuple[int, int]]
    keywords: Callable[[], dict[str, Any]] = dict


PLACEMENTS: dict[str, Placement] = {
    "replicate": Placement("replicate", lambda n: (n, 1)),
    # The whole model gathered once per step (the traced step: no per-block runner to gather block by block).
    "shard": Placement("shard", lambda n: (1, n), lambda: {"repeated_blocks": ()}),
    # Each block's shards gathered just before its forward, given back after, gathered again for its backward.
    "block-shard": Placement("block-shard", lambda n: (1, n), lambda: {"repeated_blocks": "auto"}),
    # The same, each block's gather issued one block ahead (make_train_step(prefetch_gathers=True)): the blocks inlined.
    "block-shard-prefetch": Placement(
        "block-shard", lambda n: (1, n), lambda: {"repeated_blocks": "auto", "prefetch_gathers": True}
    ),
}
"""``--variants`` names → their placement."""

CHECKPOINTING: dict[str, Callable[[], dict[str, Any]]] = {
    "none": dict,
    # every block's forward recomputed in its backward
    "full": lambda: {"activation_checkpointing": ActivationCheckpointing("full")},
    # the matmul and attention outputs kept, the rest recomputed
    "selective": lambda: {"activation_checkpointing": ActivationCheckpointing("selective")},
}
"""``--ac`` names → the ``make_train_step`` keywords of that activation-checkpointing policy."""

DONATION: dict[str, bool] = {"donate": True, "pure": False}
"""``--donation`` names → ``make_train_step(donate=...)``: the loop's step, which updates the state it is given in
place, or the pure step, which holds the old and the new state at once."""


# --- one cell -------------------------------------------------------------------------------------------------------


def _model_config(args: argparse.Namespace, depth: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=depth,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        intermediate_size=args.intermediate or 3 * args.hidden,
        max_seq_len=args.seq,
    )


class _Meshes:
    """One mesh per degrees for the whole run (each mesh creates process groups: a collective call)."""

    def __init__(self, device: str) -> None:
        self.device, self._meshes = device, {}  # type: ignore[var-annotated]

    def __call__(self, degrees: tuple[int, int]) -> Any:
        if degrees not in self._meshes:
            self._meshes[degrees] = init_data_parallel_mesh(*degrees, device_type=self.device)
        return self._meshes[degrees]


def _build(
    placement: Placement,
    ac: str,
    depth: int,
    args: argparse.Namespace,
    meshes: _Meshes,
    compile: bool | str,
    donate: bool,
) -> tuple[Callable, Any]:
    world_size = torch.distributed.get_world_size()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3LM(_model_config(args, depth))
    opt = optim.adamw(1e-3, weight_decay=1e-2)
    # On one GPU, replicating is the plain one-device step (no mesh, no DTensor): what a one-GPU user runs, and what
    # torch 2.11 (the GPU machines') can run: it has no DTensor rule for the optimizer's _foreach_lerp. On the CPU
    # the one-rank cells keep their mesh of one, as the README's table was measured.
    plain = args.device == "cuda" and world_size == 1 and placement.name == "replicate"
    mesh = None if plain else meshes(placement.degrees(world_size))
    state = init_train_state(model, opt, task=CausalLMTask(), mesh=mesh)
    checkpointing = CHECKPOINTING[ac]
    keywords = {"repeated_blocks": "auto" if args.blocks == "auto" else (), **placement.keywords(), **checkpointing()}
    if compile is False:  # the eager tracking run of a compiled cell: nothing to reorder, so no prefetch there
        keywords.pop("prefetch_gathers", None)
    step = make_train_step(
        model,
        CausalLMTask(),
        opt,
        num_microbatches=args.microbatches,
        plan=None if mesh is None else parallel.plan_for(state.params, mesh),
        max_grad_norm=1.0,
        compile=compile,
        donate=donate,
        **keywords,
    )
    return step, state


def _batch(args: argparse.Namespace, depth: int) -> dict[str, torch.Tensor]:
    """This rank's rows: ``--batch`` rows of a global batch of ``--batch × ranks``."""
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    batch = dp_scaling._global_batch(_model_config(args, depth), args.batch * world_size, args.seq)
    return {k: v.to(args.device) for k, v in dp_scaling._rows(batch, rank, world_size).items()}


class _Counter(dp_scaling.CollectiveCounter):
    """``dp_scaling``'s collective counter, on while compiled code runs (as the memory tracker is)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _warm(step: Callable, state: Any, batch: Any) -> tuple[Any, float]:
    """Two steps (the compiles, and lazily built groups; Adam's moments stop being zero): ``(state, seconds)``."""
    start = time.perf_counter()
    for _ in range(2):
        state, out = step(state, batch)
    out.loss.item()
    return state, time.perf_counter() - start


def _track(
    step: Callable, state: Any, batch: Any, args: argparse.Namespace
) -> tuple[Any, _memory.StepMemory, int, dict]:
    """One step under the memory tracker and the collective counter, then the next step under the allocator's eye:
    ``(the state after them, memory, bytes the tracker missed, collectives)``."""
    counter = _Counter()
    with counter:
        state, _, memory = _memory.track_step(step, state, batch)
    with _memory.allocator_peak(args.device) as allocated:
        state, out = step(state, batch)
        out.loss.item()
    untracked = allocated["peak"] - (memory.peak - sum(memory.before.values()))
    return state, memory, untracked, {"records": counter.records}


def _stepper(step: Callable, holder: list[Any], batch: Any) -> Callable[[], None]:
    """One step on ``holder[0]``, which the new state replaces (``dp_scaling._stepper`` with the state in sight)."""

    def run() -> None:
        holder[0], out = step(holder[0], batch)
        out.loss.item()  # a host sync: the step's collectives and kernels have finished

    return run


def measure(
    placement: Placement, ac: str, depth: int, args: argparse.Namespace, meshes: _Meshes, donate: bool = True
) -> dict:
    """One cell on this rank (a collective call: every rank runs it); ``donate``: the step the loop runs, which
    updates the state it is given in place (``make_train_step(donate=True)``), else the pure step.

    The step compiled with ``--backend aot_eager`` is tracked when its backward is visible at runtime (per-block
    regions: autograd runs the compiled backward; every op of an ``aot_eager`` graph is seen); otherwise (another
    backend, whose kernels allocate unseen; no compile; or a traced step, whose backward is inside its one graph)
    the same step run eagerly is tracked, and the row says so.
    """
    import torch.distributed as dist

    batch = _batch(args, depth)
    cell: dict[str, Any] = {}
    step, state = _build(placement, ac, depth, args, meshes, compile=args.backend, donate=donate)
    try:
        state, cell["compile_s"] = _warm(step, state, batch)
    except torch._dynamo.exc.TorchDynamoException as error:  # every rank fails alike, while tracing
        cell["compile_error"] = f"{type(error).__name__}: {str(error).splitlines()[2].strip()}"
    if "compile_error" not in cell:
        resident = sum(
            st.nbytes() for ts in _memory.state_tensors(state, batch).values() for t in ts for st in _memory.storages(t)
        )
        with _memory.allocator_peak(args.device) as allocated:
            state, out = step(state, batch)
            out.loss.item()
        cell["allocator_peak"] = resident + allocated["peak"]
        if args.timing:
            holder = [state]  # a donating step consumes the state it is given: each run takes the last one's
            run = _stepper(step, holder, batch)
            samples = []
            for _ in range(args.repeats):
                dist.barrier()
                samples.append(dp_scaling._timed(run, args.steps))
            dist.barrier()
            cell["ms_per_step"] = statistics.median(samples)
            if args.device == "cpu":
                cell.update(communication(run, args.steps))
                dist.barrier()
            state = holder[0]
    if "compile_error" not in cell and args.backend == "aot_eager":
        state, memory, untracked, counted = _track(step, state, batch, args)
        cell["tracked"] = args.backend
    if cell.get("tracked") is None or memory.num_backwards == 0:
        step, state = _build(placement, ac, depth, args, meshes, compile=False, donate=donate)
        state, _ = _warm(step, state, batch)
        state, memory, untracked, counted = _track(step, state, batch, args)
        cell["tracked"] = "eager"
    records = counted["records"]
    world_size = dist.get_world_size()
    param_bytes = sum(p.numel() * p.element_size() for p in state.params.values())  # a DTensor's numel is global
    cell.update(
        peak=memory.peak,
        at_peak=memory.at_peak,
        peaks=memory.peaks,
        before=memory.before,
        largest=memory.largest,
        untracked=untracked,
        param_bytes=param_bytes,
        collectives=len(records),
        collective_kinds={name: sum(r[0] == name for r in records) for name in sorted({r[0] for r in records})},
        bytes_measured=sum(record[3] for record in records),
        bytes_minimum=dp_scaling.minimum_bytes(placement.name, param_bytes, placement.degrees(world_size)),
    )
    return cell


def communication(run: Callable[[], None], steps: int) -> dict[str, float]:
    """``steps`` runs of ``run`` under torch's profiler (gloo): per step, the milliseconds gloo's worker threads spent
    in collectives (``comm_ms``), those this rank's step thread spent waiting for one (``wait_ms``: communication not
    hidden behind compute, and the wait for a slower peer), and the step's time under the profiler (``profiled_ms``).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run()
        elapsed = time.perf_counter() - start
    events = prof.events()

    def total(matches: Callable[[str], bool]) -> float:
        # outermost matching events only: an event nested in another that matches would count twice
        return sum(
            e.cpu_time_total for e in events if matches(e.name) and not (e.cpu_parent and matches(e.cpu_parent.name))
        )

    comm = total(lambda name: name.startswith("gloo:"))
    wait = total(lambda name: name == "_c10d_functional::wait_tensor")
    return {"comm_ms": comm / 1e3 / steps, "wait_ms": wait / 1e3 / steps, "profiled_ms": elapsed * 1e3 / steps}


def _blocks(placement: Placement, args: argparse.Namespace, depth: int) -> bool:
    """Whether the placement's step runs repeated blocks at ``depth`` (activation checkpointing needs them): the step
    asks for them, and the model has some (``find_repeated_blocks``, on a model without storage)."""
    if placement.keywords().get("repeated_blocks", "auto" if args.blocks == "auto" else ()) == ():
        return False
    with torch.device("meta"):
        return bool(find_repeated_blocks(Qwen3LM(_model_config(args, depth))))


def _rank_worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace, out_dir: str) -> None:
    import torch._inductor.config as inductor_config
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank; a forked child must not enter the parent's OpenMP pool
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=900),
    )
    try:
        per_rank_compile_cache(rank)
        inductor_config.compile_threads = 1  # no compile worker pool in a forked rank
        # Every cell compiles the same code objects (the step's head, pieces and tail) with other shapes.
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 4096
        meshes = _Meshes(args.device)
        cells = []
        for depth in args.depths:
            for name in args.variants:
                placement = PLACEMENTS[name]
                for ac in args.ac:
                    if ac != "none" and not _blocks(placement, args, depth):
                        continue  # checkpointing acts on repeated blocks (main says which cells had none)
                    for kind in args.donation:
                        cell = {"placement": name, "ac": ac, "depth": depth, "ranks": world_size, "step": kind}
                        cells.append({**cell, **measure(placement, ac, depth, args, meshes, DONATION[kind])})
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, cells)
        if rank == 0:
            Path(out_dir, f"world_{world_size}.json").write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


# --- the table ------------------------------------------------------------------------------------------------------


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """One row per cell: each memory figure the highest rank's, the time the slowest rank's, the bytes rank 0's."""
    rows = []
    for cells in zip(*per_rank, strict=True):
        row = dict(cells[0])
        row["peak"] = max(c["peak"] for c in cells)
        for key in ("at_peak", "peaks", "before"):
            row[key] = {k: max(c[key][k] for c in cells) for k in _memory.CATEGORIES}
        for key in ("untracked", "allocator_peak", "ms_per_step", "compile_s", "comm_ms", "wait_ms", "profiled_ms"):
            if key in row:
                row[key] = max(c[key] for c in cells)
        rows.append(row)
    return rows


def _mib(value: float) -> str:
    return f"{value / 2**20:8.2f}"


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:7.1f}" if key in row else f"{'-':>7s}"


def print_table(rows: list[dict]) -> None:
    """The memory table, then the compile errors and the bytes the tracker missed (none unless inductor)."""
    labels = ("params", "gathered", "grads", "optim", "activ", "bw tmp", "other")
    names = dict(zip(_memory.CATEGORIES, labels, strict=True))
    head = f"{'placement':11s} {'ac':5s} {'depth':>5s} {'ranks':>5s} {'step':6s} {'seen':9s} {'at rest':>8s} "
    head += " ".join(f"{n:>8s}" for n in names.values())
    print(
        "MiB per rank. step: donate (the loop's: the state updated in place) or pure (old and new state at once);\n"
        "seen: the step the tracker ran (benchmarks/_memory.py); at rest: params + optimizer state between steps;\n"
        "then each category's own peak during that step, and its total peak; compiled: the compiled step's peak "
        "(allocator);\ncolls, sent: collectives and ring bytes per step per rank; /min: sent over the "
        "least the placement must send\n(dp_scaling.minimum_bytes); comm, wait: ms per step gloo spent in collectives, "
        "and the step waited for them\n(under the profiler; wait ≈ comm: no communication was hidden behind compute)"
    )
    print(
        f"{head} {'total':>8s} {'compiled':>8s} {'ms/step':>8s} {'colls':>6s} {'sent':>8s} {'/min':>6s} "
        f"{'comm':>7s} {'wait':>7s}"
    )
    errors, untracked = {}, []
    for row in rows:
        rest = row["before"]["params"] + row["before"]["optimizer"]
        cells = " ".join(_mib(row["peaks"][c]) for c in names)
        ratio = f"{row['bytes_measured'] / row['bytes_minimum']:6.3f}" if row["bytes_minimum"] else f"{'-':>6s}"
        compiled = _mib(row["allocator_peak"]) if "allocator_peak" in row else f"{'-':>8s}"
        ms = f"{row['ms_per_step']:8.1f}" if "ms_per_step" in row else f"{'-':>8s}"
        label = f"{row['placement']:11s} {row['ac']:5s} {row['depth']:5d} {row['ranks']:5d} {row['step']:6s}"
        print(
            f"{label} {row['tracked']:9s} {_mib(rest)} {cells} {_mib(row['peak'])} {compiled} {ms} "
            f"{row['collectives']:6d} {_mib(row['bytes_measured'])} {ratio} {_ms(row, 'comm_ms')} {_ms(row, 'wait_ms')}"
        )
        if "compile_error" in row:
            errors.setdefault(row["compile_error"], []).append(label.split())
        if row["untracked"]:
            untracked.append(f"{label}: {row['untracked']} B")
    for error, labels in errors.items():
        print(f"compiled step failed ({', '.join(' '.join(map(str, lab)) for lab in labels)}): {error}")
    print("bytes the eager allocator saw and the tracker did not: " + ("; ".join(untracked) or "none"))


def _names(text: str, table: dict[str, Any], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in table:
            parser.error(f"{flag} {name}: unknown; choose from {', '.join(table)}")
    return names


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="replicate,shard", help=f"placements: {', '.join(PLACEMENTS)}")
    parser.add_argument("--ac", default="none", help=f"activation checkpointing: {', '.join(CHECKPOINTING)}")
    parser.add_argument(
        "--donation", default="donate", help=f"the step's form, donating or pure: {', '.join(DONATION)}"
    )
    parser.add_argument("--depths", type=_ints, default=[4, 16], help="decoder layers, comma-separated")
    parser.add_argument("--ranks", type=_ints, default=[1, 2], help="world sizes, comma-separated (one run each)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=0, help="default: hidden / heads")
    parser.add_argument("--intermediate", type=int, default=0, help="the MLP's width; default: 3 x hidden")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument(
        "--blocks",
        choices=("auto", "none"),
        default="auto",
        help="repeated_blocks: auto (the loop's default: per-block regions) or none (one traced graph)",
    )
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend of the compiled step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="memory only, no timed steps")
    parser.add_argument("--quick", action="store_true", help="a tiny model, depths 1 and 2: a smoke run")
    parser.add_argument(
        "--qwen3-0.6b",
        dest="qwen3_06b",
        action="store_true",
        help="Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936), 1 row",
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.variants = _names(args.variants, PLACEMENTS, "--variants", parser)
    args.ac = _names(args.ac, CHECKPOINTING, "--ac", parser)
    args.donation = _names(args.donation, DONATION, "--donation", parser)
    if args.qwen3_06b:
        args.hidden, args.heads, args.kv_heads, args.head_dim = 1024, 16, 8, 128
        args.intermediate, args.vocab, args.depths, args.batch = 3072, 151936, [28], 1
    if args.quick:
        args.hidden, args.heads, args.kv_heads, args.seq, args.batch = 32, 4, 2, 32, 2
        args.depths, args.steps, args.repeats = [1, 2], 1, 1
    if args.device == "cuda" and max(args.ranks) > torch.cuda.device_count():
        parser.error(
            f"--ranks {max(args.ranks)} with --device cuda needs a GPU per rank; this machine has "
            f"{torch.cuda.device_count()}: pass --ranks 1 (or fewer ranks)"
        )
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    load = os.getloadavg()
    rows = []
    for world_size in args.ranks:
        per_rank = dp_scaling.run_ranks(world_size, args, timeout_s=3600, worker=_rank_worker)
        rows.extend(_merge(per_rank))
    rows.sort(
        key=lambda r: (
            r["depth"],
            list(PLACEMENTS).index(r["placement"]),
            r["ac"],
            r["ranks"],
            list(DONATION).index(r["step"]),
        )
    )
    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "torch": torch.__version__},
        "rows": rows,
        "wall_s": time.perf_counter() - start,
        "load_average_start": load,
        "load_average_end": os.getloadavg(),
    }
    print_table(rows)
    checkpointing = [ac for ac in args.ac if ac != "none"]
    for name in args.variants:
        depths = [str(depth) for depth in args.depths if not _blocks(PLACEMENTS[name], args, depth)]
        if checkpointing and depths:
            print(
                f"{name} x {', '.join(checkpointing)} at depth {', '.join(depths)}: not run (activation checkpointing "
                f"recomputes repeated blocks, and {name}'s step has none there)"
            )
    print(
        f"backend {args.backend}; {args.batch} rows x {args.seq} tokens per rank; wall {report['wall_s']:.0f} s; "
        f"load average {load[0]:.1f} at the start, {report['load_average_end'][0]:.1f} at the end, on "
        f"{os.cpu_count()} cores"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
