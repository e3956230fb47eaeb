"""The one bridge to torch's pipeline IR (``torch.distributed.pipelining.schedules._Action``), a private API.

Imported lazily inside the two functions, so ``import d9dfn.pipeline`` does not load
``torch.distributed.pipelining``. Pinned by ``tests/test_pipeline_program.py``, which runs torch's
``_validate_schedule`` on converted programs and converts torch's own programs back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from d9dfn.pipeline._program import Action, Program, parse_action

__all__ = ["from_torch", "to_torch"]

_FSDP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")


def to_torch(program: Program) -> dict[int, list[Any]]:
    """``program`` as torch's ``pipeline_order``: ``{rank: [_Action, ...]}`` (send/recv included if lowered).

    >>> from d9dfn.pipeline import one_f_one_b
    >>> to_torch(one_f_one_b(2, 1, 1))
    {0: [0F0, 0B0], 1: [1F0, 1B0]}
    """
    from torch.distributed.pipelining.schedules import _Action

    return {rank: [_Action.from_str(str(action)) for action in actions] for rank, actions in enumerate(program.ranks)}


def from_torch(
    pipeline_order: Mapping[int, Sequence[Any]],
    num_microbatches: int,
    stage_to_rank: Sequence[int] | None = None,
) -> Program:
    """The program of torch's ``pipeline_order`` (what ``get_schedule_ops`` or a schedule's ``pipeline_order``
    gives): idle ``None`` slots are dropped and an ``OVERLAP_F_B`` pair becomes its actions in order, which is how
    torch's runtime runs it; torch's FSDP actions (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) are dropped, since
    a program is dataflow and the step's tail owns the gradient reduction. ``stage_to_rank`` defaults to the rank
    each stage's actions sit on.
    """
    rows: list[tuple[Action, ...]] = []
    for rank in range(len(pipeline_order)):
        row: list[Action] = []
        for item in pipeline_order[rank]:
            if item is None:
                continue
            for sub in item.sub_actions if item.sub_actions is not None else (item,):
                if sub.computation_type.value not in _FSDP_KINDS:
                    row.append(parse_action(str(sub)))
        rows.append(tuple(row))
    if stage_to_rank is None:
        owner = {a.stage: rank for rank, row in enumerate(rows) for a in row}
        stage_to_rank = [owner[stage] for stage in range(max(owner) + 1)]
    return Program(tuple(rows), num_microbatches, tuple(stage_to_rank))
