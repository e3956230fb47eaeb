"""Initial weights from a safetensors directory: exact round trip with export, clear errors otherwise; a run's weights
from its checkpoints in the dtypes it saved them in (a pure-bf16 run), its left-out base hashed in that dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from d9dfn.checkpoint import (
    BASE_KEY,
    CheckpointMismatchError,
    CheckpointStore,
    base_record,
    export_safetensors,
    fingerprint,
    load_initial_weights,
    load_weights,
)
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


def _two_layers(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))


def _save_bf16(run_dir, params: dict, metadata: dict | None = None) -> None:
    """A step 2 as a pure-bf16 run saves it: params in bfloat16, the optimizer's state beside them."""
    with CheckpointStore(run_dir / "checkpoints") as store:
        store.save(2, {"params": params, "buffers": {}, "opt_state": {"count": torch.tensor(2)}}, metadata)


def test_load_weights_returns_a_pure_bf16_runs_weights_in_bf16_to_a_float32_model(tmp_path):
    saved = {name: p.detach().to(torch.bfloat16) for name, p in _two_layers(seed=1).named_parameters()}
    _save_bf16(tmp_path, saved)
    model = _two_layers()  # float32, as inference and export build it
    weights, buffers, step = load_weights(tmp_path, model)
    assert step == 2
    assert buffers == {}
    assert {name: w.dtype for name, w in weights.items()} == dict.fromkeys(saved, torch.bfloat16)
    assert_trees_close(weights, saved, rtol=0, atol=0)
    # Names and shapes are still the model's: another model is refused, naming the leaf.
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointMismatchError, match=r"params/0\.weight .*shape=\(4, 3\).*shape=\(5, 3\)"):
        load_weights(tmp_path, other)


def test_load_weights_hashes_a_left_out_base_in_the_runs_dtype(tmp_path):
    """A pure-bf16 LoRA-like run: its first layer (the base) left out, read from a folder in float32 and hashed after
    the cast to bf16, as the run hashed it; it comes back in bf16, and another base is still refused."""
    folder = tmp_path / "base"
    folder.mkdir()
    start = {name: p.detach().clone() for name, p in _two_layers(seed=1).named_parameters()}  # the folder's, float32
    base = [name for name in start if name.startswith("0.")]
    run = {name: p.to(torch.bfloat16) for name, p in start.items()}  # what the run trained on: all cast (cast_params)
    _save_bf16(
        tmp_path,
        {name: p for name, p in run.items() if name not in base},
        {BASE_KEY: base_record(folder, fingerprint(run, base))},
    )

    def load_base(model, where, values=start):
        assert where == folder.absolute()
        with torch.no_grad():
            for name in base:
                model.get_parameter(name).copy_(values[name])

    weights, _, _ = load_weights(tmp_path, _two_layers(), load_base=load_base)
    assert_trees_close(weights, run, rtol=0, atol=0)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    changed = {**start, "0.bias": start["0.bias"] + 0.5}
    with pytest.raises(ValueError, match=r"has other values for 0\.bias"):
        load_weights(tmp_path, _two_layers(), load_base=lambda model, where: load_base(model, where, changed))
