"""The precision policy (issue 15): params, gradients and the optimizer in param_dtype, the model in
compute_dtype, reductions in reduce_dtype; bf16 compute runs on CPU, so all of it is checked here."""

from __future__ import annotations

import math

import pytest
import torch
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, tiny_job

import d9dfn.optim as optim
from d9dfn import (
    DataParallel,
    Precision,
    cast_params,
    init_train_state,
    make_eval_step,
    make_train_step,
    tree_leaves,
)
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.tasks import CausalLMTask


def _model() -> Qwen3LM:
    torch.manual_seed(0)
    return Qwen3LM(Qwen3Config.tiny(vocab_size=64))


def _batches(n: int = 4) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


class _DtypeProbe(CausalLMTask):
    """Fails the trace unless the model's logits come out in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def compute_loss(self, outputs, state, step):
        assert outputs["logits"].dtype == self.dtype, outputs["logits"].dtype
        return super().compute_loss(outputs, state, step)


def _run(precision: Precision | None, *, compile: bool, steps: int = 4, opt=None, model=None):
    model = model if model is not None else _model()
    opt = opt if opt is not None else optim.adamw(3e-3)
    state = init_train_state(model, opt)
    step = make_train_step(
        model, CausalLMTask(), opt, num_microbatches=2, precision=precision, compile="aot_eager" if compile else False
    )
    losses = []
    for batch in _batches(steps):
        state, out = step(state, batch)
        losses.append(out)
    return state, losses


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_bf16_mixed_keeps_fp32_master_weights_grads_and_optimizer_and_stays_near_fp32(compile):
    _, ref = _run(None, compile=compile)
    state, out = _run(Precision.bf16_mixed(), compile=compile)
    for name, p in state.params.items():
        assert p.dtype == torch.float32, name
    moments = [
        t for t in tree_leaves(state.opt_state) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim > 0
    ]
    assert moments
    assert all(t.dtype == torch.float32 for t in moments)
    for got, want in zip(out, ref, strict=True):
        assert got.loss.dtype == got.grad_norm.dtype == got.loss_weight.dtype == torch.float32
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-2, atol=0)  # bf16 compute: within 1%
    assert not torch.equal(out[-1].loss, ref[-1].loss)  # it did compute in bf16


def test_bf16_mixed_runs_the_model_in_bf16_and_the_eval_step_too():
    model = _model()
    state = init_train_state(model, optim.sgd(0.1))
    policy = Precision.bf16_mixed()
    step = make_train_step(model, _DtypeProbe(torch.bfloat16), optim.sgd(0.1), precision=policy, compile=False)
    new, _ = step(state, _batches(1)[0])
    assert new.params["embed_tokens.weight"].dtype == torch.float32
    evaluate = make_eval_step(model, _DtypeProbe(torch.bfloat16), precision=policy, compile=False)
    evaluate(state, CausalLMTask().create_metrics().init(), _batches(1)[0])
    with pytest.raises(AssertionError, match="float32"):  # the probe does fail without the policy
        make_eval_step(model, _DtypeProbe(torch.bfloat16), compile=False)(
            state, CausalLMTask().create_metrics().init(), _batches(1)[0]
        )


def test_pure_bf16_params_with_stochastic_adamw_train():
    model = cast_params(_model(), torch.bfloat16)
    state, out = _run(
        Precision.bf16_pure(), compile=False, steps=6, opt=optim.stochastic_adamw(3e-3, key=0), model=model
    )
    assert all(p.dtype == torch.bfloat16 for p in state.params.values())
    assert all(torch.isfinite(o.loss) for o in out)
    assert out[-1].loss < out[0].loss


def test_params_in_another_dtype_than_the_policy_are_named():
    model = _model()
    state = init_train_state(model, optim.sgd(0.1))
    step = make_train_step(model, CausalLMTask(), optim.sgd(0.1), precision=Precision.bf16_pure(), compile=False)
    with pytest.raises(ValueError, match=r"params\['embed_tokens.weight'\] is torch.float32 but precision.param_dtype"):
        step(state, _batches(1)[0])


def test_gradients_cross_the_reduction_in_reduce_dtype():
    seen = []

    def reduce(grads, loss_sum, weight_sum):
        seen.extend(g.dtype for g in grads.values())
        return grads, loss_sum, weight_sum

    model = _model()
    state = init_train_state(model, optim.sgd(0.1))
    policy = Precision(compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    step = make_train_step(
        model, CausalLMTask(), optim.sgd(0.1), precision=policy, data_parallel=DataParallel(reduce), compile=False
    )
    new, _ = step(state, _batches(1)[0])
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in new.params.values())  # and back in the params' dtype


def test_unsupported_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"compute_dtype=torch.float16; choose one of torch.float32, torch.bfloat16"):
        Precision(compute_dtype=torch.float16)


# --- the loop: trainer.precision and trainer.run.device ----------------------------------------------------------

LOOP = (*TINY_TRAINER, "trainer.batching.global_batch_size=4", "trainer.total_steps=4", *TINY_MODEL, *TINY_DATA)


def _job(save_dir, *overrides):
    return tiny_job(save_dir, *overrides, base=LOOP)


@pytest.mark.slow
def test_the_loop_applies_trainer_precision(tmp_path):
    from d9dfn.jobs import evaluate_lm, train_lm

    fp32 = train_lm(_job(tmp_path / "a"))
    mixed = train_lm(_job(tmp_path / "b", "trainer.precision.compute_dtype=bfloat16"))
    assert all(p.dtype == torch.float32 for p in mixed.state.params.values())
    a, b = fp32.state.params["embed_tokens.weight"], mixed.state.params["embed_tokens.weight"]
    assert not torch.equal(a, b)  # bf16 compute: not the fp32 run
    torch.testing.assert_close(b, a, rtol=0.0, atol=2e-2)  # but near it (Adam steps are at most ~lr each)
    report = evaluate_lm(_job(tmp_path / "b", "trainer.precision.compute_dtype=bfloat16"))  # infer in bf16 too
    assert math.isfinite(report["perplexity"])

    pure = train_lm(
        _job(
            tmp_path / "c",
            "trainer.precision.param_dtype=bfloat16",
            'trainer.optimizer={"name": "stochastic_adamw", "lr": 0.003, "state_dtype": "float32"}',
        )
    )
    assert all(p.dtype == torch.bfloat16 for p in pure.state.params.values())


def test_run_device_cuda_without_a_gpu_is_refused_by_name(tmp_path):
    from d9dfn.jobs import train_lm

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run.device=cuda is valid here")
    with pytest.raises(ValueError, match=r"run.device='cuda' but torch sees no CUDA device .* set run.device='cpu'"):
        train_lm(_job(tmp_path, "trainer.run.device=cuda"))
    assert not (tmp_path / "stdlib-lm" / "checkpoints").exists()  # refused before anything was written


def test_examples_gpu_medium_json_is_the_medium_preset_in_bf16_on_cuda():
    from pathlib import Path

    from d9dfn.config import load_config
    from d9dfn.jobs import LMJobConfig

    job = load_config(LMJobConfig, Path(__file__).resolve().parent.parent / "examples" / "gpu-medium.json")
    assert job.model.to_qwen3(job.data.seq_len) == Qwen3Config.medium()
    assert job.trainer.run.device == "cuda"
    assert job.trainer.precision.policy() == Precision.bf16_mixed()
