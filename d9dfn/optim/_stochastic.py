"""AdamW for bfloat16 params with stochastic rounding (d9d's ``StochasticAdamW``), pure and reproducible.

The math runs in float32. The new bf16 param is rounded *stochastically*: uniform random bits are added
to the low 16 bits of the float32 pattern, which is then truncated, so a value rounds up with probability
equal to its distance from the lower bf16 neighbour, in units of the gap. The expectation is the float32
result, which is why small updates are not lost to round-to-nearest.

How it fits ``updates`` + ``apply_updates``: the transform computes the rounded param itself and returns
``update = float32(new) - float32(param)``. Both are bf16 values, so this difference is exact in float32
whenever their exponents differ by at most 15 (the param did not change by more than a factor of about
2**15 in one step), and then ``apply_updates`` (``param + update`` in float32, cast to bf16) reproduces
the rounded value bit for bit. Because its updates are final, ``stochastic_adamw`` must come last in a
``chain`` and its updates must not be scaled afterwards.

The noise does not depend on the layout. Each element's bits are a hash of (key, step, leaf, the element's
row-major index in the *whole* tensor) (:func:`d9dfn.prng.random_bits` with ``offset``/``whole``); a ``DTensor``
(sharded over ``ep``, ``dp_shard``, both, or replicated) is rounded as its local shard, with the indices its
shard starts at (:func:`d9dfn.parallel.shard_offset`). So every rank draws exactly the slice of the one-process
noise, and a sharded run equals the one-process run bit for bit. Chosen over drawing the whole tensor's noise and
slicing it: that costs a full-size int64 tensor per param on every rank (8 bytes an element, four times a bf16
expert weight that EP and FSDP split precisely so that no rank holds it whole) and hashes every element on every
rank; the per-shard indices cost the shard's size and one broadcast range per dim, and need no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn import prng
from d9dfn._pytree import format_path
from d9dfn._types import Grads, Params, PathPredicate, Transform, Updates
from d9dfn.optim._adam import adam_core
from d9dfn.optim._base import (
    LearningRate,
    check_lr,
    check_range,
    flatten_like,
    flatten_tensors,
    lr_at,
    new_count,
    record_lr,
    select_flags,
    unflatten,
)
from d9dfn.parallel._placement import is_distributed_tensor, local_of, placed_like, shard_offset

__all__ = ["StochasticAdamWState", "stochastic_adamw", "stochastic_round"]

_LOW16 = 0xFFFF
_HIGH16 = 0xFFFF0000
_MASK32 = 0xFFFFFFFF
_SUPPORTED = (torch.bfloat16, torch.float32)


class StochasticAdamWState(NamedTuple):
    """State of :func:`stochastic_adamw`: step count, the rate the last update used, moments, the rounding key."""

    count: torch.Tensor  # type: ignore[assignment]  # optax's name; shadows tuple.count, unused on a state
    lr: torch.Tensor
    mu: Params
    nu: Params
    key: torch.Tensor


def stochastic_round(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically, unbiased: ``E[result] == x`` (NaN stays NaN).

    Each element's noise is a function of ``key`` and its index in the whole tensor: a ``DTensor`` ``x`` (Shard
    and Replicate placements) is rounded shard by shard, each as the same slice of the unsplit tensor's result.

    Args:
        x: a float32 tensor, or a ``DTensor`` of one.
        key: a :mod:`d9dfn.prng` key; the same key gives the same bits, in eager and compiled code.

    Returns:
        A bfloat16 tensor shaped (and placed) like ``x``; each value is one of the two bf16 neighbours of ``x``.

    >>> import torch
    >>> from d9dfn import prng
    >>> x = torch.full((10_000,), 1.0 + 2.0**-9)  # a quarter of the way from 1.0 to the next bf16, 1.0078125
    >>> y = stochastic_round(x, prng.key(0))
    >>> sorted(set(y.float().tolist())), abs(float(y.float().mean()) - float(x[0])) < 2e-4
    ([1.0, 1.0078125], True)
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: x has dtype {x.dtype}; pass a float32 tensor (x.float())")
    local = local_of(x)
    if is_distributed_tensor(x):  # the shard's own slice of the whole tensor's noise
        noise = prng.random_bits(key, local.shape, offset=shard_offset(x), whole=x.shape)
    else:
        noise = prng.random_bits(key, local.shape)
    return placed_like(x, _round_with(local, noise))


def _round_with(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Plain float32 ``x`` rounded to bfloat16 with one 32-bit ``noise`` value per element (its low 16 bits)."""
    # The 32-bit pattern as an unsigned value in int64, so the additions below cannot overflow.
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    # Adding noise below bit 16 carries into the bf16 part with probability (low 16 bits) / 2**16;
    # sign-magnitude makes this symmetric for negative values. Truncation keeps the high 16 bits.
    rounded = (bits + (noise & _LOW16)) & _HIGH16
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    # NaN patterns can carry into the sign or overflow; keep them NaN.
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)


def stochastic_adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    state_dtype: torch.dtype = torch.float32,
    *,
    key: torch.Tensor | int,
    weight_decay_mask: PathPredicate | None = None,
) -> Transform:
    """AdamW in float32 math for bfloat16 (or float32) params, rounding the new bf16 params stochastically.

    The randomness for step ``count`` and leaf ``i`` comes from ``fold_in(fold_in(key, count), i)``, so
    results are bit-identical for a fixed key, and for ``DTensor`` params on any layout (sharded over ``ep``,
    ``dp_shard``, both, or replicated) equal to the one-process result: each element's noise depends on its index in
    the whole tensor, not on the split. Moments kept in bf16 (``state_dtype=torch.bfloat16``) are rounded
    stochastically too, with keys of their own. Float32 params get the exact float32 result.

    Args:
        lr: a float, or a schedule evaluated at the step count before the update.
        betas: decay rates of the first and second moments, each in ``[0, 1)``.
        eps: added to the denominator's root.
        weight_decay: decoupled decay coefficient (``param·(1 - lr·weight_decay)``).
        state_dtype: dtype of the moments, ``torch.float32`` or ``torch.bfloat16``.
        key: a :mod:`d9dfn.prng` key or an int seed; it is kept in the state.
        weight_decay_mask: ``(name, leaf) -> bool``; only leaves it selects decay (all when ``None``).

    Returns:
        A :class:`~d9dfn.Transform` whose state is :class:`StochasticAdamWState`; ``update`` needs
        ``params``, and the transform must be last in a chain (see the module notes).

    >>> import torch
    >>> from d9dfn import optim
    >>> params = {"w": torch.ones(4, dtype=torch.bfloat16)}
    >>> opt = stochastic_adamw(1e-3, weight_decay=0.0, key=0)
    >>> updates, state = opt.update({"w": torch.ones(4)}, opt.init(params), params)
    >>> new = optim.apply_updates(params, updates)
    >>> new["w"].dtype, sorted(set(new["w"].float().tolist())) <= [0.99609375, 1.0]
    (torch.bfloat16, True)
    """
    fn = "stochastic_adamw"
    lr = check_lr(fn, lr)
    if len(betas) != 2:
        raise ValueError(f"{fn}: betas={betas!r} must be a pair (beta1, beta2)")
    beta1 = check_range(fn, "betas[0]", betas[0], 0.0, 1.0, high_open=True)
    beta2 = check_range(fn, "betas[1]", betas[1], 0.0, 1.0, high_open=True)
    eps = check_range(fn, "eps", eps, 0.0, float("inf"))
    weight_decay = check_range(fn, "weight_decay", weight_decay, 0.0, float("inf"))
    if state_dtype not in _SUPPORTED:
        raise ValueError(f"{fn}: state_dtype={state_dtype} is not supported; pass torch.float32 or torch.bfloat16")
    if isinstance(key, bool) or not isinstance(key, int | torch.Tensor):
        raise TypeError(f"{fn}: key={key!r} is a {type(key).__name__}; pass prng.key(seed) or an int seed")
    base_key = prng.key(key) if isinstance(key, int) else key
    if base_key.shape != () or base_key.dtype != torch.int64:
        raise ValueError(
            f"{fn}: key has shape {tuple(base_key.shape)} and dtype {base_key.dtype}; "
            f"pass a 0-d int64 key from prng.key"
        )

    def init(params: Params) -> StochasticAdamWState:
        leaves, spec = flatten_tensors(f"{fn}.init", "params", params)
        for path, leaf in zip(spec.paths(), leaves, strict=True):
            if leaf.dtype not in _SUPPORTED:
                raise TypeError(
                    f"{fn}.init: params{format_path(path)} has dtype {leaf.dtype}; stochastic rounding targets "
                    f"bfloat16 (float32 params are updated exactly); cast the param to torch.bfloat16 or torch.float32"
                )
        count = new_count(leaves)
        return StochasticAdamWState(
            count=count,
            lr=record_lr(lr_at(lr, count), count),
            mu=unflatten(spec, [torch.zeros_like(p, dtype=state_dtype) for p in leaves]),
            nu=unflatten(spec, [torch.zeros_like(p, dtype=state_dtype) for p in leaves]),
            key=base_key.to(count.device),
        )

    def update(
        grads: Grads, state: StochasticAdamWState, params: Params | None = None
    ) -> tuple[Updates, StochasticAdamWState]:
        name = f"{fn}.update"
        if params is None:
            raise ValueError(f"{name}: stochastic rounding produces the new params; call update(grads, state, params)")
        mu, spec = flatten_tensors(name, "state.mu", state.mu)
        p = flatten_like(name, "params", params, spec, mu, "state.mu")
        g = flatten_like(name, "grads", grads, spec, mu, "state.mu")
        nu = flatten_like(name, "state.nu", state.nu, spec, mu, "state.mu")
        decay = select_flags(name, weight_decay_mask, spec.paths(), p) if weight_decay != 0.0 else [False] * len(p)

        lr_t = lr_at(lr, state.count)
        count = state.count + 1
        # Adam's maths, shared with adam/adamw, in float32; what follows is only decay and the rounding.
        core = adam_core(
            [grad.float() for grad in g],
            [m.float() for m in mu],
            [v.float() for v in nu],
            None,
            count.to(torch.float32),
            lr_t,
            beta1,
            beta2,
            eps,
        )
        step_key = prng.fold_in(state.key, state.count)
        state_bf16 = state_dtype == torch.bfloat16

        updates, new_mu, new_nu = [], [], []
        for i, (param, m32, v32, direction) in enumerate(zip(p, core.mu, core.nu, core.direction, strict=True)):
            p32 = param.float()
            if decay[i]:
                p32 = p32 * (1.0 - lr_t * weight_decay)
            new32 = p32 - core.step_size * direction
            # Keys are derived only where something is rounded (float32 leaves and state need none).
            rounds = param.dtype == torch.bfloat16
            new, m, v = new32, m32, v32
            if rounds or state_bf16:
                leaf_key = prng.fold_in(step_key, i)
                if rounds:
                    new = stochastic_round(new32, prng.fold_in(leaf_key, 0)).float()
                if state_bf16:
                    m = stochastic_round(m32, prng.fold_in(leaf_key, 1))
                    v = stochastic_round(v32, prng.fold_in(leaf_key, 2))
            updates.append(new - param.float())
            new_mu.append(m)
            new_nu.append(v)

        new_state = StochasticAdamWState(
            count=count,
            lr=record_lr(lr_t, state.count),
            mu=unflatten(spec, new_mu),
            nu=unflatten(spec, new_nu),
            key=state.key,
        )
        return unflatten(spec, updates), new_state

    return Transform(init, update)
