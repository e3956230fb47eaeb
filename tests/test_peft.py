"""LoRA and full-tune by pattern (``trainer.peft``, ``d9dfn.models.apply_peft``): the adapted model equals its base
until it trains, only the adapters (and ``full`` targets) train, the optimizer state covers them alone, the step's
features compose with them, a checkpoint refuses another base, and the exports are what ``transformers`` and ``peft``
load with the same logits."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from _jobs import TINY_TRAINER, job_argv, tiny_job
from test_hf_source import BASE, _folder
from test_step_compose import CONFIG, Combo, _batches, _run_simulated

import d9dfn
from d9dfn import optim, pipeline
from d9dfn.cli import main
from d9dfn.config import ConfigError, LoRAConfig, build_peft
from d9dfn.jobs import load_model, train_lm
from d9dfn.loop import EVENT_TRAIN_STEP_PRE
from d9dfn.models import (
    FullTune,
    LoRA,
    LoRALinear,
    Qwen3Config,
    Qwen3LM,
    apply_peft,
    lora_modules,
    merge_lora,
    peft_trainable,
)
from d9dfn.models._decoder import Qwen3DecoderLayer
from d9dfn.step import ActivationCheckpointing, find_repeated_blocks
from d9dfn.tasks import CausalLMTask

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")  # the hf extra has it (CI installs it): a skip here is a broken environment

ATTENTION = "q_proj|k_proj|v_proj|o_proj"
PEFT_SET = 'trainer.peft=[{"method": "lora", "targets": "q_proj|k_proj|v_proj|o_proj", "rank": 4, "alpha": 8}]'


def _adapted(seed: int = 0, dropout: float = 0.0, config: Qwen3Config = CONFIG) -> tuple[Qwen3LM, torch.nn.Module]:
    torch.manual_seed(seed)
    base = Qwen3LM(config)
    return base, apply_peft(base, [LoRA(ATTENTION, rank=4, alpha=8.0, dropout=dropout)])


def test_lora_at_step_0_computes_its_base_bitwise_with_or_without_a_dropout_key():
    base, adapted = _adapted(dropout=0.1)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7))
    expected = base(ids)["logits"]
    assert torch.equal(adapted(ids)["logits"], expected)
    assert torch.equal(adapted(ids, dropout_key=d9dfn.prng.key(3))["logits"], expected)  # B = 0: no mask shows
    assert all(
        bool(m.lora_B.weight.eq(0).all()) and m.lora_A.weight.abs().sum() > 0 for m in lora_modules(adapted).values()
    )
    assert len(lora_modules(adapted)) == 4 * CONFIG.num_layers
    assert not any(isinstance(m, LoRALinear) for m in base.modules())  # the base model is not changed


def test_lora_init_leaves_the_bases_draws_alone_and_is_kaiming_uniform():
    torch.manual_seed(0)
    base = Qwen3LM(CONFIG)
    torch.manual_seed(0)
    with torch.device("meta"):
        skeleton = apply_peft(Qwen3LM(CONFIG), [LoRA(ATTENTION, rank=4)])
    adapted = skeleton.to_empty(device="cpu")
    torch.manual_seed(0)
    adapted.reset_parameters()  # the late init the loop runs: the base draws what it draws without adapters
    for name, param in base.named_parameters():
        assert torch.equal(adapted.get_parameter(name), param), name
    a = adapted.get_parameter("layers.0.self_attn.q_proj.lora_A.weight")
    assert a.abs().max() <= 1 / CONFIG.hidden_size**0.5  # PEFT's U(±1/sqrt(in))


def test_dropout_on_the_adapters_input_is_keyed():
    _, adapted = _adapted(dropout=0.5)
    with torch.no_grad():
        for m in lora_modules(adapted).values():
            m.lora_B.weight.normal_()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7))
    one, same = (adapted(ids, dropout_key=d9dfn.prng.key(1))["logits"] for _ in range(2))
    other = adapted(ids, dropout_key=d9dfn.prng.key(2))["logits"]
    assert torch.equal(one, same)
    assert not torch.equal(one, other)
    assert not torch.equal(one, adapted(ids)["logits"])  # no key: no dropout (evaluation)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_an_adapter_on_the_untied_lm_head_adds_its_product_to_the_logits(dropout):
    """The head computed its logits from ``lm_head.weight`` alone, so an adapter there trained nothing, silently."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = Qwen3LM(config)
    adapted = apply_peft(base, [LoRA("lm_head", rank=2, alpha=4.0, dropout=dropout)])
    head = adapted.lm_head
    assert isinstance(head, LoRALinear)
    with torch.no_grad():
        head.lora_B.weight.normal_()
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7))
    h = base(ids)["logits"]  # the base's logits (the same base weights)
    got = adapted(ids)["logits"]  # no key: no dropout
    states = adapted.norm(_hidden(adapted, ids))
    expected = h + (states @ head.lora_A.weight.T @ head.lora_B.weight.T) * head.scaling
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, h)
    if dropout:  # the head's mask is drawn from the key, as the blocks' adapters' are
        keyed = adapted(ids, dropout_key=d9dfn.prng.key(1))["logits"]
        assert torch.equal(keyed, adapted(ids, dropout_key=d9dfn.prng.key(1))["logits"])
        assert not torch.equal(keyed, got)


def _hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last block's output (before the final norm) of a whole ``Qwen3LM``."""
    h, cos, sin, masks = model.prologue(ids, None, None, None, None)
    for layer in model.layers.values():
        h = layer(h, cos, sin, None, None, *masks)
    return h


def test_find_repeated_blocks_finds_only_the_decoder_layer_of_an_adapted_model():
    _, adapted = _adapted()
    assert find_repeated_blocks(adapted) == (Qwen3DecoderLayer,)


def test_trainable_predicate_takes_adapters_and_full_targets_only():
    _, adapted = _adapted()
    trains = peft_trainable([LoRA(ATTENTION), FullTune("norm")])
    names = [name for name, p in adapted.named_parameters() if trains(name, p)]
    assert "norm.weight" in names
    assert all(".lora_" in name or name == "norm.weight" for name in names), names
    assert len(names) == 2 * 4 * CONFIG.num_layers + 1


def test_merge_folds_the_adapters_into_their_base():
    _, adapted = _adapted()
    with torch.no_grad():
        for m in lora_modules(adapted).values():
            m.lora_B.weight.normal_()
    params = dict(adapted.named_parameters())
    merged = merge_lora(params, {name: m.scaling for name, m in lora_modules(adapted).items()})
    plain = Qwen3LM(CONFIG)
    plain.load_state_dict(merged)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids)["logits"], adapted(ids)["logits"], rtol=1e-5, atol=1e-5)


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in d9dfn.tree_leaves(tree) if isinstance(t, torch.Tensor))


def test_training_moves_only_the_adapters_and_the_optimizer_state_covers_them_alone():
    _, adapted = _adapted()
    task, trains = CausalLMTask(), peft_trainable([LoRA(ATTENTION)])
    state = d9dfn.init_train_state(adapted, optim.adamw(0.02), task=task, trainable=trains)
    before = {name: p.clone() for name, p in state.params.items()}
    step = d9dfn.make_train_step(adapted, task, optim.adamw(0.02), compile=False)
    combo = Combo("sequential", "off", "fp32", 1, 1, 1, None, 0)
    for batch in _batches(combo):
        state, _ = step(state, batch)
    adapters = {name for name in before if ".lora_" in name}
    assert set(state.frozen) == set(before) - adapters
    for name in state.frozen:
        assert torch.equal(state.params[name], before[name]), name  # the base, bitwise
    assert all(not torch.equal(state.params[name], before[name]) for name in adapters if "lora_B" in name)
    # AdamW's two moments per adapter element (and a 0-d count): nothing for the base.
    adapter_bytes = sum(before[name].numel() * before[name].element_size() for name in adapters)
    assert 2 * adapter_bytes <= _bytes(state.opt_state) <= 2 * adapter_bytes + 64
    assert _bytes(state.opt_state) < _bytes(before) / 4


def _lora_run(blocks: bool, precision: str, replicate: int = 1, shard: int = 1, *, reference: bool = False):
    """Two steps of the adapted ``CONFIG`` model (adapters' B drawn, so both steps move the logits) on a simulated
    mesh; ``reference``: the same batches on one process, traced, in ``num_ranks × 2`` microbatches."""
    combo = Combo("sequential", "auto" if blocks else "off", precision, replicate, shard, 2, 0.05, 7)
    _, model = _adapted(seed=7)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(std=0.02)
    for name, param in model.named_parameters():  # the base frozen by requires_grad, as init_train_state reads it
        param.requires_grad_(".lora_" in name)
    task = CausalLMTask()
    precision_value = d9dfn.Precision.bf16_mixed() if precision == "bf16" else None
    options = {"repeated_blocks": "auto" if blocks and not reference else (), "precision": precision_value}
    if combo.num_ranks > 1 and not reference:
        params, outputs = _run_simulated(combo, model, task, options)
        return params, [loss for loss, _, _ in outputs]
    optimizer = optim.adamw(0.02, eps=1e-3, weight_decay=0.1)
    num_microbatches = combo.num_ranks * combo.num_microbatches
    step = d9dfn.make_train_step(
        model, task, optimizer, num_microbatches=num_microbatches, max_grad_norm=0.05, compile=False, **options
    )
    state = d9dfn.init_train_state(model, optimizer, task=task)
    assert len(state.frozen) > 0
    outputs = []
    for batch in _batches(combo):
        state, out = step(state, batch)
        outputs.append(out.loss)
    return state.params, outputs


@pytest.mark.parametrize(
    ("blocks", "precision", "replicate", "shard"),
    [(True, "fp32", 1, 1), (True, "bf16", 1, 1), (False, "fp32", 1, 2), (True, "bf16", 2, 2)],
    ids=["per-block", "per-block-bf16", "data_shard-2", "hybrid-per-block-bf16"],
)
def test_lora_composes_with_per_block_bf16_and_sharded_data_parallelism(blocks, precision, replicate, shard):
    params, outputs = _lora_run(blocks, precision, replicate, shard)
    reference, ref_outputs = _lora_run(blocks, precision, replicate, shard, reference=True)
    tolerance = {"rtol": 2e-3, "atol": 2e-3} if precision == "bf16" else {"rtol": 1e-5, "atol": 1e-5}
    d9dfn.testing.assert_trees_close(params, reference, **tolerance)
    for loss, ref_loss in zip(outputs, ref_outputs, strict=True):
        torch.testing.assert_close(loss, ref_loss, **tolerance)
    _, start = _adapted(seed=7)
    moved = 0
    for name, param in params.items():
        if ".lora_" in name:
            moved += not torch.equal(param, start.get_parameter(name).detach())
        else:  # frozen: bitwise the start, on every layout
            assert torch.equal(param, start.get_parameter(name).detach()), name
    assert moved > 0


def test_config_errors_are_one_line_naming_the_field(tmp_path):
    with pytest.raises(
        ConfigError, match=r"trainer\.peft\.0\.rank=0: Input should be greater than or equal to 1"
    ) as error:
        tiny_job(tmp_path, 'trainer.peft=[{"method": "lora", "targets": "q_proj", "rank": 0}]')
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="not a regular expression"):
        tiny_job(tmp_path, 'trainer.peft=[{"method": "lora", "targets": "q_proj("}]')
    with pytest.raises(ConfigError, match="method"):
        tiny_job(tmp_path, 'trainer.peft=[{"method": "dora", "targets": "q_proj"}]')
    assert build_peft([LoRAConfig(method="lora", targets="q_proj", rank=2, alpha=4)]) == (LoRA("q_proj", 2, 4.0),)


def test_targets_that_match_nothing_are_one_line_naming_the_regex_and_some_modules(tmp_path, capsys):
    sets = ('trainer.peft=[{"method": "lora", "targets": "query"}]',)
    with pytest.raises(ValueError, match=r"trainer\.peft\[0\]: targets='query' matches no Linear module") as error:
        train_lm(tiny_job(tmp_path, *sets))
    assert "layers.0.self_attn.q_proj" in str(error.value)
    assert "\n" not in str(error.value)
    assert main(job_argv("train", tmp_path, *sets)) == 2
    assert "trainer.peft[0]: targets='query'" in capsys.readouterr().err
    overlap = 'trainer.peft=[{"method": "lora", "targets": "q_proj"}, {"method": "lora", "targets": ".*_proj"}]'
    with pytest.raises(ValueError, match=r"trainer\.peft\[1\]: .* which methods\[0\] already adapts"):
        train_lm(tiny_job(tmp_path, overlap))


def _losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


@pytest.mark.slow
# peft 0.21 asks transformers 5 for is_gradient_checkpointing, which warns that it goes away in v6: theirs, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_journey_lora_on_a_folder_exports_what_transformers_and_peft_load_with_the_same_logits(
    tmp_path, capsys, monkeypatch
):
    """Issue 43's must-show for LoRA: a tiny Qwen3 folder, a JSONL, ``--set trainer.peft=[...]`` → the loss falls;
    ``--format peft`` → ``PeftModel.from_pretrained`` gives d9dfn's logits; ``--format hf`` → the merged model
    gives them too; the base weights come out bitwise the folder's."""
    from test_data_files import _jsonl
    from test_hf_source import _function_records

    source = _folder(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "train.jsonl", _function_records(400))
    sets = (
        *TINY_TRAINER,
        f"model.source={source}",
        'data.files=["train.jsonl"]',
        "data.seq_len=32",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.total_steps=30",
        "trainer.checkpointing.period_steps=30",
        "trainer.batching.global_batch_size=4",
        "trainer.batching.microbatch_size=4",
        "trainer.optimizer.lr=0.01",
        "sample.num_bytes=2",
        'trainer.peft=[{"method": "lora", "targets": "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj", '
        '"rank": 8, "alpha": 16, "dropout": 0.05}]',
    )
    assert main(job_argv("train", tmp_path / "runs", *sets, base=())) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    losses = _losses(run_dir)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # the loss falls (5.56 -> 5.14 when written)

    model = load_model(run_dir)
    start = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    base = {name.removeprefix("model."): p for name, p in start.state_dict().items()}
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base[name]), name  # frozen: bitwise the folder's
    ids = torch.tensor([[5, 17, 260, 33, 101, 7, 299, 64]])
    with torch.no_grad():
        ours = model(ids)["logits"]
        assert not torch.equal(ours, start(input_ids=ids).logits)  # the adapters trained

    adapter = tmp_path / "adapter"
    assert main(["export", str(run_dir), str(adapter), "--format", "peft"]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")
    peft_model = peft.PeftModel.from_pretrained(start, adapter).eval()
    from safetensors.torch import load_file

    keys = set(load_file(adapter / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    merged = tmp_path / "merged"
    assert main(["export", str(run_dir), str(merged), "--format", "hf"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any("lora" in name for name in hf_model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)


def _saved(run_dir, step: int) -> tuple[dict, dict]:
    """The step's leaves (flat, by key) and metadata, read without a template."""
    from d9dfn.checkpoint import CheckpointStore

    with CheckpointStore(run_dir / "checkpoints", create=False) as store:
        return store.restore(step)


@pytest.mark.slow
def test_a_lora_run_saves_its_adapters_alone_resumes_and_refuses_another_base_in_one_line(tmp_path, capsys):
    """A LoRA run on a ``model.source`` folder checkpoints its trainable params (and their optimizer state) only, with
    the folder and a fingerprint of the base; it resumes from that, reading the base from the folder again, and a
    changed folder is refused in one line at resume, export and load (naming the folder); a folder gone too."""
    source = _folder(tmp_path / "src")
    sets = (f"model.source={source}", "trainer.checkpointing.period_steps=2", PEFT_SET)
    assert main(job_argv("train", tmp_path / "runs", *sets, "trainer.total_steps=2", base=BASE)) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    leaves, metadata = _saved(run_dir, 2)
    params = {key.removeprefix("params/") for key in leaves if key.startswith("params/")}
    assert params
    assert all(".lora_" in name for name in params), sorted(params)  # no base param in the checkpoint
    assert metadata["base"]["source"] == str(source.absolute())
    assert "layers.0.self_attn.q_proj.weight" in metadata["base"]["fingerprint"]
    assert set(metadata["base"]["fingerprint"]).isdisjoint(params)
    assert main(job_argv("train", tmp_path / "runs", *sets, "trainer.total_steps=4", base=BASE)) == 0  # resumes
    assert len(_losses(run_dir)) == 4
    model = load_model(run_dir)  # the base from the folder, bitwise; the adapters from the checkpoint
    start = transformers.AutoModelForCausalLM.from_pretrained(source)
    ours = dict(model.named_parameters())
    assert torch.equal(ours["layers.0.self_attn.q_proj.weight"], start.model.layers[0].self_attn.q_proj.weight)
    lora_b = ours["layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(lora_b, _saved(run_dir, 4)[0]["params/layers.0.self_attn.q_proj.lora_B.weight"])
    assert lora_b.abs().sum() > 0  # trained
    capsys.readouterr()
    # The folder's weights replaced (another base under the same path): the run is refused, naming the params.
    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] += 1e-3
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    assert main(job_argv("train", tmp_path / "runs", *sets, "trainer.total_steps=6", base=BASE)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(rf"was trained on the base read from {source}, .* other values for layers\.0\.mlp\.up_proj", err)
    assert "trainer.run.name=stdlib-lm-new" in err
    assert len(_losses(run_dir)) == 4
    assert main(["export", str(run_dir), str(tmp_path / "merged"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(rf"layers\.0\.mlp\.up_proj.*put the model the run was trained on back at {source}$", err), err
    with pytest.raises(ValueError, match=r"other values for layers\.0\.mlp\.up_proj"):
        load_model(run_dir)
    assert main(job_argv("infer", tmp_path / "runs", *sets, base=BASE)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(rf"other values for layers\.0\.mlp\.up_proj.*back at {source}", err), err
    # The folder gone: export and load_model say so in one line, naming it.
    (tmp_path / "src").rename(tmp_path / "moved")
    assert main(["export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(rf"model.source {source} .* is not a folder now.* back at {source}$", err[0]), err
    with pytest.raises(FileNotFoundError, match="is not a folder now"):
        load_model(run_dir)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's, as above
def test_a_pure_bf16_lora_run_on_a_folder_resumes_infers_loads_and_exports_what_peft_and_transformers_load(
    tmp_path, capsys
):
    """A pure-bf16 LoRA run on a ``model.source`` folder hashes its base after the cast to bf16: the resume, ``d9dfn
    train``'s and ``d9dfn infer``'s evaluations, ``load_model`` and both exports read the float32 folder, cast it as
    the run did, and find the fingerprint the run recorded; the exports are bf16, and load in peft and transformers."""
    from test_hf import PURE_BF16

    source = _folder(tmp_path / "src")
    sets = (f"model.source={source}", "trainer.checkpointing.period_steps=2", PEFT_SET, *PURE_BF16)
    assert main(job_argv("train", tmp_path / "runs", *sets, "trainer.total_steps=2", base=BASE)) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    leaves, _ = _saved(run_dir, 2)
    assert {leaves[key].dtype for key in leaves if key.startswith("params/")} == {torch.bfloat16}
    assert main(job_argv("train", tmp_path / "runs", *sets, "trainer.total_steps=4", base=BASE)) == 0  # resumes
    assert "resuming" in capsys.readouterr().out
    assert len(_losses(run_dir)) == 4
    assert main(job_argv("infer", tmp_path / "runs", *sets, "trainer.precision.param_dtype=float32", base=BASE)) == 0
    assert "validation perplexity" in capsys.readouterr().out
    model = load_model(run_dir)
    ours = dict(model.named_parameters())
    assert {p.dtype for p in ours.values()} == {torch.bfloat16}
    start = transformers.AutoModelForCausalLM.from_pretrained(source).eval()  # the folder's float32 weights
    folder_q = start.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(ours["layers.0.self_attn.q_proj.weight"], folder_q.to(torch.bfloat16))  # the run's base
    lora_b = ours["layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(lora_b, _saved(run_dir, 4)[0]["params/layers.0.self_attn.q_proj.lora_B.weight"])
    assert lora_b.abs().sum() > 0  # trained

    ids = torch.tensor([[5, 17, 260, 33, 101, 7, 299, 64]])
    with torch.no_grad():
        logits = model(ids)["logits"]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run_dir), str(adapter), "--format", "peft"]) == 0
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(adapter / "adapter_model.safetensors").values()} == {torch.bfloat16}
    base = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    peft_model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, logits, rtol=0.02, atol=0.02)
    assert main(["export", str(run_dir), str(merged), "--format", "hf"]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert {p.dtype for p in hf_model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=ids).logits, logits, rtol=0.02, atol=0.02)


def _sharded_lora_worker(rank: int, world_size: int, init_file: str, save_dir: str, sets: list[str], out: str) -> None:
    from _ranks import _init

    from d9dfn.parallel import full_tensors

    _init(rank, world_size, init_file, timeout_s=120.0)
    result = train_lm(tiny_job(Path(save_dir), *sets, 'mesh={"data_parallel_shard": 2}', base=BASE))
    params = full_tensors(result.state.params)  # a collective
    if rank == 0:
        torch.save({"params": params, "frozen": list(result.state.frozen)}, out)


@pytest.mark.slow
@pytest.mark.ranks
def test_a_lora_checkpoint_without_its_base_reshards_one_process_to_two_ranks_and_back(tmp_path):
    """A LoRA run on a folder, 2 steps on one process; resumed to step 4 on 2 gloo ranks sharding the params (the
    base comes from the folder as sharded DTensors, the adapters and their moments from the checkpoint); the step-4
    checkpoint, saved by both ranks without the base, loads on one process bitwise as the ranks held it."""
    from _ranks import _run_ranks

    source = _folder(tmp_path / "src")
    sets = [
        f"model.source={source}",
        PEFT_SET,
        "trainer.checkpointing.period_steps=2",
        "trainer.batching.global_batch_size=4",
        "trainer.batching.microbatch_size=2",
    ]
    first = train_lm(tiny_job(tmp_path / "runs", *sets, "trainer.total_steps=2", base=BASE))
    out = tmp_path / "ranks.pt"
    _run_ranks(
        _sharded_lora_worker,
        2,
        tmp_path,
        str(tmp_path / "runs"),
        [*sets, "trainer.total_steps=4"],
        str(out),
        timeout_s=300,
        clean=True,
    )
    held = torch.load(out)
    assert "layers.0.self_attn.q_proj.weight" in held["frozen"]
    leaves, _ = _saved(first.run_dir, 4)
    assert not any(name in held["frozen"] for name in (key.removeprefix("params/") for key in leaves))
    model = load_model(first.run_dir)
    loaded = dict(model.named_parameters())
    assert loaded.keys() == held["params"].keys()
    for name, param in held["params"].items():
        assert torch.equal(loaded[name], param), name
    moved = [name for name in loaded if ".lora_B" in name]
    assert moved
    assert all(not torch.equal(first.state.params[name], loaded[name]) for name in moved)  # trained on


def test_a_lora_run_on_a_folder_with_pipelining_is_refused_in_one_line(tmp_path):
    """Its checkpoints would leave the base out, and pipeline stages cannot read it from the folder."""
    source = _folder(tmp_path / "src")
    job = tiny_job(
        tmp_path, f"model.source={source}", PEFT_SET, 'trainer.pipelining={"schedule": {"schedule": "1f1b"}}', base=BASE
    )
    with pytest.raises(ValueError, match=r"trainer.peft run's checkpoints leave the frozen base out .*pipelining=null"):
        train_lm(job)


def test_peft_export_refuses_a_run_without_adapters_or_with_full_targets():
    from d9dfn.jobs._peft_export import check_peft_export

    with pytest.raises(ValueError, match="no LoRA adapters"):
        check_peft_export([FullTune("norm")], "d9dfn export --format peft")
    with pytest.raises(ValueError, match="export the merged model with --format hf"):
        check_peft_export([LoRA("q_proj"), FullTune("norm")], "d9dfn export --format peft")
    assert check_peft_export([LoRA("q_proj", 4)], "x") == LoRA("q_proj", 4)


class _CrashesBeforeStep(CausalLMTask):
    """Raises just before step ``step``: the run ends there as a kill ends it (no stop handler, no checkpoint of its
    own; what it logged after its last checkpoint stays in ``metrics.jsonl`` for the resume to forget)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def register_events(self, bus) -> None:
        super().register_events(bus)

        def crash(context) -> None:
            if context.step == self.step:
                raise RuntimeError(f"killed before step {self.step}")

        bus.subscribe(EVENT_TRAIN_STEP_PRE, crash)


@pytest.mark.slow  # three eager runs of the job
@pytest.mark.parametrize("source", [False, True], ids=["own-init", "model-source"])
def test_a_lora_run_on_packed_files_killed_mid_epoch_resumes_bitwise(tmp_path, monkeypatch, source):
    """Issue 43's must-show: LoRA (with dropout, so the step's key is in play) on ``data.files`` packed, ended before
    step 8 of 12 (checkpoints every 3, every step logged), resumed from step 6: ``metrics.jsonl`` byte-identical to an
    uninterrupted run's, params and optimizer state bitwise, the base frozen. The whole run is inside the first epoch,
    so the data position comes from the checkpoint, not from an epoch's start. On a ``model.source`` folder the
    checkpoints hold no base param: the resume reads the base from the folder again."""
    from test_data_files import FILES_BASE, _jsonl, _text_records

    import d9dfn.jobs._lm as lm_module
    from d9dfn.jobs import FilesProvider
    from d9dfn.jobs._source import resolve_source
    from d9dfn.loop import committed_steps

    data = _jsonl(tmp_path / "d.jsonl", _text_records(600, seed=2))
    total_steps = 12
    base = FILES_BASE
    if source:
        folder = _folder(tmp_path / "src")
        base = (*(s for s in FILES_BASE if not s.startswith("model.")), f"model.source={folder}")

    def job(name: str):
        return tiny_job(
            tmp_path / name,
            f'data.files=["{data}"]',
            f"data.cache_dir={tmp_path / 'cache'}",
            f"trainer.total_steps={total_steps}",
            "trainer.checkpointing.period_steps=3",
            "trainer.checkpointing.num_to_keep=null",
            "trainer.logging.period_steps=1",
            "trainer.determinism.deterministic_algorithms=true",
            'trainer.peft=[{"method": "lora", "targets": "q_proj|v_proj|down_proj", "rank": 2, "alpha": 4, '
            '"dropout": 0.1}, {"method": "full", "targets": "norm"}]',
            base=base,
        )

    resolved, tokenizer = resolve_source(job("clean"))
    vocab_size = resolved.model.to_qwen3(16).vocab_size
    packed = FilesProvider(resolved.data, tokenizer, vocab_size=vocab_size, max_positions=16, say=lambda line: None)
    assert job("clean").data.packing
    assert len(packed.datasets["train"]) // 2 > total_steps  # the whole run is inside the first epoch
    clean = train_lm(job("clean"))
    monkeypatch.setattr(lm_module, "CausalLMTask", lambda: _CrashesBeforeStep(8))
    with pytest.raises(RuntimeError, match="killed before step 8"):
        train_lm(job("killed"))
    monkeypatch.undo()
    run_dir = clean.run_dir.parent.parent / "killed" / clean.run_dir.name
    assert committed_steps(run_dir / "checkpoints") == [3, 6]
    saved = {key.removeprefix("params/") for key in _saved(run_dir, 6)[0] if key.startswith("params/")}
    assert ("layers.0.self_attn.q_proj.weight" in saved) is not source  # a folder's base is left out
    assert max(_logged(run_dir)) == 7  # step 7 logged after the last checkpoint: the resume must forget it
    resumed = train_lm(job("killed"))
    assert resumed.steps_run == total_steps - 6
    assert _logged(run_dir) == list(range(1, total_steps + 1))
    assert (run_dir / "metrics.jsonl").read_bytes() == (clean.run_dir / "metrics.jsonl").read_bytes()
    torch.testing.assert_close(resumed.state.params, clean.state.params, rtol=0, atol=0)
    torch.testing.assert_close(resumed.state.opt_state, clean.state.opt_state, rtol=0, atol=0)
    trained = set(resumed.state.params) - set(resumed.state.frozen)
    assert "layers.0.self_attn.q_proj.weight" in resumed.state.frozen
    assert all(".lora_" in name or "norm" in name for name in trained), trained
    assert "norm.weight" in trained


def _logged(run_dir) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step"] for record in records if "loss" in record]


# --- with activation checkpointing and pipeline stages -----------------------------------------------------------

DROPOUT_CONFIG = dataclasses.replace(CONFIG, dropout=0.1)
"""``CONFIG`` with the model's dropout on too: the blocks' keys and the adapters' keys both in play."""
METHODS = (LoRA(ATTENTION, rank=4, alpha=8.0, dropout=0.2), FullTune("norm"))


def _stepped(executor=None, **options):
    """Two eager steps (AdamW, 2 microbatches, the step's key on) of ``DROPOUT_CONFIG`` adapted by ``METHODS`` (B drawn,
    so the adapters move the loss from the first step); the base frozen by the predicate. Returns params and losses.
    """
    torch.manual_seed(0)
    model = apply_peft(Qwen3LM(DROPOUT_CONFIG), METHODS)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(std=0.02)
    task, opt = CausalLMTask(), optim.adamw(0.01)
    state = d9dfn.init_train_state(model, opt, task=task, trainable=peft_trainable(METHODS))
    assert "layers.0.self_attn.q_proj.weight" in state.frozen
    step = d9dfn.make_train_step(
        model, task, opt, num_microbatches=2, rng_kwarg="dropout_key", compile=False, executor=executor, **options
    )
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, CONFIG.vocab_size, (4, 9), generator=gen)
        state, out = step(state, {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
        losses.append(out.loss)
    return state.params, losses


def _assert_bitwise(actual, expected) -> None:
    (params, losses), (ref_params, ref_losses) = actual, expected
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), name
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (losses, ref_losses)


@pytest.mark.parametrize(
    "policy",
    [ActivationCheckpointing("full"), ActivationCheckpointing("selective"), ActivationCheckpointing("full", every=2)],
    ids=["full", "selective", "every-2"],
)
def test_lora_with_activation_checkpointing_equals_lora_without_it_bitwise(policy):
    """Eager, the recompute runs the same ops: the loss and every param bitwise, dropout masks (the model's and the
    adapters') included; the adapters moved and the base did not."""
    expected = _stepped(repeated_blocks="auto")
    _assert_bitwise(_stepped(repeated_blocks="auto", activation_checkpointing=policy), expected)
    torch.manual_seed(0)
    start = dict(apply_peft(Qwen3LM(DROPOUT_CONFIG), METHODS).named_parameters())
    params = expected[0]
    assert all(torch.equal(params[n], start[n]) for n in params if ".lora_" not in n and "norm" not in n)
    assert not torch.equal(
        params["layers.0.self_attn.q_proj.lora_A.weight"], start["layers.0.self_attn.q_proj.lora_A.weight"]
    )


@pytest.mark.parametrize("policy", [None, ActivationCheckpointing("selective")], ids=["plain", "checkpointed"])
def test_lora_in_pipeline_stages_equals_the_one_process_step(policy):
    """Stages built from adapted ``Qwen3LM(config, stage)`` (``apply_peft(check=False)``, as the job's provider builds
    them), run by 1F1B over 2 stages, give the one-stage step's loss and params bitwise (fp32, eager), with activation
    checkpointing inside the stages too. (The LM job refuses ``model.source`` with ``trainer.pipelining``, so this is
    the step level.)"""
    stages = pipeline.build_stages(lambda info: apply_peft(Qwen3LM(DROPOUT_CONFIG, info), METHODS, check=False), 2)
    assert "layers.3.self_attn.o_proj.lora_B.weight" in stages[1].param_names
    executor = pipeline.Pipeline(pipeline.one_f_one_b(2, 1, 2), stages)
    expected = _stepped(repeated_blocks="auto")
    _assert_bitwise(_stepped(executor, repeated_blocks="auto", activation_checkpointing=policy), expected)


@pytest.mark.slow  # two eager runs of the job
def test_a_pipelined_lora_job_builds_its_stages_and_two_schedules_agree_bitwise(tmp_path):
    """The LM job with ``trainer.peft`` and ``trainer.pipelining`` (the byte model: the job refuses ``model.source``
    with pipelining): each stage is adapted by the provider and initialized per module by ``seeded_reset`` (which
    refused the adapters' factors before they had a ``reset_parameters``); 1F1B over two traced stages and
    zero-bubble V (its backward split into I and W) log the same ``metrics.jsonl`` bitwise, the base frozen."""
    common = (
        "model.num_layers=3",
        "model.tie_word_embeddings=false",
        "trainer.total_steps=3",
        "trainer.repeated_blocks=[]",
        "trainer.logging.period_steps=1",
        'trainer.peft=[{"method": "lora", "targets": "q_proj|v_proj|down_proj", "rank": 2, "alpha": 4, '
        '"dropout": 0.1}]',
    )
    runs = {
        name: train_lm(tiny_job(tmp_path / name, *common, f'trainer.pipelining={{"schedule": {schedule}}}'))
        for name, schedule in (
            ("1f1b", '{"schedule": "1f1b", "num_stages_per_rank": 2}'),
            ("v", '{"schedule": "zero_bubble_v"}'),
        )
    }
    one_f_one_b, v = runs["1f1b"], runs["v"]
    assert (one_f_one_b.run_dir / "metrics.jsonl").read_bytes() == (v.run_dir / "metrics.jsonl").read_bytes()
    assert len(_logged(one_f_one_b.run_dir)) == 3
    params, frozen = one_f_one_b.state.params, one_f_one_b.state.frozen
    assert set(params) - set(frozen) == {name for name in params if ".lora_" in name}
    assert len([name for name in params if ".lora_" in name]) == 2 * 3 * 3
    assert all(params[name].abs().max() > 0 for name in params if "lora_B" in name)  # moved from their zero init
    torch.testing.assert_close(params, v.state.params, rtol=0, atol=0)


def test_the_memory_check_counts_gradients_and_moments_of_the_trainable_params_only(tmp_path, monkeypatch):
    """``trainer.peft``'s estimate: the weights of base and adapters, but gradients and AdamW's two moments of the
    adapters alone (the names the state trains), so it is smaller than full fine-tuning's by ``(base - adapters) ×
    4 × 3`` bytes in fp32; the optimizer bytes are those the state then holds. A device between the two estimates
    refuses the full fine-tune and runs the LoRA one (before, both were refused)."""
    import d9dfn.loop._memory as memory
    import d9dfn.loop._train as train_module

    seen: list = []
    check = train_module.check_memory
    monkeypatch.setattr(
        train_module, "check_memory", lambda estimate, *a, **k: (seen.append(estimate), check(estimate, *a, **k))
    )
    steps = ("trainer.total_steps=1", "sample.num_bytes=0")
    full = train_lm(tiny_job(tmp_path / "full", *steps))
    early, full_estimate = seen
    assert (early.params, early.grads) == (full_estimate.params, full_estimate.grads)  # the config's arithmetic
    seen.clear()
    lora = train_lm(tiny_job(tmp_path / "lora", *steps, PEFT_SET))
    (estimate,) = seen  # no early count: it would count the frozen base as trainable
    num_base = full_estimate.num_params
    num_adapters = sum(p.numel() for name, p in lora.state.params.items() if ".lora_" in name)
    assert 0 < num_adapters < num_base / 4
    assert sum(full.state.params[name].numel() for name in lora.state.frozen) == num_base
    scalars = full_estimate.optimizer - 2 * 4 * num_base  # AdamW's count and lr
    assert (estimate.num_params, estimate.params) == (num_base + num_adapters, 4 * (num_base + num_adapters))
    assert (estimate.grads, estimate.optimizer) == (4 * num_adapters, 2 * 4 * num_adapters + scalars)
    assert full_estimate.total - estimate.total == 3 * 4 * (num_base - num_adapters) - 4 * num_adapters
    assert estimate.optimizer == _bytes(lora.state.opt_state)

    monkeypatch.setattr(memory, "device_memory", lambda device: (estimate.total + full_estimate.total) // 2)
    with pytest.raises(ValueError, match=r"TrainingConfigurator: the model's .* more than this host's memory"):
        train_lm(tiny_job(tmp_path / "full-small", *steps))
    assert train_lm(tiny_job(tmp_path / "lora-small", *steps, PEFT_SET)).steps_run == 1
