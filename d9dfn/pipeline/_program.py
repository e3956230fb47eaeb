"""The vocabulary of pipeline programs: actions, programs, stage placements, and the validity check.

Plain Python on purpose (no torch import): a program is data that the builders produce, ``lower`` rewrites,
``simulate`` times and an executor interprets. The string form of an action is torch's
(``torch.distributed.pipelining.schedules._Action``): ``{stage}{kind}{microbatch}``, e.g. ``0F3``, ``1I0``,
``2SEND_B1``, so programs convert to torch's IR and its ``_validate_schedule`` (``d9dfn/pipeline/_torch_ir.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple, TypeAlias

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Action",
    "ActionKind",
    "Program",
    "loop_placement",
    "parse_action",
    "v_placement",
    "validate",
]

ActionKind: TypeAlias = Literal["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
COMM_KINDS: tuple[ActionKind, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

# Longest alternatives first, so "SEND_F" is not read as a stage followed by garbage.
_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")


class Action(NamedTuple):
    """One step of a rank's program: ``kind`` of ``stage`` on ``microbatch``; prints as torch does (``0F3``).

    Kinds: ``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W`` weight-gradient backward;
    after :func:`~d9dfn.pipeline.lower` also ``SEND_F``/``RECV_F`` (activations, stage s → s+1; the recv is
    named by the receiving stage) and ``SEND_B``/``RECV_B`` (gradients, stage s → s−1).

    >>> Action(2, "SEND_B", 1)
    2SEND_B1
    >>> parse_action("0F3") == Action(0, "F", 3)
    True
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @property
    def is_compute(self) -> bool:
        """True for ``F``, ``B``, ``I`` and ``W``."""
        return self.kind in COMPUTE_KINDS


def parse_action(text: str) -> Action:
    """The action written as ``text`` in torch's notation (``0F3``, ``2SEND_B1``): the inverse of ``str``.

    Raises:
        ValueError: ``text`` is not ``{stage}{kind}{microbatch}`` with one of the eight kinds.
    """
    match = _ACTION_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"parse_action: {text!r} is not an action; write {{stage}}{{kind}}{{microbatch}} with kind one of "
            f"{', '.join(COMPUTE_KINDS + COMM_KINDS)}, e.g. '0F3' or '2SEND_B1'"
        )
    stage, kind, microbatch = match.groups()
    return Action(int(stage), kind, int(microbatch))  # type: ignore[arg-type]


def loop_placement(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % num_ranks`` (GPipe, 1F1B, interleaved, looped BFS, ZB1P).

    >>> loop_placement(2, 2)
    (0, 1, 0, 1)
    """
    return tuple(stage % num_ranks for stage in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank ``r`` holds stages ``r`` and ``2·num_ranks−1−r`` (ZB-V, DualPipeV).

    >>> v_placement(3)
    (0, 1, 2, 2, 1, 0)
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """What every pipeline rank runs, in order: ``ranks[r]`` is rank ``r``'s tuple of actions.

    ``stage_to_rank[s]`` is the rank that holds stage ``s`` (so ``num_stages = len(stage_to_rank)``);
    ``num_microbatches`` is the number of microbatches one step splits the batch into. Construction checks
    only the shape (every action's stage lives on the rank that runs it, indices in range); the dataflow rules
    are :func:`validate`'s.

    >>> prog = Program.from_strings(["0F0 0F1 0B0 0B1"], num_microbatches=2, stage_to_rank=(0,))
    >>> prog.to_strings()
    ('0F0 0F1 0B0 0B1',)
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        num_ranks, num_stages = len(self.ranks), len(self.stage_to_rank)
        if self.num_microbatches < 1:
            raise ValueError(f"Program: num_microbatches={self.num_microbatches} must be at least 1")
        if sorted(set(self.stage_to_rank)) != list(range(num_ranks)):
            raise ValueError(
                f"Program: stage_to_rank={self.stage_to_rank} must place stages on every rank 0..{num_ranks - 1} "
                f"and on no other (the program has {num_ranks} rank rows)"
            )
        for rank, actions in enumerate(self.ranks):
            for step, action in enumerate(actions):
                if not isinstance(action, Action):
                    raise TypeError(f"Program: rank {rank}, step {step} holds {action!r}, not an Action")
                if not (0 <= action.stage < num_stages and 0 <= action.microbatch < self.num_microbatches):
                    raise ValueError(
                        f"Program: rank {rank}, step {step}: {action} is outside {num_stages} stages × "
                        f"{self.num_microbatches} microbatches"
                    )
                if self.stage_to_rank[action.stage] != rank:
                    raise ValueError(
                        f"Program: rank {rank}, step {step}: {action} belongs to stage {action.stage}, which "
                        f"stage_to_rank puts on rank {self.stage_to_rank[action.stage]}"
                    )

    @property
    def num_ranks(self) -> int:
        """The number of pipeline ranks (rows)."""
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """The number of stages over all ranks."""
        return len(self.stage_to_rank)

    @property
    def is_lowered(self) -> bool:
        """True when the program holds send/recv actions (the output of :func:`~d9dfn.pipeline.lower`)."""
        return any(not action.is_compute for actions in self.ranks for action in actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages held by ``rank``, in increasing order."""
        return tuple(stage for stage, owner in enumerate(self.stage_to_rank) if owner == rank)

    def compute_only(self) -> Program:
        """The same program without its send/recv actions."""
        ranks = tuple(tuple(a for a in actions if a.is_compute) for actions in self.ranks)
        return dataclasses.replace(self, ranks=ranks)

    def to_strings(self) -> tuple[str, ...]:
        """One line per rank: its actions in torch's notation, separated by spaces."""
        return tuple(" ".join(map(str, actions)) for actions in self.ranks)

    @classmethod
    def from_strings(
        cls, rows: Sequence[str | Iterable[str]], *, num_microbatches: int, stage_to_rank: Sequence[int]
    ) -> Program:
        """The program whose rank ``r`` runs the actions written in ``rows[r]`` (a string split on spaces and
        commas, as torch's CSV dumps are, or an iterable of action strings)."""
        parsed = []
        for row in rows:
            items = row.replace(",", " ").split() if isinstance(row, str) else list(row)
            parsed.append(tuple(parse_action(item) for item in items))
        return cls(tuple(parsed), num_microbatches, tuple(stage_to_rank))

    def __str__(self) -> str:
        return "\n".join(f"r{rank}: {line}" for rank, line in enumerate(self.to_strings()))


def validate(program: Program) -> None:
    """Check the dataflow rules every program obeys, on compute actions only; raise on the first violation.

    Per stage: every microbatch has exactly one ``F`` and exactly one ``B`` or one ``I`` plus one ``W`` (a
    program with no backward at all is an inference program: one ``F`` each); the
    ``F`` comes before the ``B``/``I`` and the ``I`` before the ``W`` (same rank, so list order is time order).
    Whether the ranks can run together without deadlock is :func:`~d9dfn.pipeline.dry_run`'s question.

    Raises:
        ValueError: naming the rank, the step, the action and the rule it breaks.
    """
    seen: dict[tuple[int, int], list[str]] = {}
    for rank, actions in enumerate(program.ranks):
        for step, action in enumerate(actions):
            if not action.is_compute:
                continue
            key = (action.stage, action.microbatch)
            done = seen.setdefault(key, [])
            need = {"F": (), "B": ("F",), "I": ("F",), "W": ("I",)}[action.kind]
            if action.kind in done or (action.kind in "BI" and ("B" in done or "I" in done)):
                raise ValueError(f"validate: rank {rank}, step {step}: {action} repeats a backward or a forward")
            missing = [kind for kind in need if kind not in done]
            if missing:
                raise ValueError(
                    f"validate: rank {rank}, step {step}: {action} runs before {action.stage}{missing[0]}"
                    f"{action.microbatch}; put that action earlier on rank {rank}"
                )
            done.append(action.kind)
    # A program without any backward is an inference program: one F per (stage, microbatch) is all it needs.
    forward_only = all(kinds == ["F"] for kinds in seen.values())
    allowed = (["F"],) if forward_only else (["B", "F"], ["F", "I", "W"])
    for stage in range(program.num_stages):
        for microbatch in range(program.num_microbatches):
            done = seen.get((stage, microbatch), [])
            if sorted(done) not in allowed:
                raise ValueError(
                    f"validate: stage {stage}, microbatch {microbatch} runs {done or 'nothing'}; every "
                    f"(stage, microbatch) needs one F and then one B, or one F, one I and one W (or, in a "
                    f"forward-only program, one F)"
                )
