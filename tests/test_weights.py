"""Initial weights from a safetensors directory: exact round trip with export, clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from d9dfn.checkpoint import export_safetensors, load_initial_weights
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.testing import assert_trees_close


def _state(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_load_initial_weights_round_trips_an_export(tmp_path):
    torch.manual_seed(0)
    source = Qwen3LM(Qwen3Config.tiny())
    params = dict(source.named_parameters())
    export_safetensors(source, params, dict(source.named_buffers()), tmp_path)
    torch.manual_seed(1)
    target = Qwen3LM(Qwen3Config.tiny())
    assert not torch.equal(target.embed_tokens.weight, source.embed_tokens.weight)
    load_initial_weights(target, tmp_path)
    assert_trees_close(_state(target), _state(source), rtol=0, atol=0)


def test_load_initial_weights_applies_the_mapper(tmp_path):
    source = Qwen3LM(Qwen3Config.tiny())
    save_file({f"model.{k}": v.contiguous() for k, v in _state(source).items()}, str(tmp_path / "w.safetensors"))
    target = Qwen3LM(Qwen3Config.tiny())
    load_initial_weights(target, tmp_path, mapper=lambda t: {k.removeprefix("model."): v for k, v in t.items()})
    assert_trees_close(_state(target), _state(source), rtol=0, atol=0)


def test_load_initial_weights_names_what_does_not_fit(tmp_path):
    source = _state(Qwen3LM(Qwen3Config.tiny()))
    source["extra.weight"] = torch.zeros(1)
    source.pop("norm.weight")
    save_file({k: v.contiguous() for k, v in source.items()}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\], unexpected \['extra.weight'\]"):
        load_initial_weights(Qwen3LM(Qwen3Config.tiny()), tmp_path)


def test_load_initial_weights_missing_directory_says_where(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file in .*nowhere"):
        load_initial_weights(Qwen3LM(Qwen3Config.tiny()), tmp_path / "nowhere")
