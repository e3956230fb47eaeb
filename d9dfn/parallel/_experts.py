"""Expert parallelism inside an MoE layer: each token copy travels to the rank that holds its expert and comes back,
with two differentiable all-to-alls (:func:`all_to_all`: ``torch.distributed._functional_collectives.
all_to_all_single`` in an ``autograd.Function`` whose adjoint is the same exchange).

The expert axis (role ``expert``, ``d9dfn.parallel.MeshAxes``) splits the stacked experts (dim 0) over its ``n``
ranks: rank ``r`` holds experts ``[r·E/n, (r+1)·E/n)`` (``Shard(0)``, the plan's :data:`~d9dfn.parallel.
EXPERT_PARALLEL_RULES`; stored further split along dim 1 over the ``dp_shard`` ranks left beside the expert axis, and
gathered over them by the step before the layer runs). :func:`dispatch_experts` is the layer's routed-expert output on
such a rank, for the tokens this rank routed, equal to what the whole experts compute on one process:

1. the ``T·k`` token copies sorted by expert (so by destination rank), laid out in one fixed-size slot of ``C =
   T·min(k, E/n)`` rows per destination (the most one rank can send another: a token's ``k`` experts are distinct),
   zero rows after the real ones;
2. the per-expert counts exchanged (an all-to-all of ``E`` integers, no gradient), the copies exchanged (``n·C``
   rows each way);
3. on the receiving rank, each row's local expert found from the counts on the device (``searchsorted``), the padding
   rows given expert 0 and weight 0, and the local experts computed by the caller's ``compute`` (the model's own
   grouped / dense / reference paths, with top-1 weight 1.0: exact);
4. the outputs sent back the same way, put back in token order and added per token in ascending expert order, each
   times its routing weight: the order and the products of ``experts_dense`` / ``experts_reference`` on one process.

**Static shapes, no host sync**: the slots' size depends on ``T``, ``k`` and ``E/n`` only, so the split sizes are
equal and known when tracing: nothing leaves the device, the layer compiles once (``torch.compile``), and
``LocalTensorMode`` simulates it. The price is bytes: each all-to-all moves ``n·C`` rows per rank where ``T·k`` are
real (``k ≤ E/n``: ``n`` times the minimum); a variable-split exchange would move only the real rows but needs the
counts on the host (a device→host sync per MoE layer per microbatch, torchtitan's choice). Backward: the all-to-alls'
adjoints are the reverse all-to-alls, so each rank's expert gradient sums the products of every token of the expert
group routed to its experts: complete over the expert axis, partial only over the other data-parallel axes (the
plan's ``partial`` of an expert param leaves the expert axis out: ``d9dfn.parallel.ParamLayout``).

Every rank of the expert group must route the same number of tokens ``T`` per call (the step's microbatches have
static shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ExpertParallel",
    "all_to_all",
    "bind_expert_parallel",
    "dispatch_experts",
    "expert_parallel_of",
    "slot_rows",
]

ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(rows (N, H), local_experts (N,) int64, weights (N,) float32) -> (N, H)``: each row through its local expert,
times its weight (the model's expert path with top-1 routing)."""


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert group an MoE layer dispatches over: a plain value the compiled step holds as a constant.

    Attributes:
        group: the registered name of the expert axis's process group (what the functional collectives take).
        size: its number of ranks ``n``; each holds ``E/n`` consecutive experts.
    """

    group: str
    size: int


def expert_parallel_of(plan: Any) -> ExpertParallel | None:
    """The expert group of a plan bound to a mesh with an expert axis of more than one rank over which some param is
    computed split (the plan's rules: :data:`~d9dfn.parallel.EXPERT_PARALLEL_RULES`), else ``None`` (the MoE layers
    then compute their experts whole). Resolves the group's name: call it when the step is built."""
    from d9dfn.parallel._reduce import group_name

    if plan is None or plan.mesh is None:
        return None
    name = plan.axes.name_of("expert")
    if name is None or plan.axes.size_of("expert") == 1:
        return None
    index = plan.axes.names.index(name)
    if not any(layout.compute[index] != "R" for layout in plan.params.values()):
        return None  # an expert axis, but nothing computed split over it
    return ExpertParallel(group_name(plan.mesh.get_group(name), "expert_parallel_of"), plan.axes.size_of("expert"))


def bind_expert_parallel(model: torch.nn.Module, ep: ExpertParallel | None) -> int:
    """Hand the expert group ``ep`` (``None``: unbind) to every MoE layer of ``model`` (each module with an
    ``expert_parallel`` attribute: ``d9dfn.models.qwen3_moe.SparseMoeBlock``), which then dispatches its routed copies
    over it (:func:`dispatch_experts`). Returns how many layers it bound."""
    layers = [module for module in model.modules() if hasattr(module, "expert_parallel")]
    for layer in layers:
        setattr(layer, "expert_parallel", ep)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors only)
    return len(layers)


def slot_rows(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """``C``: the rows of one destination's slot, the most copies one rank can send another.

    >>> slot_rows(10, 2, 4), slot_rows(10, 2, 1)
    (20, 10)
    """
    return num_tokens * min(top_k, num_local_experts)


class _AllToAll(torch.autograd.Function):
    """An all-to-all of equal slots over a group, differentiable under ``torch.func`` (the step's ``vjp``; torch's
    ``all_to_all_single_autograd`` is not): its adjoint is the same exchange (slot ``s`` of rank ``r`` came from slot
    ``r`` of rank ``s``, and its gradient goes back there)."""

    @staticmethod
    def forward(x: torch.Tensor, group: str) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        exchanged = funcol.all_to_all_single(x.contiguous(), None, None, group)  # type: ignore[arg-type]
        out: torch.Tensor = funcol.wait_tensor(exchanged)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None  # type: ignore[no-untyped-call]


def all_to_all(x: torch.Tensor, group: str) -> torch.Tensor:
    """``x`` (n·C, ...) as n equal slots exchanged over ``group``: slot ``s`` of the result is slot ``r`` of rank
    ``s`` 's ``x``, ``r`` this rank; differentiable (its own adjoint), also under ``torch.func``."""
    out: torch.Tensor = _AllToAll.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def dispatch_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    num_local_experts: int,
    compute: ExpertCompute,
    ep: ExpertParallel,
) -> torch.Tensor:
    """The routed experts' weighted outputs per token (the module docstring's steps), with this rank's experts.

    Args:
        x: (T, H) this rank's tokens.
        chosen: (T, k) int64 global expert ids, distinct per token.
        weights: (T, k) float32 routing weights.
        num_local_experts: ``E/n``, the experts this rank holds.
        compute: this rank's experts on received rows (:data:`ExpertCompute`).
        ep: the expert group.

    Returns:
        (T, H) in ``x``'s dtype.
    """
    import torch.distributed._functional_collectives as funcol

    num_tokens, top_k = chosen.shape
    size, local = ep.size, num_local_experts
    slot = slot_rows(num_tokens, top_k, local)
    flat = chosen.reshape(-1)  # (T·k,): copy j is token j // k
    order = flat.argsort(stable=True)  # copies by expert, so by destination rank
    counts = torch.zeros(size * local, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    per_rank = counts.view(size, local).sum(1)  # (n,) copies to each rank
    dest = flat[order] // local  # (T·k,) the destination of each sorted copy
    first = per_rank.cumsum(0) - per_rank  # (n,) the sorted index of each destination's first copy
    where = dest * slot + torch.arange(flat.numel(), device=x.device) - first[dest]  # (T·k,) row in the send buffer
    send = x.new_zeros(size * slot, x.shape[1]).index_copy(0, where, x[order // top_k])  # (n·C, H)

    # (n, E/n): row s = the copies source s sends to each of this rank's experts. No gradient: plain funcol.
    exchanged = funcol.all_to_all_single(counts, None, None, ep.group)  # type: ignore[arg-type]
    received = funcol.wait_tensor(exchanged).view(size, local)  # type: ignore[no-untyped-call]
    rows = all_to_all(send, ep.group)  # (n·C, H): slot s from source s
    ends = received.cumsum(1)  # (n, E/n) end of each local expert's rows within a slot
    position = torch.arange(slot, device=x.device).expand(size, slot).contiguous()
    expert = torch.searchsorted(ends, position, right=True).reshape(-1)  # (n·C,) local expert; E/n: a padding row
    real = expert < local
    out = compute(rows, torch.where(real, expert, 0), real.to(torch.float32))  # (n·C, H), padding rows zero

    back = all_to_all(out, ep.group)  # (n·C, H): slot r from rank r
    copies = torch.empty_like(back[: flat.numel()]).index_copy(0, order, back[where])  # (T·k, H) in copy order
    copies = copies.view(num_tokens, top_k, -1)
    ascending = chosen.argsort(dim=-1)  # add in ascending expert order, as experts_dense / experts_reference do
    by_expert = copies.gather(1, ascending.unsqueeze(-1).expand_as(copies))
    weight = weights.gather(-1, ascending)
    total = torch.zeros_like(x)
    for k in range(top_k):  # top_k is static
        total = total + by_expert[:, k] * weight[:, k, None].to(x.dtype)
    return total
