"""d9dfn.compat.megatron: Megatron Bridge forward steps, unchanged, in d9dfn's pure step.

A tiny GPT in Megatron's style (``model(tokens, position_ids, labels=labels)`` returns per-token losses)
and its forward step with a masked next-token loss are trained through the adapter in every signature,
and compared with the same computation written directly as a d9dfn task.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from _ranks import _init, _run_ranks
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import d9dfn
from d9dfn import optim, parallel
from d9dfn.compat.megatron import (
    GlobalState,
    MegatronInferenceTask,
    MegatronModel,
    MegatronTask,
    Timers,
    inspect_forward_step,
    loss_func_result,
    pretrain,
)
from d9dfn.testing import assert_trees_close

VOCAB, DIM, SEQ = 32, 16, 8

# The adapter and the direct task run the same float32 ops in the same order, so after 12 AdamW steps
# their params agree bit for bit (tolerance 0). Eager against compiled allows for kernel differences.
RTOL, ATOL = 1e-5, 1e-6


class TinyGPT(nn.Module):
    """Embeddings, one pre-norm causal attention block, an MLP and a tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"vocab_size": VOCAB}  # a plain attribute, as Megatron models carry a config
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm_f = nn.LayerNorm(DIM)

    def logits(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos(position_ids)  # (B, T, D)
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = h + self.mlp(self.norm2(h))
        return self.norm_f(h) @ self.embed.weight.T  # (B, T, V)

    def forward(self, tokens, position_ids, labels=None):
        logits = self.logits(tokens, position_ids)
        if labels is None:
            return logits
        # As Megatron's GPTModel with labels: per-token cross-entropy, (B, T).
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def make_batch(batch_size: int = 8, seed: int = 0, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sequences that repeat a short random motif (learnable), with a random loss mask."""
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, VOCAB, (batch_size, 3), generator=gen)
    tokens = motif.repeat(1, SEQ // 3 + 2)[:, : SEQ + 1]
    if mask is None:
        mask = torch.rand(batch_size, SEQ, generator=gen) > 0.25
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": mask.float(),
        "position_ids": torch.arange(SEQ).expand(batch_size, SEQ).clone(),
    }


# --- the user's Megatron code: a loss function and forward steps in every signature --------------------


def masked_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's per-token loss: (loss_sum, num_tokens, {"lm loss": [sum, count]})."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    reporting = torch.cat([loss_sum.clone().detach().view(1), num_tokens.view(1)])
    return loss_sum, num_tokens, {"lm loss": reporting}


def mean_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The two-tuple form: the microbatch's mean loss."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum().clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def _body(data_iterator, model, state=None, loss=masked_loss):
    batch = next(data_iterator)
    if state is not None:
        state.timers("forward-step", log_level=2).start()
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    if state is not None:
        state.timers("forward-step").stop()
    return output, functools.partial(loss, batch["loss_mask"])


def forward_two(data_iterator, model):
    return _body(data_iterator, model)


def forward_state(state: GlobalState, data_iterator, model):
    return _body(data_iterator, model, state)


def forward_plan(data_iterator, model, return_schedule_plan=False):
    assert return_schedule_plan is False
    return _body(data_iterator, model)


def forward_four(state: GlobalState, data_iterator, model, return_schedule_plan: bool = False):
    assert return_schedule_plan is False
    return _body(data_iterator, model, state)


class ForwardFunctor:
    """A stateful forward step (its Python state is a constant of the trace)."""

    def __init__(self, loss_scale: float = 1.0) -> None:
        self.loss_scale = loss_scale

    def __call__(self, state: GlobalState, data_iterator, model, return_schedule_plan=False):
        output, loss_func = _body(data_iterator, model, state)
        return output * self.loss_scale, loss_func


SIGNATURES = {
    "two": forward_two,
    "state": forward_state,
    "plan": forward_plan,
    "four": forward_four,
    "functor": ForwardFunctor(loss_scale=1.0),
}


# --- the same computation written directly as a d9dfn task -----------------------------------------------


class DirectGPT(TinyGPT):
    def forward(self, input_ids, position_ids):
        return {"logits": self.logits(input_ids, position_ids)}


class DirectTask(d9dfn.TrainTask):
    def build_forward_inputs(self, batch, state):
        state = state.set("labels", batch["labels"]).set("loss_mask", batch["loss_mask"])
        inputs = {"input_ids": batch["tokens"], "position_ids": batch["position_ids"]}
        return d9dfn.BuildForwardInputsResult(inputs=inputs), state

    def compute_loss(self, outputs, state, step):
        labels, mask = state["labels"], state["loss_mask"]
        losses = F.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten(), reduction="none")
        num_tokens = mask.sum()
        loss_sum = (losses * mask.flatten()).sum()
        return d9dfn.ComputeLossResult(loss=loss_sum / num_tokens.clamp(min=1), loss_weight=num_tokens)


def train(model, task, steps: int, num_microbatches: int = 2, **kwargs):
    opt = optim.adamw(1e-2)
    state = d9dfn.init_train_state(model, opt)
    step = d9dfn.make_train_step(model, task, opt, num_microbatches=num_microbatches, compile=False, **kwargs)
    losses = []
    for i in range(steps):
        state, out = step(state, make_batch(seed=i % 3))
        losses.append(float(out.loss))
    return state, losses, out


def test_megatron_model_has_the_module_names_and_tensors():
    gpt = TinyGPT()
    wrapped = MegatronModel(gpt)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in gpt.named_parameters()]
    assert list(wrapped.state_dict()) == list(gpt.state_dict())
    assert wrapped.embed is gpt.embed
    assert wrapped.config == {"vocab_size": VOCAB}  # plain attributes come from the module


def test_megatron_model_to_empty_materializes_the_module():
    with torch.device("meta"):
        wrapped = MegatronModel(TinyGPT())
    wrapped.to_empty(device="cpu")
    assert not any(p.is_meta for p in wrapped.module.parameters())
    assert wrapped.module.embed.weight is wrapped.embed.weight


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_megatron_task_every_signature_trains_like_the_direct_task(name):
    torch.manual_seed(0)
    adapted, losses, out = train(MegatronModel(TinyGPT()), MegatronTask(SIGNATURES[name]), steps=12)
    torch.manual_seed(0)
    direct, direct_losses, _ = train(DirectGPT(), DirectTask(), steps=12)
    assert losses[-1] < 0.8 * losses[0]
    assert_trees_close(adapted.params, direct.params, rtol=0, atol=0)
    assert losses == direct_losses
    # Megatron's [sum, count] reporting pair logs the token mean, which here is the loss itself.
    assert float(out.logs["lm loss"]) == pytest.approx(losses[-1], rel=1e-6)


def test_megatron_task_functor_keeps_its_python_state():
    torch.manual_seed(0)
    _, doubled, _ = train(MegatronModel(TinyGPT()), MegatronTask(ForwardFunctor(loss_scale=2.0)), steps=1)
    torch.manual_seed(0)
    _, plain, _ = train(MegatronModel(TinyGPT()), MegatronTask(ForwardFunctor(loss_scale=1.0)), steps=1)
    assert doubled[0] == pytest.approx(2 * plain[0], rel=1e-6)


def _step_grads(model, task, batch, num_microbatches):
    """The step's loss and the gradient it applied (SGD with lr 1 and no momentum: Δparams = -grad)."""
    opt = optim.sgd(1.0)
    state = d9dfn.init_train_state(model, opt)
    new, out = d9dfn.make_train_step(model, task, opt, num_microbatches=num_microbatches, compile=False)(state, batch)
    return out, {name: state.params[name] - new.params[name] for name in state.params}


def _global_token_mean(gpt, params, batch):
    def loss(p):
        per_token = torch.func.functional_call(
            gpt, p, (batch["tokens"], batch["position_ids"]), {"labels": batch["labels"]}
        )
        return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    return torch.func.grad_and_value(loss)(params)


@given(
    num_microbatches=st.sampled_from([1, 2, 4]),
    counts=st.lists(st.integers(0, SEQ), min_size=8, max_size=8).filter(lambda c: sum(c) > 0),
)
def test_megatron_task_three_tuple_is_the_global_token_mean(num_microbatches, counts):
    # Row i counts its first counts[i] tokens: microbatches carry uneven (even zero) token counts.
    mask = torch.arange(SEQ).expand(8, SEQ) < torch.tensor(counts).unsqueeze(1)
    batch = make_batch(mask=mask)
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    out, grads = _step_grads(model, MegatronTask(forward_four), batch, num_microbatches)
    params = {name: p.detach() for name, p in model.named_parameters()}
    expected_grads, expected_loss = _global_token_mean(model.module, params, batch)
    assert float(out.loss) == pytest.approx(float(expected_loss), rel=1e-5)
    assert float(out.loss_weight) == sum(counts)
    assert_trees_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


def test_megatron_task_two_tuple_is_the_mean_of_microbatch_means():
    counts = [8, 8, 8, 8, 1, 1, 1, 1]  # microbatch 0 has 32 tokens, microbatch 1 has 4
    mask = torch.arange(SEQ).expand(8, SEQ) < torch.tensor(counts).unsqueeze(1)
    batch = make_batch(mask=mask)
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    task = MegatronTask(lambda data_iterator, model: _body(data_iterator, model, loss=mean_loss))
    out, _ = _step_grads(model, task, batch, num_microbatches=2)
    per_token = model.module(batch["tokens"], batch["position_ids"], labels=batch["labels"]).detach()
    halves = [(per_token[s] * mask[s]).sum() / mask[s].sum() for s in (slice(0, 4), slice(4, 8))]
    assert float(out.loss) == pytest.approx(float(sum(halves) / 2), rel=1e-5)
    assert float(out.loss_weight) == 2.0  # one per microbatch, as Megatron divides by num_microbatches
    token_mean = (per_token * mask).sum() / mask.sum()
    assert abs(float(out.loss) - float(token_mean)) > 1e-3  # the two forms differ on uneven counts


def test_megatron_task_global_state_carries_config_step_and_timers():
    seen = {}

    def forward_step(state: GlobalState, data_iterator, model):
        seen.update(cfg=state.cfg, step=state.step, train_step=state.train_state.step, config=model.config)
        return _body(data_iterator, model, state)

    task = MegatronTask(forward_step, config={"seq_length": SEQ})
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    opt = optim.sgd(0.1)
    state = d9dfn.init_train_state(model, opt)
    step = d9dfn.make_train_step(model, task, opt, compile=False)
    state, _ = step(state, make_batch())
    state, _ = step(state, make_batch())
    assert seen["cfg"] == {"seq_length": SEQ}
    assert int(seen["step"]) == 1
    assert seen["train_step"] is seen["step"]
    assert seen["config"] == {"vocab_size": VOCAB}
    assert task.timers.names == ("forward-step",)
    hparams = task.dump_hparams()
    assert hparams["forward_step"].endswith("<locals>.forward_step")
    assert (hparams["takes_state"], hparams["takes_schedule_plan"]) == (True, False)


@pytest.mark.slow
def test_megatron_task_compiles_without_recompiling():
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    task = MegatronTask(forward_four)
    opt = optim.adamw(1e-2)
    eager_state = state = d9dfn.init_train_state(model, opt)
    step = d9dfn.make_train_step(model, task, opt, num_microbatches=2, compile="aot_eager")
    eager = d9dfn.make_train_step(model, task, opt, num_microbatches=2, compile=False)
    torch._dynamo.reset()
    state, _ = step(state, make_batch(seed=0))
    with torch.compiler.set_stance("fail_on_recompile"):
        state, out = step(state, make_batch(seed=1))
    assert task.timers.names == ()  # traced code records nothing: it would be a guard on Python state
    for seed in (0, 1):
        eager_state, eager_out = eager(eager_state, make_batch(seed=seed))
    assert_trees_close(state.params, eager_state.params, rtol=RTOL, atol=ATOL)
    assert float(out.logs["lm loss"]) == pytest.approx(float(eager_out.logs["lm loss"]), rel=1e-5)
    assert task.timers.names == ("forward-step",)


def test_megatron_task_eval_step_reports_the_token_mean():
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    state = d9dfn.init_train_state(model, optim.sgd(0.1))
    evaluate = d9dfn.make_eval_step(model, MegatronTask(forward_two), num_microbatches=2, compile=False)
    batch = make_batch()
    _, out = evaluate(state, None, batch)
    per_token = model.module(batch["tokens"], batch["position_ids"], labels=batch["labels"]).detach()
    expected = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)


def test_megatron_inference_task_folds_inference_data():
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["position_ids"])
        return logits, lambda out: {"hits": (out.argmax(-1) == batch["labels"]).sum(), "rows": out.new_ones(())}

    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    task = MegatronInferenceTask(forward_step)
    params, buffers = d9dfn.split_module_state(model)
    start = d9dfn.InferenceState(
        params=params,
        buffers=buffers,
        step=torch.zeros((), dtype=torch.int64),
        rng=d9dfn.prng.key(0),
        task_state=task.init_state(),
    )
    batch = make_batch()
    result = d9dfn.make_inference_step(model, task, num_microbatches=2, compile=False)(start, batch)
    expected = (model.module(batch["tokens"], batch["position_ids"]).argmax(-1) == batch["labels"]).sum()
    assert int(result.task_state["hits"]) == int(expected)
    assert float(task.finalize(result.task_state)["rows"]) == 2.0  # one per microbatch


class NormedLM(nn.Module):
    """Tied embedding/head, BatchNorm statistics and dropout from d9dfn's key: the model-side corners."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def logits(self, tokens, dropout_key):
        h = self.norm(self.embed(tokens).transpose(1, 2)).transpose(1, 2)  # (B, T, D)
        h = h * d9dfn.prng.bernoulli(dropout_key, 0.9, h.shape) / 0.9
        return self.head(h)

    def forward(self, tokens, dropout_key):
        return self.logits(tokens, dropout_key)


class DirectNormedLM(NormedLM):
    def forward(self, tokens, dropout_key):
        return {"logits": self.logits(tokens, dropout_key)}


def test_megatron_model_tied_weights_buffers_and_dropout_key_match_a_direct_model():
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"])  # the step's dropout key is added to every call
        return logits, lambda out: (F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten()), {})

    class Direct(d9dfn.TrainTask):
        def build_forward_inputs(self, batch, state):
            return d9dfn.BuildForwardInputsResult(inputs={"tokens": batch["tokens"]}), state.set(
                "labels", batch["labels"]
            )

        def compute_loss(self, outputs, state, step):
            return d9dfn.ComputeLossResult(
                loss=F.cross_entropy(outputs["logits"].flatten(0, 1), state["labels"].flatten())
            )

    results = []
    for model, task in ((MegatronModel(NormedLM()), MegatronTask(forward_step)), (DirectNormedLM(), Direct())):
        torch.manual_seed(0)
        model.load_state_dict(NormedLM().state_dict())
        opt = optim.adamw(1e-2)
        state = d9dfn.init_train_state(model, opt)
        step = d9dfn.make_train_step(model, task, opt, num_microbatches=2, rng_kwarg="dropout_key", compile=False)
        for seed in range(3):
            state, _ = step(state, make_batch(seed=seed))
        results.append(state)
    adapted, direct = results
    assert sorted(adapted.params) == ["embed.weight", "norm.bias", "norm.weight"]  # the head is tied
    assert int(adapted.buffers["norm.num_batches_tracked"]) == 6  # 3 steps x 2 microbatches
    assert_trees_close(adapted.params, direct.params, rtol=0, atol=0)
    assert_trees_close(adapted.buffers, direct.buffers, rtol=0, atol=0)


# --- signature detection and errors ---------------------------------------------------------------------


def test_inspect_forward_step_every_signature():
    from d9dfn.compat.megatron import ForwardStepSignature as S

    def named_state(state, data_iterator, model):
        return None

    def string_hint(s: "GlobalState", data_iterator, model):  # noqa: UP037 (a string hint on purpose)
        return None

    assert inspect_forward_step(forward_two) == S(False, False)
    assert inspect_forward_step(forward_state) == S(True, False)
    assert inspect_forward_step(forward_plan) == S(False, True)
    assert inspect_forward_step(forward_four) == S(True, True)
    assert inspect_forward_step(ForwardFunctor()) == S(True, True)
    assert inspect_forward_step(named_state) == S(True, False)
    assert inspect_forward_step(string_hint) == S(True, False)
    # A 4-argument step with the state bound by partial is the 3-argument schedule-plan form.
    assert inspect_forward_step(functools.partial(forward_four, GlobalState(None, Timers(), None, None))) == S(
        False, True
    )


@pytest.mark.parametrize(
    ("forward_step", "match"),
    [
        (lambda data_iterator: None, r"has 1 parameter\(s\)"),
        (lambda a, b, c: None, r"first, 'a', is neither annotated GlobalState"),
        (lambda *args: None, r"\*args or \*\*kwargs"),
        (lambda data_iterator, model, *, extra=1: None, "keyword-only"),
        (ForwardFunctor, r"pass an instance of the functor, e.g. ForwardFunctor\(...\)"),
        (42, "expected a callable forward step"),
    ],
)
def test_inspect_forward_step_rejects_other_signatures(forward_step, match):
    with pytest.raises(TypeError, match=match):
        MegatronTask(forward_step)


def _one_step(forward_step):
    torch.manual_seed(0)
    model = MegatronModel(TinyGPT())
    opt = optim.sgd(0.1)
    step = d9dfn.make_train_step(model, MegatronTask(forward_step), opt, compile=False)
    return step(d9dfn.init_train_state(model, opt), make_batch())


def test_megatron_task_rejects_a_forward_step_that_returns_no_loss_func():
    def forward_step(data_iterator, model):
        output, _ = _body(data_iterator, model)
        return output

    with pytest.raises(
        TypeError, match=r"returned Tensor; a Megatron forward step returns \(output_tensor, loss_func\)"
    ):
        _one_step(forward_step)


def test_megatron_task_rejects_inference_data_when_training():
    def forward_step(data_iterator, model):
        output, _ = _body(data_iterator, model)
        return output, lambda out: {"per_token": out}

    with pytest.raises(TypeError, match=r"loss_func returned dict.*use MegatronInferenceTask"):
        _one_step(forward_step)


def test_loss_func_result_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"reduced\['x'\] has shape \(3,\)"):
        loss_func_result((torch.tensor(1.0), {"x": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"the loss has shape \(2,\)"):
        loss_func_result((torch.ones(2), {}))


def test_megatron_task_rejects_a_plain_model():
    opt = optim.sgd(0.1)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self):
            return {"x": self.w}

    model = Plain()
    step = d9dfn.make_train_step(model, MegatronTask(forward_two), opt, compile=False)
    with pytest.raises(TypeError, match=r"build the step with MegatronModel\(your_module\)"):
        step(d9dfn.init_train_state(model, opt), make_batch())


# --- pretrain: the one-call job ---------------------------------------------------------------------------


def test_pretrain_runs_a_d9dfn_job(tmp_path):
    from d9dfn.config import TrainerConfig

    batch = make_batch(batch_size=16)
    dataset = [{key: value[i] for key, value in batch.items()} for i in range(16)]
    config = TrainerConfig.model_validate(
        {
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "batching": {"global_batch_size": 8, "microbatch_size": 4},
            "checkpointing": {"save_dir": str(tmp_path), "period_steps": 10},
            "logging": {"period_steps": 1},
            "total_steps": 10,
            "compile": False,
        }
    )
    result = pretrain(config, forward_four, model=TinyGPT, dataset=dataset, megatron_config={"name": "tiny"})
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert result.steps_run == 10
    assert losses[-1] < losses[0]
    assert all("task/lm loss" in r for r in records if "loss" in r)


def test_pretrain_rejects_wrong_inputs(tmp_path):
    from d9dfn.config import TrainerConfig

    config = TrainerConfig.model_validate({"optimizer": {"name": "sgd", "lr": 0.1}})
    with pytest.raises(TypeError, match=r"pass a d9dfn\.loop\.TrainerConfig"):
        pretrain({"lr": 0.1}, forward_two, model=TinyGPT, dataset=[])
    with pytest.raises(TypeError, match="pass a function that builds the module"):
        pretrain(config, forward_two, model=TinyGPT(), dataset=[])
    with pytest.raises(TypeError, match="has 1 parameter"):
        pretrain(config, lambda it: None, model=TinyGPT, dataset=[])


# --- the migration page's d9dfn code runs -------------------------------------------------------------------


@pytest.mark.slow
def test_migration_page_code_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    import d9dfn.step._options

    page = Path(__file__).resolve().parent.parent / "docs" / "migration" / "from-megatron-bridge.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL) if "d9dfn" in b]
    assert len(blocks) == 2
    # The page compiles with the default backend; aot_eager checks the same whole-graph trace, faster.
    real_backend_of = d9dfn.step._options.backend_of
    monkeypatch.setattr(
        d9dfn.step._options, "backend_of", lambda compile: "aot_eager" if compile is True else real_backend_of(compile)
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    records = [json.loads(line) for line in (namespace["result"].run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0]
    assert torch.isfinite(namespace["out"].loss)


# --- the three-tuple loss over 2 data-parallel ranks (gloo) -------------------------------------------


def _three_tuple_dp_worker(rank: int, world_size: int, init_file: str) -> None:
    dist = _init(rank, world_size, init_file)
    counts = [8, 1, 0, 5, 3, 7, 2, 6]  # rank 0: microbatches of 9 and 5 tokens; rank 1: 10 and 8
    mask = torch.arange(SEQ).expand(8, SEQ) < torch.tensor(counts).unsqueeze(1)
    batch = make_batch(mask=mask)
    rows = slice(rank * 4, rank * 4 + 4)
    torch.manual_seed(0)  # the same initial params on both ranks
    model = MegatronModel(TinyGPT())
    opt = optim.sgd(1.0)
    state = d9dfn.init_train_state(model, opt)
    step = d9dfn.make_train_step(
        model,
        MegatronTask(forward_four),
        opt,
        num_microbatches=2,
        compile=False,
        data_parallel=parallel.data_parallel(dist.group.WORLD, rank),
    )
    new, out = step(state, {key: value[rows] for key, value in batch.items()})
    params = {name: p.detach() for name, p in model.named_parameters()}
    expected_grads, expected_loss = _global_token_mean(model.module, params, batch)  # the whole global batch
    assert float(out.loss_weight) == sum(counts)
    assert float(out.loss) == pytest.approx(float(expected_loss), rel=1e-5)
    applied = {name: state.params[name] - new.params[name] for name in state.params}  # SGD, lr 1: the gradient
    assert_trees_close(applied, expected_grads, rtol=1e-4, atol=1e-6)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_megatron_task_three_tuple_is_the_global_token_mean_over_two_data_parallel_ranks(tmp_path):
    # Uneven token counts across microbatches and ranks: the step's gradient and loss are those of the
    # token mean over the whole global batch, as Megatron's calculate_per_token_loss=True.
    _run_ranks(_three_tuple_dp_worker, 2, tmp_path)
