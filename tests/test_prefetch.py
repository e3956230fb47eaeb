"""Prefetch of the per-block all-gathers (``make_train_step(prefetch_gathers=True)``, ``d9dfn.parallel._prefetch``).

The graph pass on hand-built graphs (where each gather goes, what stays put), the refusals, and the sharded step
on 2 gloo ranks: the same results as without prefetch (bitwise under ``aot_eager``: the same ops, issued in another
order, with the gathers of the forward and the backward graphs moved) and as one process (to rounding; under inductor
too, which fuses the inlined blocks otherwise than their regions).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from _ranks import _init, _run_ranks
from hypothesis import given
from hypothesis import strategies as st

import d9dfn
from d9dfn import optim, parallel
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.parallel import _prefetch
from d9dfn.parallel._prefetch import prefetch_gathers
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

_C10D, _ATEN = torch.ops._c10d_functional, torch.ops.aten


def _compute(x: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    return _ATEN.sin.default(_ATEN.mul.Tensor(x, _ATEN.sum.default(full)))


def _blocks(buckets: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Three blocks as AOTAutograd's graphs hold them: each gathers its bucket (cast first), waits, computes."""
    for bucket in buckets:
        gathered = _C10D.all_gather_into_tensor.default(_ATEN._to_copy.default(bucket, dtype=torch.bfloat16), 2, "0")
        x = _compute(x, _C10D.wait_tensor.default(gathered))
    return x


def _traced(fn: Any) -> torch.fx.GraphModule:
    def three(b0: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return fn([b0, b1, b2], x)

    return torch.fx.symbolic_trace(three)


def _order(graph: torch.fx.Graph) -> list[str]:
    names = {"all_gather_into_tensor": "gather", "wait_tensor": "wait", "sin": "compute"}
    kept = []
    for node in graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in names:
            kept.append(names[name])
    return kept


def test_each_gather_moves_to_just_after_the_previous_wait_with_its_cast() -> None:
    gm = _traced(_blocks)
    assert _order(gm.graph) == ["gather", "wait", "compute"] * 3
    assert prefetch_gathers(gm.graph) == 2
    gm.graph.lint()
    # block k+1's gather is issued once block k's has arrived, before block k computes: one block ahead
    assert _order(gm.graph) == ["gather", "wait", "gather", "compute", "wait", "gather", "compute", "wait", "compute"]
    casts = [n for n in gm.graph.nodes if n.target is _ATEN._to_copy.default]
    assert len(casts) == 3
    for cast in casts:  # each cast still right before the gather that reads it
        assert next(iter(cast.users)).target is _C10D.all_gather_into_tensor.default
        assert cast.next.target is _C10D.all_gather_into_tensor.default
    assert prefetch_gathers(gm.graph) == 0  # already one block ahead: nothing moves again


def test_a_gather_whose_input_needs_an_impure_op_stays_where_it_is() -> None:
    def blocks(buckets: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for index, bucket in enumerate(buckets):
            sent = _ATEN.add_.Tensor(_ATEN.clone.default(bucket), 1.0) if index == 1 else bucket  # a mutation
            x = _compute(x, _C10D.wait_tensor.default(_C10D.all_gather_into_tensor.default(sent, 2, "0")))
        return x

    gm = _traced(blocks)
    assert prefetch_gathers(gm.graph) == 1  # the third moves; the second needs add_ first
    assert _order(gm.graph) == ["gather", "wait", "compute", "gather", "wait", "gather", "compute", "wait", "compute"]


@given(impure=st.lists(st.booleans(), min_size=1, max_size=6))
def test_the_pass_keeps_a_valid_graph_and_the_gathers_order(impure: list[bool]) -> None:
    """Any number of blocks, any of them with a mutation before its gather: the graph stays valid, every node stays,
    the all-gathers keep their order (every rank issues them alike), and each gather that moved sits, with its cast,
    right after the wait of the one before."""

    def blocks(buckets: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for bucket, mutated in zip(buckets, impure, strict=True):
            sent = _ATEN.add_.Tensor(_ATEN.clone.default(bucket), 1.0) if mutated else bucket
            sent = _ATEN._to_copy.default(sent, dtype=torch.bfloat16)
            x = _compute(x, _C10D.wait_tensor.default(_C10D.all_gather_into_tensor.default(sent, 2, "0")))
        return x

    names = [f"b{i}" for i in range(len(impure))]
    namespace: dict[str, Any] = {"blocks": blocks}
    exec(f"def many({', '.join(names)}, x):\n    return blocks([{', '.join(names)}], x)", namespace)
    gm = torch.fx.symbolic_trace(namespace["many"])
    before = list(gm.graph.nodes)
    gathers = [n for n in before if n.target is _C10D.all_gather_into_tensor.default]
    moved = prefetch_gathers(gm.graph)
    gm.graph.lint()
    after = list(gm.graph.nodes)
    assert set(after) == set(before)
    assert [n for n in after if n.target is _C10D.all_gather_into_tensor.default] == gathers
    assert moved == sum(not mutated for mutated in impure[1:])
    for previous, gather, mutated in zip(gathers, gathers[1:], impure[1:], strict=False):
        if not mutated:
            [wait] = previous.users
            assert wait.next.target is _ATEN._to_copy.default
            assert wait.next.next is gather


def test_prefetch_is_refused_where_it_would_do_nothing() -> None:
    model, task, opt = Qwen3LM(Qwen3Config.tiny(num_layers=2)), CausalLMTask(), optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"prefetch_gathers .* no repeated blocks .* prefetch_gathers=False"):
        d9dfn.make_train_step(model, task, opt, prefetch_gathers=True, repeated_blocks=(), compile="aot_eager")
    with pytest.raises(ValueError, match=r"prefetch_gathers .* backend None .* 'inductor' or 'aot_eager'"):
        d9dfn.make_train_step(model, task, opt, prefetch_gathers=True, repeated_blocks="auto", compile=False)
    # Refused when the step is built: its plan (none here: plain params) gathers no param per block.
    with pytest.raises(
        ValueError, match=r"prefetch_gathers .* no param is gathered per block .*data_parallel_shard > 1"
    ):
        d9dfn.make_train_step(model, task, opt, prefetch_gathers=True, repeated_blocks="auto", compile="aot_eager")


CONFIG = Qwen3Config.tiny(num_layers=4, tie_word_embeddings=False, hidden_size=16, head_dim=4, intermediate_size=24)
ROWS, SEQ = 4, 6


def _prefetch_worker(rank: int, world_size: int, init_file: str, cases: list) -> None:
    dist = _init(rank, world_size, init_file)
    moved: list[int] = []
    spied = _prefetch.prefetch_gathers

    def spy(graph: torch.fx.Graph) -> int:
        moved.append(spied(graph))
        return moved[-1]

    _prefetch.prefetch_gathers = spy  # type: ignore[assignment]
    try:
        from d9dfn.loop import init_data_parallel_mesh

        mesh = init_data_parallel_mesh(1, world_size, device_type="cpu")
        torch.manual_seed(0)
        model, task, opt = Qwen3LM(CONFIG), CausalLMTask(), optim.adamw(0.02, eps=1e-3)
        reference = d9dfn.make_train_step(model, task, opt, num_microbatches=2 * world_size, compile=False)
        for backend, policy in cases:
            options: dict[str, Any] = {
                "num_microbatches": 2,
                "repeated_blocks": "auto",
                "activation_checkpointing": None if policy is None else d9dfn.step.ActivationCheckpointing(policy),
                "plan": parallel.plan_for(model, mesh),
                "compile": backend,
            }
            # aot_eager: against the same step without prefetch, bitwise (the same ops, issued in another order),
            # and the pass seen moving the gathers. Inductor fuses the inlined blocks otherwise than their regions,
            # and may take its graphs from its cache (past the spy): there, the one-process step to rounding.
            plain = d9dfn.make_train_step(model, task, opt, **options) if backend == "aot_eager" else None
            early = d9dfn.make_train_step(model, task, opt, prefetch_gathers=True, **options)
            expected = d9dfn.init_train_state(model, opt, task=task)
            a = b = d9dfn.init_train_state(model, opt, task=task, mesh=mesh)
            gen = torch.Generator().manual_seed(3)
            moved.clear()
            for _ in range(2):
                tokens = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=gen)
                batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
                mine = {key: value[rank * 2 : (rank + 1) * 2] for key, value in batch.items()}
                expected, want = reference(expected, batch)
                b, out_b = early(b, mine)
                for field in ("loss", "loss_weight", "grad_norm"):
                    assert_trees_close(getattr(out_b, field), getattr(want, field), rtol=1e-5, atol=1e-5)
                if plain is not None:
                    a, out_a = plain(a, mine)
                    for field in ("loss", "loss_weight", "grad_norm"):
                        assert_trees_close(getattr(out_b, field), getattr(out_a, field), rtol=0, atol=0)
            assert_trees_close(parallel.full_tensors(b.params), expected.params, rtol=1e-5, atol=1e-5)
            if plain is not None:
                assert_trees_close(b.params, a.params, rtol=0, atol=0)  # DTensor shards, bitwise
                # the forward and the backward graph each had the gathers of 4 blocks: 3 moved in each
                assert sorted(moved) == [3, 3], (backend, policy, moved)
    finally:
        _prefetch.prefetch_gathers = spied  # type: ignore[assignment]
        dist.destroy_process_group()


@pytest.mark.slow  # one case per test, so that xdist spreads the three (together 277 s in one CI run)
@pytest.mark.parametrize(
    ("backend", "policy"),
    [("aot_eager", None), ("aot_eager", "full"), ("inductor", None)],
    ids=["aot", "aot-ac", "ind"],
)
@pytest.mark.ranks
def test_prefetched_gathers_train_like_the_step_without_them(tmp_path: Any, backend: str, policy: str | None) -> None:
    _run_ranks(_prefetch_worker, 2, tmp_path, [(backend, policy)], timeout_s=900, clean=True)


def test_inductor_gets_the_pass_as_its_post_grad_pass() -> None:
    backend, options = _prefetch.prefetching_backend("inductor")
    assert backend == "inductor"
    graph_pass = options["post_grad_custom_post_pass"]
    gm = _traced(_blocks)
    graph_pass(gm.graph)
    assert _order(gm.graph) == ["gather", "wait", "gather", "compute", "wait", "gather", "compute", "wait", "compute"]
    assert graph_pass.uuid() == _prefetch.prefetching_backend("inductor")[1]["post_grad_custom_post_pass"].uuid()
    with pytest.raises(ValueError, match=r"backend='eager'; prefetch runs with inductor or aot_eager"):
        _prefetch.prefetching_backend("eager")


def test_trainer_prefetch_gathers_reaches_the_step(tmp_path, capsys):
    from test_train import tiny_job

    from d9dfn.cli import main

    config = tmp_path / "job.json"
    config.write_text(tiny_job(tmp_path / "refused", "trainer.compile=false").model_dump_json())
    assert main(["train", str(config), "--set", "trainer.prefetch_gathers=true"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("d9dfn: error: ")
    assert "make_train_step: prefetch_gathers " in line
    assert line.endswith("pass prefetch_gathers=False")
