"""Checkpoints across pipeline layouts (issue 13 item 5): each plain leaf is written once, by the lowest rank
holding it, and a rank restores only its own template's leaves, wherever they were written.

A pipeline rank holds only its stages' params and optimizer state (by full name) plus the scalars every rank
shares (step, RNG key, optimizer count, lr). Here the "stages" are two halves of ``full_state``'s params.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import _init, _run_ranks
from test_checkpoint_distributed import AdamLike, assert_restored, full_state
from test_pipeline_distributed import _local_state
from test_pipeline_executor import _contiguous_split, _Regression, _setup

from d9dfn import make_train_step, parallel, pipeline
from d9dfn._pytree import tree_flatten_with_path
from d9dfn.checkpoint import CheckpointStore
from d9dfn.checkpoint import _layout as layout
from d9dfn.loop import init_pipeline_mesh
from d9dfn.testing import assert_trees_close

HALVES = (("w", "emb"), ("norm", "head.bias"))
"""The params of pipeline stage 0 and of stage 1."""


def half(state: dict[str, Any], part: int) -> dict[str, Any]:
    """The state a pipeline rank of stage ``part`` holds: its params and moments, and the shared scalars."""
    adam = state["opt_state"][0]

    def pick(tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tree[name] for name in HALVES[part]}

    return {
        "params": pick(state["params"]),
        "opt_state": (AdamLike(mu=pick(adam.mu), nu=pick(adam.nu), count=adam.count), None),
        "step": state["step"],
        "key": state["key"],
        "lr": state["lr"],
    }


def manifests(step_dir: Path) -> list[dict[str, Any]]:
    count = json.loads((step_dir / "d9dfn" / "metadata").read_text())["num_ranks"]
    return [json.loads((step_dir / f"manifest_{r:05d}" / "metadata").read_text())["leaves"] for r in range(count)]


SHARED = ["lr", "opt_state/0/2", "opt_state/1", "step", "key"]
"""The leaves every rank holds: lr, the optimizer count (a NamedTuple index), the None after it, step, key."""


def test_each_plain_leaf_is_encoded_by_the_lowest_rank_holding_it() -> None:
    state = full_state(3)
    parts = [half(state, 0), half(state, 0), half(state, 1), half(state, 1)]  # pp2 x dp2, pp outermost
    held = [layout.plain_keys(part) for part in parts]
    written = [layout.encode(part, rank, layout.first_holder_keys(held, rank))[1] for rank, part in enumerate(parts)]
    stage0 = [f"params/{n}" for n in HALVES[0]] + [f"opt_state/0/{m}/{n}" for m in (0, 1) for n in HALVES[0]]
    assert set(written[0]) == {*stage0, *SHARED}
    assert written[1] == written[3] == {}
    assert not set(written[0]) & set(written[2])  # every leaf once
    index = layout.index_manifests([{"leaves": leaves} for leaves in written])
    assert set(index) == set(layout.leaf_keys(state))
    # Without ``writes``, rank 0 writes every plain leaf and the others none (the data-parallel rule).
    assert set(layout.encode(parts[2], 0)[1]) == set(layout.leaf_keys(parts[2]))
    assert layout.encode(parts[2], 2)[1] == {}


def _pp_save_worker(rank: int, world_size: int, init_file: str, directory: str, pp: int) -> None:
    """``world_size`` ranks, ``pp`` stages (pp outermost, the rest dp replicas), save step 3 and read it back."""
    dist = _init(rank, world_size, init_file)
    try:
        part = rank // (world_size // pp)
        with CheckpointStore(directory) as store:
            store.save(3, half(full_state(3), part), {"step": 3})
            restored, metadata = store.restore(3, like=half(full_state(0), part))  # strict: the union is all
        assert metadata == {"step": 3}
        assert_restored(restored, half(full_state(3), part), half(full_state(3), part))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_a_pp2_checkpoint_restores_on_one_process(tmp_path: Path) -> None:
    directory = tmp_path / "pp2"
    _run_ranks(_pp_save_worker, 2, tmp_path, str(directory), 2, clean=True)
    written = manifests(directory / "3")
    stage = [{f"params/{n}" for n in names} for names in HALVES]
    assert {k for k in written[0] if k.startswith("params/")} == stage[0]
    assert {k for k in written[1] if k.startswith("params/")} == stage[1]
    assert [k for k in SHARED if k in written[1]] == []  # shared scalars: rank 0 only
    assert not set(written[0]) & set(written[1])
    restored, metadata = CheckpointStore(directory, create=False).restore(3, like=full_state(0))
    assert metadata == {"step": 3}
    assert_restored(restored, full_state(3), full_state(3))  # the union, bit for bit


def _pp_restore_worker(rank: int, world_size: int, init_file: str, directory: str) -> None:
    """Two pipeline ranks read a one-process checkpoint, each with a template of its stage's half."""
    dist = _init(rank, world_size, init_file)
    try:
        store = CheckpointStore(directory, create=False)
        restored, metadata = store.restore(None, like=half(full_state(0), rank))
        assert metadata == {"step": 5}
        assert_restored(restored, half(full_state(5), rank), half(full_state(5), rank))
        # strict: a saved leaf that no rank's template has (both ranks dropped their moments) is refused.
        no_nu = half(full_state(0), rank)
        no_nu["opt_state"] = (no_nu["opt_state"][0]._replace(nu={}), None)
        with pytest.raises(ValueError, match=r"checkpoint has \['opt_state/0/1/emb'.*that no rank's template has"):
            store.restore(None, like=no_nu)
        restored, _ = store.restore(None, like=no_nu, strict=False)
        assert restored["opt_state"][0].nu == {}
        # A template leaf the checkpoint lacks names its key path (here on rank 1 only; every rank fails).
        extra = half(full_state(0), rank)
        if rank == 1:
            extra["params"]["lm_head"] = torch.zeros(2)
        with pytest.raises(
            ValueError, match=r"template has \[\"\['params'\]\['lm_head'\]\"\]" + ("" if rank == 1 else ".*rank 1")
        ):
            store.restore(None, like=extra)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_a_one_process_checkpoint_restores_on_pp2_ranks(tmp_path: Path) -> None:
    directory = tmp_path / "single"
    with CheckpointStore(directory) as store:
        store.save(5, full_state(5), {"step": 5})
    _run_ranks(_pp_restore_worker, 2, tmp_path, str(directory), clean=True)


@pytest.mark.slow
@pytest.mark.ranks
def test_a_pp2_dp2_checkpoint_writes_each_leaf_once_and_restores_on_one_process(tmp_path: Path) -> None:
    directory = tmp_path / "pp2dp2"
    _run_ranks(_pp_save_worker, 4, tmp_path, str(directory), 2, clean=True)
    step_dir = directory / "3"
    written = manifests(step_dir)
    assert written[1] == written[3] == {}  # the dp replicas write nothing
    assert not set(written[0]) & set(written[2])
    assert set(written[0]) | set(written[2]) == set(layout.leaf_keys(full_state(3)))
    assert sorted(p.name for p in step_dir.iterdir() if p.name.startswith("rank_")) == ["rank_00000", "rank_00002"]
    restored, _ = CheckpointStore(directory, create=False).restore(3, like=full_state(0))
    assert_restored(restored, full_state(3), full_state(3))


def third_batch(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Step 3's batch: one not seen before."""
    return {key: value.flip(0) for key, value in batches[0].items()}


def flat(tree: Any) -> dict[str, Any]:
    """``tree``'s leaves by checkpoint key."""
    return dict(zip(layout.leaf_keys(tree), tree_flatten_with_path(tree)[1], strict=True))


def _pp_train_worker(rank: int, world_size: int, init_file: str, directory: str) -> None:
    """Two pipeline ranks (one stage each) train two steps of the pipeline tests' model and save step 2."""
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_pipeline_mesh(2, 1, device_type="cpu")
        model, opt, state, batches = _setup(2, 5, norm=True, dropout=0.25)
        stages = pipeline.split_stages(model, _contiguous_split(2, 2))
        ranked = pipeline.PipelineRank(
            pipeline.SCHEDULES["one_f_one_b"](2, 1, 2),
            stages,
            parallel.pipeline_rank(mesh),
            parallel.pipeline_group(mesh),
        )
        step = make_train_step(
            model, _Regression(), opt, num_microbatches=2, executor=ranked, rng_kwarg="dropout_key", compile=False
        )
        local = _local_state(state, opt, ranked.local_stages)
        for batch in batches:
            local, _ = step(local, batch)
        with CheckpointStore(directory) as store:
            store.save(2, local, {"step": 2})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_training_saved_with_pp2_continues_on_one_process_identically(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    _run_ranks(_pp_train_worker, 2, tmp_path, str(directory), clean=True, timeout_s=170)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (_init): the same kernels' summation order, for bitwise equality
    try:
        _continue_on_one_process(directory)
    finally:
        torch.set_num_threads(threads)


def _continue_on_one_process(directory: Path) -> None:
    """Restore the pp=2 step 2 into the whole model's state and run step 3: as the uninterrupted run, bitwise."""
    model, opt, initial, batches = _setup(2, 5, norm=True, dropout=0.25)
    step = make_train_step(model, _Regression(), opt, num_microbatches=2, rng_kwarg="dropout_key", compile=False)
    uninterrupted = initial
    for batch in batches:  # the uninterrupted one-process run: steps 1 and 2
        uninterrupted, _ = step(uninterrupted, batch)
    resumed, metadata = CheckpointStore(directory, create=False).restore(None, like=initial)
    assert metadata == {"step": 2}
    assert_trees_close(resumed, uninterrupted, rtol=0, atol=0)  # the pp=2 run equals the one-process run, bitwise
    third = third_batch(batches)
    expected, want = step(uninterrupted, third)
    got_state, got = step(resumed, third)
    assert_trees_close(got_state, expected, rtol=0, atol=0)
    assert_trees_close(got.loss, want.loss, rtol=0, atol=0)


def _pp_resume_worker(rank: int, world_size: int, init_file: str, directory: str) -> None:
    """Two pipeline ranks resume a one-process step 2, each with its stage's template, and run step 3."""
    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_pipeline_mesh(2, 1, device_type="cpu")
        model, opt, state, batches = _setup(2, 5, norm=True, dropout=0.25)
        stages = pipeline.split_stages(model, _contiguous_split(2, 2))
        ranked = pipeline.PipelineRank(
            pipeline.SCHEDULES["one_f_one_b"](2, 1, 2),
            stages,
            parallel.pipeline_rank(mesh),
            parallel.pipeline_group(mesh),
        )
        options = {"num_microbatches": 2, "rng_kwarg": "dropout_key", "compile": False}
        step = make_train_step(model, _Regression(), opt, executor=ranked, **options)
        reference = make_train_step(model, _Regression(), opt, **options)
        expected = state
        for batch in [*batches, third_batch(batches)]:  # the uninterrupted one-process run, steps 1-3
            expected, want = reference(expected, batch)
        resumed, metadata = CheckpointStore(directory, create=False).restore(
            None, like=_local_state(state, opt, ranked.local_stages)
        )
        assert metadata == {"step": 2}
        local, got = step(resumed, third_batch(batches))
        assert_trees_close(got.loss, want.loss, rtol=0, atol=0)
        whole = flat(expected)
        mine = flat(local)
        assert {k for k in mine if k.startswith("params/")} == {f"params/{n}" for n in resumed.params}
        for key, leaf in mine.items():  # params, buffers, optimizer state, step, rng, ...: bitwise
            assert_trees_close(leaf, whole[key], rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_training_saved_on_one_process_continues_on_pp2_ranks_identically(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (_init)
    try:
        model, opt, state, batches = _setup(2, 5, norm=True, dropout=0.25)
        step = make_train_step(model, _Regression(), opt, num_microbatches=2, rng_kwarg="dropout_key", compile=False)
        for batch in batches:
            state, _ = step(state, batch)
    finally:
        torch.set_num_threads(threads)
    with CheckpointStore(directory) as store:
        store.save(2, state, {"step": 2})
    _run_ranks(_pp_resume_worker, 2, tmp_path, str(directory), clean=True, timeout_s=170)
