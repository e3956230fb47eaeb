"""Mixture of experts on CPU (issue 41 item 6): the MoE step's speed against its baselines, the expert-parallel
all-to-all's bytes against the minimum, host syncs per step, cold compile time against the expert count, and memory
per rank at EP 1 and 2.

Every figure of one run comes from this one process (and, for the ranks' figures, 2 gloo ranks it forks); speeds are
medians of interleaved repetitions and compared as ratios measured side by side (these machines are noisy and shared,
absolute numbers are not the point):

- **speed** (one process, bf16 mixed, the same global batch): ``moe_grouped`` (``Qwen3MoeLM``, the experts on
  ``torch._grouped_mm``: the default bf16 path) compiled per block and eager; ``moe_loop`` (the same model with the
  experts on the reference path: one matmul per expert over its tokens, found with ``torch.where``, a Python loop;
  eager only, its shapes depend on the data); ``dense`` (``Qwen3LM`` of the same widths whose MLP is as wide as the
  ``top_k`` experts a token runs through: equal active parameters per token), compiled per block and eager.
- **host syncs per step**: in an eager step, the aten ops that bring a value to the host (``_local_scalar_dense``:
  ``.item()``, ``.tolist()``, ``bool(tensor)``) or whose output shape is data-dependent (``nonzero``, what
  ``torch.where(cond)`` runs), counted by a dispatch mode; and in a compiled step after the first, the Python-level
  ``Tensor.item`` / ``tolist`` / ``__bool__`` calls (what runs between the compiled pieces).
- **cold compile time against the expert count**: the first compiled step (per-block, bf16, the compiler's caches
  off) minus a warm one, for each ``--compile-experts``; the graph depends on the experts only through shapes, so it
  should stay flat.
- **ranks** (2 forked gloo ranks): memory per rank at EP 1 (the experts replicated over 2 data-parallel ranks) and
  EP 2 (split over both): the train state's bytes (local params and optimizer state) and an eager step's allocator
  peak (``benchmarks/_memory.py``); and at EP 2 the all-to-all bytes of one eager step (``benchmarks/dp_scaling.py``'s
  ``CollectiveCounter``: payload, and the ring's ``(n-1)/n`` of it that leaves the rank) against two minima: the real
  token copies (``T·k`` rows per exchange: what a variable-split exchange would send) and the copies whose expert is
  on the other rank (what must cross the network).

Run: ``python benchmarks/moe.py [--json PATH] [--quick] [--backend inductor|aot_eager] [--no-ranks]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import d9dfn.optim as optim
from d9dfn import Precision, init_train_state, make_train_step, parallel
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.models._decoder import Qwen3DecoderLayer
from d9dfn.models.qwen3_moe import QWEN3_MOE_PLAN, Qwen3MoeConfig, Qwen3MoeDecoderLayer, Qwen3MoeLM
from d9dfn.models.qwen3_moe import _model as moe_model
from d9dfn.models.qwen3_moe._moe import experts
from d9dfn.tasks import CausalLMTask

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive")
"""aten ops that wait for the device: a scalar to the host, or an output whose shape depends on the data."""


# --- the models and the steps --------------------------------------------------------------------------------------


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "max_seq_len": args.seq,
        "tie_word_embeddings": False,
    }


def moe_config(args: argparse.Namespace, num_experts: int | None = None) -> Qwen3MoeConfig:
    """Every layer an MoE layer of ``num_experts`` (default ``--experts``) experts of width ``--moe-inter``."""
    return Qwen3MoeConfig(
        **_sizes(args),
        intermediate_size=args.moe_inter * args.top_k,
        num_experts=num_experts or args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_inter,
    )


def dense_config(args: argparse.Namespace) -> Qwen3Config:
    """The dense model of equal active parameters: its MLP as wide as the ``top_k`` experts a token runs through."""
    return Qwen3Config(**_sizes(args), intermediate_size=args.moe_inter * args.top_k)


def active_params_per_token(config: Qwen3Config) -> int:
    """The params a token's forward multiplies by (embedding lookups excluded, the router included)."""
    hidden, layers = config.hidden_size, config.num_layers
    attn = hidden * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    if isinstance(config, Qwen3MoeConfig):
        mlp = 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok + hidden * config.num_experts
    else:
        mlp = 3 * hidden * config.intermediate_size
    return layers * (attn + mlp) + hidden * config.vocab_size


@contextlib.contextmanager
def expert_path(path: str) -> Iterator[None]:
    """Every MoE layer's experts on ``path`` (``auto``: the library's choice, grouped in bf16)."""
    original = vars(moe_model)["experts"]
    setattr(moe_model, "experts", functools.partial(experts, path=path))  # type: ignore[arg-type]  # noqa: B010
    try:
        yield
    finally:
        setattr(moe_model, "experts", original)  # noqa: B010


def batch(args: argparse.Namespace, rows: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (rows or args.batch, args.seq + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def make_step(
    model: torch.nn.Module, args: argparse.Namespace, compile: bool | str, plan: Any = None, mesh: Any = None
) -> tuple[Callable, Any]:
    """The bf16-mixed step (per-block compiled when ``compile``) and its first train state."""
    task = CausalLMTask(num_experts=model.config.num_experts if isinstance(model, Qwen3MoeLM) else None)
    moe = isinstance(model, Qwen3MoeLM)
    opt = optim.adamw(1e-3)
    blocks = (Qwen3MoeDecoderLayer,) if moe else (Qwen3DecoderLayer,)
    step = make_train_step(
        model,
        task,
        opt,
        num_microbatches=args.microbatches,
        repeated_blocks=blocks if compile else (),
        precision=Precision.bf16_mixed(),
        plan=plan,
        compile=compile,
    )
    placements = {} if plan is None else {"mesh": mesh, "placements": plan.placements}
    return step, init_train_state(model, opt, task=task, **placements)


def _model(config: Qwen3Config) -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen3MoeLM(config) if isinstance(config, Qwen3MoeConfig) else Qwen3LM(config)


# --- host syncs ----------------------------------------------------------------------------------------------------


class SyncCounter(TorchDispatchMode):
    """Counts the aten ops of :data:`SYNC_OPS` run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_syncs() -> Iterator[dict[str, int]]:
    """Counts the Python-level ``Tensor.item``, ``tolist`` and ``__bool__`` calls inside it."""
    counts = {"item": 0, "tolist": 0, "__bool__": 0}
    originals = {name: getattr(torch.Tensor, name) for name in counts}

    def counted(name: str) -> Callable:
        def call(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return originals[name](self, *a, **k)

        return call

    for name in counts:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def eager_syncs(step: Callable, state: Any, data: dict[str, torch.Tensor]) -> tuple[int, dict[str, int], Any]:
    with SyncCounter() as counter:
        state, _ = step(state, data)
    return sum(counter.counts.values()), counter.counts, state


# --- speed ---------------------------------------------------------------------------------------------------------


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of each variant (median of ``--reps`` interleaved timings of ``--steps`` steps) and host syncs."""
    variants: dict[str, tuple[Qwen3Config, str, bool | str]] = {
        "moe_grouped_compiled": (moe_config(args), "auto", args.backend),
        "moe_grouped_eager": (moe_config(args), "auto", False),
        "moe_loop_eager": (moe_config(args), "reference", False),
        "dense_compiled": (dense_config(args), "auto", args.backend),
        "dense_eager": (dense_config(args), "auto", False),
    }
    data = batch(args)
    steps, states, syncs = {}, {}, {}
    for name, (config, path, compile) in variants.items():
        step, state = make_step(_model(config), args, compile)
        with expert_path(path):
            state, _ = step(state, data)  # the compile, or the first step's allocations
            if compile:
                with python_syncs() as counts:
                    state, _ = step(state, data)
                syncs[name] = {"total": sum(counts.values()), **counts}
            else:
                total, counts, state = eager_syncs(step, state, data)
                syncs[name] = {"total": total, **counts}
        steps[name], states[name] = step, state
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, (_, path, _) in variants.items():
            with expert_path(path):
                start = time.perf_counter()
                for _ in range(args.steps):
                    states[name], out = steps[name](states[name], data)
                float(out.loss)
                times[name].append(time.perf_counter() - start)
    tokens = data["input_ids"].numel() * args.steps
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "tokens_per_s": rates,
        "ratios": {
            "grouped_compiled_over_loop_eager": rates["moe_grouped_compiled"] / rates["moe_loop_eager"],
            "grouped_eager_over_loop_eager": rates["moe_grouped_eager"] / rates["moe_loop_eager"],
            "grouped_compiled_over_dense_compiled": rates["moe_grouped_compiled"] / rates["dense_compiled"],
            "grouped_eager_over_dense_eager": rates["moe_grouped_eager"] / rates["dense_eager"],
        },
        "host_syncs_per_step": syncs,
        "active_params_per_token": {
            "moe": active_params_per_token(moe_config(args)),
            "dense": active_params_per_token(dense_config(args)),
        },
    }


# --- cold compile time ---------------------------------------------------------------------------------------------


def compile_times(args: argparse.Namespace) -> dict[int, float]:
    """Seconds of the first compiled step above a warm one, per expert count, with the compiler's caches off: the
    least of ``--compile-reps`` sweeps over the counts (a shared machine's load only adds time)."""
    from torch._inductor import config as inductor_config

    data, out = batch(args), dict[int, float]()
    with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False):
        for num_experts in [e for _ in range(args.compile_reps) for e in args.compile_experts]:
            torch._dynamo.reset()
            step, state = make_step(_model(moe_config(args, num_experts)), args, args.backend)
            start = time.perf_counter()
            state, result = step(state, data)
            float(result.loss)
            cold = time.perf_counter() - start
            start = time.perf_counter()
            state, result = step(state, data)
            float(result.loss)
            seconds = cold - (time.perf_counter() - start)
            out[num_experts] = min(out.get(num_experts, seconds), seconds)
    return out


# --- ranks: memory per rank, all-to-all bytes ----------------------------------------------------------------------


def _state_bytes(state: Any) -> int:
    from d9dfn import tree_leaves

    total = 0
    for leaf in tree_leaves((state.params, state.opt_state)):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if parallel.is_distributed_tensor(leaf) else leaf
            total += local.numel() * local.element_size()
    return total


def _rank_run(rank: int, world_size: int, args: argparse.Namespace, ep: int) -> dict[str, Any]:
    """One eager step at EP ``ep`` over ``world_size`` replicated data-parallel ranks: memory and collectives."""
    from _memory import allocator_peak
    from dp_scaling import CollectiveCounter

    from d9dfn.config import DeviceMeshParameters
    from d9dfn.loop import init_mesh, mesh_axes
    from d9dfn.models import logical_dims

    config = moe_config(args)
    model = _model(config)
    mesh = init_mesh(
        mesh_axes(DeviceMeshParameters(data_parallel_replicate=world_size, expert_parallel=ep)), device_type="cpu"
    )
    params = dict(model.named_parameters())
    dims = logical_dims(QWEN3_MOE_PLAN, params)
    plan = parallel.plan_for(model, mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
    parallel.bind_expert_parallel(model, parallel.expert_parallel_of(plan))
    step, state = make_step(model, args, False, plan=plan, mesh=mesh)
    rows = args.batch // world_size
    data = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch(args).items()}
    state, _ = step(state, data)  # the optimizer's moments exist after it
    before = state.metric_state["experts"].clone()
    with allocator_peak("cpu") as peak:
        state, _ = step(state, data)
    counts = state.metric_state["experts"] - before  # (E,) this rank's copies of one step, summed over the layers
    with CollectiveCounter() as counter:
        state, _ = step(state, data)
    syncs, _, state = eager_syncs(step, state, data)
    exchanges = [r for r in counter.records if r[0].startswith("all_to_all")]
    local = config.num_experts // ep
    mine = counts[rank * local : (rank + 1) * local].sum() if ep > 1 else counts.sum()
    element = 2  # the exchanged rows are bf16 activations and their gradients
    # Per MoE layer and microbatch: dispatch and combine forward, their adjoints backward: four row exchanges.
    real = 4 * float(counts.sum()) * args.hidden * element
    remote = 4 * float(counts.sum() - mine) * args.hidden * element
    return {
        "state_bytes": _state_bytes(state),
        "step_peak_bytes": peak["peak"],
        "host_syncs_eager": syncs,
        "all_to_all": {
            "calls": len(exchanges),
            "payload_bytes": sum(r[2] for r in exchanges),
            "network_bytes": sum(r[3] for r in exchanges),
            "real_copy_bytes": real,
            "remote_copy_bytes": remote,
        },
    }


def _rank_worker(rank: int, world_size: int, init_file: str, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = {f"ep{ep}": _rank_run(rank, world_size, args, ep) for ep in (1, 2)}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(args: argparse.Namespace, world_size: int = 2, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """:func:`_rank_run` at EP 1 and 2 on ``world_size`` forked gloo ranks; each rank's results."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _rank_worker,
            args=(world_size, str(Path(tmp, "store")), args, tmp),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"benchmarks/moe.py: the ranks did not finish within {timeout_s} s")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


# --- the table -----------------------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    lines = []
    if "speed" in result:
        speed = result["speed"]
        lines += ["| variant | tokens/s | host syncs per step |", "|---|---:|---:|"]
        for name, rate in speed["tokens_per_s"].items():
            lines.append(f"| {name} | {rate:,.0f} | {speed['host_syncs_per_step'][name]['total']} |")
        lines += ["", *(f"- {name}: {ratio:.2f}x" for name, ratio in speed["ratios"].items())]
        lines.append(f"- active params per token: {speed['active_params_per_token']}")
    if "compile_s" in result:
        lines += ["", "| experts | cold compile (s) |", "|---:|---:|"]
        lines += [f"| {e} | {s:.1f} |" for e, s in result["compile_s"].items()]
    if "ranks" in result:
        lines += [
            "",
            "| EP | rank | state bytes | step peak bytes | host syncs (eager) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for rank, per in enumerate(result["ranks"]):
            for ep, r in per.items():
                lines.append(
                    f"| {ep[2:]} | {rank} | {r['state_bytes']:,} | {r['step_peak_bytes']:,} | {r['host_syncs_eager']} |"
                )
        a2a = result["ranks"][0]["ep2"]["all_to_all"]
        lines += [
            "",
            f"- EP 2 all-to-all per step, rank 0: {a2a['calls']} calls, payload {a2a['payload_bytes']:,.0f} B, "
            f"network {a2a['network_bytes']:,.0f} B; real copies {a2a['real_copy_bytes']:,.0f} B "
            f"({a2a['payload_bytes'] / max(a2a['real_copy_bytes'], 1):.2f}x), remote copies "
            f"{a2a['remote_copy_bytes']:,.0f} B ({a2a['network_bytes'] / max(a2a['remote_copy_bytes'], 1):.2f}x)",
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (the smoke test)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variants")
    parser.add_argument("--no-ranks", action="store_true", help="skip the forked gloo ranks")
    parser.add_argument("--no-compile-sweep", action="store_true", help="skip the cold compile times")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-inter", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compile-experts", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--compile-reps", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.moe_inter, args.seq, args.batch, args.vocab = 16, 16, 8, 4, 64
        args.steps, args.reps, args.experts, args.compile_experts, args.compile_reps = 1, 1, 4, [4, 8], 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.no_ranks:  # first: the ranks fork this process before it has compiled anything
        result["ranks"] = run_ranks(args)
    result["speed"] = speed(args)
    if not args.no_compile_sweep:
        result["compile_s"] = compile_times(args)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
