"""The catalogue of model families (``d9dfn.models.FAMILIES``): every family's plan covers its model, and a family
registered in the one table is what the job's ``model.family``, the Hugging Face mapping and export see."""

from __future__ import annotations

import fnmatch
import json

import pytest
import torch
from _jobs import TINY, job_argv, tiny_job
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from d9dfn.cli import main
from d9dfn.config import ConfigError
from d9dfn.jobs import Qwen3Provider, check_source_config
from d9dfn.loop import InitializeModelStageContext
from d9dfn.models import (
    FAMILIES,
    HF_FAMILIES,
    Family,
    HFFamily,
    Qwen3Config,
    Qwen3LM,
    from_hf_config,
    logical_dims,
    to_hf_config,
)
from d9dfn.models._decoder import DECODER_PLAN, decoder_config
from d9dfn.models.qwen3_moe import Qwen3MoeConfig
from d9dfn.pipeline import PipelineStageInfo


def test_catalogue_names_its_families_by_their_own_names():
    assert list(FAMILIES) == ["qwen3", "llama", "mistral", "qwen2", "qwen3_moe"]
    assert all(family.name == name for name, family in FAMILIES.items())
    assert dict(HF_FAMILIES) == {name: family.hf for name, family in FAMILIES.items()}


def _params(family: Family, stage: PipelineStageInfo | None = None, **fields) -> dict[str, torch.Tensor]:
    sizes = {"hidden_size": 16, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "intermediate_size": 32}
    with torch.device("meta"):
        return dict(family.model(family.config(**sizes, **fields), stage).named_parameters())


@given(
    name=st.sampled_from(list(FAMILIES)),
    num_layers=st.integers(1, 3),
    switches=st.fixed_dictionaries({name: st.booleans() for name in ("qkv_bias", "o_proj_bias", "qk_norm")}),
    tie=st.booleans(),
)
def test_family_plan_gives_every_parameter_one_logical_dim_per_tensor_dim(name, num_layers, switches, tie):
    family = FAMILIES[name]
    params = _params(family, num_layers=num_layers, tie_word_embeddings=tie, **switches)
    dims = logical_dims(family.plan, params)  # raises unless each parameter matches one pattern, of its rank
    assert list(dims) == list(params)
    assert all(len(dims[key]) == param.ndim for key, param in params.items())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_plan_has_no_pattern_that_no_model_of_the_family_uses(name):
    family = FAMILIES[name]
    every_switch = {"qkv_bias": True, "o_proj_bias": True, "qk_norm": True, "tie_word_embeddings": False}
    if family.config_type is Qwen3MoeConfig:  # a dense layer and a shared expert: every pattern of its plan
        every_switch |= {"mlp_only_layers": (1,), "shared_expert_intermediate_size": 8}
    params = _params(family, num_layers=3, **every_switch)
    used = {pattern for pattern in family.plan if any(fnmatch.fnmatchcase(key, pattern) for key in params)}
    assert used == set(family.plan)
    # Pipeline stages keep the whole model's names, so the one plan covers each stage too (the MoE family's as well).
    stages = [_params(family, PipelineStageInfo(i, 2), num_layers=3, **every_switch) for i in range(2)]
    assert [list(logical_dims(family.plan, stage)) for stage in stages] == [list(stage) for stage in stages]
    assert {key for stage in stages for key in stage} == set(params)


def test_logical_dims_refuses_a_parameter_matched_never_twice_or_with_another_rank():
    weight = {"layers.0.mlp.up_proj.weight": torch.empty(4, 2)}
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up_proj.weight' matches no pattern of the plan; add one"):
        logical_dims({"layers.*.mlp.down_proj.weight": ("embed", "mlp")}, weight)
    twice = {"layers.*.mlp.up_proj.weight": ("mlp", "embed"), "layers.*.weight": ("mlp", "embed")}
    with pytest.raises(ValueError, match=r"matches 2 patterns of the plan \('layers.\*.mlp.up_proj.weight', 'layers"):
        logical_dims(twice, weight)
    with pytest.raises(
        ValueError, match=r"has 2 dimensions \(shape \(4, 2\)\) but its pattern .* names 1: \('mlp',\); give"
    ):
        logical_dims({"layers.*.mlp.up_proj.weight": ("mlp",)}, weight)


def test_to_hf_config_exports_as_the_first_family_that_expresses_the_model_or_says_none_does():
    assert to_hf_config(Qwen3Config.tiny(qk_norm=False))["model_type"] == "llama"  # llama before mistral
    assert to_hf_config(Qwen3Config.tiny(qk_norm=False, qkv_bias=True))["model_type"] == "qwen2"
    no_family = r"no family of d9dfn\.models\.FAMILIES builds it; export d9dfn's format instead"
    with pytest.raises(ValueError, match=r"the model has \{'qk_norm': True, 'qkv_bias': True, .*" + no_family):
        to_hf_config(Qwen3Config.tiny(qkv_bias=True))  # q/k norm and q/k/v biases without an o bias: none
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM builds .* but the model has .*" + no_family):
        to_hf_config(Qwen3Config.tiny(qkv_bias=True), "qwen3")


# --- adding a family: its folder (here: this test) and its entry in FAMILIES ----------------------------------


class ToyLM(Qwen3LM):
    """The toy family's model: the shared decoder under its own class, so a test can see which family built it."""


def _toy_to_hf(state, config):
    return {f"toy.{key}": tensor for key, tensor in state.items()}


def _toy_from_hf(state, config):
    return {key.removeprefix("toy."): tensor for key, tensor in state.items()}


_TOY_HF = HFFamily(
    architecture="ToyForCausalLM",
    qk_norm=False,
    bias="none",
    window="none",
    defaults={"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
)
TOY = Family(
    name="toy",
    hf=_TOY_HF,
    config=decoder_config(_TOY_HF),
    model=ToyLM,
    to_hf_state=_toy_to_hf,
    from_hf_state=_toy_from_hf,
    plan=DECODER_PLAN,
)


def test_unknown_model_family_is_a_one_line_error_naming_the_field_and_the_families(tmp_path):
    with pytest.raises(ConfigError) as error:
        tiny_job(tmp_path, "model.family=toy")
    assert str(error.value) == (
        "load_config: model.family: 'toy' is not a model family; set model.family to one of qwen3, llama, mistral, "
        "qwen2, qwen3_moe (the names in d9dfn.models.FAMILIES)"
    )


def test_family_registered_in_the_catalogue_is_what_the_job_and_the_hf_mapping_see(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    job = tiny_job(tmp_path, "model.family=toy")
    config = job.model.to_qwen3(job.data.seq_len)
    assert (config.qk_norm, config.qkv_bias, config.hidden_size) == (False, False, 16)  # the toy's config builder
    provider = Qwen3Provider(config, job.model.family)
    assert type(provider.initialize_model_stage(InitializeModelStageContext()).model) is ToyLM
    assert HF_FAMILIES["toy"] is _TOY_HF
    hf = to_hf_config(config, "toy")
    assert (hf["model_type"], hf["architectures"]) == ("toy", ["ToyForCausalLM"])
    assert from_hf_config(hf) == config
    check_source_config(config, hf, family="toy")  # a toy HF folder is a source checkpoint of a toy job
    with pytest.raises(ValueError, match=r"model\.family is 'qwen3'; set --set model\.family=toy"):
        check_source_config(config, hf, family="qwen3")


@pytest.mark.slow
def test_family_registered_in_the_catalogue_exports_and_loads_through_its_own_tensor_names(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    sets = ("model.family=toy", "model.tie_word_embeddings=false", "trainer.total_steps=1")
    assert main(job_argv("train", tmp_path / "a", *sets, base=TINY)) == 0
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "a" / "stdlib-lm"), str(out), "--format", "hf"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]
    with safe_open(out / "model.safetensors", "pt") as exported:
        names = set(exported.keys())
    assert "toy.lm_head.weight" in names  # the toy's mapping named every tensor
    assert all(name.startswith("toy.") for name in names)
    # As a source checkpoint: only the toy's from_hf_state turns those names back into the model's.
    source = f"trainer.model_stage_factory.source_checkpoint={out}"
    assert main(job_argv("train", tmp_path / "b", *sets, source, "trainer.optimizer.lr=1e-12", base=TINY)) == 0
