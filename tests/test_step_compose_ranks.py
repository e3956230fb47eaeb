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

import os
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


# --- mixture of experts: expert parallelism inside the compiled step ------------------------------------------------

MOE_STEPS, MOE_ROWS, MOE_SEQ = 3, 4, 8
MOE_TOLERANCE = {"rtol": 2e-3, "atol": 2e-3}
"""bf16 mixed (the experts on ``torch._grouped_mm``) against the one-process compiled step with the same options:
``tests/test_step_compose.py``'s bf16 tolerance. The expert group's ranks compute each expert over other rows than one
process does and add the data-parallel sums in another order (measured: 1.1e-4 on the losses, 1.8e-4 on the params)."""
MOE_GRAD_RTOL = 1e-2
"""Each gradient's ‖Δg‖ / ‖g‖ at the first step (the same params on both sides): the expert gradients are bf16 sums
over other token sets (both ranks' tokens at once, against one microbatch's), so a near-zero element can differ by more
than 2e-3 (measured: 4e-3 at most); a gradient wrong by a factor or missing a rank's share is off by 0.5 or more. Later
steps' gradients are not compared: params 1e-4 apart can flip a near-tie of the router's top-2 (measured: 0.14 on the
first layer's experts at step 3), which the losses and params absorb."""


def _moe_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(MOE_STEPS):
        tokens = torch.randint(0, 64, (MOE_ROWS, MOE_SEQ + 1), generator=gen)
        batches.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return batches


def _moe_run(mesh: Any, rank: int, world_size: int) -> dict[str, Any]:
    """``MOE_STEPS`` compiled steps of a 4-layer Qwen3-MoE (4 experts, top-2), per-block compiled, every block
    checkpointed, bf16 mixed; on ``mesh`` (its expert axis splitting the experts) with this rank's rows, or on one
    process (``mesh=None``) with the whole batch in ``world_size`` times the microbatches."""
    from test_expert_parallel import _record
    from torch._dynamo.testing import CompileCounterWithBackend

    from d9dfn.models import logical_dims
    from d9dfn.models.qwen3_moe import QWEN3_MOE_PLAN, Qwen3MoeConfig, Qwen3MoeDecoderLayer, Qwen3MoeLM

    torch.manual_seed(0)
    model = Qwen3MoeLM(Qwen3MoeConfig.tiny(vocab_size=64, num_layers=4))
    task = CausalLMTask(aux_loss_weight=0.01, num_experts=4)
    plan, ep = None, None
    if mesh is not None:
        params = dict(model.named_parameters())
        dims = logical_dims(QWEN3_MOE_PLAN, params)
        plan = parallel.plan_for(model, mesh, dims=dims, rules=parallel.EXPERT_PARALLEL_RULES)
        ep = parallel.expert_parallel_of(plan)
        assert ep is not None
        parallel.bind_expert_parallel(model, ep)
    counter = CompileCounterWithBackend("inductor")
    opt = optim.chain(_record(), optim.sgd(0.1, momentum=0.9))
    step = d9dfn.make_train_step(
        model,
        task,
        opt,
        num_microbatches=2 if mesh is not None else 2 * world_size,
        repeated_blocks=(Qwen3MoeDecoderLayer,),
        activation_checkpointing=d9dfn.step.ActivationCheckpointing(),
        precision=d9dfn.Precision.bf16_mixed(),
        plan=plan,
        compile=counter,
    )
    placements = {} if plan is None else {"mesh": mesh, "placements": plan.placements}
    state = d9dfn.init_train_state(model, opt, task=task, **placements)
    rows = MOE_ROWS // world_size
    losses, grads = [], []
    for index, batch in enumerate(_moe_batches()):
        if mesh is not None:
            batch = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):  # steps 2..N reuse every piece
            state, out = step(state, batch)
        losses.append(out.loss)
        grads.append(parallel.full_tensors(dict(state.opt_state[0])))
    return {
        "losses": losses,
        "grads": grads,
        "params": parallel.full_tensors(state.params),
        "counts": state.metric_state["experts"],
        "counter": counter,
        "local_experts": state.params["layers.0.mlp.experts.gate_up_proj"],
    }


def _moe_deltas(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Max |Δ| of the losses and the params; the largest ‖Δg‖ / ‖g‖ over the gradients, per step."""
    return {
        "loss": max(float((a - b).abs()) for a, b in zip(got["losses"], want["losses"], strict=True)),
        **{
            f"grad_rel_{i}": max(float((mine[n] - g).norm() / g.norm()) for n, g in theirs.items())
            for i, (mine, theirs) in enumerate(zip(got["grads"], want["grads"], strict=True))
        },
        "params": max(float((got["params"][n] - p).abs().max()) for n, p in want["params"].items()),
    }


def _moe_worker(rank: int, world_size: int, init_file: str, placement: str) -> None:
    from test_blocks import _region_uses
    from test_expert_parallel import _degrees

    from d9dfn.loop import init_mesh

    dist = _init(rank, world_size, init_file, timeout_s=300.0)  # a peer compiling cold may be minutes late
    try:
        got = _moe_run(init_mesh(_degrees(placement, world_size, 2), device_type="cpu"), rank, world_size)
    finally:
        dist.destroy_process_group()
    counter = got["counter"]
    # The forward: one traced MoE layer for the four (two microbatches: the region's calls per graph).
    assert _region_uses(counter)[:2] == [[], [4]], _region_uses(counter)
    targets = {
        node.target
        for graph in counter.graphs
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    }
    assert torch._grouped_mm in targets  # the experts on the grouped path, inside the region
    assert got["local_experts"].to_local().shape[0] == 2  # each rank holds half the experts
    # Each token copy counted once, the recompute adding none: this rank's rows x top-2 x 4 layers x steps.
    assert float(got["counts"].sum()) == MOE_STEPS * (MOE_ROWS // world_size) * MOE_SEQ * 2 * 4
    if rank:
        return  # the params, gradients and losses are the group's: rank 0 compares them (one reference compile)
    want = _moe_run(None, rank, world_size)
    deltas = _moe_deltas(got, want)
    if os.environ.get("D9DFN_EP_REPORT"):
        print(f"compiled ep2 {placement}: {deltas}", flush=True)
    for index, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        torch.testing.assert_close(a, b, **MOE_TOLERANCE, msg=lambda m, i=index: f"step {i} loss: {m}")
    assert_trees_close(got["params"], want["params"], **MOE_TOLERANCE)
    assert deltas["grad_rel_0"] <= MOE_GRAD_RTOL, deltas  # the first step's: the same params on both sides


@pytest.mark.ranks
@pytest.mark.compiled
def test_expert_parallel_ranks_compose_per_block_compilation_checkpointing_and_bf16(tmp_path: Any) -> None:
    """Two gloo ranks, the experts split over both (``mesh.expert_parallel=2`` out of replicated data parallelism):
    the inductor-compiled step with the MoE decoder layer compiled once for its four layers (its all-to-alls inside
    the region), every block checkpointed, bf16 mixed with the experts on ``torch._grouped_mm``; no recompile over
    three steps; the expert counts not double-counted by the recompute; loss and params within :data:`MOE_TOLERANCE`,
    every gradient within :data:`MOE_GRAD_RTOL` of the one-process compiled step with the same options."""
    _run_ranks(_moe_worker, 2, tmp_path, "replicate", timeout_s=900)


def _moe_pipeline_worker(rank: int, world_size: int, init_file: str, cases: list) -> None:
    """A 4-layer Qwen3-MoE in 2 stages, one per gloo rank (1F1B): each rank's stage params, the loss, Σw and the
    gradient norm against the one-stage step on one process with the same options."""
    from test_step_compose import _moe_batches

    from d9dfn.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeLM

    dist = _init(rank, world_size, init_file, timeout_s=300.0)
    try:
        mesh = init_pipeline_mesh(2, 1, 1, device_type="cpu")
        config = Qwen3MoeConfig.tiny(vocab_size=64, num_layers=4, tie_word_embeddings=False)
        for blocks, compile in cases:
            torch.manual_seed(0)
            model, task = Qwen3MoeLM(config), CausalLMTask(aux_loss_weight=0.1, num_experts=4)
            opt = optim.sgd(0.1, momentum=0.9)
            program = pipeline.one_f_one_b(2, 1, NUM_MICROBATCHES)
            stages = pipeline.build_stages(lambda info: Qwen3MoeLM(config, info), 2)
            rank_executor = pipeline.PipelineRank(
                program, stages, parallel.pipeline_rank(mesh), parallel.pipeline_group(mesh)
            )
            options: dict[str, Any] = {"num_microbatches": NUM_MICROBATCHES, "compile": compile}
            if blocks:
                options.update(repeated_blocks="auto", activation_checkpointing=d9dfn.step.ActivationCheckpointing())
            reference = d9dfn.make_train_step(model, task, opt, **options)
            step = d9dfn.make_train_step(model, task, opt, executor=rank_executor, **options)
            expected = d9dfn.init_train_state(model, opt, task=task)
            params = {n: p for s in rank_executor.local_stages for n, p in s.select_params(expected.params).items()}
            local = expected.replace(params=params, buffers={}, opt_state=opt.init(params))
            tolerance = {"rtol": 1e-5, "atol": 1e-5} if blocks else {"rtol": 0.0, "atol": 0.0}
            for batch in _moe_batches(4):
                expected, want = reference(expected, batch)
                local, got = step(local, batch)
                for field in ("loss", "loss_weight", "grad_norm"):
                    assert_trees_close(getattr(got, field), getattr(want, field), **tolerance)
            for stage in rank_executor.local_stages:
                assert_trees_close(stage.select_params(local.params), stage.select_params(expected.params), **tolerance)
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_moe_in_two_pipeline_ranks_equals_the_one_stage_step(tmp_path: Any) -> None:
    """The expert load (counts, router probability sums) sent to the next rank with the hidden states and its
    cotangent back: the traced 1F1B stages bitwise the one-stage step; per-block compiled (``aot_eager``) with every
    block checkpointed within 1e-5."""
    _run_ranks(_moe_pipeline_worker, 2, tmp_path, [(False, False), (True, "aot_eager")], timeout_s=600, clean=True)
