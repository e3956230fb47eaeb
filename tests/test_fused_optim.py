"""The optimizers' fused kernels (``Transform.fused``) and the step's fused tail: the same update as the pure
transform to rounding, pure (never writes into params or state), the skip inside the kernel, the device policy,
and a step that runs the kernel eagerly equal to the step that compiles the optimizer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_blocks import LAYER, _batches, _model

from d9dfn import FusedUpdate, init_train_state, make_train_step, optim, schedules
from d9dfn._pytree import tree_map
from d9dfn.step._tail import Tail
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

SHAPES = st.lists(st.sampled_from([(), (1,), (3,), (2, 3), (4, 1, 2)]), min_size=1, max_size=4)


def _factory(name: str, **kw):
    """A fused-capable transform by name, with ``kw`` passed on."""
    makers = {
        "adamw": lambda **k: optim.adamw(**k),
        "adam_l2": lambda **k: optim.adam(**{"weight_decay": 0.05, **k}),
        "adam_decoupled": lambda **k: optim.adam(**{"weight_decay": 0.05, "decoupled_weight_decay": True, **k}),
    }
    return makers[name](**kw)


def _tree(shapes, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(shape, generator=gen).to(dtype) for i, shape in enumerate(shapes)}


def _copy(tree):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _pure_update(opt, grads, state, params, scale):
    updates, new_state = opt.update({k: g / scale for k, g in grads.items()}, state, params)
    return optim.apply_updates(params, updates), new_state


@settings(max_examples=25, deadline=None)
@given(
    SHAPES,
    st.integers(0, 2**31 - 1),
    st.sampled_from(["adamw", "adam_l2", "adam_decoupled"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1.0, 0.25, 8.0]),
)
def test_the_fused_update_equals_the_pure_update(shapes, seed, name, amsgrad, maximize, masked, scale):
    mask = (lambda path, leaf: path != "p0") if masked else None
    kw = {"lr": 3e-2, "amsgrad": amsgrad, "maximize": maximize, "weight_decay_mask": mask, "fused": True}
    opt = _factory(name, **kw)
    assert opt.fused is not None
    assert not opt.fused.auto
    params = _tree(shapes, seed)
    state = opt.init(params)
    fused_params, fused_state = params, state
    for step in range(3):
        grads = tree_map(lambda p, s=step: torch.randn_like(p) + s, params)
        before = _copy((fused_params, fused_state))
        got = opt.fused.apply(_copy(grads), fused_state, fused_params, torch.tensor(scale), None)
        assert_trees_close((fused_params, fused_state), before, rtol=0, atol=0)  # pure: nothing written into
        expected = _pure_update(opt, grads, state, params, scale)
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
        fused_params, fused_state = got
        params, state = expected


def test_the_kernel_skips_a_flagged_update_and_keeps_only_the_scalars_for_the_caller():
    lr = schedules.scale(schedules.piecewise(1.0, [schedules.rest(0.0, schedules.linear())], total_steps=10), 1e-2)
    opt = optim.adamw(lr, fused=True)
    params = _tree([(3,), (2, 3)], 0)
    state = opt.init(params)
    grads = tree_map(torch.ones_like, params)
    new_params, new_state = opt.fused.apply(grads, state, params, torch.tensor(1.0), torch.tensor(1.0))
    assert_trees_close(new_params, params, rtol=0, atol=0)
    assert_trees_close((new_state.mu, new_state.nu), (state.mu, state.nu), rtol=0, atol=0)
    assert int(new_state.count) == 1  # as if updated: the step keeps the scalars (d9dfn.FusedUpdateFn)


def test_fused_none_is_the_steps_choice_by_device_and_false_has_no_kernel():
    auto, forced = optim.adamw(1e-3).fused, optim.adamw(1e-3, fused=True).fused
    assert isinstance(auto, FusedUpdate)
    assert auto.auto
    assert auto.wanted(torch.device("cpu"))
    assert not auto.wanted(torch.device("meta"))
    assert forced.wanted(torch.device("meta"))
    assert optim.adamw(1e-3, fused=False).fused is None
    assert optim.sgd(0.1).fused is None  # no kernel: the compiled tail
    assert optim.chain(optim.adamw(1e-3)).fused is None


def _steps(opt, *, poison_at=None, **kw):
    """Three steps of a 2-layer model with repeated blocks, ``aot_eager``; at ``poison_at`` one param is NaN (and
    the step must then keep the whole state)."""
    model = _model(layers=2)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, compile="aot_eager", repeated_blocks=LAYER, **kw)
    outs = []
    for i, batch in enumerate(_batches(3)):
        if i == poison_at:
            poisoned = state.replace(params={**state.params, "norm.weight": state.params["norm.weight"] * torch.nan})
            new, out = step(poisoned, batch)
            assert bool(out.skipped)
            assert_trees_close((new.params, new.opt_state), (poisoned.params, poisoned.opt_state), rtol=0, atol=0)
            assert_trees_close(new.step, state.step + 1, rtol=0, atol=0)
            state = new.replace(params=state.params)
        else:
            state, out = step(state, batch)
        outs.append(out)
    return state, outs, step


@pytest.mark.parametrize("skip", [False, True])
def test_a_step_with_the_fused_tail_equals_the_compiled_optimizer_tail(skip):
    kw = {"max_grad_norm": 0.5, "skip_nonfinite": skip, "poison_at": 1 if skip else None}
    fused_state, fused_outs, fused_step = _steps(optim.adamw(1e-2, fused=True), **kw)
    state, outs, step = _steps(optim.adamw(1e-2, fused=False), **kw)
    assert isinstance(fused_step.pieces["tail"], Tail)  # the tail itself, run eagerly
    assert not isinstance(step.pieces["tail"], Tail)  # compiled
    assert_trees_close(fused_state.params, state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(fused_state.opt_state, state.opt_state, rtol=1e-5, atol=1e-6)
    for got, expected in zip(fused_outs, outs, strict=True):
        assert_trees_close(
            (got.loss, got.grad_norm, got.lr, got.skipped),
            (expected.loss, expected.grad_norm, expected.lr, expected.skipped),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize(("name", "stages_per_rank"), [("one_f_one_b", 1), ("zero_bubble_v", 2)])
def test_a_pipelined_step_with_the_fused_tail_equals_the_unpipelined_one_bitwise(name, stages_per_rank):
    from test_pipeline_executor import _contiguous_split, _Regression, _setup

    from d9dfn import Sequential, pipeline

    model, opt, state, batches = _setup(4, 4, norm=True, dropout=0.25, fused=True)
    program = pipeline.SCHEDULES[name](2, stages_per_rank, 4)
    stages = pipeline.split_stages(model, _contiguous_split(4, program.num_stages))
    options = {"num_microbatches": 4, "rng_kwarg": "dropout_key", "max_grad_norm": 0.5, "compile": False}
    piped = make_train_step(model, _Regression(), opt, executor=pipeline.Pipeline(program, stages), **options)
    plain = make_train_step(model, _Regression(), opt, executor=Sequential(), **options)
    expected, actual = state, state
    for batch in batches:
        expected, expected_out = plain(expected, batch)
        actual, actual_out = piped(actual, batch)
        assert_trees_close(actual_out, expected_out, rtol=0, atol=0)
    assert_trees_close(actual, expected, rtol=0, atol=0)
    assert isinstance(piped.pieces["tail"], Tail)
