"""Vocabulary parallelism: the embedding, the LM head and the cross-entropy split over the tensor axis by vocabulary
rows, the logits never gathered (Megatron's ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``,
Shoeybi et al. 2019 §3).

Under :data:`~d9dfn.parallel.VOCAB_PARALLEL_RULES` the embedding's and the LM head's weights (``(V, D)``) are split
``S(0)`` over the ``n`` tensor ranks: rank ``r`` holds ids ``[r·V/n, (r+1)·V/n)``. Then, per microbatch:

* the embedding (:func:`vocab_parallel_embedding`): each rank looks up the ids in its range (zeros elsewhere) and the
  parts are summed over the group (an all-reduce; a reduce-scatter onto the sequence with sequence parallelism): its
  adjoint hands every rank the whole output gradient, whose rows in its range are its shard's gradient;
* the head: ``enter_tensor_parallel(h)`` (its adjoint sums ``∂L/∂h`` over the group: each rank's vocabulary rows give
  a part) then this rank's logits ``(B, T, V/n)``, returned as :class:`VocabParallelLogits`, never gathered;
* the cross-entropy (:func:`vocab_parallel_nll`): the max over the vocabulary all-reduced (max), then the sum of
  ``exp`` and the target's logit (picked on the rank that holds it, zero elsewhere) all-reduced together (one
  all-reduce of ``(2, B, T)``): 2 all-reduces forward, none backward, where the gradient
  ``softmax − one-hot`` is computed on the local shard. Token accuracy (:func:`vocab_parallel_correct`): each rank's
  best (value, id) and one all-reduce (max) of the value, then of the id among the ranks that hold the max.

Every collective moves ``(B, T)`` or ``(B, T, D)`` tensors, never ``(B, T, V)``. The collectives are torch's raw
``_c10d_functional`` ops under ``no_grad`` inside ``autograd.Function`` s (``torch.func`` runs them; a compiled graph
holds them; ``LocalTensorMode``'s simulated ranks run them), as in ``parallel/_tensor.py``. The rank's first id is a
tensor (from :func:`~d9dfn.parallel.sequence_rank`), so no Python int differs per rank.

A consumer that needs the whole distribution (sampling the next token) gathers it explicitly, and only where it needs
it, through :func:`whole_logits` (the last position's: ``V`` values per row, one all-gather); nothing else gathers
the logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from d9dfn.parallel._tensor import TensorParallel

__all__ = [
    "VocabParallelLogits",
    "check_vocab_parallel",
    "vocab_parallel_correct",
    "vocab_parallel_embedding",
    "vocab_parallel_nll",
    "whole_logits",
]

_IGNORE_INDEX = -100  # d9dfn.tasks.IGNORE_INDEX (tasks import parallel, not the other way)


@dataclasses.dataclass(frozen=True)
class VocabParallelLogits:
    """A model's ``"logits"`` output under vocabulary parallelism: this rank's columns of the logits, never gathered;
    ``d9dfn.tasks.token_nll`` (and the token accuracy) recognise it and compute on the shards.

    Attributes:
        local: (B, T, V/n) this rank's logits, for ids ``[start, start + V/n)``.
        start: 0-d int64, this rank's first id (a tensor: simulated ranks and compiled graphs need no per-rank int).
        tp: the tensor group the vocabulary is split over.
    """

    local: torch.Tensor
    start: torch.Tensor
    tp: TensorParallel

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(
            "VocabParallelLogits: the model's logits are this rank's columns under vocabulary parallelism, not a "
            "(B, T, V) tensor; compute on the shards (d9dfn.tasks.token_nll, token_correct), gather the positions you "
            "need with d9dfn.parallel.whole_logits(logits, index), or set --set mesh.vocab_parallel=false"
        )


def check_vocab_parallel(vocab_size: int, degree: int) -> None:
    """A vocabulary of ``vocab_size`` ids split evenly over ``degree`` tensor-parallel ranks, else refused in one line
    (no padding: a padded vocabulary would change the checkpoint's shapes).

    >>> check_vocab_parallel(256, 2)
    >>> check_vocab_parallel(255, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: mesh.tensor_parallel=2 does not divide model vocab_size=255: ...
    """
    if vocab_size % degree:
        raise ValueError(
            f"mesh.tensor_parallel={degree} does not divide model vocab_size={vocab_size}: each tensor-parallel rank "
            f"holds the same number of vocabulary rows; set --set model.vocab_size to a multiple of {degree} "
            f"(e.g. {-(-vocab_size // degree) * degree}), or --set mesh.tensor_parallel to a divisor of {vocab_size}"
        )


def _all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    with torch.no_grad():  # the raw op: torch's autograd formula for it is a Function torch.func cannot run
        out: torch.Tensor = funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x.contiguous(), op, group))  # type: ignore[no-untyped-call]
    return out


def _local_ids(labels: torch.Tensor, start: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids -> (B, T) their index in this rank's shard (0 where not held) and (B, T) bool, true where held."""
    local = labels - start
    held = (local >= 0) & (local < num_local)
    return torch.where(held, local, torch.zeros_like(local)), held


class _VocabParallelNLL(torch.autograd.Function):
    """Per token ``log Σ_v exp(z_v) − z_target`` from the vocabulary shards; backward ``softmax − one-hot`` on the
    local shard, no collective."""

    @staticmethod
    def forward(
        local: torch.Tensor, labels: torch.Tensor, start: torch.Tensor, group: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = local.float()  # (B, T, V/n), accumulated in float32 whatever the logits' dtype (as token_nll)
        top = _all_reduce(z.detach().amax(-1), "max", group)  # (B, T), the max over the whole vocabulary
        exp = (z - top.unsqueeze(-1)).exp()  # (B, T, V/n)
        index, held = _local_ids(labels, start, z.shape[-1])
        picked = torch.where(held, z.gather(-1, index.unsqueeze(-1)).squeeze(-1), torch.zeros_like(top))
        sums = _all_reduce(torch.stack((exp.sum(-1), picked)), "sum", group)  # (2, B, T): Σ exp and z_target
        counted = labels != _IGNORE_INDEX
        nll = torch.where(counted, sums[0].log() + top - sums[1], torch.zeros_like(top))  # (B, T)
        softmax = exp / sums[0].unsqueeze(-1)
        return nll, softmax

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        local, labels, start, _ = inputs
        ctx.save_for_backward(output[1], labels, start)
        ctx.dtype = local.dtype
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor, None, None, None]:
        softmax, labels, start = ctx.saved_tensors
        index, held = _local_ids(labels, start, softmax.shape[-1])
        one_hot = torch.zeros_like(softmax).scatter(-1, index.unsqueeze(-1), held.unsqueeze(-1).to(softmax.dtype))
        scale = torch.where(labels != _IGNORE_INDEX, grad, torch.zeros_like(grad)).unsqueeze(-1)  # (B, T, 1)
        return ((softmax - one_hot) * scale).to(ctx.dtype), None, None, None


def vocab_parallel_nll(logits: VocabParallelLogits, labels: torch.Tensor) -> torch.Tensor:
    """The summed next-token negative log-likelihood of ``labels`` (B, T) (``-100``: no loss) under the whole
    vocabulary's softmax, from this rank's logits: 0-d float32, the same on every rank of the group. Differentiable
    (``torch.func.vjp`` included); the gradient of ``logits.local`` is computed on the shard."""
    nll, _ = _VocabParallelNLL.apply(logits.local, labels, logits.start, logits.tp.group)  # type: ignore[no-untyped-call]
    out: torch.Tensor = nll.sum()
    return out


def vocab_parallel_correct(logits: VocabParallelLogits, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the whole vocabulary's argmax equals ``labels`` (torch's first index among ties), from this rank's
    logits: the best value all-reduced (max), then the smallest id holding it (a max of the negated ids)."""
    with torch.no_grad():
        z = logits.local.detach()
        best, index = z.max(-1)  # (B, T): this rank's best value and its first local id
        top = _all_reduce(best, "max", logits.tp.group)
        # The ranks holding the max offer their id; the others one larger than any id, never the smallest.
        ids = torch.where(best == top, index + logits.start, torch.full_like(index, 1 << 62))
        first = -_all_reduce(-ids, "max", logits.tp.group)  # the smallest id among the ranks holding the max
        out: torch.Tensor = first == labels
    return out


def whole_logits(logits: torch.Tensor | VocabParallelLogits, index: Any = ()) -> torch.Tensor:
    """The whole vocabulary's logits at ``index`` (an index of the leading dimensions, e.g. ``(0, -1)``: the first
    row's last position), for a consumer that needs the whole distribution: a plain tensor is indexed as it is; this
    rank's columns of a :class:`VocabParallelLogits` are indexed, then all-gathered over its group (one all-gather of
    the indexed ``(..., V/n)``, without gradient). Gather only what you need: the last position's ``V`` values to
    sample a token, never the ``(B, T, V)`` a loss computes on the shards (:func:`vocab_parallel_nll`).

    >>> whole_logits(torch.arange(6.0).reshape(1, 2, 3), (0, -1))
    tensor([3., 4., 5.])
    """
    if not isinstance(logits, VocabParallelLogits):
        return logits[index]
    import torch.distributed._functional_collectives as funcol

    local = logits.local[index]  # (..., V/n)
    if local.ndim == 0:
        raise ValueError(
            f"whole_logits: index {index!r} took the vocabulary dimension too; index the leading ones only"
        )
    size = logits.tp.size
    with torch.no_grad():  # the raw op (dim 0), as parallel/_tensor.py's gathers
        stacked = torch.ops._c10d_functional.all_gather_into_tensor(local.contiguous(), size, logits.tp.group)
        out: torch.Tensor = funcol.wait_tensor(stacked)  # type: ignore[no-untyped-call]  # every rank's, along dim 0
    # (n, ..., V/n) -> (..., n, V/n) -> (..., V): rank r's columns are ids [r·V/n, (r+1)·V/n), in rank order.
    return out.reshape(size, *local.shape).movedim(0, -2).flatten(-2)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> (B, T, D) this rank's part of their embedding: its rows of ``weight`` (V/n, D) for the ids in
    ``[start, start + V/n)``, zeros for the others. Summed over the group (``leave_tensor_parallel``, or
    ``scatter_sequence`` with sequence parallelism) it is the whole embedding."""
    index, held = _local_ids(ids, start, weight.shape[0])
    rows = torch.nn.functional.embedding(index, weight)  # (B, T, D); its gradient reaches the held rows only
    return rows * held.unsqueeze(-1).to(rows.dtype)
