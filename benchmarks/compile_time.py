"""Cold compile time and graph count of the train step against the microbatch count and the depth.

Each (variant, count) runs in its own subprocess with a fresh, empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a
temporary directory), so every number is a cold compile. The variants are the program step (head, one per-microbatch
forward+backward+accumulate piece, tail: ``make_train_step``), the unrolled one-graph step (``make_train_step(...,
executor=Sequential(unroll=True))``) and ``blocks_tail``, the program step with each decoder layer compiled once
(``make_train_step(..., repeated_blocks=(Qwen3DecoderLayer,))``; AdamW is leafwise, so the tail updates each layer's
leaves through one region too), and ``blocks``, the same with the tail over the whole tree (AdamW given a weight-decay
mask that selects every leaf: the same update, not leafwise); ``infer`` and ``infer_blocks`` time the forward-only
inference step the job's evaluation runs, without and with ``repeated_blocks``. Reported: graphs compiled, seconds for
the first step (compile + one run), and time(m)/time(1); ``--warm-calls N``: the median warm step.
Target (issue 12): time(8)/time(1) <= 1.3 for the program.
Run: ``python benchmarks/compile_time.py [--microbatches 1,2,4,8] [--layers 2] [--json PATH]``; against depth
(issue 15): ``--layers 4,8,16,28 --microbatches 1 --variants program`` (t(L)/t(first L) in the last column).

Probes of torch's own tool for compiling a repeated block once (issue 15 item 3), not d9dfn steps: ``fwbw``
compiles the model's loss with the params swapped into the module around the compiled call and takes
``torch.autograd.grad`` of it; ``regions`` does the same with ``torch.compiler.nested_compile_region`` on
``Qwen3DecoderLayer.forward`` (the form that traces one layer and reuses it: under ``grad_and_value``, which
d9dfn's step uses, it fails to trace) and inductor's ``allow_buffer_reuse`` off; ``regions_reuse`` leaves buffer
reuse on, which on torch 2.13 gives wrong gradients (inductor reuses the storage of a tensor a region saved for
backward; ``docs/design/step.md``). Each reports the largest gradient error relative to an eager
``grad_and_value`` (``grad_err``): the number to check before trusting a compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(variant: str, num_microbatches: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import d9dfn.optim as optim
    from d9dfn import (
        BuildForwardInputsResult,
        ComputeLossResult,
        Sequential,
        TrainTask,
        init_train_state,
        make_train_step,
    )
    from d9dfn.models import Qwen3Config, Qwen3LM

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
    optimizer = optim.adamw(1e-3, weight_decay=1e-2)
    state = init_train_state(model, optimizer)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if variant in ("fwbw", "regions", "regions_reuse"):
        return _probe_regions(variant, model, NextToken(), state, batch, args)
    from d9dfn.models._qwen3 import Qwen3DecoderLayer

    if variant in ("infer", "infer_blocks"):
        return _inference(variant, model, state, batch, num_microbatches, args, (Qwen3DecoderLayer,))

    blocks = (Qwen3DecoderLayer,) if variant in ("blocks", "blocks_tail") else ()
    if variant == "blocks":  # the whole-tree tail: a mask (of every leaf) makes AdamW not leafwise, same update
        optimizer = optim.adamw(1e-3, weight_decay=1e-2, weight_decay_mask=lambda name, leaf: True)
    step = make_train_step(
        model,
        NextToken(),
        optimizer,
        num_microbatches=num_microbatches,
        executor=Sequential(unroll=variant == "unrolled"),
        repeated_blocks=blocks,
    )
    start = time.perf_counter()
    state, out = step(state, batch)
    float(out.loss)
    first = time.perf_counter() - start
    start = time.perf_counter()
    state, out = step(state, batch)
    float(out.loss)
    second = time.perf_counter() - start
    warm = []
    for _ in range(args.warm_calls):
        start = time.perf_counter()
        state, out = step(state, batch)
        float(out.loss)
        warm.append(time.perf_counter() - start)
    counters = torch._dynamo.utils.counters
    return {
        "variant": variant,
        "warm_ms": 1e3 * sorted(warm)[len(warm) // 2] if warm else None,
        "microbatches": num_microbatches,
        "layers": int(args.layers),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "first_step_s": first,
        "compile_s": first - second,
    }


def _inference(variant: str, model, state, batch, num_microbatches: int, args, blocks) -> dict:
    """The forward-only step the job's evaluation runs (``make_inference_step``, perplexity task), cold then warm;
    ``infer_blocks`` compiles the decoder layer once (``repeated_blocks``)."""
    import torch

    from d9dfn import InferenceState, make_inference_step
    from d9dfn.tasks import PerplexityTask

    task = PerplexityTask()
    step = make_inference_step(
        model, task, num_microbatches=num_microbatches, repeated_blocks=blocks if variant == "infer_blocks" else ()
    )
    inference = InferenceState(
        params=state.params, buffers=state.buffers, step=state.step, rng=state.rng, task_state=task.init_state()
    )
    times = []
    for _ in range(2 + args.warm_calls):
        start = time.perf_counter()
        inference = step(inference, batch)
        float(inference.task_state["nll"])
        times.append(time.perf_counter() - start)
    warm = times[2:]
    return {
        "variant": variant,
        "warm_ms": 1e3 * sorted(warm)[len(warm) // 2] if warm else None,
        "microbatches": num_microbatches,
        "layers": int(args.layers),
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "first_step_s": times[0],
        "compile_s": times[0] - times[1],
    }


def _probe_regions(variant: str, model, task, state, batch, args: argparse.Namespace) -> dict:
    """Cold first forward+backward of the loss, compiled with or without nested compile regions (see above)."""
    import torch
    import torch._functorch.config
    from torch.func import functional_call, grad_and_value

    from d9dfn import PipelineState
    from d9dfn.models._qwen3 import Qwen3DecoderLayer
    from d9dfn.step._blocks import swapped_in

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
    start = time.perf_counter()
    with swapped_in(model, leaves):
        loss = compiled(forward.inputs)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    first = time.perf_counter() - start
    warm = []
    for _ in range(args.warm_calls):  # the compiled forward+backward's speed, warm
        start = time.perf_counter()
        with swapped_in(model, leaves):
            warm_loss = compiled(forward.inputs)
        torch.autograd.grad(warm_loss, list(leaves.values()))
        warm.append(time.perf_counter() - start)
    errors = ((g - reference[n]).abs().max() / reference[n].abs().max() for n, g in zip(leaves, grads, strict=True))
    error = max(float(e) for e in errors)
    counters = torch._dynamo.utils.counters
    return {
        "variant": variant,
        "microbatches": 1,
        "layers": int(args.layers),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "first_step_s": first,
        "grad_err": error,
        "warm_ms": 1e3 * sorted(warm)[len(warm) // 2] if warm else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", default="2", help="decoder layers; a comma list measures each")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--variants", default="program,unrolled")
    parser.add_argument("--warm-calls", type=int, default=0, help="time this many warm steps (median, ms)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MICROBATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), args)))
        return {}

    rows = []
    for layers in (int(n) for n in str(args.layers).split(",")):
        passthrough = ["--hidden", str(args.hidden), "--layers", str(layers), "--seq", str(args.seq)]
        passthrough += ["--batch", str(args.batch), "--warm-calls", str(args.warm_calls)]
        for variant in args.variants.split(","):
            for count in (int(n) for n in args.microbatches.split(",")):
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    done = subprocess.run(
                        [sys.executable, __file__, *passthrough, "--child", variant, str(count)],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                row = rows[-1]
                print(
                    f"{variant:10s} L={layers:<3d} m={count:<2d} graphs={row['graphs']:<3d} "
                    f"first step {row['first_step_s']:7.2f} s"
                    + (f"  grad_err {row['grad_err']:.2e}" if "grad_err" in row else "")
                    + (f"  warm {row['warm_ms']:.1f} ms" if row.get("warm_ms") else ""),
                    flush=True,
                )
    print(f"\n{'variant':10s} {'L':>3s} {'m':>3s} {'graphs':>7s} {'first s':>8s} {'t/t(first)':>10s}")
    for row in rows:
        base = next(r for r in rows if r["variant"] == row["variant"])  # the first (L, m) measured
        row["ratio_to_first"] = row["first_step_s"] / base["first_step_s"]
        print(
            f"{row['variant']:10s} {row['layers']:3d} {row['microbatches']:3d} {row['graphs']:7d} "
            f"{row['first_step_s']:8.2f} {row['ratio_to_first']:10.3f}"
        )
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "child")}, "results": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
