"""Cold compile time and graph count of the train step against the microbatch count and the depth.

Each (variant, count) runs in its own subprocess with a fresh, empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in a temporary directory), so every number is a cold compile. The variants are
the program step (head, one per-microbatch forward+backward+accumulate piece, tail: ``make_train_step``) and
the unrolled one-graph step (``make_train_step(..., unroll=True)``). Reported: graphs compiled, seconds for the
first step (compile + one run), and time(m)/time(1). Target (issue 12): time(8)/time(1) <= 1.3 for the program.
Run: ``python benchmarks/compile_time.py [--microbatches 1,2,4,8] [--layers 2] [--json PATH]``; against depth
(issue 15): ``--layers 4,8,16,28 --microbatches 1 --variants program`` (t(L)/t(first L) in the last column).
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
    from d9dfn import BuildForwardInputsResult, ComputeLossResult, TrainTask, init_train_state, make_train_step
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
    step = make_train_step(
        model, NextToken(), optimizer, num_microbatches=num_microbatches, unroll=variant == "unrolled"
    )
    start = time.perf_counter()
    state, out = step(state, batch)
    float(out.loss)
    first = time.perf_counter() - start
    start = time.perf_counter()
    state, out = step(state, batch)
    float(out.loss)
    second = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    return {
        "variant": variant,
        "microbatches": num_microbatches,
        "layers": int(args.layers),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "first_step_s": first,
        "compile_s": first - second,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", default="2", help="decoder layers; a comma list measures each")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--variants", default="program,unrolled")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MICROBATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), args)))
        return {}

    rows = []
    for layers in (int(n) for n in str(args.layers).split(",")):
        passthrough = ["--hidden", str(args.hidden), "--layers", str(layers), "--seq", str(args.seq)]
        passthrough += ["--batch", str(args.batch)]
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
                    f"first step {row['first_step_s']:7.2f} s",
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
