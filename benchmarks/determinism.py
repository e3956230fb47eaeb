"""The cost of deterministic compiled steps: the default job's step with and without deterministic algorithms.

One process, one configured default job (``d9dfn train``'s model, batch and optimizer): the same compiled
step function runs under ``torch.use_deterministic_algorithms(False)`` (baseline) and ``(True)``
(deterministic; dynamo guards on the flag, so each mode has its own compiled graph). Timed in alternating
blocks of ``--steps`` steps, ``--rounds`` times; the ratio compares the medians. Each mode also repeats one
step from the same state and batch and counts the repeats whose new params are bitwise equal to the first:
the baseline's embedding gradient is summed with atomic adds in a parallel loop (inductor's CPU ``index_put``
with ``accumulate=True``), so its order, and the last bits, change from call to call.

Run: ``OMP_NUM_THREADS=2 python benchmarks/determinism.py [--steps 5 --rounds 3 --repeats 8 --threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from d9dfn.config import DeviceMeshParameters, load_config
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, default_job
from d9dfn.loop import TrainingConfigurator
from d9dfn.loop._runtime import deterministic_algorithms
from d9dfn.tasks import CausalLMTask


def _configure(save_dir: str) -> Any:
    job = load_config(LMJobConfig, None, [f"trainer.checkpointing.save_dir={save_dir}"], default=default_job())
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    ).configure()


def _same_params(a: Any, b: Any) -> bool:
    return all(torch.equal(a.params[name], b.params[name]) for name in a.params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per mode (alternating)")
    parser.add_argument("--repeats", type=int, default=8, help="repeats of one step, compared bitwise")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as save_dir:
        trainer = _configure(save_dir)
        state, batches = trainer.initial_state(), iter(trainer.data)
        batch = next(batches)
        modes = {"baseline": False, "deterministic": True}
        for name, enabled in modes.items():  # compile both graphs before timing
            started = time.perf_counter()
            with deterministic_algorithms(enabled):
                trainer.step_fn(state, batch)
            print(f"{name}: compile + first step {time.perf_counter() - started:.1f} s", flush=True)
        times: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(args.rounds):
            for name, enabled in modes.items():
                with deterministic_algorithms(enabled):
                    current = state
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        current, output = trainer.step_fn(current, batch)
                    float(output.loss)  # wait for the last step
                    times[name].append((time.perf_counter() - started) / args.steps)
        for name, enabled in modes.items():
            with deterministic_algorithms(enabled):
                first, _ = trainer.step_fn(state, batch)
                equal = sum(_same_params(first, trainer.step_fn(state, batch)[0]) for _ in range(args.repeats))
            print(
                f"{name}: {statistics.median(times[name]) * 1000:.0f} ms/step (median of {args.rounds} blocks of "
                f"{args.steps}); repeats bitwise equal to the first: {equal}/{args.repeats}"
            )
        ratio = statistics.median(times["deterministic"]) / statistics.median(times["baseline"])
        print(f"deterministic / baseline step time: {ratio:.2f} ({args.threads} threads)")


if __name__ == "__main__":
    main()
