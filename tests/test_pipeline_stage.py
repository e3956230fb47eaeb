"""Pipeline stages: d9d's layer split, pure stage calls with full names, Qwen3LM stages, generic splits, meta shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from d9dfn import prng
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.pipeline import (
    PipelineStageInfo,
    Stage,
    build_stages,
    distribute_layers,
    split_stages,
    stage_io_shapes,
)


class DictSequential(nn.Sequential):
    """An ``nn.Sequential`` that speaks d9d's stage contract: ``x`` in, ``{"x": ...}`` out."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": super().forward(x)}


def _run(stages, params, buffers, inputs, kwargs):
    """Compose the stages as a pipeline would (d9d's dataflow); returns the last outputs and all new buffers."""
    new_buffers = {}
    for stage in stages:
        inputs, updated = stage(stage.select_params(params), stage.select_buffers(buffers), inputs, kwargs)
        new_buffers.update(updated)
    return inputs, new_buffers


def _qwen_stages(config: Qwen3Config, num_stages: int) -> tuple[Stage, ...]:
    return build_stages(lambda info: Qwen3LM(config, stage=info), num_stages)


# ----------------------------------------------------------------------------------------- distribute_layers


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "first", "last", "expected"),
    [  # d9d's own cases (d9d tests/pipelining, test_distribute_layers_scenarios)
        (24, 4, 1, 1, [(0, 6), (6, 13), (13, 19), (19, 24)]),
        (30, 4, 0, 2, [(0, 8), (8, 16), (16, 24), (24, 30)]),
        (10, 1, 1, 2, [(0, 10)]),
        (12, 2, 1, 1, [(0, 6), (6, 12)]),
        (32, 4, 0, 0, [(0, 8), (8, 16), (16, 24), (24, 32)]),
        (34, 4, 0, 0, [(0, 9), (9, 18), (18, 26), (26, 34)]),
    ],
)
def test_distribute_layers_matches_d9d(num_layers, num_stages, first, last, expected):
    ranges = distribute_layers(num_layers, num_stages, first_stage_cost=first, last_stage_cost=last)
    assert [(r.start, r.stop) for r in ranges] == expected


@pytest.mark.parametrize(("num_layers", "num_stages"), [(0, 4), (2, 4)])
def test_distribute_layers_too_long_pipeline_raises(num_layers, num_stages):
    with pytest.raises(ValueError, match=r"distribute_layers: .* leave stage \d+ with -?\d+ layers.*fewer stages"):
        distribute_layers(num_layers, num_stages, first_stage_cost=1, last_stage_cost=1)


@given(
    num_layers=st.integers(0, 64),
    num_stages=st.integers(1, 16),
    first=st.integers(0, 4),
    last=st.integers(0, 4),
)
def test_distribute_layers_tiles_the_layers(num_layers, num_stages, first, last):
    virtual = num_layers + first + last
    shares = [virtual // num_stages + (i < virtual % num_stages) for i in range(num_stages)]
    shares[0] -= first
    shares[-1] -= last
    if min(shares) <= 0:
        with pytest.raises(ValueError, match=r"distribute_layers: .* leave stage"):
            distribute_layers(num_layers, num_stages, first_stage_cost=first, last_stage_cost=last)
        assert num_layers < num_stages or first or last  # without costs, enough layers always fit
        return
    ranges = distribute_layers(num_layers, num_stages, first_stage_cost=first, last_stage_cost=last)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, each once
    assert all(len(r) > 0 for r in ranges)
    middle = [len(r) for r in ranges[1:-1]]
    assert not middle or max(middle) - min(middle) <= 1
    if not first and not last:
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_distribute_layers_without_costs_fills_every_stage_when_layers_suffice():
    for num_stages in range(1, 9):
        for num_layers in range(num_stages, 20):
            assert all(len(r) for r in distribute_layers(num_layers, num_stages))


def test_distribute_layers_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"distribute_layers: num_stages=0 must be an int >= 1"):
        distribute_layers(4, 0)
    with pytest.raises(ValueError, match=r"distribute_layers: last_stage_cost=-1 must be an int >= 0"):
        distribute_layers(4, 2, last_stage_cost=-1)


def test_pipeline_stage_info_properties_and_validation():
    assert PipelineStageInfo(0, 1).is_current_stage_first
    assert PipelineStageInfo(0, 1).is_current_stage_last
    middle = PipelineStageInfo(current_stage=1, num_stages=3)
    assert not middle.is_current_stage_first
    assert not middle.is_current_stage_last
    assert PipelineStageInfo(2, 3).is_current_stage_last
    with pytest.raises(ValueError, match=r"current_stage=3 with num_stages=3; pass .*0 <= current_stage"):
        PipelineStageInfo(3, 3)
    with pytest.raises(ValueError, match=r"num_stages=True must be an int"):
        PipelineStageInfo(0, True)


# ------------------------------------------------------------------------------------------- Qwen3LM stages


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "config",
    [
        Qwen3Config.tiny(num_layers=7, tie_word_embeddings=False),
        Qwen3Config.tiny(num_layers=9, tie_word_embeddings=False, dropout=0.1),
    ],
    ids=["plain", "dropout"],
)
def test_qwen3_stages_compose_to_the_whole_model_bitwise(config, num_stages):
    model = Qwen3LM(config)
    params = dict(model.named_parameters())
    stages = _qwen_stages(config, num_stages)
    input_ids = torch.randint(0, config.vocab_size, (3, 7))
    kwargs = {"position_ids": torch.arange(2, 9).expand(3, 7), "dropout_key": prng.key(5)}

    expected = model(input_ids, **kwargs)["logits"]
    outputs, new_buffers = _run(stages, params, {}, {"input_ids": input_ids}, kwargs)

    assert outputs.keys() == {"logits"}
    assert new_buffers == {}
    assert torch.equal(outputs["logits"], expected)
    if config.dropout:  # the key reached every stage: without it the logits differ
        assert not torch.equal(expected, model(input_ids, position_ids=kwargs["position_ids"])["logits"])


def test_qwen3_stages_compose_bitwise_in_bfloat16():
    config = Qwen3Config.tiny(num_layers=5, tie_word_embeddings=False)
    model = Qwen3LM(config).to(torch.bfloat16)
    input_ids = torch.randint(0, config.vocab_size, (2, 9))
    outputs, _ = _run(_qwen_stages(config, 3), dict(model.named_parameters()), {}, {"input_ids": input_ids}, {})
    assert outputs["logits"].dtype == torch.bfloat16
    assert torch.equal(outputs["logits"], model(input_ids)["logits"])


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_qwen3_stage_names_partition_the_whole_model(num_stages):
    config = Qwen3Config.tiny(num_layers=7, tie_word_embeddings=False)
    names = [name for name, _ in Qwen3LM(config).named_parameters()]
    stages = _qwen_stages(config, num_stages)
    held = [name for stage in stages for name in stage.param_names]
    assert sorted(held) == sorted(names)  # each name once, and nothing else
    assert all(p.device.type == "meta" for s in stages for p in s.module.parameters())
    assert "embed_tokens.weight" in stages[0].param_names
    assert "lm_head.weight" in stages[-1].param_names
    ranges = distribute_layers(7, num_stages, last_stage_cost=1)
    for stage, layers in zip(stages, ranges, strict=True):  # global indices as names
        assert {int(n.split(".")[1]) for n in stage.param_names if n.startswith("layers.")} == set(layers)


def test_qwen3_one_stage_is_the_unchanged_whole_model():
    config = Qwen3Config.tiny()
    torch.manual_seed(3)
    whole = Qwen3LM(config)
    torch.manual_seed(3)
    one = Qwen3LM(config, stage=PipelineStageInfo(0, 1))
    assert [n for n, _ in one.named_parameters()] == [n for n, _ in whole.named_parameters()]
    assert [n for n, _ in whole.named_parameters()][:2] == ["embed_tokens.weight", "layers.0.input_layernorm.weight"]
    assert all(torch.equal(a, b) for a, b in zip(one.parameters(), whole.parameters(), strict=True))
    ids = torch.randint(0, 256, (2, 5))
    assert one(ids).keys() == {"logits"}
    assert torch.equal(one(ids)["logits"], whole(ids)["logits"])


def test_qwen3_tied_embeddings_across_stages_are_refused():
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True shares embed_tokens.weight.*stage 1 of 2.*"):
        Qwen3LM(Qwen3Config.tiny(num_layers=4), stage=PipelineStageInfo(1, 2))
    with pytest.raises(ValueError, match=r"untie it to pipeline this model: Qwen3Config\(\.\.\., tie_word_embeddings"):
        _qwen_stages(Qwen3Config.tiny(num_layers=4), 2)
    assert Qwen3LM(Qwen3Config.tiny(), stage=PipelineStageInfo(0, 1)).lm_head is None  # one stage may tie


def test_qwen3_stage_rejects_the_other_kind_of_input():
    config = Qwen3Config.tiny(num_layers=3, tie_word_embeddings=False)
    first = Qwen3LM(config, stage=PipelineStageInfo(0, 2))
    last = Qwen3LM(config, stage=PipelineStageInfo(1, 2))
    assert first(torch.zeros(2, 4, dtype=torch.long)).keys() == {"hidden_states"}
    with pytest.raises(ValueError, match=r"\(stage 1 of 2\): a later stage takes hidden_states .* got input_ids="):
        last(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(stage 0 of 2\): the first stage embeds tokens"):
        first(hidden_states=torch.zeros(2, 4, 32))
    with pytest.raises(ValueError, match=r"hidden_states has shape \(2, 4, 8\), expected \(batch, seq, 32\)"):
        last(hidden_states=torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match=r"position_ids has shape \(3,\), but hidden_states has shape \(2, 4, 32\)"):
        last(hidden_states=torch.zeros(2, 4, 32), position_ids=torch.arange(3))


def test_qwen3_stage_that_gets_no_layer_is_refused():
    with pytest.raises(ValueError, match=r"distribute_layers: 2 layers over 2 stages .* last_stage_cost=1"):
        Qwen3LM(Qwen3Config.tiny(num_layers=2, tie_word_embeddings=False), stage=PipelineStageInfo(0, 2))
    stage = Qwen3LM(
        Qwen3Config.tiny(num_layers=2, tie_word_embeddings=False), stage=PipelineStageInfo(1, 2), last_stage_cost=0
    )
    assert list(stage.layers) == ["1"]


# ------------------------------------------------------------------------------------- Stage and split_stages


def test_split_stages_on_a_sequential_mlp_keeps_names_and_composes():
    torch.manual_seed(1)
    model = DictSequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))
    stages = split_stages(model, [["0", "1"], ["2", "3"], ["4"]])
    assert [sorted(s.param_names) for s in stages] == [
        ["0.bias", "0.weight"],
        ["2.bias", "2.weight"],
        ["4.bias", "4.weight"],
    ]
    assert list(stages[1].module._modules) == ["2", "3"]  # keys kept, not renumbered
    assert all(p.device.type == "meta" for s in stages for p in s.module.parameters())
    x = torch.randn(5, 4)
    outputs, _ = _run(stages, dict(model.named_parameters()), {}, {"x": x}, {})
    assert torch.equal(outputs["x"], model(x)["x"])
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model itself is untouched


def test_split_stages_sets_absent_attributes_to_none():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.body = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.head = nn.Linear(4, 1)

    stages = split_stages(Net(), [["embed", "body.0"], ["body.1", "head"]])
    assert stages[0].module.head is None
    assert stages[1].module.embed is None
    assert sorted(stages[1].param_names) == ["body.1.bias", "body.1.weight", "head.bias", "head.weight"]


def test_split_stages_errors_name_the_name_and_the_fix():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"stage 1 names '3', which is not a submodule.*Sequential"):
        split_stages(model, [["0"], ["3"]])
    with pytest.raises(ValueError, match=r"'1.weight' is on no stage \(2 names in all\); list every module"):
        split_stages(model, [["0"]])
    with pytest.raises(ValueError, match=r"'0.bias' is on stage 0 and on stage 1; list every module in exactly one"):
        split_stages(model, [["0"], ["0", "1"]])
    with pytest.raises(ValueError, match=r"stage 0 is the string '0'; pass a list of names: \['0'\]"):
        split_stages(model, ["0", ["1"]])


def test_stage_call_checks_names_and_outputs():
    model = DictSequential(nn.Linear(2, 2), nn.Linear(2, 2))
    stages = split_stages(model, [["0"], ["1"]])
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"Stage 0: params has 2 names of other stages .*stage.select_params"):
        stages[0](params, {}, {"x": torch.ones(1, 2)}, {})
    with pytest.raises(ValueError, match=r"Stage 1.select_params: params lacks '1.bias'"):
        stages[1].select_params({"1.weight": params["1.weight"]})
    with pytest.raises(ValueError, match=r"'x' is both an input and a kwarg"):
        stages[0](stages[0].select_params(params), {}, {"x": torch.ones(1, 2)}, {"x": 1})
    plain = split_stages(nn.Sequential(nn.Linear(2, 2)), [["0"]])[0]
    with pytest.raises(TypeError, match=r"Stage 0: Sequential.forward returned Tensor; a stage returns a dict"):
        plain({n: torch.zeros(p.shape) for n, p in plain.module.named_parameters()}, {}, {"input": torch.ones(2)}, {})


def test_batchnorm_stage_leaves_its_input_buffers_untouched():
    torch.manual_seed(2)
    model = DictSequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2)).train()
    stages = split_stages(model, [["0", "1"], ["2", "3"]])
    assert stages[0].buffer_names == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    before = {name: b.clone() for name, b in buffers.items()}
    x = torch.randn(6, 3)
    outputs, new_buffers = _run(stages, dict(model.named_parameters()), buffers, {"x": x}, {})
    assert all(torch.equal(buffers[name], before[name]) for name in before)  # nothing written in place
    expected = model(x)["x"]  # the eager module updates its own buffers
    assert torch.equal(outputs["x"], expected)
    assert new_buffers.keys() == before.keys()
    assert all(torch.equal(new_buffers[name], b) for name, b in model.named_buffers())
    assert not torch.equal(new_buffers["1.running_mean"], before["1.running_mean"])


def test_build_stages_refuses_overlapping_stages():
    with pytest.raises(ValueError, match=r"build_stages: '0.bias' is on stage 0 and on stage 1"):
        build_stages(lambda info: nn.Sequential(nn.Linear(2, 2)), 2)


# ---------------------------------------------------------------------------------------------- meta shapes


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stage_io_shapes_equal_the_real_outputs(num_stages):
    config = Qwen3Config.tiny(num_layers=7, tie_word_embeddings=False, dropout=0.1)
    model = Qwen3LM(config)
    stages = _qwen_stages(config, num_stages)
    input_ids = torch.randint(0, config.vocab_size, (8, 11))
    kwargs = {"position_ids": torch.arange(11).expand(8, 11), "dropout_key": prng.key(0)}
    shapes = stage_io_shapes(stages, {"input_ids": input_ids}, kwargs, microbatch_size=2)

    mb_inputs, mb_kwargs = {"input_ids": input_ids[:2]}, {**kwargs, "position_ids": kwargs["position_ids"][:2]}
    params = dict(model.named_parameters())
    for stage, spec in zip(stages, shapes, strict=True):
        mb_inputs, _ = stage(stage.select_params(params), {}, mb_inputs, mb_kwargs)
        assert spec.keys() == mb_inputs.keys()
        for name, tensor in mb_inputs.items():
            assert spec[name].device.type == "meta"
            assert (spec[name].shape, spec[name].dtype) == (tensor.shape, tensor.dtype)
    assert tuple(shapes[-1]["logits"].shape) == (2, 11, 256)


def test_stage_io_shapes_on_a_generic_split_and_its_errors():
    model = DictSequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).to(torch.float64)
    stages = split_stages(model, [["0", "1"], ["2"]])
    x = torch.empty(12, 4, dtype=torch.float64, device="meta")
    shapes = stage_io_shapes(stages, {"x": x}, {}, microbatch_size=3)
    assert [(tuple(s["x"].shape), s["x"].dtype) for s in shapes] == [((3, 8), torch.float64), ((3, 3), torch.float64)]
    with pytest.raises(ValueError, match=r"inputs\['x'\] has 12 rows, which microbatch_size=5 does not divide"):
        stage_io_shapes(stages, {"x": torch.empty(12, 4)}, {}, microbatch_size=5)
