"""Context parallelism: each rank of the ``cp`` axis holds a part of every sequence (issue 42).

The context axis (role ``context``, ``d9dfn.parallel.MeshAxes``) is a **token axis**: its ranks take the same rows
of the batch but different positions of each row, so ``Σw``, the loss sums, metric states and the gradients of the
params (whole on every ``cp`` rank) are summed over it, as over a data-parallel axis; the plan needs no rule for it.

**The split** (:func:`split_context`, inverse :func:`unsplit_context`): a sequence of ``T`` positions is cut into
``2·cp`` chunks of ``T / (2·cp)``; rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r`` (head-tail load balancing: a
causal mask gives late queries more keys, and each rank then holds one early and one late chunk, so every rank
computes the same number of query-key pairs; torch's context parallelism and Megatron's use the same order). It
applies to every per-token tensor of a batch (``input_ids``, ``labels``, ``position_ids``); the step then runs on
this rank's part as on a batch of its own, and the task does not change.

**Attention over the sharded sequence** (:func:`gather_context`, :func:`context_mask`): the simplest correct
scheme. Each rank rotates its queries and keys at their global positions, then all-gathers the keys and values along
the sequence (one collective: they travel as one tensor; its adjoint a reduce-scatter, so each rank's keys get the
gradient of every rank's queries), and attends its local queries to all ``T`` keys under the causal mask of the
*global* positions: the local queries are two chunks that are not contiguous, and the gathered keys are in rank
order (chunks ``0, 2cp−1, 1, 2cp−2, …``), so the mask is ``index(key) ≤ index(query)``, not a triangle. Per decoder
block and microbatch: one all-gather forward, one reduce-scatter backward. Ring attention (keys passed around the
ring, partial outputs merged by their log-sum-exp) moves the same bytes without holding all keys; not built yet.

This rank's index comes from one tiny reduce-scatter (:func:`context_rank`), as sequence parallelism's does, so the
same code runs on real ranks, on simulated ones (``LocalTensorMode``) and in a compiled graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from d9dfn.parallel._tensor import _gather, _GatherSequence, group_rank

__all__ = [
    "CONTEXT_KEYS",
    "ContextParallel",
    "check_context_parallel",
    "context_indices",
    "context_mask",
    "context_parallel_of",
    "context_rank",
    "gather_context",
    "gather_documents",
    "split_context",
    "unsplit_context",
]

CONTEXT_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids")
"""The per-token entries of a batch that :func:`split_context` splits along dim 1 (the others pass whole)."""


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context group the decoder's attention gathers its keys and values over: a plain value the compiled step
    holds as a constant.

    Attributes:
        group: the registered name of the context axis's process group (what the functional collectives take).
        size: its number of ranks ``cp``; each holds ``2`` of the ``2·cp`` chunks of every sequence.
    """

    group: str
    size: int


def context_parallel_of(plan: Any) -> ContextParallel | None:
    """The context group of a plan bound to a mesh with a context axis of more than one rank, else ``None``. Resolves
    the group's name: call it when the step is built."""
    from d9dfn.parallel._reduce import group_name

    if plan is None or plan.mesh is None:
        return None
    name = plan.axes.name_of("context")
    if name is None or plan.axes.size_of("context") == 1:
        return None
    return ContextParallel(group_name(plan.mesh.get_group(name), "context_parallel_of"), plan.axes.size_of("context"))


def check_context_parallel(seq_len: int, size: int) -> None:
    """``seq_len`` cut into ``2·size`` equal chunks (head-tail load balancing), else refused in one line.

    >>> check_context_parallel(8, 2)
    >>> check_context_parallel(6, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: mesh.context_parallel_shard=2 cuts each sequence into 4 chunks, and data.seq_len=6 does not ...
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"check_context_parallel: size={size!r}; pass the context axis's number of ranks (>= 1)")
    if seq_len % (2 * size):
        fits = [n for n in range(2 * size, 2 * seq_len, 2 * size) if abs(n - seq_len) < 2 * size]
        raise ValueError(
            f"mesh.context_parallel_shard={size} cuts each sequence into {2 * size} chunks, and data.seq_len={seq_len} "
            f"does not divide by {2 * size}; set --set data.seq_len to a multiple of {2 * size} (e.g. {fits}) or "
            "--set mesh.context_parallel_shard to a degree whose double divides it"
        )


def context_indices(seq_len: int, size: int, rank: int | torch.Tensor, device: Any = None) -> torch.Tensor:
    """The global positions (0 … ``seq_len`` − 1) that rank ``rank`` of ``size`` holds, in its local order: chunk
    ``rank`` then chunk ``2·size − 1 − rank``. ``rank`` may be a 0-d int64 tensor (:func:`context_rank`).

    >>> context_indices(8, 2, 0).tolist(), context_indices(8, 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    check_context_parallel(seq_len, size)
    chunk = seq_len // (2 * size)
    if isinstance(rank, torch.Tensor):
        device = rank.device
    steps = torch.arange(chunk, device=device)
    return torch.cat((rank * chunk + steps, (2 * size - 1 - rank) * chunk + steps))


def _gathered_indices(local_len: int, size: int, device: Any) -> torch.Tensor:
    """(T,): the global position of each key after :func:`gather_context` (every rank's part, in rank order)."""
    seq_len = local_len * size
    return torch.cat([context_indices(seq_len, size, rank, device) for rank in range(size)])


def context_mask(
    query_positions: torch.Tensor,
    size: int,
    query_documents: torch.Tensor | None = None,
    key_documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal mask of this rank's queries against every rank's gathered keys; with packed documents, causal
    within each document only (one process's ``d9dfn.models.document_mask``).

    Args:
        query_positions: (T/cp,) this rank's global positions (:func:`context_indices`).
        size: the context degree ``cp``.
        query_documents: (B | 1, T/cp) this rank's document ids (packed rows), or ``None``.
        key_documents: (B | 1, T) every rank's, gathered (:func:`gather_documents`); given with ``query_documents``.

    Returns:
        (1, 1, T/cp, T) bool (with documents (B | 1, 1, T/cp, T)), true where a query may attend a key
        (``position(key) ≤ position(query)``, and the same document), broadcast over the heads by
        ``scaled_dot_product_attention``.

    >>> context_mask(context_indices(4, 1, 0), 1).int()[0, 0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    keys = _gathered_indices(query_positions.shape[-1], size, query_positions.device)  # (T,)
    causal = (keys.unsqueeze(0) <= query_positions.unsqueeze(-1)).unsqueeze(0).unsqueeze(0)  # (1, 1, T/cp, T)
    if query_documents is None or key_documents is None:
        return causal
    same = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)  # (B, T/cp, 1) == (B, 1, T) -> (B, T/cp, T)
    return causal & same.unsqueeze(1)


def context_rank(cp: ContextParallel, device: torch.device) -> torch.Tensor:
    """This rank's index in the context group as a 0-d int64 tensor (one tiny reduce-scatter: no Python int per
    rank, so it runs on real ranks, simulated ones and in a compiled graph)."""
    return group_rank(cp.group, cp.size, device)


def gather_context(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """(B, T/cp, ...) this rank's positions -> (B, T, ...) every rank's, in rank order (not in position order:
    :func:`context_mask` masks by position); its gradient is reduce-scattered back (each rank's part of the sum over
    the ranks that attended to it)."""
    out: torch.Tensor = _GatherSequence.apply(x, cp.group, cp.size)  # type: ignore[no-untyped-call]
    return out


def gather_documents(document_ids: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """(B | 1, T/cp) this rank's document ids -> (B | 1, T) every rank's, in rank order (the keys' order after
    :func:`gather_context`); integers, so no gradient: one all-gather per microbatch."""
    return _gather(document_ids, cp.group, cp.size)


def _check_tensor(key: str, value: torch.Tensor, size: int) -> None:
    if value.ndim < 2:
        raise ValueError(
            f"split_context: batch[{key!r}] has shape {tuple(value.shape)}; per-token entries are (batch, seq, ...): "
            "add the batch dimension"
        )
    check_context_parallel(int(value.shape[1]), size)


def split_context(batch: Mapping[str, Any], size: int, rank: int, keys: Sequence[str] = CONTEXT_KEYS) -> dict[str, Any]:
    """This rank's part of every sequence of ``batch``: each entry named in ``keys`` (B, T, ...) -> (B, T/cp, ...),
    chunks ``rank`` and ``2·size − 1 − rank`` of ``2·size``; every other entry as it is. Pure: a new dict, the
    inputs untouched.

    Args:
        batch: the step's batch (the rows this data-parallel rank takes).
        size: the context degree ``cp``.
        rank: this rank's index on the context axis, ``0 ≤ rank < size``.
        keys: the per-token entries.

    Raises:
        ValueError: a sequence length ``2·size`` does not divide (naming ``--set data.seq_len`` and
            ``mesh.context_parallel_shard``), a per-token entry without a sequence dimension, or a rank out of range.

    >>> split_context({"input_ids": torch.arange(8).reshape(1, 8), "id": 3}, 2, 1)
    {'input_ids': tensor([[2, 3, 4, 5]]), 'id': 3}
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(
            f"split_context: rank={rank!r}; pass this rank's index on the context axis, 0 <= rank < {size}"
        )
    out = dict(batch)
    for key in keys:
        value = batch.get(key)
        if value is None:
            continue
        _check_tensor(key, value, size)
        out[key] = value.index_select(1, context_indices(int(value.shape[1]), size, rank, value.device))
    return out


def unsplit_context(parts: Sequence[Mapping[str, Any]], keys: Sequence[str] = CONTEXT_KEYS) -> dict[str, Any]:
    """The inverse of :func:`split_context`: every rank's part (``parts[r]`` from rank ``r``) -> the whole batch; the
    entries not in ``keys`` are taken from ``parts[0]``.

    >>> whole = {"input_ids": torch.arange(12).reshape(1, 12)}
    >>> parts = [split_context(whole, 3, rank) for rank in range(3)]
    >>> torch.equal(unsplit_context(parts)["input_ids"], whole["input_ids"])
    True
    """
    if not parts:
        raise ValueError("unsplit_context: no parts; pass every context rank's part, rank 0 first")
    size = len(parts)
    out = dict(parts[0])
    for key in keys:
        if parts[0].get(key) is None:
            continue
        if any(part.get(key) is None for part in parts):
            raise ValueError(f"unsplit_context: batch[{key!r}] is in part 0 but missing in another; pass whole parts")
        values: list[torch.Tensor] = [part[key] for part in parts]
        gathered = torch.cat(values, dim=1)  # (B, T, ...) in rank order
        order = _gathered_indices(int(values[0].shape[1]), size, gathered.device)
        out[key] = gathered.index_select(1, torch.argsort(order))
    return out
