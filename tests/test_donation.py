"""Donation (``make_train_step(donate=True)``): the step updates the train state it is given in place and returns it,
bitwise the pure step's results, for every form of the tail; the state it took is consumed (one clear error on any
read of its params or optimizer state); the fused kernel without its copies; the reduction of the step's own
gradient sums into themselves, a capped bucket at a time, and none at all over one rank."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as torch_pytree
from _ranks import _init, _run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_blocks import LAYER, _batches, _model
from test_fused_optim import _copy, _tree

from d9dfn import init_train_state, make_eval_step, make_train_step, optim, tree_leaves
from d9dfn.parallel._bucket import bucketed
from d9dfn.step._state import Donated
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_close

FORMS = ("fused", "blockwise", "whole")
"""The tail's forms: the optimizer's fused kernel (eager), each repeated block through one region, the whole tree."""

DONATED = r"TrainState\.(params|opt_state) was donated to the train step at step \d+"


def _setup(form: str, layers: int = 2, **kw):
    """A model, its optimizer and the step's keywords for one tail form."""
    model = _model(layers=layers)
    opt = optim.adamw(3e-3, weight_decay=0.01, fused=form == "fused")
    blocks = LAYER if form in ("fused", "blockwise") else ()
    return model, opt, {"repeated_blocks": blocks, **kw}


def _steps(form: str, donate: bool, steps: int = 3, poison_at: int | None = None, **kw):
    """``steps`` steps; at ``poison_at`` one param is NaN (a non-finite step). Returns the last state, the outputs
    and each state the step was given (for a donating step all consumed after their step)."""
    model, opt, options = _setup(form, **kw)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, donate=donate, **options)
    outs, given_states = [], []
    for i, batch in enumerate(_batches(steps)):
        if i == poison_at:
            state = state.replace(params={**state.params, "norm.weight": state.params["norm.weight"] * torch.nan})
        given_states.append(state)
        state, out = step(state, batch)
        outs.append(out)
    return state, outs, given_states


def _assert_bitwise(a, b) -> None:
    (state, outs, _), (ref, ref_outs, _) = a, b
    assert_trees_close(
        (state.params, state.opt_state, state.step), (ref.params, ref.opt_state, ref.step), rtol=0, atol=0
    )
    for got, expected in zip(outs, ref_outs, strict=True):
        assert_trees_close(got, expected, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(
    form=st.sampled_from(FORMS),
    num_microbatches=st.sampled_from([1, 2]),
    max_grad_norm=st.sampled_from([None, 0.05]),
    skip=st.booleans(),
)
def test_a_donating_step_equals_the_pure_step_bitwise(form, num_microbatches, max_grad_norm, skip) -> None:
    kw = {"num_microbatches": num_microbatches, "max_grad_norm": max_grad_norm, "compile": False}
    if skip:
        kw.update(skip_nonfinite=True, poison_at=2)
    donated = _steps(form, donate=True, **kw)
    _assert_bitwise(donated, _steps(form, donate=False, **kw))
    assert [bool(out.skipped) for out in donated[1]] == [False, False, skip]
    first = donated[2][0]
    with pytest.raises(RuntimeError, match=DONATED):
        first.params["norm.weight"]


@pytest.mark.slow  # compiles the step three times
@pytest.mark.parametrize("form", FORMS)
def test_a_donating_compiled_step_equals_the_pure_step_bitwise(form) -> None:
    """``aot_eager``: the compiled tails write their new values into the state's tensors (inputs of the graph)."""
    kw = {"compile": "aot_eager", "max_grad_norm": 0.05}
    _assert_bitwise(_steps(form, donate=True, **kw), _steps(form, donate=False, **kw))


@pytest.mark.parametrize("form", FORMS)
def test_a_donating_step_returns_the_tensors_it_was_given(form) -> None:
    model, opt, options = _setup(form, compile=False)
    state = init_train_state(model, opt)
    params, moments = dict(state.params), dict(state.opt_state.nu)
    step = make_train_step(model, CausalLMTask(), opt, donate=True, **options)
    new, _ = step(state, _batches(1)[0])
    assert all(new.params[name] is p for name, p in params.items())
    assert all(new.opt_state.nu[name] is v for name, v in moments.items())
    assert not torch.equal(new.opt_state.nu["norm.weight"], torch.zeros_like(moments["norm.weight"]))  # updated
    assert new.opt_state.count is not state.step  # the scalars are new tensors: the outputs may keep them


def test_a_consumed_state_raises_on_every_read_of_what_it_gave_up() -> None:
    model, opt, options = _setup("fused", compile=False)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, donate=True, **options)
    batch = _batches(1)[0]
    new, _ = step(state, batch)
    reads = {
        "an item": lambda: state.params["norm.weight"],
        "a method": lambda: state.params.items(),
        "len": lambda: len(state.params),
        "an iteration": lambda: list(state.params),
        "a truth value": lambda: bool(state.params),
        "a moment": lambda: state.opt_state.mu,
        "d9dfn's flatten": lambda: tree_leaves(state),
        "torch's flatten": lambda: torch_pytree.tree_leaves(state),
        "the donating step again": lambda: step(state, batch),
        "a pure step": lambda: make_train_step(model, CausalLMTask(), opt, **options)(state, batch),
        "an eval step": lambda: make_eval_step(model, CausalLMTask(), compile=False)(state, None, batch),
    }
    for what, read in reads.items():
        with pytest.raises(RuntimeError, match=DONATED + r".*use the state that step returned") as caught:
            read()
        assert "step 0" in str(caught.value), what
    assert isinstance(state.params, Donated)
    assert "donated" in repr(state.params)
    # What the step did not take stays readable; the new state flattens as any live one.
    assert int(state.step) == 0
    assert set(state.buffers) == set(new.buffers)
    assert len(tree_leaves(new)) == len(tree_leaves(new.replace()))
    step(new, batch)  # the returned state is live
    with pytest.raises(RuntimeError, match=r"at step 1"):
        new.params["norm.weight"]


def test_a_pure_step_leaves_the_state_it_is_given_alone() -> None:
    model, opt, options = _setup("fused", compile=False)
    state = init_train_state(model, opt)
    before = _copy((state.params, state.opt_state))
    step = make_train_step(model, CausalLMTask(), opt, **options)
    step(state, _batches(1)[0])
    assert_trees_close((state.params, state.opt_state), before, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.sampled_from([(), (1,), (3,), (2, 3), (4, 1, 2)]), min_size=1, max_size=4),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_the_fused_kernel_in_place_equals_its_pure_form_bitwise(shapes, seed, amsgrad) -> None:
    opt = optim.adamw(3e-2, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    params = _tree(shapes, seed)
    state = opt.init(params)
    mine_params, mine_state = _copy((params, state))
    for i in range(3):
        grads = {k: torch.randn_like(p) + i for k, p in params.items()}
        params, state = opt.fused.apply(_copy(grads), state, params, torch.tensor(2.0), None)
        got_params, got_state = opt.fused.apply(
            _copy(grads), mine_state, mine_params, torch.tensor(2.0), None, in_place=True
        )
        assert all(got_params[k] is mine_params[k] for k in params)  # written into, and returned
        assert all(got_state.mu[k] is mine_state.mu[k] for k in params)
        assert_trees_close((got_params, got_state), (params, state), rtol=0, atol=0)
        mine_params, mine_state = got_params, got_state


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([(), (1,), (5,), (2, 3)]), st.sampled_from([0, 1])), min_size=1, max_size=6),
    st.sampled_from([1, 8, 20, 1 << 20]),
)
def test_a_bucketed_reduction_into_its_inputs_equals_the_flat_one(specs, cap_bytes) -> None:
    """Copied back into the inputs, bucket by bucket (cut at ``cap_bytes``), the results are the flat reduction's;
    the collective runs once per capped bucket."""
    gen = torch.Generator().manual_seed(len(specs))
    tensors = [torch.randn(shape, generator=gen) for shape, _ in specs]
    keys = [key for _, key in specs]
    calls: list[int] = []

    def collective(flat: torch.Tensor, key) -> torch.Tensor:  # in place, as the step's all-reduce does
        calls.append(flat.numel())
        return flat.mul_(3.0).add_(key)

    expected = bucketed([t.clone() for t in tensors], lambda flat, key: flat * 3.0 + key, group_by=keys)
    calls.clear()
    got = bucketed(tensors, collective, group_by=keys, into_inputs=True, cap_bytes=cap_bytes)
    assert all(g is t for g, t in zip(got, tensors, strict=True))
    assert_trees_close(got, expected, rtol=0, atol=0)
    assert max(calls) * 4 <= max(cap_bytes, max(t.numel() * 4 for t in tensors))
    if cap_bytes >= 1 << 20:
        assert len(calls) == len(set(keys))  # one bucket per key under a large cap


def test_a_reduction_over_one_rank_makes_no_flat_copy() -> None:
    """On a mesh of one the all-reduce is the identity: each gradient is placed as it is (no ``cat`` into a bucket)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from d9dfn.loop import init_data_parallel_mesh
    from d9dfn.parallel import distribute_params
    from d9dfn.parallel._grads import reduce_partial_gradients

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_data_parallel_mesh(1, 1, device_type="cpu")
        params = distribute_params({"a": torch.ones(3, 2), "b": torch.ones(4)}, mesh)
        grads = {"a": torch.randn(3, 2), "b": torch.randn(4)}
        for in_place in (False, True):
            reduced = reduce_partial_gradients(grads, params, in_place=in_place)
            for name, grad in grads.items():
                assert reduced[name].to_local().data_ptr() == grad.data_ptr(), (name, in_place)
    finally:
        dist.destroy_process_group()


def _replicated_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file)
    try:
        from d9dfn import parallel
        from d9dfn.loop import init_data_parallel_mesh

        mesh = init_data_parallel_mesh(world_size, 1, device_type="cpu")
        runs = []
        for donate in (False, True):
            model, opt, options = _setup("fused", compile=False, max_grad_norm=0.05)
            state = init_train_state(model, opt, mesh=mesh)
            step = make_train_step(
                model, CausalLMTask(), opt, plan=parallel.plan_for(state.params, mesh), donate=donate, **options
            )
            outs = []
            for batch in _batches(3):
                state, out = step(state, {k: v[rank::world_size] for k, v in batch.items()})
                outs.append(out)
            runs.append(((state, outs, None), parallel.full_tensors(state.params)))
        (donated, donated_full), (pure, pure_full) = runs[1], runs[0]
        _assert_bitwise(donated, pure)
        assert_trees_close(donated_full, pure_full, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # forked ranks
@pytest.mark.ranks
def test_a_donating_replicated_step_on_two_ranks_equals_the_pure_one_bitwise(tmp_path) -> None:
    """On real gloo ranks, the fused tail: the gradient sums all-reduced into themselves, params and moments updated
    in place (replicated ``DTensor`` s), bitwise the pure step."""
    _run_ranks(_replicated_worker, 2, tmp_path, timeout_s=120)
