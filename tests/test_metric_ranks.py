"""Every data-parallel rank's metric state in checkpoints (``d9dfn/loop/_metric_ranks.py``): saved as rows, given back.

The 2-rank resume itself (byte-identical ``metrics.jsonl`` from a step inside a logging period, and the merge on
one process) is in ``tests/test_train_distributed.py``
(``test_torchrun_resume_inside_a_logging_period_logs_byte_identical_metrics``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_train import tiny_job

from d9dfn.checkpoint import CheckpointStore
from d9dfn.jobs import train_lm
from d9dfn.loop._metric_ranks import METADATA_KEY, gather_rank_states, rank_state
from d9dfn.metrics._base import add_states


def _like() -> dict:
    """An empty metric state of two leaves, of two dtypes (integers: sums are exact in any order)."""
    return {"count": torch.zeros((), dtype=torch.int64), "hist": torch.zeros(3, dtype=torch.int32)}


def _rows(num_rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "count": torch.randint(0, 100, (num_rows,), generator=gen),
        "hist": torch.randint(0, 100, (num_rows, 3), generator=gen, dtype=torch.int32),
    }


@given(st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**16))
def test_rank_state_gives_each_rank_its_row_or_merges_them_on_rank_0(num_rows: int, size: int, seed: int) -> None:
    saved = _rows(num_rows, seed)
    states = [rank_state(saved, num_rows, _like(), rank=r, size=size, merge=add_states) for r in range(size)]
    assert all(merged == (num_rows != size) for _, merged in states)
    if num_rows == size:  # the same number of ranks: each its own row, bit for bit
        for r, (state, _) in enumerate(states):
            assert all(torch.equal(state[k], saved[k][r]) and state[k].dtype == saved[k].dtype for k in saved)
    else:  # another number: rank 0 holds the merge of every row, the others an empty state
        assert all(torch.equal(states[0][0][k], saved[k].sum(0, dtype=saved[k].dtype)) for k in saved)
        assert all(not state[k].any() for state, _ in states[1:] for k in saved)
    # Whichever way, the ranks' states add up to the saved ones' total: what the loop logs at the period's end.
    for key in saved:
        assert torch.equal(sum(state[key] for state, _ in states), saved[key].sum(0))


def test_rank_state_of_a_checkpoint_from_before_per_rank_states_is_one_row() -> None:
    old = {"count": torch.tensor(7), "hist": torch.tensor([1, 2, 3], dtype=torch.int32)}  # rank 0's state, as saved
    state, merged = rank_state(old, None, _like(), rank=0, size=1, merge=add_states)
    assert not merged
    assert state["count"].item() == 7
    assert state["hist"].tolist() == [1, 2, 3]
    other, merged = rank_state(old, None, _like(), rank=1, size=2, merge=add_states)  # on 2 ranks: rank 0's alone
    assert merged
    assert not any(leaf.any() for leaf in other.values())


def test_rank_state_names_a_leaf_that_does_not_fit() -> None:
    saved = _rows(2, 0)
    saved["hist"] = saved["hist"][:, :2]
    with pytest.raises(
        ValueError,
        match=r"metric state leaf \['hist'\] is torch.int32 \(2, 2\), but this task's .*"
        r"need torch.int32 \(2, 3\) \(2 data-parallel ranks' states of shape \(3,\)\); resume with",
    ):
        rank_state(saved, 2, _like(), rank=0, size=2, merge=add_states)


def test_gather_rank_states_on_one_process_is_one_row_of_the_same_bits() -> None:
    state = {"total": torch.tensor([0.1, -0.0]), "n": 3}
    rows = gather_rank_states(state, None)
    assert rows["n"] == 3
    assert rows["total"].shape == (1, 2)
    assert torch.equal(rows["total"][0].view(torch.int32), state["total"].view(torch.int32))


def test_a_checkpoint_from_before_per_rank_metric_states_resumes_byte_identically(tmp_path: Path) -> None:
    """One process, a checkpoint at step 3 inside the logging period 1-4, rewritten as a d9dfn from before this
    change wrote it (the metric state unstacked, no ``metric_state_ranks``): the resume logs the same bytes."""
    job = tiny_job(
        tmp_path,
        "trainer.total_steps=6",
        "trainer.logging.period_steps=4",
        "trainer.checkpointing.period_steps=3",
        "eval_batches=1",
        "sample.num_bytes=0",
    )
    run_dir = train_lm(job).run_dir
    uninterrupted = (run_dir / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in map(json.loads, uninterrupted.splitlines()) if "metrics/accuracy" in r] == [4, 6]
    checkpoints = run_dir / "checkpoints"
    with CheckpointStore(checkpoints, create=False) as store:
        flat, metadata = store.restore(3)
    assert metadata.pop(METADATA_KEY) == 1
    stacked = {key: leaf for key, leaf in flat.items() if key.startswith("metric_state/")}
    assert stacked
    assert all(leaf.shape[0] == 1 for leaf in stacked.values())
    shutil.rmtree(checkpoints)
    with CheckpointStore(checkpoints) as store:
        store.save(3, {**flat, **{key: leaf[0] for key, leaf in stacked.items()}}, metadata)
    train_lm(job)
    assert (run_dir / "metrics.jsonl").read_bytes() == uninterrupted
