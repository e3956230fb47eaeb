"""Memory and communication per rank under tensor and context parallelism (issue 42, item 6), against one process.

For each cell (``tp1``: one process; ``tp2``, ``tp4``: tensor parallelism with vocabulary parallelism, the job's
default rules, ``loop/_train.py::_rules``; ``tp2-sp``, ``tp4-sp``: with sequence parallelism too; ``cp2``, ``cp4``:
context parallelism, head-tail split) one eager step of the reference decoder (:class:`d9dfn.models.Qwen3LM`, sizes
from the flags, fused AdamW, clipping at 1.0) runs as rank 0 of a fake process group of ``tp · cp`` ranks: its
collectives move nothing, but every tensor has that rank's shape, so every byte counted is rank 0's exactly (the flags'
sizes divide evenly: every rank holds the same). Per rank:

- ``params``, ``optim``: the bytes of the train state's local shards (``benchmarks/_memory.py::storages``);
- ``grads``: the bytes of one gradient of every param in its compute layout (the plan's ``compute`` placements: a
  tensor-parallel weight's gradient is its shard's, a replicated param's whole), exact from the shapes;
  ``grads peak``: the most gradient bytes :class:`_memory.MemoryTracker` saw alive at once (sums, flat buckets,
  scaled copies);
- ``activ``: tensors a forward made and its backward read (saved for backward, the tracker's ``activations``), and
  the ops that made them (:func:`print_activations`), which show what does not shrink;
- each with its ratio to one process's figure beside the ideal ``1/degree``; ``repl``: the params every rank holds
  whole (norms: with tp, params per rank are exactly ``split/tp + repl``).

The collectives of the same step are counted (``dp_scaling.CollectiveCounter``: op, group, payload, ring bytes per
rank) and compared with :func:`theory`, which derives them from the model's shapes (its docstring is the
derivation). Step time is not measured here: ``benchmarks/memory.py`` times the step on gloo ranks.

Run: ``python benchmarks/scaling.py [--cells tp1,tp2,tp2-sp,tp4,tp4-sp,cp2,cp4] [--microbatches 1] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, however this file is loaded

import _memory
import dp_scaling

import d9dfn.optim as optim
from d9dfn import init_train_state, make_train_step, parallel
from d9dfn.models import Qwen3Config, Qwen3LM, bind_context_parallel, bind_tensor_parallel, logical_dims, summed_dims
from d9dfn.models._decoder import DECODER_PLAN, DECODER_SUMS_OVER
from d9dfn.tasks import CausalLMTask


@dataclasses.dataclass(frozen=True)
class Cell:
    """One layout: ``tp`` tensor ranks (vocabulary parallel when more than one; ``sequence``: sequence parallel too)
    or ``cp`` context ranks (the two are not built together: ``bind_context_parallel`` refuses a tensor group)."""

    name: str
    tp: int = 1
    cp: int = 1
    sequence: bool = False

    @property
    def degree(self) -> int:
        return self.tp * self.cp


CELLS: dict[str, Cell] = {
    cell.name: cell
    for cell in (
        Cell("tp1"),
        Cell("tp2", tp=2),
        Cell("tp2-sp", tp=2, sequence=True),
        Cell("tp4", tp=4),
        Cell("tp4-sp", tp=4, sequence=True),
        Cell("cp2", cp=2),
        Cell("cp4", cp=4),
    )
}
"""``--cells`` names → their layout."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and batch of every cell: ``rows`` rows of ``seq`` tokens per step, in ``microbatches``."""

    config: Qwen3Config
    rows: int
    seq: int
    microbatches: int = 1


# --- one cell -------------------------------------------------------------------------------------------------------


def _batch(shape: Shape) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.config.vocab_size, (shape.rows, shape.seq + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _rules(cell: Cell) -> parallel.Rules:
    tensor = parallel.SEQUENCE_PARALLEL_RULES if cell.sequence else parallel.TENSOR_PARALLEL_RULES
    return (*tensor, *parallel.VOCAB_PARALLEL_RULES)


def _plan(cell: Cell, model: Qwen3LM, mesh: Any) -> parallel.ParallelPlan:
    """The plan the loop builds for the cell, the model bound to its tensor or context group."""
    if cell.tp > 1:
        params = dict(model.named_parameters())
        plan = parallel.plan_for(
            model,
            mesh,
            dims=logical_dims(DECODER_PLAN, params),
            rules=_rules(cell),
            sums_over=summed_dims(DECODER_SUMS_OVER, params),
        )
        assert bind_tensor_parallel(model, parallel.tensor_parallel_of(plan, _rules(cell))) > 0
        return plan
    plan = parallel.plan_for(model, mesh)
    assert bind_context_parallel(model, parallel.context_parallel_of(plan)) > 0
    return plan


def _nbytes(tensors: Any) -> int:
    return sum(st.nbytes() for t in _memory._tensors(tensors) for st in _memory.storages(t))


def _grad_bytes(model: Qwen3LM, plan: parallel.ParallelPlan | None, mesh: Any) -> tuple[int, int]:
    """``(gradient bytes, bytes of the params computed whole)`` on one rank: each param's numel over the ranks of the
    axes its compute layout splits (the sizes divide evenly), times its element size."""
    grads = replicated = 0
    for name, param in model.named_parameters():
        split = (
            1
            if plan is None
            else math.prod(mesh.size(axis) for axis, p in enumerate(plan.params[name].compute) if p != "R")
        )
        grads += param.numel() // split * param.element_size()
        replicated += param.numel() * param.element_size() if split == 1 else 0
    return grads, replicated


def _build(cell: Cell, shape: Shape, rank: int, compile: bool | str = False) -> tuple[Any, Any, Any, Any, Any]:
    """``(step, state, batch, model, plan)`` of ``cell`` on this rank of the process group already started (none for
    one process): the model bound to its group, the batch this rank reads (every tp rank the whole; a cp rank its
    head-tail chunks)."""
    from d9dfn.loop import init_mesh

    torch.manual_seed(0)
    model, task, opt = Qwen3LM(shape.config), CausalLMTask(), optim.adamw(1e-3)
    batch = _batch(shape)
    plan = mesh = None
    if cell.degree > 1:
        mesh = init_mesh(parallel.MeshAxes.of(tensor=cell.tp, context=cell.cp), device_type="cpu")
        plan = _plan(cell, model, mesh)
        if cell.cp > 1:
            batch = parallel.split_context(batch, cell.cp, rank)
    state = init_train_state(model, opt, task=task, mesh=mesh, placements=None if plan is None else plan.placements)
    step = make_train_step(
        model, task, opt, num_microbatches=shape.microbatches, plan=plan, max_grad_norm=1.0, compile=compile
    )
    return step, state, batch, model, plan


def measure(cell: Cell, shape: Shape) -> dict[str, Any]:
    """One tracked step of ``cell`` as rank 0 of a fake process group of ``cell.degree`` ranks (after a first step:
    Adam's moments exist): its bytes per category and its collectives."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if cell.degree > 1:
        # DTensor caches output specs by mesh shape: a cached spec would name an earlier cell's destroyed groups.
        _clear_sharding_prop_cache()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cell.degree)
    try:
        step, state, batch, model, plan = _build(cell, shape, 0)
        state, _ = step(state, batch)
        counter = dp_scaling.CollectiveCounter()
        with counter:
            state, _, memory = _memory.track_step(step, state, batch)
        grads, replicated = _grad_bytes(model, plan, None if plan is None else plan.mesh)
        return {
            "cell": cell.name,
            "degree": cell.degree,
            "params": _nbytes(state.params),
            "grads": grads,
            "optim": _nbytes(state.opt_state),
            "activations": memory.peaks["activations"],
            "grads_peak": memory.peaks["grads"],
            "replicated": replicated,
            "activations_by_op": memory.activations_by_op,
            "collectives": [list(record) for record in counter.records],
        }
    finally:
        if cell.degree > 1:
            dist.destroy_process_group()
            _clear_sharding_prop_cache()


# --- step time on gloo ranks ----------------------------------------------------------------------------------------


def _time(step: Any, state: Any, batch: Any, args: argparse.Namespace, together: bool) -> dict[str, float]:
    """Median ms per step of ``args.repeats`` runs of ``args.steps`` steps after 2 warm ones; ``together``: every rank
    runs it, starting each run at a barrier, and then once more under the profiler for the time spent in gloo's
    collectives and waiting for them (``memory.communication``)."""
    import statistics

    import memory as memory_bench
    import torch.distributed as dist

    holder = [state]

    def run() -> None:
        holder[0], out = step(holder[0], batch)
        out.loss.item()  # a host sync: the step's collectives and kernels have finished

    for _ in range(2):
        run()
    samples = []
    for _ in range(args.repeats):
        if together:
            dist.barrier()
        samples.append(dp_scaling._timed(run, args.steps))
    result = {"ms_per_step": statistics.median(samples)}
    if together:
        dist.barrier()
        result.update(memory_bench.communication(run, args.steps))
    return result


def _timing_worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace, out_dir: str) -> None:
    """One rank of the timing run: the one-process step on rank 0 alone (one thread, the other rank waiting), then
    every cell of ``world_size`` ranks on all of them; rank 0 writes every rank's times."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    torch.set_num_threads(1)  # one core per rank; a forked child must not enter the parent's OpenMP pool
    _clear_sharding_prop_cache()  # specs the parent cached on its fake groups' meshes
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    try:
        results: dict[str, dict[str, float]] = {}
        if rank == 0:
            step, state, batch, _, _ = _build(CELLS["tp1"], args.shape, 0, args.backend)
            results["tp1"] = _time(step, state, batch, args, together=False)
        dist.barrier()
        for cell in args.timed:
            step, state, batch, _, _ = _build(cell, args.shape, rank, args.backend)
            results[cell.name] = _time(step, state, batch, args, together=True)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out_dir, f"world_{world_size}.json").write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def time_cells(cells: list[Cell], shape: Shape, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The eager step's time of each cell of 2 ranks on 2 forked gloo ranks, and one process's on one of them: per
    cell the slowest rank's."""
    args.shape, args.timed = shape, [cell for cell in cells if cell.degree == 2]
    per_rank = dp_scaling.run_ranks(2, args, timeout_s=1800, worker=_timing_worker)
    rows = []
    for name in ["tp1", *(cell.name for cell in args.timed)]:
        found = [ranks[name] for ranks in per_rank if name in ranks]
        rows.append({"cell": name, **{key: max(f[key] for f in found) for key in found[0]}})
    return rows


def print_times(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["ms_per_step"]
    print("ms per step on gloo ranks (1 thread each; tp1: one process on one of them, the other waiting); then the")
    print("same steps under the profiler: their ms per step (prof), gloo's ms in collectives (comm) and the step's ms")
    print("waiting for them (wait); each the slowest rank's")
    print(f"{'cell':7s} {'ms/step':>8s} {'x 1p':>6s} {'prof':>7s} {'comm':>7s} {'wait':>7s}")
    for row in rows:
        keys = ("profiled_ms", "comm_ms", "wait_ms")
        profiled = " ".join(f"{row[key]:7.1f}" if key in row else f"{'-':>7s}" for key in keys)
        print(f"{row['cell']:7s} {row['ms_per_step']:8.1f} {row['ms_per_step'] / base:6.2f} {profiled}")


# --- the theoretical collectives ------------------------------------------------------------------------------------


def _ring(op: str, n: int, payload: float) -> float:
    """Bytes one rank sends for ``op`` on ``n`` ranks with the ring algorithm (``dp_scaling.CollectiveCounter``'s
    prices: all-reduce ``2(n-1)/n`` of its input, all-gather ``(n-1)/n`` of its output, reduce-scatter of its input)."""
    return payload * (2 if op == "all_reduce" else 1) * (n - 1) / n


def theory(cell: Cell, shape: Shape) -> list[tuple[str, int, float]]:
    """The collectives one step must run, derived from the layout: ``(op, group size, payload bytes)`` each.

    ``M`` microbatches of ``b = rows / M`` rows, ``L`` blocks, width ``D``, ``T`` tokens a row, float32; ``A = b·T·D·4``
    the residual stream of one microbatch, ``n`` the degree. Per microbatch, the rank of this process in its group
    (``parallel.group_rank``: a reduce-scatter of ``n`` int32).

    - **tp** (vocabulary parallel): per block, attention and MLP each enter the tensor region (identity forward,
      all-reduce of ``A`` backward) and leave it (all-reduce of ``A`` forward): ``4L`` all-reduces of ``A``. The
      embedding's rows are split by id: its output is a partial sum (all-reduce of ``A``), and the head's input
      gradient is partial (all-reduce of ``A`` backward); the cross-entropy all-reduces its max ``(b, T)`` and its
      ``Σexp`` with the target logit ``(b, T, 2)``, the accuracy the best value ``(b, T)`` and its id (int64).
    - **tp-sp**: the same regions entered by an all-gather of the sequence-split stream (output ``A``) and left by a
      reduce-scatter of ``A``, forward and backward: ``4L`` of each. The embedding's sum is a reduce-scatter onto the
      sequence, its backward an all-gather; the final norm's input is all-gathered forward (its backward a local
      split), the head's input gradient all-reduced whole.
    - **cp**: per block, the keys and values all-gathered along the sequence forward (output ``2·b·H_kv·T·d·4``), their
      gradient reduce-scattered backward.
    - **the tail**, once per step: gradients partial over the group are all-reduced in one bucket (tp: the q/k norms;
      with sp also the blocks' two norms, and o's bias if any; cp: every param, they are replicated and see other
      tokens); ``Σwℓ, Σw`` summed over the token axes (2 float32; with tp over the 1-rank data axes: a collective that
      moves nothing); with tp the squares of the split params' gradients, one float32 per split param, all-reduced
      for the global norm (cp: every gradient is whole after its all-reduce, the norm is local).
    """
    config, m, n = shape.config, shape.microbatches, cell.degree
    b, seq, dim = shape.rows // shape.microbatches, shape.seq, config.hidden_size
    stream = b * seq * dim * 4
    out: list[tuple[str, int, float]] = []
    if n == 1:
        return out
    per_microbatch: list[tuple[str, int, float]] = [("reduce_scatter", n, 4 * n)]
    if cell.cp > 1:
        kv = 2 * b * config.num_kv_heads * seq * config.head_dim * 4
        per_microbatch += [("all_gather", n, kv), ("reduce_scatter", n, kv)] * config.num_layers
        out += per_microbatch * m
        out += [("all_reduce", n, _param_bytes(config)), ("all_reduce", n, 2 * 4)]
        return out
    loss = [("all_reduce", n, b * seq * 4), ("all_reduce", n, b * seq * 2 * 4)]
    accuracy = [("all_reduce", n, b * seq * 4), ("all_reduce", n, b * seq * 8)]
    if cell.sequence:
        blocks = [("all_gather", n, stream), ("reduce_scatter", n, stream)] * 4 * config.num_layers
        edges = [("reduce_scatter", n, stream), ("all_gather", n, stream), ("all_gather", n, stream)]
        edges += [("all_reduce", n, stream)]
    else:
        blocks = [("all_reduce", n, stream)] * 4 * config.num_layers
        edges = [("all_reduce", n, stream)] * 2
    per_microbatch += blocks + edges + loss + accuracy
    out += per_microbatch * m
    partial = config.num_layers * 2 * config.head_dim * 4  # q_norm, k_norm
    if cell.sequence:
        partial += config.num_layers * (2 + config.o_proj_bias) * dim * 4
    num_split = config.num_layers * (7 + 3 * config.qkv_bias) + 2 - config.tie_word_embeddings
    out += [("all_reduce", n, partial), ("all_reduce", 1, 2 * 4), ("all_reduce", n, num_split * 4)]
    return out


def _param_bytes(config: Qwen3Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in Qwen3LM(config).parameters())


def counts(records: list[tuple[str, int, float]] | list[list[Any]]) -> dict[str, int]:
    """Collectives by kind (``all_reduce_``, the in-place form, counted as ``all_reduce``)."""
    found: Counter[str] = Counter()
    for record in records:
        name = str(record[0]).rstrip("_").removesuffix("_into_tensor").removesuffix("_tensor")
        found[name] += 1
    return dict(sorted(found.items()))


def sent(records: list[tuple[str, int, float]] | list[list[Any]]) -> float:
    """Ring bytes per rank: the measured records' own, or :func:`_ring` of the theory's."""
    return sum(float(r[3]) if len(r) == 4 else _ring(str(r[0]), int(r[1]), float(r[2])) for r in records)


# --- the tables -----------------------------------------------------------------------------------------------------

_COLUMNS = (("params", "params"), ("grads", "grads"), ("optim", "optim"), ("activations", "activ"))


def print_memory(rows: list[dict[str, Any]]) -> None:
    base = next(row for row in rows if row["degree"] == 1)
    head = f"{'cell':7s} {'n':>2s} {'ideal':>5s} " + " ".join(f"{label:>8s} {'/1p':>5s}" for _, label in _COLUMNS)
    print("bytes per rank; /1p: over one process's; ideal: 1/n; repl: params every rank holds whole")
    print(f"{head} {'repl':>7s} {'grads peak':>10s} {'/1p':>5s}")
    for row in rows:
        cells = " ".join(f"{row[key]:8d} {row[key] / base[key]:5.3f}" for key, _ in _COLUMNS)
        peak = f"{row['grads_peak']:10d} {row['grads_peak'] / base['grads_peak']:5.3f}"
        print(f"{row['cell']:7s} {row['degree']:2d} {1 / row['degree']:5.3f} {cells} {row['replicated']:7d} {peak}")


def print_collectives(rows: list[dict[str, Any]], shape: Shape) -> None:
    print("collectives per step on one rank (ag all-gather, rs reduce-scatter, ar all-reduce) and ring bytes sent")
    print(f"{'cell':7s} {'measured':>18s} {'theory':>18s} {'bytes':>9s} {'theory':>9s} {'match':>5s}")
    for row in rows:
        expected = theory(CELLS[row["cell"]], shape)
        found, derived = counts(row["collectives"]), counts(expected)

        def text(c: dict[str, int]) -> str:
            return f"{c.get('all_gather', 0)}ag {c.get('reduce_scatter', 0)}rs {c.get('all_reduce', 0)}ar"

        same = found == derived and sent(row["collectives"]) == sent(expected)
        print(
            f"{row['cell']:7s} {text(found):>18s} {text(derived):>18s} {sent(row['collectives']):9.0f} "
            f"{sent(expected):9.0f} {'yes' if same else 'NO':>5s}"
        )


def print_activations(rows: list[dict[str, Any]], top: int = 5) -> None:
    """The ops that made the activations, then per family measured at two degrees ``n < n'`` the split
    ``activations = fixed + shrinking / n`` that fits both (:func:`fit`): ``fixed`` is what every rank keeps whatever
    the degree."""
    print("activation bytes per rank by the op that made them (largest first)")
    for row in rows:
        ops = sorted(row["activations_by_op"].items(), key=lambda kv: -kv[1])[:top]
        print(f"{row['cell']:7s} " + ", ".join(f"{op.removeprefix('aten.')} {nbytes}" for op, nbytes in ops))
    by_family: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["degree"] > 1:
            by_family.setdefault(re.sub(r"\d", "", row["cell"]), []).append(row)  # tp4-sp -> tp-sp
    for family, members in by_family.items():
        if len(members) >= 2:
            (a, b) = members[0], members[-1]
            fixed, shrinking = fit(a["degree"], a["activations"], b["degree"], b["activations"])
            print(
                f"{family}: activations = {fixed:.0f} + {shrinking:.0f} / n (from n = {a['degree']}, {b['degree']}): "
                f"{fixed / (fixed + shrinking):.1%} of them do not shrink"
            )


def fit(n: int, bytes_n: int, m: int, bytes_m: int) -> tuple[float, float]:
    """``(fixed, shrinking)`` with ``fixed + shrinking / n = bytes_n`` and ``fixed + shrinking / m = bytes_m``."""
    shrinking = (bytes_n - bytes_m) / (1 / n - 1 / m)
    return bytes_n - shrinking / n, shrinking


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scaling.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=",".join(CELLS), help=f"layouts: {', '.join(CELLS)}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rows", type=int, default=2, help="rows per step (every rank reads them all)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per row; 2 x the largest cp must divide it")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument(
        "--timing", action="store_true", help="also time the 2-rank cells' eager step on 2 forked gloo ranks"
    )
    parser.add_argument(
        "--backend", default=False, help="torch.compile backend of the timed step (aot_eager, inductor); default: eager"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[list[Cell], Shape, argparse.Namespace]:
    parser = _parser()
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.cells.split(",") if name.strip()]
    for name in names:
        if name not in CELLS:
            parser.error(f"--cells {name}: unknown; choose from {', '.join(CELLS)}")
    config = Qwen3Config.tiny(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        tie_word_embeddings=False,
    )
    return [CELLS[name] for name in names], Shape(config, args.rows, args.seq, args.microbatches), args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    cells, shape, args = parse_args(argv)
    start, load = time.perf_counter(), os.getloadavg()
    if all(cell.degree > 1 for cell in cells):
        cells = [CELLS["tp1"], *cells]  # the ratios' denominator
    rows = [measure(cell, shape) for cell in cells]
    print_memory(rows)
    print()
    print_collectives(rows, shape)
    print()
    print_activations(rows)
    times = time_cells(cells, shape, args) if args.timing else []
    if times:
        print()
        print_times(times)
    config = shape.config
    print(
        f"Qwen3LM: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads}/{config.num_kv_heads} "
        f"heads of {config.head_dim}, MLP {config.intermediate_size}, vocab {config.vocab_size} (untied); "
        f"{shape.rows} rows x {shape.seq} tokens in {shape.microbatches} microbatch(es); fused AdamW; bytes eager, "
        f"times {args.backend or 'eager'}; "
        f"torch {torch.__version__}; wall {time.perf_counter() - start:.0f} s; load average "
        f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "times": times}, indent=2))
    return rows


if __name__ == "__main__":
    main()
