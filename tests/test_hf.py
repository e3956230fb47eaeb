"""Hugging Face folders of the Llama family (Qwen3, Llama, Mistral, Qwen2) in and out: bitwise-equal logits both
ways, and every config mismatch or unsupported feature is an error naming the field.

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
from safetensors.torch import save_file

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
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, check_source_config, load_model
from d9dfn.loop import (
    InitializeModelStageContext,
    InitializeModelStageResult,
    ModelProvider,
    TrainingConfigurator,
    materialize_model,
)
from d9dfn.loop import _events as ev
from d9dfn.models import (
    FAMILIES,
    HF_FAMILIES,
    Qwen3Config,
    Qwen3LM,
    RopeScaling,
    check_hf_config,
    from_hf_config,
    from_hf_state,
    to_hf_config,
    to_hf_state,
)
from d9dfn.optim import adamw
from d9dfn.step import find_repeated_blocks
from d9dfn.tasks import CausalLMTask

transformers = pytest.importorskip("transformers")  # the `hf` extra; CI installs it (noxfile: tests)

TINY = (*TINY_TRAINER, "trainer.total_steps=2", "trainer.checkpointing.period_steps=2", *TINY_MODEL, *TINY_DATA)
TINY = (*TINY, "model.num_layers=2")  # two blocks: a layer-mapping slip would show

# Frequencies of head_dim 8 at theta 1e4 have wavelengths 6.3, 63, 628 and 6283 positions: with pretraining's
# context 256 and factors 1 / 8, llama3 keeps the first (< 256 / 8), blends the second and divides the others.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 256,
}


def _argv(command: str, save_dir: Path, *overrides: str) -> list[str]:
    return job_argv(command, save_dir, *overrides, base=TINY)


def _hf_model(tie: bool, family: str = "qwen3", **overrides) -> torch.nn.Module:
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
    config = transformers.AutoConfig.for_model(family, **{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF inits norm weights to ones and biases to zeros; perturb them so a skipped one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ours_logits(model: Qwen3LM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)["logits"]


def _load_hf_folder(folder: Path, **overrides) -> Qwen3LM:
    """``Qwen3LM`` from an HF folder, as a source checkpoint loads one: config checked, names mapped, strict."""
    config = from_hf_config(json.loads((folder / "config.json").read_text()), **overrides)
    model = Qwen3LM(config)
    load_initial_weights(model, folder, lambda s: from_hf_state(s, config), lambda f: check_hf_config(config, f))
    return model


DECODER_FAMILIES = sorted(name for name, family in FAMILIES.items() if family.config_type is Qwen3Config)
"""The families of the shared decoder (``Qwen3Config``); qwen3_moe has its own tests (``tests/test_qwen3_moe.py``)."""

_FAMILY_SWITCHES = st.sampled_from(DECODER_FAMILIES).flatmap(
    lambda family: st.tuples(st.just(family), st.booleans().map(HF_FAMILIES[family].switches))
)


@given(
    layers=st.integers(1, 4),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([4, 8]),
    theta=st.floats(100.0, 1e7),
    eps=st.floats(1e-8, 1e-3),
    tie=st.booleans(),
    family_switches=_FAMILY_SWITCHES,
    scaling=st.sampled_from([None, RopeScaling("linear", 2.0), RopeScaling("llama3", 8.0, 1.0, 4.0, 32)]),
)
def test_hf_config_round_trips_and_checks_clean(layers, heads, head_dim, theta, eps, tie, family_switches, scaling):
    family, switches = family_switches
    config = Qwen3Config.tiny(
        num_layers=layers,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=eps,
        tie_word_embeddings=tie,
        rope_scaling=scaling,
        **switches,
    )
    hf = json.loads(json.dumps(to_hf_config(config, family)))  # through JSON, as a file carries it
    assert (hf["model_type"], hf["architectures"]) == (family, [HF_FAMILIES[family].architecture])
    assert from_hf_config(hf) == config
    check_hf_config(config, hf)
    if family != "mistral":  # mistral and llama build the same switches: the default picks llama
        assert to_hf_config(config) == hf


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_hf_family_defaults_are_transformers_defaults(family):
    # What a config.json leaves out is what transformers assumes, family by family (e.g. 8 kv heads in Mistral).
    theirs = transformers.AutoConfig.for_model(family)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    expected = {
        "vocab_size": theirs.vocab_size,
        "hidden_size": theirs.hidden_size,
        "num_layers": theirs.num_hidden_layers,
        "num_heads": theirs.num_attention_heads,
        "num_kv_heads": theirs.num_key_value_heads,
        "head_dim": head_dim,
        "intermediate_size": theirs.intermediate_size,
        "rope_theta": theirs.rope_parameters["rope_theta"],
        "rms_norm_eps": theirs.rms_norm_eps,
        "tie_word_embeddings": theirs.tie_word_embeddings,
        "qkv_bias": family == "qwen2",
        "rope_scaling": None,
    }
    config = from_hf_config({"model_type": family}, max_seq_len=64)
    assert {name: getattr(config, name) for name in expected} == expected
    no_window = from_hf_config({"model_type": family, "sliding_window": None})
    assert no_window.max_seq_len == theirs.max_position_embeddings
    spec = HF_FAMILIES[family]
    if spec.window == "use_sliding_window":  # the window Qwen's flag turns on, from layer max_window_layers
        on = transformers.AutoConfig.for_model(family, use_sliding_window=True)
        assert (spec.defaults["sliding_window"], spec.defaults["max_window_layers"]) == (
            on.sliding_window,
            on.max_window_layers,
        )
    if family == "mistral":  # Mistral's default window (4096) is shorter than its default context
        with pytest.raises(ValueError, match=f"sliding_window={theirs.sliding_window} "):
            from_hf_config({"model_type": family})


_ROUND_TRIPS = {
    "qwen3": ("qwen3", False, {}),
    "qwen3-tied": ("qwen3", True, {}),
    "llama": ("llama", False, {}),
    "llama-tied-attention-bias": ("llama", True, {"attention_bias": True}),
    "llama3-rope": ("llama", False, {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 512}),
    "mistral-window-as-long-as-the-context": ("mistral", False, {"sliding_window": 32}),
    "mistral-head-dim-16": ("mistral", True, {"head_dim": 16, "sliding_window": None}),  # not hidden / heads
    "qwen2": ("qwen2", True, {}),
    "qwen2-linear-rope": (
        "qwen2",
        False,
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
    ),
    "qwen2-window-on-no-layer": (
        "qwen2",
        False,
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ),
}


@pytest.mark.parametrize("case", list(_ROUND_TRIPS))
def test_hf_to_d9dfn_to_hf_round_trip_has_bitwise_equal_logits(tmp_path, case):
    family, tie, overrides = _ROUND_TRIPS[case]
    source = _hf_model(tie, family, **overrides)
    source.save_pretrained(tmp_path / "hf")
    model = _load_hf_folder(tmp_path / "hf", max_seq_len=32)
    bias = family == "qwen2" or overrides.get("attention_bias", False)
    assert (model.config.qk_norm, model.config.qkv_bias) == (family == "qwen3", bias)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(source, ids)

    (tmp_path / "out").mkdir()
    save_file(to_hf_state(model.state_dict(), model.config), tmp_path / "out" / "model.safetensors")
    (tmp_path / "out" / "config.json").write_text(json.dumps(to_hf_config(model.config, family)))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == HF_FAMILIES[family].architecture
    assert back.config.tie_word_embeddings is tie
    # The same maths in the same order (float32 on the CPU): equal bit for bit, both ways.
    torch.testing.assert_close(_ours_logits(model, ids), expected, rtol=0, atol=0)
    torch.testing.assert_close(_hf_logits(back, ids), expected, rtol=0, atol=0)
    if "rope" in case:  # the scaling is live: the unscaled model differs
        plain = Qwen3LM(dataclasses.replace(model.config, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        assert not torch.equal(_ours_logits(plain, ids), expected)


def test_rope_scaling_llama3_keeps_high_blends_middle_and_divides_low_frequencies():
    inv_freq = 1.0 / 10_000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaled = RopeScaling("llama3", *(LLAMA3_ROPE[key] for key in keys)).scale(inv_freq)
    assert scaled[0] == inv_freq[0]
    assert inv_freq[1] / 8 < scaled[1] < inv_freq[1]
    assert torch.equal(scaled[2:], inv_freq[2:] / 8)
    assert torch.equal(RopeScaling("linear", 4.0).scale(inv_freq), inv_freq / 4)


def test_sliding_window_shorter_than_the_context_is_refused_where_it_changes_the_logits(tmp_path):
    source = _hf_model(False, "mistral", sliding_window=31)
    source.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"sliding_window=31 .*max_seq_len is 32.* at most 31: pass max_seq_len=31"):
        _load_hf_folder(tmp_path / "hf", max_seq_len=32)
    model = _load_hf_folder(tmp_path / "hf", max_seq_len=31)
    ids = torch.randint(0, 96, (1, 32))
    torch.testing.assert_close(_ours_logits(model, ids[:, :31]), _hf_logits(source, ids[:, :31]), rtol=0, atol=0)
    full = Qwen3LM(dataclasses.replace(model.config, max_seq_len=32))
    full.load_state_dict(model.state_dict())
    # Position 31 sees position 0 in full attention but not through a window of 31: what the refusal guards.
    assert not torch.equal(_ours_logits(full, ids)[:, -1], _hf_logits(source, ids)[:, -1])


@pytest.mark.parametrize(
    ("family", "edit", "match"),
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
        ("qwen2", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
        ("llama", {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "rope_type='longrope'"),
        ("llama", {"rope_parameters": {**LLAMA3_ROPE, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("gemma", {}, "model_type='gemma'; d9dfn loads model_type qwen3, llama, mistral, qwen2, qwen3_moe only"),
        ("mistral", {"sliding_window": 16}, r"sliding_window=16 \(MistralForCausalLM.*max_seq_len is 64"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "sliding_window=16"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention"] * 2}, "16"),
    ],
    ids=[
        "yarn",
        "dynamic",
        "longrope-legacy-key",
        "partial-rotary",
        "llama3-incomplete",
        "mlp-bias",
        "gelu",
        "gemma",
        "mistral-window",
        "qwen2-window-from-layer-1",
        "qwen3-window-by-layer-types",
    ],
)
def test_features_qwen3lm_lacks_are_refused_by_name(family, edit, match):
    switches = HF_FAMILIES.get(family, HF_FAMILIES["qwen3"]).switches()
    hf = {**to_hf_config(Qwen3Config.tiny(**switches), "qwen3" if family == "gemma" else family), **edit}
    hf["model_type"] = family
    with pytest.raises(ValueError, match=match):
        from_hf_config(hf)


def test_each_config_mismatch_is_an_error_naming_the_field(tmp_path):
    _hf_model(False).save_pretrained(tmp_path)
    found = json.loads((tmp_path / "config.json").read_text())
    config = dataclasses.replace(from_hf_config(found), max_seq_len=32)
    edits = {
        "rope_theta": {"rope_theta": 10_000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
        "rms_norm_eps": {"rms_norm_eps": 1e-6},
        "tie_word_embeddings": {"tie_word_embeddings": True},
        "num_hidden_layers": {"num_hidden_layers": None},  # left out: HF reads its default, 32 layers
        "head_dim": {"head_dim": 16},
        "qk_norm": {"model_type": "qwen2"},  # no q/k norm in Qwen2 (and biases)
        "qkv_bias": {"attention_bias": True},
        "rope_scaling": {"rope_parameters": {"rope_type": "linear", "rope_theta": 50_000.0, "factor": 2.0}},
    }
    model = Qwen3LM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for field, edit in edits.items():
        edited = {k: v for k, v in {**found, **edit}.items() if v is not None}
        (tmp_path / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=rf"config.json.*{field} is .* there.* but .* here; build the model with"):
            load_initial_weights(
                model, tmp_path, lambda s: from_hf_state(s, config), lambda f: check_hf_config(config, f)
            )
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)  # checked before any tensor loads


def test_tied_model_refuses_a_different_lm_head():
    config = Qwen3Config.tiny()
    state = {"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.ones(2, 2)}
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        from_hf_state(state, config)


def test_to_hf_config_refuses_a_family_that_cannot_express_the_model():
    with pytest.raises(ValueError, match=r"MistralForCausalLM builds .*'qk_norm': False.*export it as family='qwen3'"):
        to_hf_config(Qwen3Config.tiny(), "mistral")
    with pytest.raises(ValueError, match="family='gpt2'; choose one of qwen3, llama, mistral, qwen2"):
        to_hf_config(Qwen3Config.tiny(), "gpt2")


def test_d9dfn_format_config_mismatch_names_the_job_field():
    config = Qwen3Config.tiny()
    found = {**dataclasses.asdict(config), "rope_theta": 500.0}
    with pytest.raises(
        ValueError, match=r"rope_theta=500.0 but this job's has 10000.0; set --set model.rope_theta=500.0"
    ):
        check_source_config(config, found)
    found = dataclasses.asdict(LMJobConfig().model.model_copy(update={"family": "mistral"}).to_qwen3(64))
    with pytest.raises(
        ValueError, match=r"qk_norm=False.* but this job's has qk_norm=True.*model.family=llama or mistral"
    ):
        check_source_config(LMJobConfig().model.to_qwen3(64), found)


def test_hf_source_checkpoint_mismatches_name_the_jobs_set_path(tmp_path):
    job = tiny_job(tmp_path, "model.family=llama", "model.hidden_size=32", "model.rope_theta=50000.0")
    config = job.model.to_qwen3(job.data.seq_len)
    hf = to_hf_config(config, "llama")
    check_source_config(config, hf, family="llama")
    cases = [
        ("qwen3", {}, "this job's model.family is 'qwen3'; set --set model.family=llama"),
        ("llama", {"hidden_size": 64}, "hidden_size is 64 there but 32 here; set --set model.hidden_size=64"),
        ("llama", {"vocab_size": 96}, "vocab_size is 96 there but 256 here; this job cannot build vocab_size=96"),
        ("llama", {"max_position_embeddings": 8}, "max_seq_len is 16; at most 8: set --set data.seq_len=8"),
        ("llama", {"attention_bias": True}, "but False here; this job cannot build qkv_bias=True"),
    ]
    for family, edit, message in cases:
        with pytest.raises(ValueError, match=message):
            check_source_config(config, {**hf, **edit}, family=family)


def test_cli_hf_source_checkpoint_of_another_size_exits_2_naming_the_set_path(tmp_path, capsys):
    source = _hf_model(False, "llama", vocab_size=256, hidden_size=32, rope_theta=10_000.0, rms_norm_eps=1e-6)
    source.save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bars
    sets = (
        "model.family=llama",
        "model.tie_word_embeddings=false",
        f"trainer.model_stage_factory.source_checkpoint={tmp_path / 'hf'}",
    )
    assert main(_argv("train", tmp_path / "runs", *sets)) == 2  # the tiny job's model is hidden 16
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("d9dfn: error: ")
    assert "hidden_size is 32 there but 16 here; set --set model.hidden_size=32, or load a checkpoint" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tie"), [("qwen3", True), ("qwen3", False), ("llama", False), ("mistral", False), ("qwen2", True)]
)
def test_export_hf_loads_in_transformers_with_equal_logits_and_back_into_a_run(tmp_path, capsys, family, tie):
    sets = (f"model.family={family}", f"model.tie_word_embeddings={'true' if tie else 'false'}")
    assert main(_argv("train", tmp_path / "a", *sets)) == 0
    run_dir = tmp_path / "a" / "stdlib-lm"
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == HF_FAMILIES[family].architecture
    job = LMJobConfig.model_validate_json((run_dir / "job.json").read_text())
    qwen3 = job.model.to_qwen3(job.data.seq_len)
    _, model = materialize_model(Qwen3Provider(qwen3, family), InitializeModelStageContext(), torch.device("cpu"))
    params, buffers, _ = load_weights(run_dir, model)
    ours = Qwen3LM(qwen3)
    ours.load_state_dict({**params, **buffers})
    ids = torch.randint(0, 256, (2, 16))
    diff = (_ours_logits(ours, ids) - _hf_logits(hf_model, ids)).abs().max().item()
    with capsys.disabled():
        print(f"d9dfn export --format hf -> {type(hf_model).__name__} (tied={tie}): max |Δ logits| = {diff:.3g}")
    assert diff == 0.0
    assert hf_model.config.tie_word_embeddings is tie

    # The HF folder is a source checkpoint for a d9dfn run: one step at a negligible lr starts from its weights.
    sets = (*sets, "trainer.total_steps=1", f"trainer.model_stage_factory.source_checkpoint={out}")
    assert main(_argv("train", tmp_path / "b", *sets, "trainer.optimizer.lr=1e-12")) == 0
    again, _, _ = load_weights(tmp_path / "b" / "stdlib-lm", model)
    torch.testing.assert_close(again, params, rtol=1e-6, atol=1e-9)

    # A job whose model differs from the folder's config fails before step 1, naming the field and its --set path.
    capsys.readouterr()
    code = main(_argv("train", tmp_path / "c", *sets, "model.rope_theta=500.0"))
    assert code == 2
    assert "rope_theta is 10000.0 there but 500.0 here; set --set model.rope_theta=10000.0" in capsys.readouterr().err


PURE_BF16 = (
    "trainer.precision.param_dtype=bfloat16",
    "trainer.precision.compute_dtype=bfloat16",
    'trainer.optimizer={"name": "stochastic_adamw", "lr": 0.01, "state_dtype": "bfloat16"}',
)
"""A pure-bf16 run: bf16 params and moments, updated with stochastic rounding."""


@pytest.mark.slow
def test_a_pure_bf16_run_infers_loads_and_exports_in_bf16_what_transformers_loads(tmp_path, capsys):
    """``d9dfn train`` of a pure-bf16 run ends with its evaluation (the checkpoint read into the job's float32 model in
    its own dtype), ``d9dfn infer`` evaluates it in float32 too, ``load_model`` gives the bf16 model and ``--format hf``
    writes bf16 weights that ``transformers`` loads in bf16 with the same logits."""
    assert main(_argv("train", tmp_path, *PURE_BF16)) == 0
    assert "validation perplexity" in capsys.readouterr().out
    assert main(_argv("infer", tmp_path)) == 0  # float32 inference of the bf16 checkpoint: evaluated anew
    out = capsys.readouterr().out
    assert "validation perplexity" in out
    assert "reusing" not in out
    run_dir = tmp_path / "stdlib-lm"
    model = load_model(run_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    export = tmp_path / "hf"
    assert main(["export", str(run_dir), str(export), "--format", "hf"]) == 0
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(export / "model.safetensors").values()} == {torch.bfloat16}
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert {p.dtype for p in hf_model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_hf_logits(hf_model, ids), _ours_logits(model, ids), rtol=0.02, atol=0.02)


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
    # The loop's default, trainer.repeated_blocks=null, finds the decoder layer: "auto" here too.
    step = make_train_step(
        trainer.skeleton, CausalLMTask(), trainer.optimizer, max_grad_norm=clip, repeated_blocks="auto", compile=False
    )
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


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "aot_eager"])
def test_tied_hf_model_loads_without_lm_head_trains_per_block_and_exports(tmp_path, monkeypatch, compile):
    # Tied (Qwen3's small checkpoints are): save_pretrained writes no lm_head.weight, and the module holds one
    # Parameter under two names. Issue 43: the load refused the folder (missing lm_head.weight) and the per-block
    # step refused the module (its params name the tensor once).
    from safetensors import safe_open

    import d9dfn.step._options

    real_backend_of = d9dfn.step._options.backend_of
    monkeypatch.setattr(
        d9dfn.step._options, "backend_of", lambda compile: "aot_eager" if compile is True else real_backend_of(compile)
    )
    source = _hf_model(True, vocab_size=256)
    source.save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as file:
        assert "lm_head.weight" not in set(file.keys())
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    config.use_cache = False
    source_dir = f"trainer.model_stage_factory.source_checkpoint={tmp_path / 'hf'}"
    trainer = _hf_trainer(tmp_path / "runs", config, source_dir, f"trainer.compile={str(compile).lower()}")
    # trainer.repeated_blocks=null: the step finds the decoder layer and runs the per-block runner.
    assert find_repeated_blocks(trainer.skeleton) == (type(trainer.model.model.layers[0]),)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(trainer.model.eval()(ids).logits, _hf_logits(source, ids))
    trainer.train()
    logged = _logged_losses(trainer.run_dir)
    assert all(math.isfinite(loss) for loss in logged.values())
    assert logged[6] < logged[1]

    trainer.export(tmp_path / "out")
    config.save_pretrained(tmp_path / "out")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    trained = trainer.restore_latest(trainer.initial_state(), announce=False).params
    assert "lm_head.weight" not in trained  # the tied tensor, once: under the embedding's name
    assert torch.equal(back.lm_head.weight, back.model.embed_tokens.weight)
    assert torch.equal(back.model.embed_tokens.weight, trained["model.embed_tokens.weight"])
    assert not torch.equal(back.model.embed_tokens.weight, source.model.embed_tokens.weight)  # it trained


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

    import d9dfn.step._options

    page = Path(__file__).resolve().parent.parent / "docs" / "migration" / "from-hugging-face.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert len(blocks) == 5
    # The page compiles with the default backend; aot_eager checks the same traces, faster.
    real_backend_of = d9dfn.step._options.backend_of
    monkeypatch.setattr(
        d9dfn.step._options, "backend_of", lambda compile: "aot_eager" if compile is True else real_backend_of(compile)
    )
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)
    assert namespace["same"] is True  # the Llama folder's logits, bit for bit
    before, after = namespace["before"], namespace["after"]
    assert len(before) == len(after) == 10
    gap = max(abs(a - b) for a, b in zip(before, after, strict=True))
    print(f"HF loop vs d9dfn step, 10 steps: max abs loss difference {gap:.3g}")
    assert gap < 1e-4  # torch AdamW vs d9dfn's adamw, eager vs compiled
    assert after[-1] < after[0]
    logged = _logged_losses(namespace["result"].run_dir)
    assert sorted(logged) == list(range(1, 21))
    assert logged[20] < logged[1]
