"""Vocabulary parallelism's pieces (``d9dfn/parallel/_vocab.py``) against torch's whole-vocabulary functions, on 2
simulated ranks (``LocalTensorMode`` over the fake process group): the cross-entropy and its gradient under
``torch.func.vjp``, the accuracy's argmax (ties across the ranks' boundary included), the embedding; and the
refusals. The whole step is ``tests/test_tensor_parallel.py``'s oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_parallel_properties import _agreed, _forget_meshes

from d9dfn import parallel
from d9dfn.models import Qwen3Config, Qwen3LM, logical_dims
from d9dfn.models._decoder import DECODER_PLAN, bind_tensor_parallel
from d9dfn.tasks import IGNORE_INDEX, token_correct, token_nll

WORLD, BATCH, SEQ, VOCAB, DIM = 2, 3, 5, 8, 4
PART = VOCAB // WORLD


@pytest.fixture
def ranks() -> Iterator[tuple[Any, parallel.TensorParallel]]:
    """The simulated ranks' mode and the tensor group over all of them."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        tp = parallel.TensorParallel(parallel.group_name(dist.group.WORLD), WORLD, vocab=True)
        yield LocalTensorMode(WORLD), tp  # entered by the test, around the sharded computation only
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _per_rank(tensor: Any) -> list[torch.Tensor]:
    return [tensor._local_tensors[rank] for rank in range(WORLD)]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=gen) * 4
    logits[0, 0] = 1.0  # a tie over the whole vocabulary: the argmax is id 0
    logits[0, 1, [1, PART + 1]] = 50.0  # a tie across the ranks' boundary: the first id wins, as torch's argmax
    logits[0, 2, [PART, PART + 2]] = 50.0  # a tie on rank 1 only
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :3] = torch.tensor([0, 1, PART])
    labels[1, 1] = labels[2, 4] = IGNORE_INDEX
    return logits, labels


def _sharded(mode: Any, logits: torch.Tensor, tp: parallel.TensorParallel) -> parallel.VocabParallelLogits:
    local = mode.rank_map(lambda rank: logits[..., rank * PART : (rank + 1) * PART].clone())
    start = mode.rank_map(lambda rank: torch.tensor(rank * PART))
    return parallel.VocabParallelLogits(local, start, tp)


def test_vocab_parallel_nll_and_its_gradient_equal_the_whole_cross_entropy(ranks: Any) -> None:
    mode, tp = ranks
    logits, labels = _inputs()
    with mode:
        sharded = _sharded(mode, logits, tp)
        nll, vjp, *_ = torch.func.vjp(
            lambda local: token_nll(parallel.VocabParallelLogits(local, sharded.start, tp), labels)[0], sharded.local
        )
        (grad,) = vjp(torch.tensor(0.5))
    whole, whole_vjp, *_ = torch.func.vjp(lambda z: token_nll(z, labels)[0], logits)
    (whole_grad,) = whole_vjp(torch.tensor(0.5))
    torch.testing.assert_close(_agreed(nll), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(_per_rank(grad), -1), whole_grad, rtol=1e-6, atol=1e-7)
    assert (whole_grad[1, 1] == 0).all()  # an ignored label: no gradient (and none on the shards: compared above)


def test_vocab_parallel_correct_is_the_whole_argmax_ties_included(ranks: Any) -> None:
    mode, tp = ranks
    logits, labels = _inputs()
    with mode:
        correct = token_correct(_sharded(mode, logits, tp), labels)
        hits = parallel.vocab_parallel_correct(_sharded(mode, logits, tp), labels)
    torch.testing.assert_close(_agreed(correct), token_correct(logits, labels), rtol=0, atol=0)
    assert torch.equal(_agreed(hits), logits.argmax(-1) == labels)
    assert _agreed(hits)[0, :3].tolist() == [True, True, True]  # the ties resolved to the first id


def test_vocab_parallel_embedding_summed_over_the_ranks_is_the_embedding(ranks: Any) -> None:
    mode, _ = ranks
    weight = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with mode:
        local = mode.rank_map(lambda rank: weight[rank * PART : (rank + 1) * PART].clone())
        start = mode.rank_map(lambda rank: torch.tensor(rank * PART))
        part = parallel.vocab_parallel_embedding(ids, local, start)
    parts = _per_rank(part)
    torch.testing.assert_close(sum(parts), F.embedding(ids, weight), rtol=0, atol=0)
    assert all(((p != 0).any(-1) == ((ids >= r * PART) & (ids < (r + 1) * PART))).all() for r, p in enumerate(parts))


def test_binding_refuses_a_vocabulary_the_degree_does_not_divide_in_one_line() -> None:
    model = Qwen3LM(Qwen3Config.tiny(vocab_size=255))
    with pytest.raises(ValueError, match=r"^mesh.tensor_parallel=2 does not divide model vocab_size=255: ") as error:
        bind_tensor_parallel(model, parallel.TensorParallel("unused", 2, vocab=True))
    assert "--set model.vocab_size to a multiple of 2 (e.g. 256)" in str(error.value)
    assert "\n" not in str(error.value)
    assert bind_tensor_parallel(model, parallel.TensorParallel("unused", 2)) == 4  # heads and width alone: bound


def test_unbinding_vocab_parallelism_restores_the_whole_model_bitwise() -> None:
    model = Qwen3LM(Qwen3Config.tiny(tie_word_embeddings=False))
    x = torch.zeros(1, SEQ, dtype=torch.long)
    whole = model(x)["logits"]
    bind_tensor_parallel(model, parallel.TensorParallel("unused", 2, vocab=True))
    assert model.tensor_parallel is not None
    assert model.tensor_parallel.vocab
    bind_tensor_parallel(model, None)
    assert model.tensor_parallel is None
    torch.testing.assert_close(model(x)["logits"], whole, rtol=0, atol=0)


def test_the_vocab_rule_splits_the_embedding_and_the_head_by_rows() -> None:
    model = Qwen3LM(Qwen3Config.tiny(tie_word_embeddings=False))
    params = dict(model.named_parameters())
    rules = (*parallel.TENSOR_PARALLEL_RULES, *parallel.VOCAB_PARALLEL_RULES)
    dims = logical_dims(DECODER_PLAN, params)
    plan = parallel.make_plan(params, parallel.MeshAxes.of(tensor=2), dims=dims, rules=rules)
    whole = parallel.make_plan(params, parallel.MeshAxes.of(tensor=2), dims=dims, rules=parallel.TENSOR_PARALLEL_RULES)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        layout = plan.params[name]
        assert layout.compute[-1] == layout.storage[-1] == "S(0)", (name, layout)
        assert whole.params[name].compute[-1] == "R"
        assert "tp" not in layout.partial  # complete on every rank: a local shard's gradient
    others = [name for name in plan.params if name not in ("embed_tokens.weight", "lm_head.weight")]
    assert [plan.params[name] for name in others] == [whole.params[name] for name in others]


@pytest.mark.slow
def test_the_vocab_parallel_step_compiles_per_block_as_it_runs_eagerly() -> None:
    """The step with vocabulary and sequence parallelism traced whole by dynamo (``VocabParallelLogits`` through the
    graph, the functions' collectives in it) and per block (``repeated_blocks``), with the ``aot_eager`` backend: the
    same losses and params as eagerly. Rank 0 of a fake process group of 2, whose collectives do nothing (so this
    checks the trace, not the arithmetic across ranks: the simulated-rank oracle does); inductor on the same path
    measured once by hand (max |Δ| params 1.9e-6)."""
    from test_tensor_parallel import _batches, _optimizer, build
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import d9dfn
    from d9dfn.loop import init_mesh

    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(tensor=WORLD), device_type="cpu")
        runs = []
        for compile_ in (False, "aot_eager"):
            plan, step, model, task = build(mesh, True, True, compile=compile_, repeated_blocks="auto")
            assert "stages" in step.pieces  # the per-block runner
            state = d9dfn.init_train_state(model, _optimizer(), task=task, mesh=mesh, placements=plan.placements)
            losses = []
            for batch in _batches(1):
                state, out = step(state, batch)
                losses.append(out.loss)
            local = {name: p.to_local() for name, p in state.params.items()}  # type: ignore[attr-defined]  # DTensors
            runs.append((torch.stack(losses), local))
        (eager, eager_params), (compiled, compiled_params) = runs
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        torch.testing.assert_close(compiled_params, eager_params, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def test_whole_logits_gathers_the_indexed_positions_in_id_order(ranks: Any) -> None:
    mode, tp = ranks
    logits, _ = _inputs()
    with mode:
        sharded = _sharded(mode, logits, tp)
        last, rows = parallel.whole_logits(sharded, (0, -1)), parallel.whole_logits(sharded, (slice(None), 2))
    assert torch.equal(_agreed(last), logits[0, -1])  # (V,)
    assert torch.equal(_agreed(rows), logits[:, 2])  # (B, V)
    assert torch.equal(parallel.whole_logits(logits, (0, -1)), logits[0, -1])  # a whole tensor: indexed only
    with pytest.raises(
        TypeError, match=r"^VocabParallelLogits: .*whole_logits\(logits, index\).*vocab_parallel=false$"
    ):
        sharded[0, -1]  # indexing the shards as if they were the logits: refused, naming the fixes


def test_validation_inference_and_the_sample_on_split_logits_equal_one_process() -> None:
    """The consumers of a vocab-parallel model's logits besides the train step, on 2 simulated ranks against one
    process: the validation step (``make_eval_step`` with the train task, as the loop validates during training), the
    perplexity of ``d9dfn infer`` (``PerplexityTask`` through ``make_inference_step``) and the sampler's next-token
    logits (``jobs._sample.next_logits``: the last position gathered, ``generate``'s and the pipelined sampler's)."""
    from test_tensor_parallel import CONFIG, MICROBATCHES, _batches, _model, _optimizer, _rules, tensor_parallel_plan
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import d9dfn
    from d9dfn.jobs._sample import next_logits
    from d9dfn.loop import init_mesh
    from d9dfn.tasks import CausalLMTask, PerplexityTask

    batch = _batches(1)[0]
    context = batch["input_ids"][:1]  # (1, T): the sampler's one-row batch

    def run(model: Qwen3LM, plan: Any, **placed: Any) -> tuple[torch.Tensor, ...]:
        task, perplexity = CausalLMTask(), PerplexityTask()
        state = d9dfn.init_train_state(model, _optimizer(), task=task, **placed)
        evaluate = d9dfn.make_eval_step(model, task, num_microbatches=MICROBATCHES, plan=plan, compile=False)
        metrics, out = evaluate(state, task.create_metrics().init(), batch)
        infer = d9dfn.make_inference_step(model, perplexity, num_microbatches=MICROBATCHES, plan=plan, compile=False)
        zero = torch.zeros((), dtype=torch.int64)
        start = d9dfn.InferenceState(
            params=state.params, buffers=state.buffers, step=zero, rng=zero, task_state=perplexity.init_state()
        )
        inferred = infer(start, batch)
        params = state.params if plan is None else plan.compute_params(state.params)  # this rank's vocabulary rows
        with torch.no_grad():
            logits = torch.func.functional_call(model, (params, state.buffers), (context,))["logits"]
        accuracy = task.create_metrics().compute(metrics)["accuracy"]
        return out.loss, out.loss_weight, accuracy, inferred.task_state["nll"], next_logits(logits)

    expected = run(_model(), None)
    _forget_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_mesh(parallel.MeshAxes.of(tensor=2), device_type="cpu")
        model = _model()
        plan = tensor_parallel_plan(model, mesh, vocab=True)
        assert plan.params["lm_head.weight"].compute[-1] == "S(0)"
        assert bind_tensor_parallel(model, parallel.tensor_parallel_of(plan, _rules(False, vocab=True))) > 0
        with LocalTensorMode(2):
            got = [_agreed(value) for value in run(model, plan, mesh=mesh, placements=plan.placements)]
    finally:
        dist.destroy_process_group()
        _forget_meshes()
    assert got[-1].shape == (CONFIG.vocab_size,)
    for name, a, b in zip(("loss", "weight", "accuracy", "nll", "next logits"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
