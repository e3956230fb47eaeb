"""``model.family=qwen3_moe`` in the LM job: training with the load-balancing loss and the expert metrics, a Hugging
Face ``Qwen3MoeForCausalLM`` folder as ``model.source``, ``d9dfn export --format hf`` read back by transformers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from _jobs import TINY_DATA, TINY_TRAINER, job_argv, tiny_job
from test_hf_source import _bpe

from d9dfn import PipelineState
from d9dfn.cli import main
from d9dfn.config import ConfigError
from d9dfn.jobs import load_model
from d9dfn.models import Qwen3MoeConfig
from d9dfn.tasks import CausalLMTask, token_nll

transformers = pytest.importorskip("transformers")

MOE = ("model.family=qwen3_moe", "model.num_layers=2", "trainer.total_steps=2", "trainer.checkpointing.period_steps=2")


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_causal_lm_task_weights_the_aux_loss_into_the_loss_and_logs_the_load():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    counts = torch.tensor([[6.0, 2.0, 2.0, 0.0], [3.0, 3.0, 2.0, 2.0]])  # (MoE layers, E)
    outputs = {"logits": logits, "aux_loss": torch.tensor(2.5), "expert_counts": counts}
    state = PipelineState().set("labels", labels)
    result = CausalLMTask(aux_loss_weight=0.1, num_experts=4).compute_loss(outputs, state, torch.tensor(0))
    nll, num = token_nll(logits, labels)
    torch.testing.assert_close(result.loss, nll / num + 0.1 * 2.5)
    assert float(result.logs["aux_loss"]) == 2.5
    assert float(result.logs["load_imbalance"]) == pytest.approx(2.4)  # layer 0: 6 over a mean of 2.5
    plain = CausalLMTask().compute_loss({"logits": logits}, state, torch.tensor(0))
    torch.testing.assert_close(plain.loss, nll / num)
    assert not plain.logs


@pytest.mark.slow
def test_lm_job_trains_qwen3_moe_with_the_aux_loss_and_logs_the_expert_load(tmp_path):
    sets = (*MOE, "trainer.logging.period_steps=2", "model.moe.router_aux_loss_coef=0.5")
    assert main(job_argv("train", tmp_path / "runs", *sets)) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    records = _records(run_dir)
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2
    assert all(r["task/aux_loss"] > 0 for r in steps)
    assert all(r["task/load_imbalance"] >= 1.0 for r in steps)
    logged = next(r for r in records if "metrics/experts/load_imbalance" in r)
    per_expert = [logged[f"metrics/experts/tokens_per_expert/{e}"] for e in range(4)]
    # 2 steps x 2 sequences x 16 tokens x top-2 x 2 MoE layers: every token copy counted once
    assert sum(per_expert) == 2 * 2 * 16 * 2 * 2
    assert logged["metrics/experts/load_imbalance"] == pytest.approx(max(per_expert) / (sum(per_expert) / 4))
    # the step's loss is the cross-entropy plus 0.5 x aux_loss: over the period, above the metric's cross-entropy
    mean_loss = sum(r["loss"] for r in steps) / 2
    mean_aux = sum(r["task/aux_loss"] for r in steps) / 2
    assert mean_loss == pytest.approx(logged["metrics/loss"] + 0.5 * mean_aux, rel=1e-5)
    saved = json.loads((run_dir / "job.json").read_text())["model"]
    assert saved["family"] == "qwen3_moe"
    assert saved["moe"]["router_aux_loss_coef"] == 0.5


def test_moe_settings_are_refused_in_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"model.moe is set but model.family=qwen3 has no experts; set model.family"):
        tiny_job(tmp_path, "model.moe.num_experts=8")
    with pytest.raises(ConfigError, match=r"model.moe.num_experts_per_tok=5 is more than model.moe.num_experts=4"):
        tiny_job(tmp_path, "model.family=qwen3_moe", "model.moe.num_experts_per_tok=5")
    config = tiny_job(tmp_path, "model.family=qwen3_moe", "model.moe.mlp_only_layers=[0]", "model.num_layers=2")
    moe = config.model.to_qwen3(16)
    assert isinstance(moe, Qwen3MoeConfig)
    assert moe.moe_layers() == (1,)


def _moe_folder(path):
    fields = {
        "vocab_size": 320,
        "hidden_size": 16,
        "intermediate_size": 24,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    config = transformers.AutoConfig.for_model("qwen3_moe", **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # HF inits the router to zeros: make routing matter
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(300), eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.mark.slow
def test_journey_hf_moe_folder_trains_exports_and_transformers_gives_the_same_logits(tmp_path):
    source = _moe_folder(tmp_path / "src")
    base = (*TINY_TRAINER, *TINY_DATA)
    sets = (f"model.source={source}", "trainer.total_steps=3", "trainer.checkpointing.period_steps=3")
    assert main(job_argv("train", tmp_path / "runs", *sets, base=base)) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    saved = json.loads((run_dir / "job.json").read_text())["model"]
    assert (saved["family"], saved["moe"]["num_experts"], saved["moe"]["moe_intermediate_size"]) == ("qwen3_moe", 4, 16)
    assert "task/aux_loss" in _records(run_dir)[0]

    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (source, out))
    assert ours == theirs
    back = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    model = load_model(run_dir)
    with torch.no_grad():
        expected, got = back(input_ids=ids).logits, model(ids)["logits"]
        start = transformers.AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager").eval()
        assert not torch.equal(start(input_ids=ids).logits, expected)  # the export holds the trained weights
    assert torch.equal(got, expected)  # bitwise: fp32 on the CPU, the reference path


def test_source_checkpoint_of_other_experts_names_the_moe_set_path():
    from d9dfn.jobs._providers import check_source_config
    from d9dfn.models import to_hf_config

    saved = Qwen3MoeConfig.tiny(tie_word_embeddings=False)
    job = Qwen3MoeConfig.tiny(tie_word_embeddings=False, num_experts=8)
    with pytest.raises(ValueError, match=r"num_experts is 4 there but 8 here; set --set model.moe.num_experts=4"):
        check_source_config(job, to_hf_config(saved), family="qwen3_moe")
    d9dfn_format = json.loads(json.dumps(dataclasses.asdict(saved)))  # `d9dfn export --format d9dfn`'s config.json
    check_source_config(saved, d9dfn_format, family="qwen3_moe")
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[\] but this job's has \(0,\); set --set model.moe"):
        check_source_config(dataclasses.replace(saved, mlp_only_layers=(0,)), d9dfn_format, family="qwen3_moe")


def test_a_pipelined_moe_job_in_bf16_is_refused_in_one_line_naming_the_setting(tmp_path, capsys):
    """The expert load crosses the stages with the hidden states, which a compute dtype other than float32 casts."""
    pipelined = 'trainer.pipelining={"schedule": {"schedule": "1f1b"}}'
    argv = job_argv("train", tmp_path, *MOE, pipelined, "trainer.precision.compute_dtype=bfloat16")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "trainer.precision.compute_dtype=bfloat16: the expert counts and router probabilities" in err[0]
    assert "set --set trainer.precision.compute_dtype=float32, or drop trainer.pipelining" in err[0]


@pytest.mark.slow
def test_an_hf_moe_folder_fine_tunes_with_the_balancing_bias_and_a_capacity(tmp_path):
    """The bias and the capacity are training settings, not the folder's architecture: a job sets them on a folder's
    model; the rest of ``model.moe`` is the folder's (the next test)."""
    source = _moe_folder(tmp_path / "src")
    base = (*TINY_TRAINER, *TINY_DATA)
    sets = (
        f"model.source={source}",
        "model.moe.load_balance_bias_rate=0.01",
        "model.moe.capacity_factor=1.0",
        "trainer.total_steps=2",
        "trainer.checkpointing.period_steps=2",
    )
    assert main(job_argv("train", tmp_path / "runs", *sets, base=base)) == 0
    run_dir = tmp_path / "runs" / "stdlib-lm"
    moe = json.loads((run_dir / "job.json").read_text())["model"]["moe"]
    assert (moe["num_experts"], moe["moe_intermediate_size"]) == (4, 16)  # the folder's
    assert (moe["load_balance_bias_rate"], moe["capacity_factor"], moe["router_aux_loss_coef"]) == (0.01, 1.0, 0.001)
    model = load_model(run_dir)
    biases = [buffer for name, buffer in model.named_buffers() if name.endswith("expert_bias")]
    assert len(biases) == 2
    assert all(bias.abs().sum() > 0 for bias in biases)  # moved by the two steps
    assert _records(run_dir)[-1]["step"] == 2


def test_an_architecture_setting_against_an_hf_moe_folder_is_one_line_naming_it(tmp_path, capsys):
    source = _moe_folder(tmp_path / "src")
    capsys.readouterr()  # transformers' progress bar while it saved the folder
    argv = job_argv("train", tmp_path / "runs", f"model.source={source}", "model.moe.num_experts=8")
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model.moe.num_experts=8 contradicts model.source" in line
    assert "describes num_experts=4; drop model.moe.num_experts" in line


@pytest.mark.parametrize(
    "schedule",
    ['{"schedule": "1f1b", "zero_bubble": true}', '{"schedule": "zero_bubble_v"}', '{"schedule": "dual_pipe_v"}'],
)
def test_a_pipelined_moe_job_trains_under_a_split_backward_schedule(tmp_path, capsys, schedule):
    """The I/W split traces a stage's backward once and replays it; the MoE layer takes its static-shape expert path
    while traced (``d9dfn._tracing``), so the replay holds for every microbatch's routing (it failed on the next
    microbatch before, and the job refused these programs)."""
    pipelined = f'trainer.pipelining={{"schedule": {schedule}}}'
    shape = ("model.tie_word_embeddings=false", "model.num_layers=4", "trainer.batching.global_batch_size=4")
    argv = job_argv("train", tmp_path, *MOE, pipelined, *shape, "trainer.total_steps=3")  # 2 microbatches
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "stdlib-lm" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
