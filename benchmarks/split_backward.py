"""The cost of a stage's backward forms: ``vjp`` (F, then the full B) vs the traced I/W split (fw, dI, dW).

Per stage: the matmuls each piece runs (``mm``/``addmm``/``bmm``/``baddbmm``, counted with a
``TorchDispatchMode``) and its median wall time over ``--reps`` runs, and whether the split's input and weight
gradients equal ``vjp``'s bitwise. Stages: a residual+LayerNorm+GELU MLP stack (a middle stage: its input is
differentiated) and a middle Qwen3 stage (``Qwen3Config(num_layers=6)``: hidden 128, 3 stages). The split's trace (once
per stage shape) is timed separately.

With ``--steps N`` it also times whole pipeline training steps (``make_train_step(executor=Pipeline(...))``, a Qwen3
model cut into 2 stages, every stage in one process) with the stages eager (``compile=False``: ``vjp``, or the split
replayed op by op) against compiled stage pieces (``compile=True``: each stage's ``fw``/``dI``/``dW`` compiled once by
inductor), per schedule, interleaved in this process; the compiled step is checked against the eager one.

Run: ``PYTHONPATH=. python benchmarks/split_backward.py [--reps 20] [--threads 2] [--steps 5 --step-repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp
from torch.utils._python_dispatch import TorchDispatchMode

import d9dfn.optim as optim
from d9dfn import BuildForwardInputsResult, ComputeLossResult, TrainTask, init_train_state, make_train_step, pipeline
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.pipeline._split_backward import SplitBackward

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _MATMULS:  # 2·(output numel)·(contracted dim)
            self.count += 1
            first = args[0] if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm) else args[1]
            self.flops += 2 * out.numel() * first.shape[-1]
        return out


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden + self.down(nn.functional.gelu(self.up(hidden))))


def _mlp_case(dim: int, blocks: int, batch: int) -> tuple[Callable[..., Any], Any, Any, Any]:
    module = nn.Sequential(*(_Block(dim) for _ in range(blocks)))
    params = {k: v.detach() for k, v in module.named_parameters()}

    def fn(p: Any, x: Any, c: Any) -> tuple[Any, Any]:
        return {"hidden": functional_call(module, p, (x["hidden"],))}, {}

    return fn, params, {"hidden": torch.randn(batch, dim)}, None


def _qwen_case(batch: int, seq: int) -> tuple[Callable[..., Any], Any, Any, Any]:
    config = Qwen3Config(tie_word_embeddings=False, num_layers=6)
    model = Qwen3LM(config)
    full = {k: v.detach() for k, v in model.named_parameters()}
    stages = pipeline.build_stages(lambda info: Qwen3LM(config, stage=info), 3)
    kwargs = {"position_ids": torch.arange(seq).expand(batch, seq)}
    first = {k: full[k] for k in stages[0].param_names}
    with torch.no_grad():
        hidden, _ = stages[0](first, {}, {"input_ids": torch.randint(0, config.vocab_size, (batch, seq))}, kwargs)
    stage = stages[1]

    def fn(p: Any, x: Any, c: Any) -> tuple[Any, Any]:
        out, _ = stage(p, {}, x, c)
        return {k: v for k, v in out.items() if v.is_floating_point()}, {}

    diff = {k: v for k, v in hidden.items() if v.is_floating_point()}
    return fn, {k: full[k] for k in stage.param_names}, diff, kwargs


def _timed(thunk: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = thunk()
    return time.perf_counter() - start, out


def measure(name: str, case: tuple[Callable[..., Any], Any, Any, Any], reps: int) -> list[str]:
    fn, params, inputs, consts = case
    with torch.no_grad():
        primal, _ = fn(params, inputs, consts)
    gy = {k: torch.randn_like(v) for k, v in primal.items()}
    split = SplitBackward()
    trace_s, _ = _timed(lambda: split(0, fn, params, inputs, consts))
    times: dict[str, list[float]] = {k: [] for k in ("F", "B", "fw", "I", "W")}
    counts: dict[str, int] = {}
    flops: dict[str, int] = {}
    equal = True
    for rep in range(reps + 1):  # rep 0 warms up and counts
        count = rep == 0
        modes = {k: CountMatmuls() if count else None for k in times}

        def run(key: str, thunk: Callable[[], Any], modes: dict[str, Any] = modes) -> Any:
            mode = modes[key]
            if mode is None:
                t, out = _timed(thunk)
                times[key].append(t)
                return out
            with mode:
                out = thunk()
            counts[key] = mode.count
            flops[key] = mode.flops
            return out

        _, closure, _ = run("F", lambda: vjp(lambda p, x: fn(p, x, consts), params, inputs, has_aux=True))
        expected_w, expected_x = run("B", lambda c=closure: c(gy))
        _, sv, _ = run("fw", lambda: split(0, fn, params, inputs, consts))
        got_x = run("I", lambda v=sv: v.input(gy))
        got_w = run("W", sv.weight)
        equal &= all(torch.equal(got_w[k], expected_w[k]) for k in expected_w)
        equal &= all(torch.equal(got_x[k], expected_x[k]) for k in expected_x)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    ms["I+W"], counts["I+W"], flops["I+W"] = ms["I"] + ms["W"], counts["I"] + counts["W"], flops["I"] + flops["W"]
    unit = flops["F"]
    cells = [f"{counts[k]} mm, {flops[k] / unit:.2f} F, {ms[k]:.1f} ms" for k in ("F", "B", "fw", "I", "W", "I+W")]
    return [f"| {name} | {' | '.join(cells)} | {'yes' if equal else 'NO'} | {1e3 * trace_s:.0f} |"]


class _NextToken(TrainTask):  # type: ignore[type-arg]
    def build_forward_inputs(self, batch, state):  # type: ignore[no-untyped-def]
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state.set("labels", batch["labels"])

    def compute_loss(self, outputs, state, step):  # type: ignore[no-untyped-def]
        labels = state["labels"]
        loss = nn.functional.cross_entropy(outputs["logits"].flatten(0, 1).float(), labels.flatten())
        return ComputeLossResult(loss=loss, loss_weight=torch.tensor(float(labels.numel())))


def step_rows(args: argparse.Namespace) -> list[str]:
    """ms per pipeline step, eager stages vs compiled stage pieces, per schedule (2 stages, one process)."""
    config = Qwen3Config(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        intermediate_size=3 * args.hidden,
        max_seq_len=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3LM(config)
    stages = pipeline.build_stages(lambda info: Qwen3LM(config, stage=info), 2)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    opt = optim.sgd(1e-2)
    m = args.microbatches
    runs: dict[str, Callable[[], Any]] = {}
    states: dict[str, Any] = {}
    compile_s: dict[str, float] = {}
    for name, (ranks, per_rank) in {"one_f_one_b": (2, 1), "zero_bubble_1f1b": (2, 1)}.items():
        program = pipeline.SCHEDULES[name](ranks, per_rank, m)
        for compiled in (False, True):
            key = f"{name} {'compiled' if compiled else 'eager'}"
            step = make_train_step(
                model,
                _NextToken(),
                opt,
                num_microbatches=m,
                executor=pipeline.Pipeline(program, stages),
                compile=compiled,
            )
            states[key] = init_train_state(model, opt, seed=0)

            def run(step: Any = step, key: str = key) -> Any:
                states[key], out = step(states[key], batch)
                return out

            compile_s[key], _ = _timed(lambda run=run: (run(), run()))  # traces, compiles, warms
            runs[key] = run
    losses = {key: float(run().loss) for key, run in runs.items()}
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.step_repeats):
        for key, run in runs.items():
            t, _ = _timed(lambda run=run: [run() for _ in range(args.steps)])
            times[key].append(1e3 * t / args.steps)
    ms = {key: statistics.median(v) for key, v in times.items()}
    rows = [
        f"pipeline step: Qwen3 hidden {args.hidden}, {args.layers} layers, 2 stages in one process, B={args.batch}, "
        f"T={args.seq}, m={m}; median of {args.step_repeats} × {args.steps} steps",
        "| schedule | eager ms/step | compiled ms/step | eager / compiled | first two steps (trace+compile) s "
        "| loss after warm-up (eager, compiled) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("one_f_one_b", "zero_bubble_1f1b"):
        e, c = f"{name} eager", f"{name} compiled"
        rows.append(
            f"| {name} | {ms[e]:.1f} | {ms[c]:.1f} | {ms[e] / ms[c]:.2f} | {compile_s[e]:.1f}, {compile_s[c]:.1f} "
            f"| {losses[e]:.6f}, {losses[c]:.6f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="also time pipeline steps (this many per repeat)")
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-pieces", action="store_true", help="only the pipeline steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps:
        for row in step_rows(args):
            print(row, flush=True)
    if args.skip_pieces:
        return
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU, {args.threads} threads, median of {args.reps}")
    print("cells: matmuls, their FLOPs in units of the stage's forward (F), median ms")
    print("| stage | vjp F | vjp B (full) | split fw | split I (dI) | split W (dW) | I + W | bitwise | trace ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = {
        "MLP, 4 × (res + LN + GELU), d=256, B=256": _mlp_case(256, 4, 256),
        "Qwen3 middle stage (hidden 128, 2 layers), B=4, T=128": _qwen_case(4, 128),
    }
    for name, case in cases.items():
        for row in measure(name, case, args.reps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
