"""Lowering a compute program to one with sends and receives, and a lock-step dry run that proves it cannot hang.

``lower`` is torch's and d9d's sender-inserts-receive pass (torch ``schedules._add_send_recv``, d9d
``add_communication_ops``): ranks take turns in lock-step rounds; a rank appends its next compute action once
that action's input is there (an earlier receive, or the neighbouring stage's action on the same rank), and
with it the ``SEND`` on its own row and the matching ``RECV`` at the end of the receiver's row. A send and its
receive are therefore appended at the same moment of one global order, which is why the result cannot hang
even when sends block until received (see :func:`dry_run`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from typing import NamedTuple

from d9dfn.pipeline._program import Action, Program, validate

__all__ = ["DryRun", "dry_run", "lower"]


def _input_of(program: Program, action: Action) -> Action | None:
    """What must have happened on ``action``'s own rank before it can start, beyond its own stage's actions:
    the neighbouring stage's action (same rank) or the receive of its input (other rank); ``None`` if nothing."""
    stage, mb, last = action.stage, action.microbatch, program.num_stages - 1
    if action.kind == "F" and stage > 0:
        if program.stage_to_rank[stage - 1] == program.stage_to_rank[stage]:
            return Action(stage - 1, "F", mb)
        return Action(stage, "RECV_F", mb)
    if action.kind in ("B", "I") and stage < last:
        if program.stage_to_rank[stage + 1] == program.stage_to_rank[stage]:
            return Action(stage + 1, "B", mb)  # or its I: see _done
        return Action(stage, "RECV_B", mb)
    return None


def _done(need: Action, done: set[Action]) -> bool:
    # A full backward of the neighbour is satisfied by its input-gradient half too.
    return need in done or (need.kind == "B" and need._replace(kind="I") in done)


def _comm(program: Program, action: Action) -> tuple[Action, Action, int] | None:
    """The ``(send, recv, receiving rank)`` that ``action``'s output needs, or ``None`` (same rank, or no output)."""
    stage, mb = action.stage, action.microbatch
    if action.kind == "F" and stage < program.num_stages - 1:
        peer = stage + 1
        pair = Action(stage, "SEND_F", mb), Action(peer, "RECV_F", mb)
    elif action.kind in ("B", "I") and stage > 0:
        peer = stage - 1
        pair = Action(stage, "SEND_B", mb), Action(peer, "RECV_B", mb)
    else:
        return None
    if program.stage_to_rank[peer] == program.stage_to_rank[stage]:
        return None
    return (*pair, program.stage_to_rank[peer])


def lower(program: Program) -> Program:
    """``program`` with a ``SEND`` after every action whose output goes to another rank and the matching ``RECV``
    on that rank, ordered so that the ranks cannot deadlock (:func:`dry_run` checks it).

    Activations go from stage ``s`` to ``s+1`` after ``F``, gradients from ``s`` to ``s−1`` after ``B`` or ``I``;
    neighbouring stages on one rank (the V placement's turn) exchange nothing.

    Raises:
        ValueError: ``program`` is already lowered, breaks :func:`~d9dfn.pipeline.validate`'s rules, or its
            ranks wait on each other in a cycle (named in the message).

    >>> from d9dfn.pipeline import gpipe
    >>> print(lower(gpipe(2, 1, 1)))
    r0: 0F0 0SEND_F0 0RECV_B0 0B0
    r1: 1RECV_F0 1F0 1B0 1SEND_B0
    """
    if program.is_lowered:
        raise ValueError("lower: the program already holds sends and receives; lower its compute_only() instead")
    validate(program)
    queues = [deque(actions) for actions in program.ranks]
    rows: list[list[Action]] = [[] for _ in program.ranks]
    done: list[set[Action]] = [set() for _ in program.ranks]
    while any(queues):
        progress = False
        for rank, queue in enumerate(queues):
            if not queue:
                continue
            need = _input_of(program, queue[0])
            if need is not None and not _done(need, done[rank]):
                continue
            action = queue.popleft()
            rows[rank].append(action)
            done[rank].add(action)
            if (comm := _comm(program, action)) is not None:
                send, recv, peer = comm
                rows[rank].append(send)
                rows[peer].append(recv)
                done[peer].add(recv)
            progress = True
        if not progress:
            waits = "; ".join(
                f"rank {rank} at {queue[0]} waits for {_input_of(program, queue[0])}"
                for rank, queue in enumerate(queues)
                if queue
            )
            raise ValueError(
                f"lower: the ranks wait on each other in a cycle ({waits}); reorder the program so that every "
                f"rank's next action can get its input"
            )
    return dataclasses.replace(program, ranks=tuple(tuple(row) for row in rows))


class DryRun(NamedTuple):
    """The lock-step run of a lowered program: ``steps[r][t]`` is what rank ``r`` did in round ``t``
    (``None`` = waited)."""

    num_rounds: int
    steps: tuple[tuple[Action | None, ...], ...]


def _peer(program: Program, action: Action) -> int:
    # The rank on the other end of a send or receive.
    offset = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}[action.kind]
    return program.stage_to_rank[action.stage + offset]


def dry_run(program: Program) -> DryRun:
    """Run ``program`` (lowered first if it is not) on every rank in lock-step rounds without computing anything,
    and raise if the ranks deadlock.

    In each round every rank tries its next action, with the state at the start of the round: a compute action
    runs once its input is on the rank (the receive, or the neighbouring stage's action on the same rank) and
    its own stage's earlier actions ran; a ``SEND`` is **blocking**: it runs only in the round its peer's next
    action is the matching ``RECV`` (pairs match first-in first-out per (sender, receiver)), and both run. That is
    stricter than torch's runtime (buffered ``isend``, ``irecv`` waited at the consumer), so a program that passes
    here cannot hang there either.

    Raises:
        ValueError: a round in which no rank can move (each rank's next action and what it waits for; a send or
            receive without its partner ends this way), or a ``SEND`` that meets a different ``RECV`` than its own.

    >>> from d9dfn.pipeline import one_f_one_b
    >>> dry_run(one_f_one_b(2, 1, 2)).num_rounds
    10
    """
    if not program.is_lowered:
        program = lower(program)
    pointers = [0] * program.num_ranks
    done: list[set[Action]] = [set() for _ in program.ranks]
    steps: list[list[Action | None]] = [[] for _ in program.ranks]
    sent: defaultdict[tuple[int, int], int] = defaultdict(int)  # (src, dst) -> sends matched so far

    def head(rank: int) -> Action | None:
        actions = program.ranks[rank]
        return actions[pointers[rank]] if pointers[rank] < len(actions) else None

    def blocker(rank: int, action: Action) -> str | None:
        """Why ``action`` cannot run on ``rank`` now (``None``: it can)."""
        own = {"F": None, "B": "F", "I": "F", "W": "I", "SEND_F": "F", "SEND_B": "B"}.get(action.kind)
        if own is not None and not _done(action._replace(kind=own), done[rank]):  # type: ignore[arg-type]
            return f"its own {action.stage}{own}{action.microbatch}"
        if action.is_compute:
            need = _input_of(program, action)
            return None if need is None or _done(need, done[rank]) else f"{need}"
        if action.kind.startswith("SEND"):
            peer = _peer(program, action)
            recv = head(peer)
            if recv is None or not recv.kind.startswith("RECV") or _peer(program, recv) != rank:
                return f"rank {peer} to post the receive (its next action is {recv})"
            forward = action.kind == "SEND_F"
            expected = Action(
                action.stage + (1 if forward else -1), "RECV_F" if forward else "RECV_B", action.microbatch
            )
            if recv != expected:
                raise ValueError(
                    f"dry_run: rank {rank}'s send number {sent[rank, peer]} to rank {peer} is {action}, but rank "
                    f"{peer}'s matching receive is {recv}; sends and receives between two ranks must be in the "
                    f"same order"
                )
            return None
        return f"rank {_peer(program, action)} to send"  # a RECV moves only with its SEND

    num_rounds = 0
    while any(head(rank) is not None for rank in range(program.num_ranks)):
        moves: list[int] = []
        for rank in range(program.num_ranks):
            action = head(rank)
            if action is None or action.kind.startswith("RECV"):
                continue
            if blocker(rank, action) is None:
                moves.append(rank)
                if action.kind.startswith("SEND"):
                    peer = _peer(program, action)
                    moves.append(peer)
                    sent[rank, peer] += 1
        if not moves:
            waits = "; ".join(
                f"rank {rank} at {action} waits for {blocker(rank, action)}"
                for rank in range(program.num_ranks)
                if (action := head(rank)) is not None
            )
            raise ValueError(f"dry_run: deadlock after {num_rounds} rounds: {waits}")
        for rank in range(program.num_ranks):
            if rank in moves:
                action = head(rank)
                assert action is not None
                done[rank].add(action)
                pointers[rank] += 1
                steps[rank].append(action)
            else:
                steps[rank].append(None)
        num_rounds += 1
    return DryRun(num_rounds, tuple(tuple(row) for row in steps))
