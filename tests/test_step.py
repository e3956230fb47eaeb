"""The compiled step: weighted accumulation, purity, compile behaviour, frozen params, non-finite steps."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import d9dfn.optim as optim
from d9dfn import (
    BuildForwardInputsResult,
    ComputeLossResult,
    InferenceState,
    InferenceTask,
    TrainTask,
    frozen_names,
    init_train_state,
    make_eval_step,
    make_inference_step,
    make_train_step,
    schedules,
    tree_map,
)
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.tasks import IGNORE_INDEX, CausalLMTask
from d9dfn.testing import assert_trees_close

# --- small models and tasks --------------------------------------------------------------------------


class TokenRegressor(nn.Module):
    """(B, T) ids -> (B, T, V) logits through an embedding and a BatchNorm'd linear layer."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)  # (B, T, D)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return {"logits": self.head(torch.tanh(x))}


class NoNormRegressor(TokenRegressor):
    """Without BatchNorm, so microbatch statistics do not change the function."""

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(torch.tanh(self.embed(input_ids)))}


def _batch(batch: int, seq: int, vocab: int = 11, *, masked: list[int] | None = None, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    for row, count in enumerate(masked or []):
        if count:
            labels[row, :count] = IGNORE_INDEX
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}


def _full_batch_token_mean_grad(model: nn.Module, params: dict, batch: dict) -> dict:
    def loss_fn(p: dict) -> torch.Tensor:
        logits = torch.func.functional_call(model, p, (batch["input_ids"],))["logits"]
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)

    return torch.func.grad(loss_fn)(params)


# --- weighted accumulation ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    num_microbatches=st.sampled_from([1, 2, 4]),
    masked=st.lists(st.integers(0, 5), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_make_train_step_microbatched_gradient_equals_full_batch_token_mean(num_microbatches, masked, seed):
    torch.manual_seed(seed)
    model = NoNormRegressor()
    batch = _batch(8, 6, masked=masked, seed=seed)
    # SGD with lr=1: the update is exactly minus the gradient the step computed.
    opt = optim.sgd(1.0)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, num_microbatches=num_microbatches, compile=False)
    new_state, output = step(state, batch)
    expected = _full_batch_token_mean_grad(model, state.params, batch)
    got = {name: state.params[name] - new_state.params[name] for name in expected}
    assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
    num_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
    assert float(output.loss_weight) == num_tokens


def test_make_train_step_loss_is_weighted_mean_over_microbatches():
    model = NoNormRegressor()
    batch = _batch(4, 5, masked=[5, 0, 3, 1])
    opt = optim.sgd(0.0)
    state = init_train_state(model, opt)
    _, output = make_train_step(model, CausalLMTask(), opt, num_microbatches=4, compile=False)(state, batch)
    logits = torch.func.functional_call(model, state.params, (batch["input_ids"],))["logits"]
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(output.loss, expected)


def test_make_train_step_all_masked_batch_gives_zero_gradient_not_nan():
    model = NoNormRegressor()
    batch = _batch(2, 4, masked=[4, 4])
    opt = optim.sgd(1.0)
    state = init_train_state(model, opt)
    new_state, output = make_train_step(model, CausalLMTask(), opt, num_microbatches=2, compile=False)(state, batch)
    assert float(output.loss) == 0.0
    assert float(output.grad_norm) == 0.0
    assert_trees_close(new_state.params, state.params)


# --- purity, buffers, frozen params -------------------------------------------------------------------


def test_make_train_step_never_mutates_inputs_and_returns_new_buffers():
    model = TokenRegressor()
    opt = optim.adamw(1e-2)
    state = init_train_state(model, opt)
    batch = _batch(4, 5)
    before_state = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    before_batch = tree_map(torch.clone, batch)
    new_state, _ = make_train_step(model, CausalLMTask(), opt, num_microbatches=2, compile=False)(state, batch)
    assert_trees_close(state, before_state, rtol=0, atol=0)
    assert_trees_close(batch, before_batch, rtol=0, atol=0)
    # BatchNorm ran twice (two microbatches) on the new buffers only.
    assert int(new_state.buffers["norm.num_batches_tracked"]) == 2
    assert not torch.equal(new_state.buffers["norm.running_mean"], state.buffers["norm.running_mean"])
    assert int(new_state.step) == 1


def test_make_train_step_frozen_params_get_no_gradient_and_no_optimizer_state():
    model = NoNormRegressor()
    opt = optim.adamw(1e-1)
    state = init_train_state(model, opt, trainable=lambda name, _: not name.startswith("embed"))
    assert list(state.params) == [name for name, _ in model.named_parameters()]  # frozen ones stay params
    assert state.frozen == ("embed.weight",)
    assert "embed.weight" not in state.buffers
    assert "embed.weight" not in state.opt_state.mu
    step = make_train_step(model, CausalLMTask(), opt, compile=False)
    new_state, _ = step(state, _batch(4, 5))
    assert new_state.frozen == state.frozen
    assert list(new_state.params) == list(state.params)
    assert torch.equal(new_state.params["embed.weight"], state.params["embed.weight"])
    assert not torch.equal(new_state.params["head.weight"], state.params["head.weight"])


def _frozen_base(name: str, _: torch.Tensor) -> bool:
    """LoRA's shape of a fine-tune: the embedding and the attention projections frozen, the rest trained."""
    return not (name.startswith("embed") or ("self_attn" in name and name.endswith("_proj.weight")))


def _as_buffers(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """The route frozen params took before they stayed params: each of ``names`` re-registered as a buffer."""
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, leaf).detach().clone()
        delattr(module, leaf)
        module.register_buffer(leaf, tensor)
    return model


@pytest.mark.parametrize("blocks", [(), "auto"], ids=["traced", "regional"])
@pytest.mark.parametrize("compile", [False, "aot_eager"], ids=["eager", "aot_eager"])
def test_make_train_step_frozen_params_train_as_frozen_buffers_did(blocks, compile):
    """Frozen params in ``params`` give the step frozen buffers gave: bitwise on the same (traced) path. The old route
    could not run the decoder layers as repeated blocks (a block holding buffers is refused, and "auto" finds none),
    so per block the reference is the traced one, equal to rounding."""
    model, opt, task, _, batches = _lm_setup()
    reference_model = _as_buffers(copy.deepcopy(model), frozen_names(model, _frozen_base))
    state = init_train_state(model, opt, task=task, trainable=_frozen_base)
    reference = init_train_state(reference_model, opt, task=task)
    assert set(state.frozen) == set(reference.buffers)
    assert len(state.frozen) == 9
    assert not set(state.frozen) & set(state.buffers)
    assert list(state.opt_state.mu) == list(reference.params)  # no optimizer state for the frozen ones
    kwargs = {"num_microbatches": 2, "max_grad_norm": 0.5, "compile": compile}
    step = make_train_step(model, task, opt, repeated_blocks=blocks, **kwargs)
    if blocks:
        assert step.pieces["stages"].blocks  # the frozen base's layers do run as repeated blocks
    reference_step = make_train_step(reference_model, task, opt, **kwargs)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if blocks else {"rtol": 0, "atol": 0}
    new, new_reference = state, reference
    for batch in batches[:2]:
        new, out = step(new, batch)
        new_reference, reference_out = reference_step(new_reference, batch)
        assert_trees_close(out.loss, reference_out.loss, **tolerance)
        assert_trees_close(out.grad_norm, reference_out.grad_norm, **tolerance)  # the trainable grads' norm only
    for name in state.frozen:
        assert torch.equal(new.params[name], state.params[name]), name
    trained = {name: p for name, p in new.params.items() if name not in state.frozen}
    assert_trees_close(trained, new_reference.params, **tolerance)
    assert all(not torch.equal(p, state.params[name]) for name, p in trained.items())


# --- clipping and non-finite steps -------------------------------------------------------------------


def test_make_train_step_clips_to_max_grad_norm_and_reports_the_unclipped_norm():
    model = NoNormRegressor()
    opt = optim.sgd(1.0)
    state = init_train_state(model, opt)
    batch = _batch(4, 5)
    _, unclipped = make_train_step(model, CausalLMTask(), opt, compile=False)(state, batch)
    max_norm = float(unclipped.grad_norm) / 4
    new_state, clipped = make_train_step(model, CausalLMTask(), opt, max_grad_norm=max_norm, compile=False)(
        state, batch
    )
    torch.testing.assert_close(clipped.grad_norm, unclipped.grad_norm)
    applied = optim.global_norm({k: state.params[k] - new_state.params[k] for k in state.params})
    torch.testing.assert_close(applied, torch.tensor(max_norm), rtol=1e-4, atol=1e-6)


def test_make_train_step_clips_with_optim_clip_factor_as_clip_by_global_norm_does(monkeypatch):
    import d9dfn.optim._clip as clip_module

    model, task, batch = NoNormRegressor(), CausalLMTask(), _batch(4, 5)
    inline_state = init_train_state(model, optim.sgd(1.0))
    inline_step = make_train_step(model, task, optim.sgd(1.0), max_grad_norm=0.1, compile=False)
    chained_opt = optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(1.0))
    chained_state = init_train_state(model, chained_opt)
    chained_step = make_train_step(model, task, chained_opt, compile=False)
    # One clip factor: the step's clipping and the transform's give the same params, bit for bit.
    inline, _ = inline_step(inline_state, batch)
    chained, _ = chained_step(chained_state, batch)
    assert_trees_close(inline.params, chained.params, rtol=0, atol=0)
    calls = []

    def spy(norm, max_norm, eps=clip_module.CLIP_EPS):
        calls.append((max_norm, eps))
        return torch.full_like(norm, 0.5)

    monkeypatch.setattr(optim, "clip_factor", spy)  # the step's path
    monkeypatch.setattr(clip_module, "clip_factor", spy)  # clip_by_global_norm's path
    halved, _ = inline_step(inline_state, batch)
    chained_halved, _ = chained_step(chained_state, batch)
    assert calls == [(0.1, 1e-6), (0.1, 1e-6)]
    assert_trees_close(halved.params, chained_halved.params, rtol=0, atol=0)
    assert not torch.equal(halved.params["head.weight"], inline.params["head.weight"])


def test_make_train_step_reports_the_rate_the_user_optimizer_used():
    model, task, batch = NoNormRegressor(), CausalLMTask(), _batch(4, 5)
    schedule = schedules.warmup_cosine(0.5, 2, 6)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(schedule, momentum=0.9))
    state = init_train_state(model, opt)
    step = make_train_step(model, task, opt, compile=False)
    for index in range(3):
        state, output = step(state, batch)
        assert torch.equal(output.lr, schedule(torch.tensor(index)))
        assert torch.equal(output.lr, optim.learning_rate(state.opt_state))
    # A transform that records no rate: NaN, as the docs say.
    clip_only = optim.clip_by_global_norm(1.0)
    _, output = make_train_step(model, task, clip_only, compile=False)(init_train_state(model, clip_only), batch)
    assert torch.isnan(output.lr)


class _NaNTask(CausalLMTask):
    def compute_loss(self, outputs, state, step):
        result = super().compute_loss(outputs, state, step)
        return result.replace(loss=result.loss * torch.tensor(float("nan")))


@pytest.mark.parametrize("skip", [False, True])
def test_make_train_step_flags_nonfinite_and_skips_update_when_asked(skip):
    model = TokenRegressor()
    opt = optim.adamw(1e-2)
    state = init_train_state(model, opt, task=_NaNTask())
    new_state, output = make_train_step(model, _NaNTask(), opt, skip_nonfinite=skip, compile=False)(state, _batch(4, 5))
    assert bool(output.nonfinite)
    assert bool(output.skipped) == skip
    assert torch.equal(output.lr, torch.tensor(1e-2))  # the rate the (discarded) update used
    if skip:
        assert_trees_close(new_state.metric_state, state.metric_state, rtol=0, atol=0)
        assert_trees_close(new_state.params, state.params, rtol=0, atol=0)
        assert_trees_close(new_state.opt_state, state.opt_state, rtol=0, atol=0)
        assert_trees_close(new_state.buffers, state.buffers, rtol=0, atol=0)
    else:
        assert torch.isnan(new_state.params["head.weight"]).all()


# --- compile: equality, graph breaks, recompiles -----------------------------------------------------


def _lm_setup(dropout: float = 0.0, num_layers: int = 2):
    config = dataclasses.replace(Qwen3Config.tiny(), dropout=dropout, num_layers=num_layers)
    torch.manual_seed(0)
    model = Qwen3LM(config)
    opt = optim.adamw(3e-3, weight_decay=0.1)
    task = CausalLMTask()
    state = init_train_state(model, opt, task=task)
    batches = [_batch(4, 16, vocab=config.vocab_size, seed=s, masked=[s % 3, 0, 2, 0]) for s in range(4)]
    return model, opt, task, state, batches


@pytest.mark.slow
def test_make_train_step_compiled_equals_eager_over_20_steps():
    model, opt, task, state, batches = _lm_setup()
    kwargs = {"num_microbatches": 2, "max_grad_norm": 1.0}
    eager = make_train_step(model, task, opt, compile=False, **kwargs)
    compiled = make_train_step(model, task, opt, compile="aot_eager", **kwargs)
    eager_state, compiled_state = state, state
    for index in range(20):
        eager_state, eager_out = eager(eager_state, batches[index % 4])
        compiled_state, compiled_out = compiled(compiled_state, batches[index % 4])
        torch.testing.assert_close(compiled_out.loss, eager_out.loss, rtol=1e-4, atol=1e-5)
    assert_trees_close(compiled_state.params, eager_state.params, rtol=1e-3, atol=1e-5)
    assert float(eager_out.loss) < float(make_train_step(model, task, opt, compile=False)(state, batches[3])[1].loss)


@pytest.mark.slow
def test_make_train_step_has_no_graph_breaks_and_no_recompiles():
    model, _, task, _, batches = _lm_setup()
    schedule = schedules.warmup_cosine(3e-3, 2, 10)  # the rate changes every step: still one graph
    opt = optim.adamw(schedule, weight_decay=0.1)
    state = init_train_state(model, opt, task=task)
    eager = make_train_step(model, task, opt, num_microbatches=2, max_grad_norm=1.0, compile=False)
    explanation = torch._dynamo.explain(eager)(state, batches[0])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    compiled = make_train_step(model, task, opt, num_microbatches=2, max_grad_norm=1.0, compile="aot_eager")
    state, output = compiled(state, batches[0])
    lrs = [output.lr]
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch in batches[1:]:
            state, output = compiled(state, batch)
            lrs.append(output.lr)
    assert int(state.step) == 4
    for step, lr in enumerate(lrs):  # the rate each update used, read from the optimizer's state
        assert torch.equal(lr, schedule(torch.tensor(step)))


@pytest.mark.slow
def test_make_train_step_dropout_is_pure_and_identical_compiled_and_eager():
    model, opt, task, state, batches = _lm_setup(dropout=0.2)
    eager = make_train_step(model, task, opt, rng_kwarg="dropout_key", compile=False)
    compiled = make_train_step(model, task, opt, rng_kwarg="dropout_key", compile="aot_eager")
    _, first = eager(state, batches[0])
    _, again = eager(state, batches[0])
    _, from_compiled = compiled(state, batches[0])
    torch.testing.assert_close(first.loss, again.loss, rtol=0, atol=0)
    torch.testing.assert_close(from_compiled.loss, first.loss, rtol=1e-5, atol=1e-6)
    without = make_train_step(model, task, opt, compile=False)(state, batches[0])[1]
    assert not torch.equal(without.loss, first.loss)  # dropout is really on


@pytest.mark.slow
@pytest.mark.compiled
def test_make_train_step_inductor_matches_eager():
    model, opt, task, state, batches = _lm_setup(num_layers=1)
    eager = make_train_step(model, task, opt, compile=False)
    compiled = make_train_step(model, task, opt, compile="inductor")
    eager_state, compiled_state = state, state
    for index in range(2):
        eager_state, eager_out = eager(eager_state, batches[index])
        compiled_state, compiled_out = compiled(compiled_state, batches[index])
    torch.testing.assert_close(compiled_out.loss, eager_out.loss, rtol=1e-4, atol=1e-5)
    assert_trees_close(compiled_state.params, eager_state.params, rtol=1e-3, atol=1e-5)


# --- metrics, eval and inference ---------------------------------------------------------------------


def test_make_train_step_updates_task_metrics_with_the_step_loss():
    model, opt, task, state, batches = _lm_setup()
    new_state, output = make_train_step(model, task, opt, num_microbatches=2, compile=False)(state, batches[0])
    torch.testing.assert_close(task.create_metrics().compute(new_state.metric_state)["loss"], output.loss)


def test_make_eval_step_matches_train_loss_without_changing_params():
    model, opt, task, state, batches = _lm_setup()
    _, train_out = make_train_step(model, task, opt, compile=False)(state, batches[0])
    metric = task.create_metrics()
    metric_state, eval_out = make_eval_step(model, task, num_microbatches=2, compile=False)(
        state, metric.init(), batches[0]
    )
    torch.testing.assert_close(eval_out.loss, train_out.loss)
    torch.testing.assert_close(metric.compute(metric_state)["loss"], train_out.loss)


class _CountTokens(InferenceTask):
    def init_state(self):
        return torch.zeros((), dtype=torch.int64)

    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state

    def process_outputs(self, task_state, outputs, state):
        return task_state + outputs["logits"].shape[0] * outputs["logits"].shape[1]


@pytest.mark.slow
def test_make_inference_step_folds_every_microbatch_into_task_state():
    model, _, _, state, batches = _lm_setup()
    task = _CountTokens()
    infer = make_inference_step(model, task, num_microbatches=2, compile="aot_eager")
    inference_state = InferenceState(
        params=state.params, buffers=state.buffers, step=state.step, rng=state.rng, task_state=task.init_state()
    )
    for batch in batches[:2]:
        inference_state = infer(inference_state, batch)
    assert int(inference_state.task_state) == 2 * 4 * 16
    assert int(inference_state.step) == 2


# --- errors ------------------------------------------------------------------------------------------


class _TensorModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class _XTask(TrainTask):
    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"x": batch}), state

    def compute_loss(self, outputs, state, step):
        return ComputeLossResult(loss=outputs["y"].sum())


def test_make_train_step_rejects_a_model_that_returns_a_tensor():
    opt = optim.sgd(0.1)
    model = _TensorModel()
    step = make_train_step(model, _XTask(), opt, compile=False)
    with pytest.raises(TypeError, match=r"returned Tensor.*dict of named outputs"):
        step(init_train_state(model, opt), torch.ones(2, 2))


def test_make_train_step_uneven_microbatches_name_the_leaf():
    opt = optim.sgd(0.1)
    model = _TensorModel()
    step = make_train_step(model, _XTask(), opt, num_microbatches=2, compile=False)
    with pytest.raises(ValueError, match=r"\['x'\]"):
        step(init_train_state(model, opt), torch.ones(3, 2))


def test_make_train_step_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_microbatches=0"):
        make_train_step(_TensorModel(), _XTask(), optim.sgd(0.1), num_microbatches=0)
    with pytest.raises(ValueError, match="max_grad_norm=-1"):
        make_train_step(_TensorModel(), _XTask(), optim.sgd(0.1), max_grad_norm=-1)


class _StatelessLossTask(TrainTask):
    """Returns no new pipeline state and no weight: the defaults must work compiled too."""

    def build_forward_inputs(self, batch, state):
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state.set("y", batch["labels"])

    def compute_loss(self, outputs, state, step):
        logits = outputs["logits"].flatten(0, 1)
        return ComputeLossResult(loss=F.cross_entropy(logits, state["y"].flatten(), ignore_index=IGNORE_INDEX))


@pytest.mark.slow
def test_make_train_step_compiles_a_task_that_returns_no_state_or_weight():
    model, opt, _, state, batches = _lm_setup(num_layers=1)
    step = make_train_step(model, _StatelessLossTask(), opt, num_microbatches=2, compile="aot_eager")
    new_state, output = step(state, batches[0])
    assert float(output.loss_weight) == 2.0  # one per microbatch
    assert int(new_state.step) == 1
