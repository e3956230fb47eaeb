"""Hugging Face Qwen3 folders in and out: equal logits both ways, and every config mismatch is an error.

Tiny HF models are built from configs (no downloads); ``transformers`` comes with the ``hf`` test extra.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from _jobs import TINY_DATA, TINY_MODEL, TINY_TRAINER, job_argv, tiny_job
from hypothesis import given
from hypothesis import strategies as st

from d9dfn import (
    BuildForwardInputsResult,
    ComputeLossResult,
    TrainTask,
    init_train_state,
    make_eval_step,
    make_train_step,
)
from d9dfn.checkpoint import load_initial_weights, load_weights
from d9dfn.cli import main
from d9dfn.config import DeviceMeshParameters
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, check_source_config
from d9dfn.loop import (
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    TrainingConfigurator,
    materialize_model,
)
from d9dfn.loop import _events as ev
from d9dfn.models import (
    Qwen3Config,
    Qwen3LM,
    check_hf_config,
    qwen3_from_hf_config,
    qwen3_from_hf_state,
    qwen3_to_hf_config,
)
from d9dfn.optim import adamw
from d9dfn.tasks import CausalLMTask

transformers = pytest.importorskip("transformers")  # the `hf` extra; CI installs it (noxfile: tests)

TINY = (*TINY_TRAINER, "trainer.total_steps=2", "trainer.checkpointing.period_steps=2", *TINY_MODEL, *TINY_DATA)
TINY = (*TINY, "model.num_layers=2")  # two blocks: a layer-mapping slip would show


def _argv(command: str, save_dir: Path, *overrides: str) -> list[str]:
    return job_argv(command, save_dir, *overrides, base=TINY)


def _hf_model(tie: bool, **overrides) -> torch.nn.Module:
    fields = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rope_theta": 50_000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
    }
    config = transformers.Qwen3Config(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF inits norm weights to ones; perturb them so a skipped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ours_logits(model: Qwen3LM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)["logits"]


@given(
    layers=st.integers(1, 4),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([4, 8]),
    theta=st.floats(100.0, 1e7),
    eps=st.floats(1e-8, 1e-3),
    tie=st.booleans(),
)
def test_hf_config_round_trips_and_checks_clean(layers, heads, head_dim, theta, eps, tie):
    config = Qwen3Config.tiny(
        num_layers=layers,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=eps,
        tie_word_embeddings=tie,
    )
    hf = json.loads(json.dumps(qwen3_to_hf_config(config)))  # through JSON, as a file carries it
    assert qwen3_from_hf_config(hf) == config
    check_hf_config(config, hf)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_folder_loads_into_qwen3lm_with_equal_logits(tmp_path, tie):
    hf_model = _hf_model(tie)
    hf_model.save_pretrained(tmp_path)
    found = json.loads((tmp_path / "config.json").read_text())
    config = dataclasses.replace(qwen3_from_hf_config(found), max_seq_len=32)
    model = Qwen3LM(config)
    load_initial_weights(
        model, tmp_path, lambda s: qwen3_from_hf_state(s, config), lambda f: check_hf_config(config, f)
    )
    ids = torch.randint(0, 96, (2, 12))
    diff = (_ours_logits(model, ids) - _hf_logits(hf_model, ids)).abs().max().item()
    print(f"HF folder -> Qwen3LM ({'tied' if tie else 'untied'}): max |Δ logits| = {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"rope_theta": 10_000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}, "rope_theta"),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),  # left out: HF reads its default, 32 layers
        ({"head_dim": 16}, "head_dim"),
    ],
    ids=["rope_theta", "rms_norm_eps", "tying", "missing-layers", "head_dim"],
)
def test_each_config_mismatch_is_an_error_naming_the_field(tmp_path, edit, field):
    _hf_model(False).save_pretrained(tmp_path)
    found = json.loads((tmp_path / "config.json").read_text())
    config = dataclasses.replace(qwen3_from_hf_config(found), max_seq_len=32)
    found.update({k: v for k, v in edit.items() if v is not None})
    for k in [k for k, v in edit.items() if v is None]:
        del found[k]
    (tmp_path / "config.json").write_text(json.dumps(found))
    model = Qwen3LM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"config.json.*{field} is .* there.* but .* here; build the model with"):
        load_initial_weights(
            model, tmp_path, lambda s: qwen3_from_hf_state(s, config), lambda f: check_hf_config(config, f)
        )
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)  # checked before any tensor loads


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_features_qwen3lm_lacks_are_refused(edit, field):
    hf = {**qwen3_to_hf_config(Qwen3Config.tiny()), **edit}
    with pytest.raises(ValueError, match=field):
        qwen3_from_hf_config(hf)


def test_tied_model_refuses_a_different_lm_head():
    config = Qwen3Config.tiny()
    state = {"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        qwen3_from_hf_state(state, config)


def test_d9dfn_format_config_mismatch_names_the_job_field():
    config = Qwen3Config.tiny()
    found = {**dataclasses.asdict(config), "rope_theta": 500.0}
    with pytest.raises(ValueError, match=r"rope_theta=500.0 but this job's has 10000.0; set model.rope_theta"):
        check_source_config(config, found)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_hf_loads_in_transformers_with_equal_logits_and_back_into_a_run(tmp_path, capsys, tie):
    tying = f"model.tie_word_embeddings={'true' if tie else 'false'}"
    assert main(_argv("train", tmp_path / "a", tying)) == 0
    run_dir = tmp_path / "a" / "stdlib-lm"
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    job = LMJobConfig.model_validate_json((run_dir / "job.json").read_text())
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    _, model = materialize_model(Qwen3Provider(qwen3), InitializeModelStageContext(), torch.device("cpu"))
    params, buffers, _ = load_weights(run_dir, model)
    ours = Qwen3LM(qwen3)
    ours.load_state_dict({**params, **buffers})
    ids = torch.randint(0, 256, (2, 16))
    diff = (_ours_logits(ours, ids) - _hf_logits(hf_model, ids)).abs().max().item()
    with capsys.disabled():
        print(
            f"d9dfn export --format hf -> AutoModelForCausalLM ({'tied' if tie else 'untied'}): "
            f"max |Δ logits| = {diff:.3g}"
        )
    assert diff < 1e-5
    assert hf_model.config.tie_word_embeddings is tie

    # The HF folder is a source checkpoint for a d9dfn run: one step at a negligible lr starts from its weights.
    sets = (tying, "trainer.total_steps=1", f"trainer.model_stage_factory.source_checkpoint={out}")
    assert main(_argv("train", tmp_path / "b", *sets, "trainer.optimizer.lr=1e-12")) == 0
    again, _, _ = load_weights(tmp_path / "b" / "stdlib-lm", model)
    torch.testing.assert_close(again, params, rtol=1e-6, atol=1e-9)

    # A job whose model differs from the folder's config fails before step 1, naming the field.
    capsys.readouterr()
    code = main(_argv("train", tmp_path / "c", *sets, "model.rope_theta=500.0"))
    assert code == 2
    assert "rope_theta is 10000.0 there but 500.0 here" in capsys.readouterr().err


# --- a transformers model through the loop ----------------------------------------------------------------


class HFQwen3Provider(ModelProvider):
    """The loop's model: transformers' own Qwen3ForCausalLM (default init: its init_weights)."""

    def __init__(self, config) -> None:
        self.config = config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        return InitializeModelStageResult(model=transformers.Qwen3ForCausalLM(self.config))


def _hf_lm_config(**overrides):
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    shape = {"num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64, "vocab_size": 256}
    return transformers.Qwen3Config(**sizes, **shape, use_cache=False, **overrides)


def _hf_trainer(save_dir: Path, config, *overrides: str):
    job = tiny_job(save_dir, "trainer.total_steps=6", *overrides, base=TINY)
    return TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=HFQwen3Provider(config),
        data_provider=CorpusProvider(job.data),
    ).configure()


def _logged_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_hf_model_trains_through_the_loop_as_make_train_step_trains_it(tmp_path):
    trainer = _hf_trainer(tmp_path, _hf_lm_config())
    start = trainer.initial_state()
    for name, tensor in [*start.params.items(), *start.buffers.items()]:  # RMSNorm ones, rebuilt inv_freq
        assert torch.isfinite(tensor).all(), name
    data_start = trainer.data.state()
    trainer.train()
    logged = _logged_losses(trainer.run_dir)
    assert all(math.isfinite(loss) for loss in logged.values())
    assert logged[6] < logged[1]

    trainer.data.restore(data_start)
    clip = trainer.config.gradient_clipping.max_norm
    step = make_train_step(trainer.skeleton, CausalLMTask(), trainer.optimizer, max_grad_norm=clip, compile=False)
    state, batches = start, iter(trainer.data)
    for position in range(1, 7):
        state, out = step(state, next(batches))
        assert out.loss.item() == logged[position], position  # bitwise: the same step on the same batches


def test_hf_folder_through_the_loop_loads_every_tensor_and_trains(tmp_path):
    # Perturbed norms (a skipped tensor would show) and rope_theta 50000 (the rotary inv_freq buffer is not in
    # the file: the loop's init must rebuild it from the config).
    source = _hf_model(False, vocab_size=256)
    source.save_pretrained(tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    config.use_cache = False
    source_dir = f"trainer.model_stage_factory.source_checkpoint={tmp_path / 'hf'}"
    trainer = _hf_trainer(tmp_path / "runs", config, source_dir)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        loaded = trainer.model.eval()(ids)  # the materialized, loaded model (steps set their own modes)
    diff = (loaded.logits - _hf_logits(source, ids)).abs().max().item()
    assert diff == 0.0, diff
    trainer.train()
    logged = _logged_losses(trainer.run_dir)
    assert all(math.isfinite(loss) for loss in logged.values())
    assert logged[6] < logged[1]


def test_uninitialized_tensor_is_an_error_naming_it(tmp_path):
    class Forgetful(HFQwen3Provider):
        def initialize_weights(self, context, model) -> None:  # skips HF's init: norms, inv_freq untouched
            for module in model.modules():
                if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                    module.reset_parameters()

    job = tiny_job(tmp_path, base=TINY)
    configurator = TrainingConfigurator(
        mesh=DeviceMeshParameters(),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Forgetful(_hf_lm_config()),
        data_provider=CorpusProvider(job.data),
    )
    never = r"Forgetful.initialize_weights: 11 tensor\(s\) were never initialized: \['model.layers.0.self_attn.q_norm"
    with pytest.raises(ValueError, match=never):
        configurator.configure()


def test_rng_kwarg_a_model_does_not_name_is_refused():
    model = transformers.Qwen3ForCausalLM(_hf_lm_config())
    with pytest.raises(ValueError, match=r"rng_kwarg='dropout_key', but Qwen3ForCausalLM.forward has no parameter"):
        make_train_step(model, CausalLMTask(), adamw(1e-3), rng_kwarg="dropout_key")


def test_steps_run_their_skeleton_in_train_and_eval_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            seen.append(self.training and self.net[1].training)
            return {"y": self.net(x)}

    class Task(TrainTask):
        def build_forward_inputs(self, batch, state):
            return BuildForwardInputsResult(inputs={"x": batch}, kwargs={}), state

        def compute_loss(self, outputs, state, step):
            return ComputeLossResult(loss=outputs["y"].square().mean())

    probe = Probe().eval()
    state = init_train_state(probe, adamw(1e-3))
    make_train_step(probe, Task(), adamw(1e-3), compile=False)(state, torch.ones(2, 4))
    make_eval_step(probe, Task(), compile=False)(state, None, torch.ones(2, 4))
    assert seen == [True, False]
    assert not probe.training  # the caller's module is left as it was
    assert not model.training


@pytest.mark.slow
def test_hf_dropout_from_torch_rng_resumes_bitwise(tmp_path):
    config = _hf_lm_config(attention_dropout=0.2)
    straight = _hf_trainer(tmp_path / "a", config)
    straight.train()
    expected = _logged_losses(straight.run_dir)

    killed = _hf_trainer(tmp_path / "b", config, "trainer.checkpointing.period_steps=3")

    def die(context) -> None:
        if context.step == 5:
            raise KeyboardInterrupt

    killed.bus.subscribe(ev.EVENT_TRAIN_STEP_PRE, die)
    with pytest.raises(KeyboardInterrupt):
        killed.train()
    resumed = _hf_trainer(tmp_path / "b", config, "trainer.checkpointing.period_steps=3")
    resumed.train()
    got = _logged_losses(resumed.run_dir)
    assert sorted(got) == list(range(1, 7))
    assert got == expected  # steps 4..6 ran after the resume from step 3: same dropout masks, same losses
    assert len(set(expected.values())) == 6
    without = _hf_trainer(tmp_path / "c", _hf_lm_config())  # the dropout is real: it changes every loss
    without.train()
    assert all(loss != expected[step] for step, loss in _logged_losses(without.run_dir).items())


@pytest.mark.slow
def test_migration_page_code_runs(tmp_path, monkeypatch):
    import re

    import d9dfn._step

    page = Path(__file__).resolve().parent.parent / "docs" / "migration" / "from-hugging-face.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert len(blocks) == 4
    # The page compiles with the default backend; aot_eager checks the same traces, faster.
    monkeypatch.setattr(
        d9dfn._step, "_compile", lambda fn, compile, backend: torch.compile(fn, fullgraph=True, backend="aot_eager")
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    before, after = namespace["before"], namespace["after"]
    assert len(before) == len(after) == 10
    gap = max(abs(a - b) for a, b in zip(before, after, strict=True))
    print(f"HF loop vs d9dfn step, 10 steps: max abs loss difference {gap:.3g}")
    assert gap < 1e-4  # torch AdamW vs d9dfn's adamw, eager vs compiled
    assert after[-1] < after[0]
    logged = _logged_losses(namespace["result"].run_dir)
    assert sorted(logged) == list(range(1, 21))
    assert logged[20] < logged[1]
