"""Activation checkpointing (``make_train_step(activation_checkpointing=...)``): the same results as without it,
bitwise in eager (the recompute runs the same ops), dropout masks included, with fewer activations kept."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import d9dfn
from d9dfn import optim, pipeline
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.step import ActivationCheckpointing
from d9dfn.tasks import CausalLMTask
from d9dfn.testing import assert_trees_equal_structure

CONFIG = Qwen3Config.tiny(
    num_layers=4, tie_word_embeddings=False, hidden_size=16, head_dim=4, intermediate_size=24, dropout=0.2
)
POLICIES = [
    ActivationCheckpointing("full"),
    ActivationCheckpointing("selective"),
    ActivationCheckpointing("full", every=2),
]


def _batches(vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (4, 9), generator=gen) for _ in range(2)]
    return [{"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()} for t in tokens]


def _train(model: nn.Module, rng_kwarg: str | None, **options: Any) -> tuple[Any, list[torch.Tensor]]:
    task, opt = CausalLMTask(), optim.adamw(0.01)
    state = d9dfn.init_train_state(model, opt, task=task)
    step = d9dfn.make_train_step(model, task, opt, num_microbatches=2, rng_kwarg=rng_kwarg, **options)
    losses = []
    for batch in _batches():
        torch.manual_seed(7)  # torch's RNG, for models that draw dropout from it (the loop reseeds it every step)
        state, out = step(state, batch)
        losses.append(out.loss)
    return state.params, losses


def _assert_bitwise(actual: tuple[Any, list], expected: tuple[Any, list]) -> None:
    (params, losses), (ref_params, ref_losses) = actual, expected
    assert_trees_equal_structure(params, ref_params)
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), name
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))


def _qwen3() -> Qwen3LM:
    torch.manual_seed(0)
    return Qwen3LM(CONFIG)


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "selective", "every2"])
def test_checkpointed_blocks_train_bitwise_like_kept_activations_dropout_included(policy: ActivationCheckpointing):
    # d9dfn's dropout: masks from the step's key, recomputed identically.
    options = {"repeated_blocks": "auto", "compile": False}
    expected = _train(_qwen3(), "dropout_key", **options)
    _assert_bitwise(_train(_qwen3(), "dropout_key", activation_checkpointing=policy, **options), expected)


class _TorchDropoutBlock(nn.Module):
    """A block whose dropout draws from torch's global generator (as Hugging Face models' do)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.linear(h)))


class _TorchDropoutLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_TorchDropoutBlock(width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return {"logits": self.head(h)}


def test_checkpointed_blocks_recompute_torch_rng_dropout_with_the_same_masks():
    def model() -> _TorchDropoutLM:
        torch.manual_seed(0)
        return _TorchDropoutLM()

    options = {"repeated_blocks": "auto", "compile": False}
    expected = _train(model(), None, **options)
    got = _train(model(), None, activation_checkpointing=ActivationCheckpointing("full"), **options)
    _assert_bitwise(got, expected)
    # The masks matter: without dropout the run differs (so equal runs above are not a dropout-free accident).
    quiet = model()
    for layer in quiet.layers:
        layer.drop.p = 0.0
    assert any(not torch.equal(p, expected[0][n]) for n, p in _train(quiet, None, **options)[0].items())


def _saved_bytes(policy: ActivationCheckpointing | None) -> int:
    """Bytes of the tensors autograd keeps from one eager train step's forwards (saved-tensor hooks)."""
    model, task, opt = _qwen3(), CausalLMTask(), optim.sgd(0.1)
    state = d9dfn.init_train_state(model, opt, task=task)
    step = d9dfn.make_train_step(
        model, task, opt, repeated_blocks="auto", activation_checkpointing=policy, compile=False
    )
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(state, _batches()[0])
    return sum(kept.values())


def test_checkpointed_blocks_keep_fewer_activations():
    # What autograd keeps outside the checkpointed blocks: their inputs (and selective's kept matmul outputs, which
    # the checkpoint holds itself) replace every block's activations.
    none, every_other, full = (_saved_bytes(p) for p in (None, POLICIES[2], POLICIES[0]))
    assert full < every_other < none, (full, every_other, none)
    assert _saved_bytes(POLICIES[1]) < none


def test_checkpointing_composes_with_a_pipeline_and_bf16():
    stages = pipeline.build_stages(lambda info: Qwen3LM(CONFIG, info), 2)
    executor = pipeline.Pipeline(pipeline.one_f_one_b(2, 1, 2), stages)
    options = {"repeated_blocks": "auto", "compile": False, "precision": d9dfn.Precision.bf16_mixed()}
    expected = _train(_qwen3(), "dropout_key", executor=executor, **options)
    got = _train(_qwen3(), "dropout_key", executor=executor, activation_checkpointing=POLICIES[1], **options)
    _assert_bitwise(got, expected)


@pytest.mark.slow
def test_checkpointed_blocks_compile_to_their_eager_results():
    policy = ActivationCheckpointing("selective")
    eager = _train(_qwen3(), "dropout_key", repeated_blocks="auto", activation_checkpointing=policy, compile=False)
    _assert_bitwise(
        _train(_qwen3(), "dropout_key", repeated_blocks="auto", activation_checkpointing=policy, compile="aot_eager"),
        eager,
    )


def test_checkpointing_without_blocks_or_a_budget_without_compile_is_refused():
    model, task, opt = _qwen3(), CausalLMTask(), optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"recomputes repeated blocks .* no repeated blocks"):
        d9dfn.make_train_step(model, task, opt, activation_checkpointing=ActivationCheckpointing(), compile=False)
    with pytest.raises(ValueError, match=r"Sequential\(unroll=True\)"):
        d9dfn.make_train_step(
            model,
            task,
            opt,
            executor=d9dfn.Sequential(unroll=True),
            repeated_blocks="auto",
            activation_checkpointing=ActivationCheckpointing(),
        )
    with pytest.raises(ValueError, match="policy 'budget' is the compiler's partitioner"):
        d9dfn.make_train_step(
            model,
            task,
            opt,
            repeated_blocks="auto",
            activation_checkpointing=ActivationCheckpointing("budget"),
            compile=False,
        )
    with pytest.raises(ValueError, match="every=0"):
        ActivationCheckpointing(every=0)


@pytest.mark.parametrize("program", ["zero_bubble_1f1b", "zero_bubble_v", "dual_pipe_v"])
def test_checkpointing_with_a_split_backward_is_refused_with_a_fix_that_works(program):
    # A zero-bubble program traces each stage whole to split its backward into I and W, so there are no blocks to
    # recompute; the refusal names a schedule that runs each backward whole, and that schedule builds.
    stages_per_rank = 1 if program == "zero_bubble_1f1b" else 2
    model, task, opt, policy = _qwen3(), CausalLMTask(), optim.sgd(0.1), ActivationCheckpointing()
    config = dataclasses.replace(CONFIG, num_layers=8)
    stages = pipeline.build_stages(lambda info: Qwen3LM(config, info), 2 * stages_per_rank)
    split = pipeline.Pipeline(getattr(pipeline, program)(2, stages_per_rank, 4), stages)
    blocks = {"repeated_blocks": "auto", "activation_checkpointing": policy, "compile": False}
    with pytest.raises(
        ValueError,
        match=r"splits each stage's backward .* choose a schedule that runs each backward "
        r"whole \(gpipe, 1f1b without zero_bubble, looped_bfs\), or pass activation_checkpointing=None",
    ):
        d9dfn.make_train_step(model, task, opt, executor=split, **blocks)
    for whole in (pipeline.gpipe, pipeline.one_f_one_b, pipeline.looped_bfs)[stages_per_rank - 1 :]:  # gpipe: 1
        executor = pipeline.Pipeline(whole(2, stages_per_rank, 4), stages)
        step = d9dfn.make_train_step(model, task, opt, executor=executor, **blocks)
        assert "stages" in step.pieces  # built: the blocks are there to recompute


@pytest.mark.slow
def test_trainer_activation_checkpointing_reaches_the_step_and_changes_no_logged_bit(tmp_path, capsys):
    from test_train import tiny_job

    from d9dfn.cli import main
    from d9dfn.jobs import train_lm

    # dropout > 0: the recompute must draw the same masks for the logs to be equal
    eager = ("trainer.compile=false", "model.dropout=0.1", "model.num_layers=3")
    plain = train_lm(tiny_job(tmp_path / "plain", *eager))
    full = train_lm(
        tiny_job(tmp_path / "full", *eager, 'trainer.activation_checkpointing={"policy": "full", "every": 2}')
    )
    assert (full.run_dir / "metrics.jsonl").read_bytes() == (plain.run_dir / "metrics.jsonl").read_bytes()

    config = tmp_path / "job.json"
    config.write_text(tiny_job(tmp_path / "refused", *eager).model_dump_json())
    argv = ["train", str(config), "--set", "trainer.repeated_blocks=[]"]
    capsys.readouterr()  # the training runs' progress above
    assert main([*argv, "--set", 'trainer.activation_checkpointing={"policy": "full"}']) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("d9dfn: error: ")
    assert "activation_checkpointing recomputes repeated blocks" in line
