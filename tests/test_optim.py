"""Optimizer transforms: numerics against torch.optim, properties (structure, chain, purity), compile, errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from d9dfn import optim, prng, schedules
from d9dfn._pytree import tree_leaves, tree_map
from d9dfn.testing import assert_trees_close, assert_trees_equal_structure, tensor_trees, tensors

NUM_STEPS = 100
# The brief's rtol 1e-5 (float32); the atol covers params that pass near zero after 100 steps, where
# rounding differences of order 1e-7 per step (torch decays params before adding the step, we add
# one update) dominate any relative measure.
RTOL, ATOL = 1e-5, 1e-5

SHAPES = st.lists(st.sampled_from([(), (1,), (3,), (2, 3), (4, 1, 2)]), min_size=1, max_size=3)
SEEDS = st.integers(0, 2**31 - 1)
LRS = st.floats(1e-4, 0.1)
BETA1S = st.sampled_from([0.0, 0.5, 0.9])
BETA2S = st.sampled_from([0.5, 0.9, 0.999])
EPSS = st.sampled_from([1e-8, 1e-6, 1e-3])
WEIGHT_DECAYS = st.sampled_from([0.0, 1e-2, 0.1])


def _problem(shapes: list[tuple[int, ...]], seed: int, num_steps: int = NUM_STEPS, dtype=torch.float32):
    """Params ``{"p0": ..}`` and a sequence of gradient dicts, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(shape, generator=gen).to(dtype) for i, shape in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()} for _ in range(num_steps)]
    return params, grads


def _run_ours(transform: optim.Transform, params, grads):
    state = transform.init(params)
    for g in grads:
        updates, state = transform.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], params, grads, scheduler=None):
    torch_params = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = make(torch_params)
    sched = scheduler(opt) if scheduler is not None else None
    for g in grads:
        for param, grad in zip(torch_params, g.values(), strict=True):
            param.grad = grad.clone()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: p.detach() for k, p in zip(params, torch_params, strict=True)}


@settings(max_examples=20)
@given(SHAPES, SEEDS, LRS, BETA1S, BETA2S, EPSS, WEIGHT_DECAYS, st.booleans(), st.booleans())
def test_adamw_matches_torch_adamw(shapes, seed, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize):
    params, grads = _problem(shapes, seed)
    kwargs = {"betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad}
    ours, _ = _run_ours(optim.adamw(lr, maximize=maximize, **kwargs), params, grads)
    theirs = _run_torch(lambda p: torch.optim.AdamW(p, lr, maximize=maximize, foreach=True, **kwargs), params, grads)
    assert_trees_close(ours, theirs, rtol=RTOL, atol=ATOL)


@settings(max_examples=20)
@given(SHAPES, SEEDS, LRS, BETA1S, BETA2S, EPSS, WEIGHT_DECAYS, st.booleans(), st.booleans(), st.booleans())
def test_adam_matches_torch_adam(shapes, seed, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled):
    params, grads = _problem(shapes, seed)
    kwargs = {
        "betas": (beta1, beta2),
        "eps": eps,
        "weight_decay": weight_decay,
        "amsgrad": amsgrad,
        "maximize": maximize,
        "decoupled_weight_decay": decoupled,
    }
    ours, _ = _run_ours(optim.adam(lr, **kwargs), params, grads)
    theirs = _run_torch(lambda p: torch.optim.Adam(p, lr, foreach=True, **kwargs), params, grads)
    assert_trees_close(ours, theirs, rtol=RTOL, atol=ATOL)


@settings(max_examples=20)
@given(
    SHAPES,
    SEEDS,
    LRS,
    st.sampled_from([0.0, 0.5, 0.9]),
    st.sampled_from([0.0, 0.3]),
    WEIGHT_DECAYS,
    st.booleans(),
    st.booleans(),
)
def test_sgd_matches_torch_sgd(shapes, seed, lr, momentum, dampening, weight_decay, nesterov, maximize):
    nesterov = nesterov and momentum > 0
    dampening = 0.0 if nesterov else dampening
    params, grads = _problem(shapes, seed)
    kwargs = {
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": weight_decay,
        "nesterov": nesterov,
        "maximize": maximize,
    }
    ours, _ = _run_ours(optim.sgd(lr, **kwargs), params, grads)
    theirs = _run_torch(lambda p: torch.optim.SGD(p, lr, foreach=True, **kwargs), params, grads)
    assert_trees_close(ours, theirs, rtol=RTOL, atol=ATOL)


@settings(max_examples=20)
@given(SHAPES, SEEDS, LRS, BETA1S, BETA2S, WEIGHT_DECAYS)
def test_stochastic_adamw_float32_params_match_torch_adamw(shapes, seed, lr, beta1, beta2, weight_decay):
    params, grads = _problem(shapes, seed)
    kwargs = {"betas": (beta1, beta2), "weight_decay": weight_decay}
    ours, _ = _run_ours(optim.stochastic_adamw(lr, key=seed, **kwargs), params, grads)
    theirs = _run_torch(lambda p: torch.optim.AdamW(p, lr, foreach=True, **kwargs), params, grads)
    assert_trees_close(ours, theirs, rtol=RTOL, atol=ATOL)


@settings(max_examples=10)
@given(SHAPES, SEEDS, st.sampled_from(["adamw", "sgd"]))
def test_schedule_lr_matches_torch_lambda_lr(shapes, seed, name):
    params, grads = _problem(shapes, seed, num_steps=30)
    multiplier = schedules.piecewise(
        0.0, [schedules.steps(5, 1.0, schedules.linear()), schedules.rest(0.1, schedules.cosine())], total_steps=30
    )
    base_lr = 0.05
    lr = schedules.scale(multiplier, base_lr)
    make_ours = {"adamw": optim.adamw, "sgd": lambda lr: optim.sgd(lr, momentum=0.9)}[name]
    make_torch = {"adamw": torch.optim.AdamW, "sgd": lambda p, lr: torch.optim.SGD(p, lr, momentum=0.9)}[name]
    ours, state = _run_ours(make_ours(lr), params, grads)

    def lambda_lr(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(multiplier(torch.tensor(step))))

    theirs = _run_torch(lambda p: make_torch(p, base_lr), params, grads, scheduler=lambda_lr)
    assert_trees_close(ours, theirs, rtol=RTOL, atol=ATOL)
    assert int(state.count) == 30


def test_adamw_weight_decay_mask_decays_only_selected_leaves():
    params, grads = _problem([(2, 3), (3,)], seed=1, num_steps=5)
    mask = optim.adamw(0.1, weight_decay=0.5, weight_decay_mask=lambda name, leaf: leaf.ndim >= 2)
    ours, _ = _run_ours(mask, params, grads)
    decayed, _ = _run_ours(optim.adamw(0.1, weight_decay=0.5), params, grads)
    undecayed, _ = _run_ours(optim.adamw(0.1, weight_decay=0.0), params, grads)
    assert_trees_close(ours["p0"], decayed["p0"], rtol=0, atol=0)
    assert_trees_close(ours["p1"], undecayed["p1"], rtol=0, atol=0)
    assert not torch.equal(decayed["p1"], undecayed["p1"])


FLOAT_TREES = tensor_trees(tensors(dtypes=[torch.float32, torch.bfloat16, torch.float64]), max_leaves=6)

TRANSFORMS = {
    "adamw": lambda: optim.adamw(1e-2),
    "adam_amsgrad": lambda: optim.adam(1e-2, amsgrad=True, weight_decay=0.1),
    "sgd_momentum": lambda: optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
}


@given(FLOAT_TREES, st.sampled_from(sorted(TRANSFORMS)))
def test_init_mirrors_params(params, name):
    state = TRANSFORMS[name]().init(params)
    buffers = [state.momentum_buffer] if name.startswith("sgd") else [state.mu, state.nu]
    if name == "adam_amsgrad":
        buffers.append(state.nu_max)
    for buffer in buffers:
        assert_trees_equal_structure(buffer, params)
        for got, param in zip(tree_leaves(buffer), tree_leaves(params), strict=True):
            assert (got.shape, got.dtype) == (param.shape, param.dtype)
            assert not got.any()
    assert (state.count.shape, state.count.dtype, int(state.count)) == ((), torch.int64, 0)


@given(tensor_trees(tensors(dtypes=[torch.float32, torch.bfloat16]), max_leaves=6), st.booleans())
def test_stochastic_adamw_init_mirrors_params_in_state_dtype(params, bf16_state):
    state_dtype = torch.bfloat16 if bf16_state else torch.float32
    state = optim.stochastic_adamw(1e-3, state_dtype=state_dtype, key=0).init(params)
    for buffer in (state.mu, state.nu):
        assert_trees_equal_structure(buffer, params)
        for got, param in zip(tree_leaves(buffer), tree_leaves(params), strict=True):
            assert (got.shape, got.dtype) == (param.shape, state_dtype)
    assert torch.equal(state.key, prng.key(0))


def _transform_pool() -> list[Callable[[], optim.Transform]]:
    return [
        lambda: optim.clip_by_global_norm(0.5),
        lambda: optim.sgd(0.1, momentum=0.9),
        lambda: optim.adam(0.01, weight_decay=0.1),
        lambda: optim.masked(optim.sgd(2.0), lambda name, leaf: name.endswith("0")),
        lambda: optim.adamw(0.01, amsgrad=True),
    ]


@settings(max_examples=25)
@given(st.lists(st.integers(0, 4), min_size=3, max_size=3), SHAPES, SEEDS)
def test_chain_is_associative(picks, shapes, seed):
    pool = _transform_pool()
    a, b, c = (pool[i] for i in picks)
    params, grads = _problem(shapes, seed, num_steps=3)
    left, _ = _run_ours(optim.chain(optim.chain(a(), b()), c()), params, grads)
    right, _ = _run_ours(optim.chain(a(), optim.chain(b(), c())), params, grads)
    flat, state = _run_ours(optim.chain(a(), b(), c()), params, grads)
    assert_trees_close(left, right, rtol=0, atol=0)
    assert_trees_close(left, flat, rtol=0, atol=0)
    assert isinstance(state, tuple)
    assert len(state) == 3


@given(SHAPES, SEEDS, st.floats(1e-3, 10.0), st.floats(0.0, 5.0))
def test_clip_by_global_norm_matches_clip_grad_norm(shapes, seed, max_norm, grad_scale):
    params, (grads,) = _problem(shapes, seed, num_steps=1)
    grads = tree_map(lambda g: g * grad_scale, grads)
    clip = optim.clip_by_global_norm(max_norm)
    ours, _ = clip.update(grads, clip.init(params))
    torch_params = [torch.nn.Parameter(p.clone()) for p in params.values()]
    for param, grad in zip(torch_params, grads.values(), strict=True):
        param.grad = grad.clone()
    total = torch.nn.utils.clip_grad_norm_(torch_params, max_norm, foreach=True)
    assert_trees_close(ours, {k: p.grad for k, p in zip(grads, torch_params, strict=True)})
    assert_trees_close(optim.global_norm(grads), total)


def test_global_norm_skips_none_and_handles_empty_and_bf16():
    tree = {"a": torch.full((4,), 0.5, dtype=torch.bfloat16), "frozen": None, "b": [torch.tensor([[1.0]])]}
    norm = optim.global_norm(tree)
    assert (norm.dtype, norm.shape) == (torch.float32, ())
    assert_trees_close(norm, torch.tensor(math.sqrt(2.0)))
    assert_trees_close(optim.global_norm({}), torch.tensor(0.0), rtol=0, atol=0)


def test_masked_applies_inner_only_to_selected_leaves():
    params = {"fc.weight": torch.ones(2, 2), "fc.bias": torch.ones(2), "norm.weight": torch.ones(2)}
    grads = tree_map(lambda p: torch.full_like(p, 2.0), params)
    opt = optim.masked(optim.sgd(0.5, momentum=0.9), lambda name, leaf: leaf.ndim >= 2)
    state = opt.init(params)
    assert list(state.inner.momentum_buffer) == ["fc.weight"]
    updates, state = opt.update(grads, state, params)
    assert_trees_close(updates["fc.weight"], torch.full((2, 2), -1.0))
    assert updates["fc.bias"] is grads["fc.bias"]
    assert updates["norm.weight"] is grads["norm.weight"]
    assert list(updates) == list(params)


def test_masked_works_on_nested_trees_with_dotted_names():
    params = {"blocks": [{"w": torch.ones(2)}, {"w": torch.ones(2)}]}
    opt = optim.masked(optim.sgd(1.0), lambda name, leaf: name == "blocks.1.w")
    updates, _ = opt.update(tree_map(torch.ones_like, params), opt.init(params), params)
    assert_trees_close(updates, {"blocks": [{"w": torch.ones(2)}, {"w": -torch.ones(2)}]})


def test_apply_updates_keeps_dtype_and_skips_none():
    params = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2), "c": torch.zeros(1)}
    out = optim.apply_updates(params, {"a": torch.full((3,), 2.0**-10), "b": torch.ones(2), "c": None})
    assert (out["a"].dtype, out["b"].dtype) == (torch.bfloat16, torch.float32)
    assert_trees_close(out["b"], torch.full((2,), 2.0))
    assert out["c"] is params["c"]
    # One rounding of the float32 sum, not two: 1 + 2**-10 is below half a bf16 ulp at 1.0.
    assert_trees_close(out["a"], torch.ones(3, dtype=torch.bfloat16), rtol=0, atol=0)


def test_apply_updates_handles_empty_and_zero_size_leaves():
    assert optim.apply_updates({}, {}) == {}
    params = {"e": torch.zeros(0, 3)}
    opt = optim.adamw(0.1)
    updates, _ = opt.update({"e": torch.zeros(0, 3)}, opt.init(params), params)
    assert optim.apply_updates(params, updates)["e"].shape == (0, 3)


# --- stochastic rounding -------------------------------------------------------------------------------------


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above float32 ``x`` in magnitude (truncation and the next pattern)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF0000
    high = low + 0x10000

    def as_float(b: torch.Tensor) -> torch.Tensor:
        return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)

    return as_float(low), as_float(high)


@given(
    st.floats(-1e38, 1e38).map(lambda v: float(torch.tensor(v, dtype=torch.float32))),
    st.integers(0, 2**32 - 1),
)
def test_stochastic_round_is_unbiased_and_picks_a_neighbour(value, seed):
    num_samples = 4096
    x = torch.full((num_samples,), value, dtype=torch.float32)
    y = prng.key(seed)
    rounded = optim.stochastic_round(x, y).float()
    low, high = _bf16_neighbours(x[:1])
    assert bool(((rounded == low) | (rounded == high)).all())
    gap = float((high - low).abs())
    # Each sample is low or high, so its std is at most gap/2: the mean is within 6 sigma of the value.
    assert abs(float(rounded.double().mean()) - value) <= 6 * gap / (2 * math.sqrt(num_samples))


@st.composite
def _splits(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, int]:
    """(shape, dim, ranks, seed): a tensor of 0-4 dims split over ``ranks`` along ``dim`` as ``torch.chunk`` (the
    ``DTensor`` ``Shard(dim)`` split: uneven, trailing ranks empty) or into equal parts when ``ranks`` divides it."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    dim = draw(st.integers(0, len(shape) - 1))
    divisors = [n for n in range(1, shape[dim] + 1) if shape[dim] % n == 0]
    ranks = draw(st.sampled_from(divisors) | st.integers(1, 9))
    return shape, dim, ranks, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60)
@given(_splits())
def test_random_bits_of_a_split_tensor_are_the_slices_of_the_whole_ones(split):
    """Each part's bits, drawn from its offset in the whole (what a ``DTensor`` shard draws), are the part of the
    whole tensor's bits, so the parts put back together are the whole's: the noise is the same on any layout."""
    shape, dim, ranks, seed = split
    key = prng.key(seed)
    whole = prng.random_bits(key, shape)
    start, parts = 0, []
    for part in torch.arange(shape[dim]).chunk(ranks):
        size = tuple(len(part) if d == dim else n for d, n in enumerate(shape))
        offset = tuple(start if d == dim else 0 for d in range(len(shape)))
        parts.append(prng.random_bits(key, size, offset=offset, whole=shape))
        assert torch.equal(parts[-1], whole.narrow(dim, start, len(part)))
        start += len(part)
    assert torch.equal(torch.cat(parts, dim), whole)


def test_random_bits_of_a_block_needs_offset_and_whole_per_dim():
    with pytest.raises(ValueError, match=r"random_bits: shape \(2, 3\), offset \(0,\) and whole \(4, 4\) must all"):
        prng.random_bits(prng.key(0), (2, 3), offset=(0,), whole=(4, 4))


def test_stochastic_round_keeps_nan_inf_and_exact_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -2.5])
    y = optim.stochastic_round(x, prng.key(1))
    assert torch.isnan(y[0])
    assert y[1:3].tolist() == [float("inf"), -float("inf")]
    assert torch.equal(y[3:].float(), x[3:])
    assert torch.equal(y[3:].float().signbit(), x[3:].signbit())


def test_stochastic_adamw_is_unbiased_in_expectation():
    num_keys = 400
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, generator=gen).to(torch.bfloat16)}
    grads = {"w": torch.randn(64, generator=gen)}
    opt = optim.stochastic_adamw(1e-2, weight_decay=0.1, key=0)
    exact_updates, _ = opt.update(
        grads, opt.init(tree_map(torch.Tensor.float, params)), tree_map(torch.Tensor.float, params)
    )
    exact = params["w"].float() + exact_updates["w"]  # the float32 result the rounding aims at
    samples = []
    for seed in range(num_keys):
        opt = optim.stochastic_adamw(1e-2, weight_decay=0.1, key=seed)
        updates, _ = opt.update(grads, opt.init(params), params)
        samples.append(optim.apply_updates(params, updates)["w"].float())
    samples = torch.stack(samples)
    low, high = _bf16_neighbours(exact)
    assert bool(((samples == low) | (samples == high)).all())
    gap = (high - low).abs()
    bound = 6 * gap / (2 * math.sqrt(num_keys))
    assert bool(((samples.mean(0) - exact).abs() <= bound).all())
    # Not round-to-nearest: most elements see both neighbours across the keys.
    assert float(((samples == low).any(0) & (samples == high).any(0)).float().mean()) > 0.5


@settings(max_examples=20)
@given(SHAPES, SEEDS, st.sampled_from([torch.float32, torch.bfloat16]), st.floats(1e-4, 1.0))
def test_stochastic_adamw_is_bit_deterministic_and_exact_through_apply_updates(shapes, seed, state_dtype, lr):
    params, grads = _problem(shapes, seed, num_steps=3, dtype=torch.bfloat16)
    opt = optim.stochastic_adamw(lr, weight_decay=0.1, state_dtype=state_dtype, key=seed)
    state = opt.init(params)
    for g in grads:
        updates, new_state = opt.update(g, state, params)
        again = opt.update(g, state, params)
        assert_trees_close((updates, new_state), again, rtol=0, atol=0)
        new_params = optim.apply_updates(params, updates)
        for p, u, new in zip(params.values(), updates.values(), new_params.values(), strict=True):
            # The update is the exact float32 difference of two bf16 values, so the sum is exact.
            assert torch.equal(new.double(), p.double() + u.double())
        params, state = new_params, new_state


def test_stochastic_adamw_depends_on_key_and_step():
    params = {"w": torch.ones(1000, dtype=torch.bfloat16)}
    grads = {"w": torch.ones(1000)}

    def first_update(key: int, count: int = 0) -> torch.Tensor:
        opt = optim.stochastic_adamw(1e-3, weight_decay=0.0, key=key)
        state = opt.init(params)._replace(count=torch.tensor(count))
        return opt.update(grads, state, params)[0]["w"]

    assert torch.equal(first_update(0), first_update(0))
    assert not torch.equal(first_update(0), first_update(1))
    assert not torch.equal(first_update(0, count=5), first_update(0, count=6))


# --- the learning rate in the state ----------------------------------------------------------------------------

LR_SCHEDULE = schedules.warmup_cosine(0.1, 3, 10)
RECORDING = {
    "adamw": lambda lr: optim.adamw(lr),
    "adam_amsgrad": lambda lr: optim.adam(lr, amsgrad=True),
    "sgd": lambda lr: optim.sgd(lr),
    "sgd_momentum": lambda lr: optim.sgd(lr, momentum=0.9),
    "stochastic_adamw": lambda lr: optim.stochastic_adamw(lr, key=0),
}


@pytest.mark.parametrize("name", sorted(RECORDING))
def test_state_records_the_rate_each_update_used(name):
    params, grads = _problem([(2, 3), (3,)], seed=0, num_steps=6)
    opt = RECORDING[name](LR_SCHEDULE)
    state = opt.init(params)
    assert torch.equal(state.lr, LR_SCHEDULE(torch.tensor(0)))  # before any update: the first update's rate
    for count, g in enumerate(grads):
        updates, state = opt.update(g, state, params)
        expected = LR_SCHEDULE(torch.tensor(count))
        assert (state.lr.shape, state.lr.dtype) == ((), torch.float32)
        assert torch.equal(state.lr, expected)
        assert torch.equal(optim.learning_rate(state), expected)
        if name == "sgd":  # the recorded rate is the one the update multiplied by
            assert torch.equal(updates["p0"], g["p0"] * -state.lr)
    constant = RECORDING[name](0.1)
    _, state = constant.update(grads[0], constant.init(params), params)
    assert torch.equal(optim.learning_rate(state), torch.tensor(0.1, dtype=torch.float32))


def test_learning_rate_looks_through_chain_and_masked_and_is_nan_without_a_rate():
    params, grads = _problem([(2, 3), (3,)], seed=1, num_steps=3)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.masked(optim.sgd(LR_SCHEDULE), lambda name, leaf: name == "p0"),
        optim.masked(optim.adamw(0.5), lambda name, leaf: name == "p1"),
    )
    state = opt.init(params)
    for g in grads:
        _, state = opt.update(g, state, params)
    # The first transform in tree order that records a rate: the masked sgd, after 3 updates.
    assert torch.equal(optim.learning_rate(state), LR_SCHEDULE(torch.tensor(2)))
    assert torch.equal(optim.learning_rate(state[2]), torch.tensor(0.5))
    assert torch.isnan(optim.learning_rate(optim.clip_by_global_norm(1.0).init(params)))
    assert torch.isnan(optim.learning_rate(optim.chain().init(params)))
    compiled = torch.compile(optim.learning_rate, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(state), LR_SCHEDULE(torch.tensor(2)))


# --- compile ---------------------------------------------------------------------------------------------------

COMPILED = {
    "adamw_schedule": lambda: optim.adamw(
        schedules.warmup_cosine(1e-2, 2, 10), amsgrad=True, weight_decay_mask=lambda n, leaf: leaf.ndim >= 2
    ),
    "adam": lambda: optim.adam(1e-2, weight_decay=0.1, maximize=True),
    "sgd": lambda: optim.sgd(1e-2, momentum=0.9, dampening=0.1, weight_decay=0.1),
    "chain_clip_masked": lambda: optim.chain(
        optim.clip_by_global_norm(1.0), optim.masked(optim.adamw(1e-2), lambda n, leaf: n != "b")
    ),
    "stochastic_adamw": lambda: optim.stochastic_adamw(1e-2, state_dtype=torch.bfloat16, key=3),
}


def _compile_case(name: str):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if name == "stochastic_adamw" else torch.float32
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in {"a": (3, 4), "b": (5,), "c": ()}.items()}
    grads = [tree_map(lambda p: torch.randn(p.shape, generator=gen).to(p.dtype), params) for _ in range(4)]
    opt = COMPILED[name]()

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return opt, step, params, grads


@pytest.mark.parametrize(
    # stochastic_adamw compiles the longest (about 10 s on 2 busy cores): it runs in the full suite only.
    "name",
    [pytest.param(name, marks=pytest.mark.slow) if name == "stochastic_adamw" else name for name in sorted(COMPILED)],
)
def test_update_compiles_without_graph_breaks_or_recompiles(name):
    opt, step, params, grads = _compile_case(name)
    torch._dynamo.reset()
    # fullgraph=True raises on any graph break, so compiling at all proves there are none.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_params, eager_state = params, opt.init(params)
    comp_params, comp_state = compiled(params, opt.init(params), grads[0])
    eager_params, eager_state = step(eager_params, eager_state, grads[0])
    with torch.compiler.set_stance("fail_on_recompile"):
        for g in grads[1:]:
            comp_params, comp_state = compiled(comp_params, comp_state, g)
            eager_params, eager_state = step(eager_params, eager_state, g)
    assert_trees_close((comp_params, comp_state), (eager_params, eager_state), rtol=0, atol=0)


# torch's inductor imports a deprecated torch.jit API; the warning is torch's, not ours.
INDUCTOR_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


@pytest.mark.slow
@pytest.mark.filterwarnings(INDUCTOR_WARNING)
@pytest.mark.compiled
def test_adamw_with_schedule_under_inductor_matches_eager():
    opt, step, params, grads = _compile_case("adamw_schedule")
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    comp, comp_state = compiled(params, opt.init(params), grads[0])
    eager, eager_state = step(params, opt.init(params), grads[0])
    with torch.compiler.set_stance("fail_on_recompile"):
        for g in grads[1:]:
            comp, comp_state = compiled(comp, comp_state, g)
            eager, eager_state = step(eager, eager_state, g)
    assert_trees_close((comp, comp_state), (eager, eager_state), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.filterwarnings(INDUCTOR_WARNING)
@pytest.mark.compiled
def test_stochastic_round_under_inductor_is_bit_identical_to_eager():
    # The risky lowerings (float/int bitcasts, the int64 hash) checked alone: inductor's C++ build of the
    # whole stochastic_adamw step takes minutes on a CPU, while on a GPU it is a Triton kernel.
    x = torch.randn(1000) * torch.logspace(-30, 30, 1000)
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    torch._dynamo.reset()
    compiled = torch.compile(optim.stochastic_round, fullgraph=True)
    for seed in range(3):
        key = prng.key(seed)
        assert torch.equal(compiled(x, key).view(torch.int16), optim.stochastic_round(x, key).view(torch.int16))


# --- purity ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_update_and_apply_updates_never_mutate_inputs(name):
    opt, step, params, grads = _compile_case(name)
    state = step(params, opt.init(params), grads[0])[1]  # a non-trivial state (nonzero moments, count 1)
    before = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (params, state, grads[1]))
    new_params, _ = step(params, state, grads[1])
    assert_trees_close((params, state, grads[1]), before, rtol=0, atol=0)
    assert not torch.equal(new_params["a"].float(), params["a"].float())


# --- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: optim.adamw(-1.0), r"adamw: lr=-1.0 must be finite and >= 0"),
        (lambda: optim.adamw("0.1"), r"adamw: lr='0.1' is a str"),
        (lambda: optim.adam(0.1, betas=(0.9, 1.0)), r"adam: betas\[1\]=1.0 is outside \[0.0, 1.0\)"),
        (lambda: optim.adamw(0.1, betas=(0.9,)), r"adamw: betas=\(0.9,\) must be a pair"),
        (lambda: optim.sgd(0.1, nesterov=True), r"sgd: nesterov=True needs momentum > 0 and dampening == 0"),
        (lambda: optim.sgd(0.1, momentum=1.5), r"sgd: momentum=1.5 is outside \[0.0, 1.0\]"),
        (lambda: optim.clip_by_global_norm(-1.0), r"clip_by_global_norm: max_norm=-1.0 is outside"),
        (lambda: optim.stochastic_adamw(0.1, state_dtype=torch.float16, key=0), r"state_dtype=torch.float16"),
        (lambda: optim.stochastic_adamw(0.1, key=torch.zeros(2, dtype=torch.int64)), r"key has shape \(2,\)"),
    ],
)
def test_factories_reject_bad_hyperparameters(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_update_names_the_missing_key_and_the_fix():
    params = {"w": torch.zeros(2), "b": torch.zeros(1)}
    opt = optim.adamw(0.1)
    with pytest.raises(ValueError, match=r"adamw.update: grads does not match .* missing \['b'\].*init was given"):
        opt.update({"w": torch.zeros(2)}, opt.init(params), params)


def test_update_names_the_leaf_with_the_wrong_shape():
    params = {"w": torch.zeros(2)}
    opt = optim.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"sgd.update: state.momentum_buffer\['w'\] has shape \(2,\) but grads"):
        opt.update({"w": torch.zeros(3)}, opt.init(params), params)


def test_update_without_params_raises_when_weight_decay_needs_them():
    params = {"w": torch.zeros(2)}
    opt = optim.adamw(0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"adamw.update: weight_decay=0.1 needs the params"):
        opt.update({"w": torch.zeros(2)}, opt.init(params))
    stochastic = optim.stochastic_adamw(0.1, key=0)
    with pytest.raises(ValueError, match=r"stochastic_adamw.update: stochastic rounding produces the new params"):
        stochastic.update({"w": torch.zeros(2)}, stochastic.init(params))


def test_predicate_must_return_a_python_bool():
    params = {"w": torch.zeros(2)}
    opt = optim.adamw(0.1, weight_decay_mask=lambda name, leaf: leaf.sum() > 0)
    with pytest.raises(TypeError, match=r"the predicate returned a Tensor for \['w'\]"):
        opt.update({"w": torch.zeros(2)}, opt.init(params), params)


def test_non_tensor_leaves_and_unsupported_dtypes_are_rejected():
    with pytest.raises(TypeError, match=r"adamw.init: params\['frozen'\] is a NoneType, not a tensor"):
        optim.adamw(0.1).init({"w": torch.zeros(1), "frozen": None})
    with pytest.raises(TypeError, match=r"stochastic_adamw.init: params\['w'\] has dtype torch.float16"):
        optim.stochastic_adamw(0.1, key=0).init({"w": torch.zeros(1, dtype=torch.float16)})
    with pytest.raises(TypeError, match=r"stochastic_round: x has dtype torch.bfloat16"):
        optim.stochastic_round(torch.zeros(1, dtype=torch.bfloat16), prng.key(0))


def test_chain_rejects_non_transforms_and_foreign_state():
    with pytest.raises(TypeError, match=r"chain: argument 1 is a function, not a Transform"):
        optim.chain(optim.sgd(0.1), lambda g: g)
    opt = optim.chain(optim.sgd(0.1), optim.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match=r"chain.update: got 1 states for 2 transforms"):
        opt.update({"w": torch.zeros(1)}, (opt.init({"w": torch.zeros(1)})[0],))


def test_apply_updates_names_the_leaf_with_the_wrong_shape():
    with pytest.raises(ValueError, match=r"apply_updates: updates\['w'\] is \(3,\) but params\['w'\] has shape \(2,\)"):
        optim.apply_updates({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"apply_updates: updates does not match .* unexpected \['v'\]"):
        optim.apply_updates({"w": torch.zeros(2)}, {"w": torch.zeros(2), "v": torch.zeros(2)})


def test_masked_rejects_duplicate_dotted_names():
    params = {"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError, match=r"masked.init: two leaves share the name 'a.b'"):
        optim.masked(optim.sgd(0.1), lambda name, leaf: True).init(params)


_LEAF = st.one_of(st.none(), st.integers(1, 3).map(lambda n: torch.zeros(n)))


@settings(max_examples=100)
@given(
    st.one_of(
        st.dictionaries(st.text("abc.", min_size=1, max_size=4), _LEAF, max_size=5),  # the fast path's flat dicts
        st.dictionaries(st.text("ab", min_size=1, max_size=2), st.one_of(_LEAF, st.tuples(_LEAF)), max_size=4),
        st.tuples(_LEAF, _LEAF),
    )
)
def test_flatten_leaves_agrees_with_optree(tree):
    """The transforms' flatten (a flat dict of tensors as a FlatDict, cheap to trace) is optree's: the same leaves in
    the same order, the same key paths, the same rebuilt tree, and the same structure by ``same_structure``."""
    from d9dfn._pytree import tree_flatten, tree_flatten_with_path
    from d9dfn.optim._base import FlatDict, flatten_leaves, same_structure

    leaves, structure = flatten_leaves(tree)
    paths, expected_leaves, spec = tree_flatten_with_path(tree)
    assert [id(leaf) for leaf in leaves] == [id(leaf) for leaf in expected_leaves]
    assert [tuple(p) for p in structure.paths()] == [tuple(p) for p in paths]
    rebuilt = structure.unflatten(leaves)
    assert type(rebuilt) is type(tree)
    assert tree_flatten(rebuilt)[1] == spec
    assert same_structure(structure, spec)
    assert same_structure(spec, structure)
    flat = isinstance(tree, dict) and all(v is None or isinstance(v, torch.Tensor) for v in tree.values())
    assert isinstance(structure, FlatDict) == flat
    other = {**tree, "zz": None} if isinstance(tree, dict) else (*tree, None)
    assert not same_structure(flatten_leaves(other)[1], spec)
    assert not same_structure(structure, tree_flatten(other)[1])


def test_optimizer_structure_errors_name_the_leaf_on_the_fast_path():
    params = {"a.w": torch.zeros(2), "b.w": torch.zeros(3)}
    opt = optim.adamw(0.1)
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"adamw.update: state.mu\['b.w'\] is a NoneType, not a tensor"):
        opt.update(params, state._replace(mu={"a.w": torch.zeros(2), "b.w": None}), params)
    with pytest.raises(ValueError, match=r"grads does not match the structure of state.mu: missing \['b.w'\]"):
        opt.update({"a.w": torch.zeros(2)}, state, params)
    with pytest.raises(ValueError, match=r"grads\['b.w'\] has shape \(2,\) but state.mu\['b.w'\] has shape \(3,\)"):
        opt.update({"a.w": torch.zeros(2), "b.w": torch.zeros(2)}, state, params)
    with pytest.raises(ValueError, match=r"apply_updates: updates\['b.w'\] is \(1,\) but params\['b.w'\] has shape"):
        optim.apply_updates(params, {"a.w": None, "b.w": torch.zeros(1)})
    assert optim.apply_updates(params, {"a.w": None, "b.w": torch.ones(3)})["b.w"].tolist() == [1.0, 1.0, 1.0]
