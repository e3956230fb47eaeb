"""A mixture-of-experts block as pure functions: routing (:func:`route`), the experts (:func:`experts_grouped`,
:func:`experts_reference`, picked by :func:`experts`), the load statistics (:class:`RouterLoad`) and the
auxiliary load-balancing loss (:func:`load_balancing_loss`, Hugging Face's ``router_aux_loss_coef`` definition).

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

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "GROUPED_BF16_TOLERANCE",
    "RouterLoad",
    "Routing",
    "Scoring",
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
    """

    counts: torch.Tensor
    prob_sums: torch.Tensor
    num_tokens: torch.Tensor

    def __add__(self, other: object) -> RouterLoad:  # a sum of loads, not a tuple concat
        assert isinstance(other, RouterLoad)
        return RouterLoad(
            self.counts + other.counts, self.prob_sums + other.prob_sums, self.num_tokens + other.num_tokens
        )


def route(logits: torch.Tensor, top_k: int, *, scoring: Scoring = "softmax", normalize: bool = False) -> Routing:
    """Top-k routing of each token, scored in float32 whatever the logits' dtype.

    Args:
        logits: (T, E) router logits.
        top_k: experts per token.
        scoring: ``softmax`` over the experts, or ``sigmoid`` per expert.
        normalize: divide the ``top_k`` weights by their sum (HF's ``norm_topk_prob``).

    Returns:
        The :class:`Routing`.

    >>> r = route(torch.tensor([[0.0, 1.0, 2.0]]), 2, normalize=True)
    >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[2, 1]], [0.7311, 0.2689])
    """
    scores = F.softmax(logits, dim=-1, dtype=torch.float32) if scoring == "softmax" else logits.float().sigmoid()
    weights, chosen = torch.topk(scores, top_k, dim=-1)  # (T, E) -> (T, k) twice
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
    :func:`experts_dense` while ``torch.compile`` traces and :func:`experts_reference` in eager mode; ``path``
    forces one. Decided by the dtype, the widths and whether torch is compiling: static, no branch on tensor
    values."""
    if path == "auto":
        if uses_grouped(x.dtype, x.shape[-1], down.shape[-1]):
            path = "grouped"
        else:
            path = "dense" if torch.compiler.is_compiling() else "reference"
    fn = {"grouped": experts_grouped, "dense": experts_dense, "reference": experts_reference}[path]
    return fn(x, routing, gate_up, down)
