"""The step's features composed across real pipeline ranks (gloo): per-block compilation and the precision policy
inside ``PipelineRank`` stages, with and without sharded data parallelism beside the pipeline.

Each rank runs its row of a 1F1B program over a 4-layer Qwen3 cut into 2 stages; every rank checks its stages'
params and the step's outputs against the same run in one process:

- against the one-process reference executor (``Pipeline``) with the same options: **bitwise** (the same stage
  runner computes the same ops; only the activations and their gradients travel, in the compute dtype);
- with sharded data parallelism beside the pipeline, against the one-process sequential step: the tolerances of
  ``tests/test_step_compose.py`` (the data-parallel sum adds in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks

import d9dfn
from d9dfn import optim, parallel, pipeline
from d9dfn.loop import init_pipeline_mesh
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

pytestmark = pytest.mark.slow

CONFIG = Qwen3Config.tiny(num_layers=4, tie_word_embeddings=False, hidden_size=16, head_dim=4, intermediate_size=24)
NUM_MICROBATCHES, ROWS, SEQ = 2, 4, 6


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=gen)
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return batches


def _options(precision: str, blocks: str, compile: bool | str) -> dict[str, Any]:
    return {
        "precision": d9dfn.Precision.bf16_mixed() if precision == "bf16" else None,
        "repeated_blocks": "auto" if blocks == "auto" else (),
        "compile": compile,
        "max_grad_norm": 0.05,
    }


def _run(mesh: Any, precision: str, blocks: str, compile: bool | str) -> None:
    dp_mesh = parallel.data_parallel_submesh(mesh)
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_rank() % dp_mesh.size()
    torch.manual_seed(0)
    model, task, opt = Qwen3LM(CONFIG), CausalLMTask(), optim.adamw(0.02, eps=1e-3, weight_decay=0.1)
    program = pipeline.one_f_one_b(mesh.size(0), 1, NUM_MICROBATCHES)
    stages = pipeline.build_stages(lambda info: Qwen3LM(CONFIG, info), program.num_stages)
    rank = pipeline.PipelineRank(program, stages, parallel.pipeline_rank(mesh), parallel.pipeline_group(mesh))
    options = _options(precision, blocks, compile)
    state = d9dfn.init_train_state(model, opt, task=task)
    if dp_size == 1:  # the one-process reference executor, same options: bitwise
        reference = d9dfn.make_train_step(model, task, opt, executor=pipeline.Pipeline(program, stages), **options)
        tolerance = {"rtol": 0.0, "atol": 0.0}
    else:  # the one-process sequential traced step, eager, on the whole batch
        reference = d9dfn.make_train_step(
            model,
            task,
            opt,
            num_microbatches=NUM_MICROBATCHES * dp_size,
            precision=options["precision"],
            max_grad_norm=options["max_grad_norm"],
            compile=False,
        )
        tolerance = {"rtol": 2e-3, "atol": 2e-3} if precision == "bf16" else {"rtol": 1e-5, "atol": 1e-5}
    rank_params = {name: p for s in rank.local_stages for name, p in s.select_params(state.params).items()}
    step = d9dfn.make_train_step(
        model,
        task,
        opt,
        executor=rank,
        plan=parallel.plan_for(rank_params, dp_mesh) if dp_size > 1 else None,
        data_parallel=parallel.data_parallel(dp_mesh, dp_rank) if dp_size > 1 else None,
        **options,
    )
    local_params = {name: p for s in rank.local_stages for name, p in s.select_params(state.params).items()}
    if dp_size > 1:
        local_params = parallel.distribute_params(local_params, dp_mesh)
    local = state.replace(params=local_params, buffers={}, opt_state=opt.init(local_params))
    expected = state
    rows = ROWS // dp_size
    for batch in _batches():
        expected, want = reference(expected, batch)
        mine = {key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch.items()}
        local, got = step(local, mine)
        for field in ("loss", "loss_weight", "grad_norm"):
            assert_trees_close(getattr(got, field), getattr(want, field), **tolerance)
    gathered = parallel.full_tensors(local.params)
    for stage in rank.local_stages:
        assert_trees_close(stage.select_params(gathered), stage.select_params(expected.params), **tolerance)


def _worker(rank: int, world_size: int, init_file: str, degrees: tuple[int, int, int], cases: list) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_pipeline_mesh(*degrees, device_type="cpu")
        for case in cases:
            try:
                _run(mesh, *case)
            except Exception as error:
                raise AssertionError(f"{case}: {error}") from error
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_pipeline_ranks_compose_per_block_compilation_and_bf16(tmp_path: Any) -> None:
    cases = [("fp32", "auto", False), ("bf16", "off", False), ("bf16", "auto", "aot_eager")]
    _run_ranks(_worker, 2, tmp_path, (2, 1, 1), cases, timeout_s=600, clean=True)


@pytest.mark.ranks
def test_pipeline_ranks_with_sharded_data_parallelism_compose_per_block_compilation_and_bf16(tmp_path: Any) -> None:
    _run_ranks(_worker, 4, tmp_path, (2, 1, 2), [("bf16", "auto", False)], timeout_s=600, clean=True)


def _sharded_worker(rank: int, world_size: int, init_file: str, backends: list) -> None:
    """One process per ``dp_shard`` rank: the per-block gathered step (compiled) against the one-process step."""
    dist = _init(rank, world_size, init_file)
    try:
        from d9dfn.loop import init_data_parallel_mesh

        mesh = init_data_parallel_mesh(1, world_size, device_type="cpu")
        torch.manual_seed(0)
        model, task, opt = Qwen3LM(CONFIG), CausalLMTask(), optim.sgd(0.1, momentum=0.9)
        reference = d9dfn.make_train_step(
            model, task, opt, num_microbatches=NUM_MICROBATCHES * world_size, max_grad_norm=0.05, compile=False
        )
        for backend in backends:
            step = d9dfn.make_train_step(
                model,
                task,
                opt,
                num_microbatches=NUM_MICROBATCHES,
                repeated_blocks="auto",
                activation_checkpointing=d9dfn.step.ActivationCheckpointing("selective", every=2),
                plan=parallel.plan_for(model, mesh),
                max_grad_norm=0.05,
                compile=backend,
            )
            expected = d9dfn.init_train_state(model, opt, task=task)
            local = d9dfn.init_train_state(model, opt, task=task, mesh=mesh)
            rows = ROWS // world_size
            for batch in _batches():
                expected, want = reference(expected, batch)
                local, got = step(local, {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()})
                for field in ("loss", "loss_weight", "grad_norm"):
                    assert_trees_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-5)
            runner = step.pieces["stages"]
            assert sorted(runner.gathering.layouts) == [f"layers.{i}" for i in range(CONFIG.num_layers)], backend
            assert_trees_close(parallel.full_tensors(local.params), expected.params, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_sharded_params_gathered_per_block_train_like_one_process_compiled(tmp_path: Any) -> None:
    """``Shard(0)`` params gathered block by block inside the compiled step (the gather recomputed for the backward,
    the gradients reduce-scattered per block), with selective checkpointing of every other block. ``aot_eager``: the
    same path under inductor, with full checkpointing, is the README's sharded ``torchrun`` command
    (tests/test_readme_commands.py), which this test's inductor run duplicated at two minutes of compiling."""
    _run_ranks(_sharded_worker, 2, tmp_path, [False, "aot_eager"], timeout_s=900, clean=True)
