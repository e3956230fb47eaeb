"""The task's metric state in a checkpoint: every data-parallel rank's, saved as rows, given back on resume.

Each data-parallel rank accumulates a partial metric state over a logging period (from its rows of every batch);
the loop sums the ranks' states (``metrics.reduce``) only when it logs. A checkpoint taken inside a period must
therefore hold every rank's partial state, or a resumed run logs other ``metrics/*`` values at the end of that
period. At a save, :func:`gather_rank_states` stacks the ranks' states along a new leading dim in data-parallel
rank order (an all-gather: bits move, nothing is added, so nothing is rounded); at a resume, :func:`rank_state`
gives each rank its own row back, or, when another number of ranks saved them, their merge to rank 0 and an empty
state to the others (``docs/design/checkpoints.md``, "Metric states of several ranks").
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from d9dfn._pytree import format_path, tree_flatten_with_path, tree_map, tree_unflatten
from d9dfn._types import PyTree
from d9dfn.checkpoint import AS_SAVED

__all__ = ["METADATA_KEY", "as_saved", "gather_rank_states", "rank_state"]

METADATA_KEY = "metric_state_ranks"
"""The checkpoint metadata's entry for the number of rows (data-parallel ranks) of the saved metric state. Absent
from checkpoints written before per-rank metric states: those hold one state, rank 0's."""


def gather_rank_states(metric_state: PyTree, group: Any) -> PyTree:
    """Every data-parallel rank's ``metric_state`` stacked along a new leading dim: row ``r`` is rank ``r``'s.

    A collective over ``group`` (one all-gather per tensor leaf; every rank gets the same stack); ``None`` (one
    data-parallel rank) gives one row without communicating. Leaves that are not tensors stay as they are.

    >>> gather_rank_states({"total": torch.tensor(3.0)}, None)
    {'total': tensor([3.])}
    """

    def gather(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if group is None:
            return leaf.detach().unsqueeze(0)
        rows = [torch.empty_like(leaf) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(rows, leaf.detach().contiguous(), group=group)
        return torch.stack(rows)

    return tree_map(gather, metric_state)


def as_saved(metric_state: PyTree) -> PyTree:
    """``metric_state`` as a restore template whose tensor leaves come back as saved (``AS_SAVED``): their number
    of rows is that of the run that saved them, which the template cannot know."""
    return tree_map(lambda leaf: AS_SAVED if isinstance(leaf, torch.Tensor) else leaf, metric_state)


def rank_state(
    saved: PyTree, num_rows: int | None, like: PyTree, rank: int, size: int, merge: Any
) -> tuple[PyTree, bool]:
    """This data-parallel rank's metric state from the rows a checkpoint holds.

    With as many rows as data-parallel ranks, rank ``r`` gets row ``r``, bit for bit. Otherwise (a resume on
    another number of ranks) rank 0 gets the merge of every row, in row order, and the other ranks ``like`` (an
    empty state): metric states hold sums, so the ranks' states still add up to the same totals, up to float
    rounding.

    Args:
        saved: the restored metric state in ``like``'s structure; each tensor leaf has ``num_rows`` rows of
            ``like``'s leaf, or is one such leaf when ``num_rows`` is ``None`` (a checkpoint from before per-rank
            states, which holds rank 0's state: one row).
        num_rows: the checkpoint metadata's ``METADATA_KEY``, ``None`` when absent.
        like: this rank's initial metric state: structure, dtypes, shapes and devices.
        rank: this rank's data-parallel rank.
        size: the number of data-parallel ranks.
        merge: the metric's ``merge`` (``Metric.merge``).

    Returns:
        The state, and whether the rows were merged (their number differs from ``size``).

    Raises:
        ValueError: a saved leaf is not ``num_rows`` rows of ``like``'s leaf (dtype, shape); names the leaf.

    >>> from d9dfn.metrics import sum_metric
    >>> m = sum_metric()
    >>> rows = {"total": torch.tensor([[1.0], [2.0]])}  # two ranks' states, one leaf of shape (1,)
    >>> rank_state(rows, 2, {"total": torch.zeros(1)}, rank=1, size=2, merge=m.merge)
    ({'total': tensor([2.])}, False)
    >>> rank_state(rows, 2, {"total": torch.zeros(1)}, rank=0, size=1, merge=m.merge)
    ({'total': tensor([3.])}, True)
    """
    paths, templates, treespec = tree_flatten_with_path(like)
    leaves = tree_flatten_with_path(saved)[1]
    for path, leaf, template in zip(paths, leaves, templates, strict=True):
        if not isinstance(template, torch.Tensor):
            continue
        shape = tuple(template.shape) if num_rows is None else (num_rows, *template.shape)
        if not (isinstance(leaf, torch.Tensor) and leaf.dtype == template.dtype and tuple(leaf.shape) == shape):
            found = f"{leaf.dtype} {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            what = "one state" if num_rows is None else f"{num_rows} data-parallel ranks' states"
            raise ValueError(
                f"Trainer: the checkpoint's metric state leaf {format_path(path)} is {found}, but this task's metrics "
                f"need {template.dtype} {shape} ({what} of shape {tuple(template.shape)}); resume with the task "
                f"(create_metrics) that saved the run, or start a new run under another run.name"
            )

    def row(index: int) -> PyTree:
        return tree_unflatten(
            treespec,
            [
                (leaf if num_rows is None else leaf[index]).to(template.device, copy=True)
                if isinstance(template, torch.Tensor)
                else leaf
                for leaf, template in zip(leaves, templates, strict=True)
            ],
        )

    num_saved = 1 if num_rows is None else num_rows
    if num_saved == size:
        return row(rank), False
    if rank != 0:
        return like, True
    return functools.reduce(merge, [row(index) for index in range(num_saved)]), True


def merge_notice(step: int, num_rows: int | None, size: int) -> str:
    """The line a resume prints when rank 0 continues with the merge of a checkpoint's metric states (``rank_state``
    merged them): saved by an older d9dfn (``num_rows`` None, one state) or with another number of ranks."""
    if num_rows is None:
        return (
            f"d9dfn: checkpoint step {step} holds rank 0's metric state only (saved by a d9dfn from before "
            f"per-rank metric states) and this run has {size} data-parallel ranks: rank 0 continues with it, so "
            "the metrics/* of the logging period in progress miss the other ranks' part of it"
        )
    return (
        f"d9dfn: checkpoint step {step} holds the metric states of {num_rows} data-parallel ranks and this run "
        f"has {size}: rank 0 continues with their merge, so the metrics/* of the logging period in progress "
        "equal an uninterrupted run's up to float rounding"
    )
