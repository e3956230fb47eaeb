"""A mixture-of-experts block as pure functions: routing (:func:`route`, optionally through a balancing bias), the
experts (:func:`experts_grouped`, :func:`experts_reference`, picked by :func:`experts`), the load statistics
(:class:`RouterLoad`), the auxiliary load-balancing loss (:func:`load_balancing_loss`, Hugging Face's
``router_aux_loss_coef`` definition), the auxiliary-loss-free balancing bias's update (:func:`balance_bias`) and the
capacity limit (:func:`expert_capacity`, :func:`drop_over_capacity`).

Expert weights are stored as Hugging Face's transformers 5 fused tensors: ``gate_up`` (E, 2I, H), the gate's
rows then the up projection's, and ``down`` (E, H, I), each expert's ``nn.Linear`` weight (out, in).

Three paths compute the same experts:

- **grouped** (:func:`experts_grouped`): the token copies sorted by expert, two ``torch._grouped_mm`` calls
  (``gate_up``, ``down``) with the per-expert offsets on the device, unsorted and summed per token. Static shapes,
  no host sync (the counts never leave the device), dropless. ``torch._grouped_mm`` takes bf16 only (on torch 2.13
  also on the CPU, eager and compiled; fp32 is refused) and widths that are multiples of 8.
- **reference** (:func:`experts_reference`): transformers' loop, one matmul per expert over exactly its tokens;
  bitwise transformers' ``Qwen3MoeForCausalLM`` in fp32. Data-dependent shapes: a host sync per expert per layer,
  eager only.
- **dense** (:func:`experts_dense`): every expert on every token as one batched matmul, each token's ``top_k``
  outputs gathered. Static shapes, no host sync, ``num_experts / top_k`` times the FLOPs: the fp32 path under
  ``torch.compile``.

:func:`experts` picks grouped for bf16, else dense while compiling and reference in eager mode;
``tests/test_qwen3_moe.py`` checks grouped against reference in bf16 within :data:`GROUPED_BF16_TOLERANCE`, and dense
against reference in fp32 within 1e-6.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from d9dfn._tracing import replayed

__all__ = [
    "GROUPED_BF16_TOLERANCE",
    "RouterLoad",
    "Routing",
    "Scoring",
    "balance_bias",
    "drop_over_capacity",
    "expert_capacity",
    "experts",
    "experts_dense",
    "experts_grouped",
    "experts_reference",
    "load_balancing_loss",
    "route",
    "router_load",
    "uses_grouped",
]

Scoring = Literal["softmax", "sigmoid"]
"""How router logits become scores: ``softmax`` over the experts (Qwen3-MoE, Mixtral) or an independent
``sigmoid`` per expert (DeepSeek-V3)."""

GROUPED_BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
"""How far the grouped and the reference path may differ in bf16 (``torch.testing.assert_close`` arguments): both
round every matmul's output to bf16, but in another order of accumulation."""


class Routing(NamedTuple):
    """Which experts each token goes to, with what weight.

    Attributes:
        weights: (T, top_k) float32 routing weights (renormalized over the ``top_k`` when asked).
        experts: (T, top_k) int64 expert indices, in descending score order.
        probs: (T, E) float32 per-token probabilities over all experts: the softmax, or the sigmoid scores
            normalized to sum to one; what the auxiliary loss reads.
    """

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


class RouterLoad(NamedTuple):
    """One MoE layer's (or a sum over layers') load statistics, from which the auxiliary loss is computed.

    Attributes:
        counts: (E,) float32 token copies routed to each expert (sums to ``tokens * top_k``).
        prob_sums: (E,) float32 each expert's routing probability summed over the tokens.
        num_tokens: 0-d float32 number of tokens routed.
        dropped: (E,) float32 token copies each expert dropped over its capacity (:func:`drop_over_capacity`);
            ``None`` when dropless. ``counts`` are the copies routed, dropped ones included (the demand the
            balancing bias answers).
    """

    counts: torch.Tensor
    prob_sums: torch.Tensor
    num_tokens: torch.Tensor
    dropped: torch.Tensor | None = None

    def __add__(self, other: object) -> RouterLoad:  # a sum of loads, not a tuple concat
        assert isinstance(other, RouterLoad)
        dropped = None if self.dropped is None or other.dropped is None else self.dropped + other.dropped
        return RouterLoad(
            self.counts + other.counts, self.prob_sums + other.prob_sums, self.num_tokens + other.num_tokens, dropped
        )


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: Scoring = "softmax",
    normalize: bool = False,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Top-k routing of each token, scored in float32 whatever the logits' dtype.

    Args:
        logits: (T, E) router logits.
        top_k: experts per token.
        scoring: ``softmax`` over the experts, or ``sigmoid`` per expert.
        normalize: divide the ``top_k`` weights by their sum (HF's ``norm_topk_prob``).
        bias: (E,) float32 balancing bias (DeepSeek-V3's auxiliary-loss-free balancing, arXiv:2412.19437 §2.1.2),
            added to the scores for the choice of the experts only: the weights stay the unbiased scores of the
            chosen experts, and no gradient reaches the bias. ``None``: the plain top-k.

    Returns:
        The :class:`Routing`.

    >>> r = route(torch.tensor([[0.0, 1.0, 2.0]]), 2, normalize=True)
    >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[2, 1]], [0.7311, 0.2689])
    >>> route(torch.tensor([[0.0, 1.0, 2.0]]), 1, bias=torch.tensor([5.0, 0.0, 0.0])).experts.tolist()
    [[0]]
    """
    scores = F.softmax(logits, dim=-1, dtype=torch.float32) if scoring == "softmax" else logits.float().sigmoid()
    if bias is None:
        weights, chosen = torch.topk(scores, top_k, dim=-1)  # (T, E) -> (T, k) twice
    else:  # chosen by the biased scores, weighted by the plain ones
        chosen = torch.topk(scores + bias.detach(), top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    probs = scores if scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return Routing(weights, chosen, probs)


def router_load(routing: Routing, num_experts: int) -> RouterLoad:
    """The load statistics of one layer's routing: copies per expert, probability sums, tokens (no host sync).

    >>> load = router_load(route(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), 2), 3)
    >>> load.counts.tolist(), float(load.num_tokens)
    ([1.0, 2.0, 1.0], 2.0)
    """
    flat = routing.experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )
    num_tokens = torch.tensor(float(routing.probs.shape[0]), device=flat.device)
    return RouterLoad(counts, routing.probs.sum(dim=0), num_tokens)


def load_balancing_loss(load: RouterLoad) -> torch.Tensor:
    """Hugging Face's auxiliary load-balancing loss (Switch Transformer, eqs. 4-6) from the load summed over layers:
    ``E * Σₑ (countsₑ / N) * (prob_sumsₑ / N)``, ``N`` the tokens of all layers together; it is ``top_k`` when the
    load is uniform. Only ``prob_sums`` carries a gradient (the counts come from a top-k).

    ``transformers``' ``load_balancing_loss_func`` pools every layer's rows the same way (it is not a mean of
    per-layer losses); ``Qwen3MoeForCausalLM`` adds ``router_aux_loss_coef`` times it to the loss.

    >>> uniform = RouterLoad(torch.full((4,), 2.0), torch.full((4,), 1.0), torch.tensor(4.0))
    >>> float(load_balancing_loss(uniform))  # 4 tokens, top-2, 4 experts: uniform gives top_k
    2.0
    """
    num_experts = load.counts.shape[0]
    return num_experts * torch.sum((load.counts / load.num_tokens) * (load.prob_sums / load.num_tokens))


def balance_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The auxiliary-loss-free balancing bias after one step (DeepSeek-V3, arXiv:2412.19437 §2.1.2): each expert's
    bias moves by ``rate`` toward balance, up when it got fewer token copies than the mean, down when more,
    ``bias + rate * sign(mean(counts) - counts)``; then the update's mean is taken off (torchtitan does the same), which
    changes no choice (top-k of the scores plus a constant is the same top-k) and keeps the bias near zero, where
    float32 still resolves the scores.

    Pure: no gradient, no host sync. ``counts`` must be the whole step's, summed over microbatches and data-parallel
    ranks, so that every rank computes the same bias.

    Args:
        bias: (E,) float32 bias.
        counts: (E,) token copies each expert was routed this step.
        rate: the step size (``Qwen3MoeConfig.load_balance_bias_rate``).

    >>> balance_bias(torch.zeros(4), torch.tensor([5.0, 3.0, 0.0, 0.0]), 0.5).tolist()  # the mean load is 2
    [-0.5, -0.5, 0.5, 0.5]
    >>> balance_bias(torch.zeros(4), torch.tensor([6.0, 2.0, 0.0, 0.0]), 0.5).tolist()  # expert 1: no change, less
    [-0.625, -0.125, 0.375, 0.375]
    """
    load = counts.detach().to(bias.dtype)
    delta = rate * torch.sign(load.mean() - load)
    return bias + (delta - delta.mean())


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Token copies an expert takes per MoE layer call: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``
    (GShard, Switch Transformer §2.2), at least 1. A Python int from the shapes: static under ``torch.compile``.

    >>> expert_capacity(8, 2, 4, 1.0), expert_capacity(8, 2, 4, 1.25), expert_capacity(3, 1, 8, 0.5)
    (4, 5, 1)
    """
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def drop_over_capacity(routing: Routing, num_experts: int, capacity: int) -> tuple[Routing, torch.Tensor]:
    """``routing`` with the token copies beyond each expert's ``capacity`` dropped: their weight set to zero, so
    their expert output adds nothing (the block's residual carries the token on) and no gradient flows through them.
    Copies queue per expert by top-k slot first (every token's first choice before any second choice, GShard's
    priority), then by token order. Static shapes, no host sync: a stable sort and a scatter on the device.

    Returns:
        The routing with the dropped copies' weights zeroed (``experts`` and ``probs`` unchanged), and (E,) float32
        the copies each expert dropped.

    >>> r = Routing(torch.ones(3, 2), torch.tensor([[0, 1], [0, 1], [0, 2]]), torch.full((3, 3), 1 / 3))
    >>> kept, dropped = drop_over_capacity(r, 3, 2)
    >>> kept.weights.tolist(), dropped.tolist()
    ([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]], [1.0, 0.0, 0.0])
    """
    num_tokens, top_k = routing.experts.shape
    flat = routing.experts.t().reshape(-1)  # (k·T,) slot-major: the priority order
    order = flat.argsort(stable=True)  # copies grouped by expert, in priority order within one
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    starts = counts.cumsum(0) - counts  # (E,) first sorted row of each expert
    rank_sorted = torch.arange(flat.shape[0], device=flat.device) - starts[flat[order]]
    position = torch.empty_like(flat).scatter_(0, order, rank_sorted)  # each copy's place in its expert's queue
    keep = (position < capacity).view(top_k, num_tokens).t()  # (T, k)
    dropped = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).index_add_(
        0, flat, (position >= capacity).to(torch.float32)
    )
    return routing._replace(weights=routing.weights * keep), dropped


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    # Shapes only: static under torch.compile, so no host sync.
    num_experts, two_inter, hidden = gate_up.shape
    if x.ndim != 2 or x.shape[1] != hidden or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit; "
            "pass x (T, H), gate_up (E, 2I, H), down (E, H, I)"
        )


def experts_reference(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU outputs, weighted and summed per token, as transformers' loop computes them: for each
    expert, one matmul over exactly the token copies routed to it (in transformers' order: by top-k slot, then by
    token), added into the output expert after expert. Bitwise transformers' ``Qwen3MoeExperts`` in fp32.

    It has data-dependent shapes: finding each expert's tokens (``torch.where``) is a device→host sync per expert
    per layer, and ``torch.compile`` cannot trace it without a graph break; :func:`experts` takes
    :func:`experts_dense` instead while compiling.

    Args:
        x: (T, H) tokens.
        routing: the tokens' routing (:func:`route`).
        gate_up: (E, 2I, H) the experts' gate rows then up rows.
        down: (E, H, I) the experts' down projections.

    Returns:
        (T, H) in ``x``'s dtype.
    """
    _check(x, gate_up, down)
    out = torch.zeros_like(x)
    by_slot = routing.experts.t()  # (k, T): transformers' expert mask, slot-major
    for expert in range(gate_up.shape[0]):
        slot, token = torch.where(by_slot == expert)  # the host sync
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)  # (n, H) -> (n, I) twice
        y = F.linear(F.silu(gate) * up, down[expert])  # (n, I) -> (n, H)
        out = out.index_add(0, token, y * routing.weights[token, slot, None].to(x.dtype))
    return out


def experts_dense(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """As :func:`experts_reference` with static shapes and no host sync: every expert on every token (one batched
    matmul, ``num_experts / top_k`` times the FLOPs), each token's ``top_k`` outputs gathered and added in ascending
    expert order. Equal to the reference up to the matmuls' rounding (their row counts differ): the fp32 path under
    ``torch.compile``."""
    _check(x, gate_up, down)
    hidden = torch.matmul(x, gate_up.transpose(-2, -1))  # (T, H) x (E, H, 2I) -> (E, T, 2I)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch.matmul(F.silu(gate) * up, down.transpose(-2, -1))  # (E, T, I) x (E, I, H) -> (E, T, H)
    order = routing.experts.argsort(dim=-1)  # ascending expert order per token, as the reference adds them
    chosen, weights = routing.experts.gather(-1, order), routing.weights.gather(-1, order)
    tokens = torch.arange(x.shape[0], device=x.device)
    total = torch.zeros_like(x)
    for slot in range(chosen.shape[1]):  # top_k is static
        total = total + out[chosen[:, slot], tokens] * weights[:, slot, None].to(x.dtype)
    return total


def experts_grouped(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """As :func:`experts_reference`, through ``torch._grouped_mm``: the ``T * top_k`` token copies sorted by expert,
    one grouped matmul per projection, unsorted and summed per token. The per-expert offsets are a cumulative sum on
    the device: no host sync. bf16 only (``torch._grouped_mm`` refuses fp32).

    >>> x = torch.randn(5, 8, dtype=torch.bfloat16)
    >>> gate_up, down = torch.randn(4, 16, 8, dtype=torch.bfloat16), torch.randn(4, 8, 8, dtype=torch.bfloat16)
    >>> experts_grouped(x, route(torch.randn(5, 4), 2), gate_up, down).shape
    torch.Size([5, 8])
    """
    _check(x, gate_up, down)
    num_tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1)  # (T·k,): copy j is token j // k
    order = flat.argsort(stable=True)  # copies grouped by expert, tokens in order within an expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offsets = counts.cumsum(0, dtype=torch.int32)  # (E,) end of each expert's rows
    sorted_x = x[order // top_k]  # (T·k, H)
    hidden = torch._grouped_mm(sorted_x, gate_up.transpose(-2, -1), offs=offsets)  # (T·k, 2I)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)  # (T·k, H)
    unsorted = torch.empty_like(out).index_copy(0, order, out).view(num_tokens, top_k, -1)  # (T, k, H)
    return (unsorted * routing.weights.unsqueeze(-1).to(x.dtype)).sum(dim=1)


def uses_grouped(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> bool:
    """Whether :func:`experts` takes the grouped path: activations in bf16, where ``torch._grouped_mm`` runs (on the
    CPU too, torch 2.13), with both widths multiples of 8 (it wants 16-byte strides), and torch has it at all.

    >>> uses_grouped(torch.bfloat16, 16, 32), uses_grouped(torch.float32, 16, 32), uses_grouped(torch.bfloat16, 16, 12)
    (True, False, False)
    """
    aligned = hidden_size % 8 == 0 and intermediate_size % 8 == 0
    return dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm")


def experts(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    path: Literal["auto", "grouped", "dense", "reference"] = "auto",
) -> torch.Tensor:
    """The experts' weighted outputs per token: :func:`experts_grouped` for bf16 (:func:`uses_grouped`), else
    :func:`experts_dense` while a graph replayed on other inputs is traced (``torch.compile``, a split backward's
    stage: ``d9dfn._tracing.replayed``) or on the meta device (a pipeline rank finds its stage's output shapes there:
    the reference path's data-dependent shapes have no meta kernel) and :func:`experts_reference` in eager mode;
    ``path`` forces one. Decided by the dtype, the widths, the device and the tracing: static, no branch on tensor
    values."""
    if path == "auto":
        if uses_grouped(x.dtype, x.shape[-1], down.shape[-1]):
            path = "grouped"
        else:
            path = "dense" if replayed() or x.is_meta else "reference"
    fn = {"grouped": experts_grouped, "dense": experts_dense, "reference": experts_reference}[path]
    return fn(x, routing, gate_up, down)
