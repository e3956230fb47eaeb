"""Heads on the decoder families: pooling against hand computations, and Hugging Face's ``*ForSequenceClassification``
mapped both ways with bitwise-equal logits (tiny models built locally from configs, no hub)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from d9dfn.models import (
    FAMILIES,
    Qwen3Config,
    SequenceClassifier,
    SequenceEmbedder,
    classifier_from_hf_state,
    classifier_plan,
    classifier_to_hf_state,
    from_hf_classifier_config,
    logical_dims,
    pool,
    to_hf_classifier_config,
)

PAD = 0
# Right-padded rows of different lengths, one left-padded row, one without padding (pad id 0 nowhere else).
IDS = torch.tensor(
    [
        [5, 9, 3, 7, 0, 0, 0, 0],
        [4, 4, 8, 2, 6, 1, 3, 0],
        [0, 0, 0, 11, 12, 13, 14, 15],
        [21, 22, 23, 24, 25, 26, 27, 28],
    ]
)


def test_pool_last_first_mean_match_a_hand_computation():
    torch.manual_seed(0)
    values = torch.randn(4, 8, 3)
    last, first = [3, 6, 7, 7], [0, 0, 3, 0]
    non_pad = [[i for i in range(8) if IDS[row, i] != PAD] for row in range(4)]
    for row in range(4):
        assert torch.equal(pool(values, IDS, "last", PAD)[row], values[row, last[row]])
        assert torch.equal(pool(values, IDS, "first", PAD)[row], values[row, first[row]])
        expected_mean = sum(values[row, i] for i in non_pad[row]) / len(non_pad[row])
        torch.testing.assert_close(pool(values, IDS, "mean", PAD)[row], expected_mean)
    # Without a pad id nothing is padding: the last and first positions, the mean over all.
    assert torch.equal(pool(values, IDS, "last", None), values[:, -1])
    assert torch.equal(pool(values, IDS, "first", None), values[:, 0])
    torch.testing.assert_close(pool(values, IDS, "mean", None), values.mean(1))


def test_pool_refuses_an_unknown_pooling_and_a_shape_mismatch():
    with pytest.raises(ValueError, match="pooling='max'; choose one of last, first, mean"):
        pool(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), "max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"do not start with input_ids' shape \(1, 3\)"):
        pool(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long), "last")


@pytest.mark.parametrize("pooling", ["last", "first", "mean"])
def test_classifier_logits_are_the_score_of_the_pooled_hidden_states(pooling):
    torch.manual_seed(0)
    model = SequenceClassifier(FAMILIES["qwen3"], Qwen3Config.tiny(), num_labels=3, pooling=pooling, pad_token_id=PAD)
    with torch.no_grad():
        hidden = model.model(IDS)["hidden_states"]  # (B, T, H)
        logits = model(IDS)["logits"]
    assert logits.shape == (4, 3)
    rows = {"last": [3, 6, 7, 7], "first": [0, 0, 3, 0]}
    for row in range(4):
        pooled = hidden[row, IDS[row] != PAD].mean(0) if pooling == "mean" else hidden[row, rows[pooling][row]]
        # A vector-matrix product vs one row of a matrix product: equal up to the summation order.
        torch.testing.assert_close(logits[row], pooled @ model.score.weight.T, rtol=1e-5, atol=1e-6)
    other = {"last": "first", "first": "mean", "mean": "last"}[pooling]
    model.pooling = other
    with torch.no_grad():  # the pooling is live: another one gives other logits
        assert not torch.allclose(model(IDS)["logits"], logits)


def test_embedder_pools_projects_and_normalizes():
    torch.manual_seed(0)
    family, config = FAMILIES["llama"], FAMILIES["llama"].config(**_tiny_fields())
    plain = SequenceEmbedder(family, config, pooling="mean", pad_token_id=PAD)
    with torch.no_grad():
        hidden = plain.model(IDS)["hidden_states"]
        out = plain(IDS)["embeddings"]
    assert out.dtype == torch.float32
    assert out.shape == (4, config.hidden_size)
    torch.testing.assert_close(out[0], hidden[0, :4].mean(0))
    projected = SequenceEmbedder(family, config, embedding_dim=5, normalize=True, pad_token_id=PAD)
    with torch.no_grad():
        hidden = projected.model(IDS)["hidden_states"]
        out = projected(IDS)["embeddings"]
    expected = hidden[1, 6] @ projected.projection.weight.T
    torch.testing.assert_close(out[1], expected / expected.norm())
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(4))


def test_classifier_has_no_lm_head_and_its_plan_covers_every_parameter():
    model = SequenceClassifier(FAMILIES["qwen3"], Qwen3Config.tiny(tie_word_embeddings=False), num_labels=2)
    names = dict(model.named_parameters())
    assert "score.weight" in names
    assert not any("lm_head" in name for name in names)
    assert all(name.startswith(("model.", "score.")) for name in names)
    dims = logical_dims(classifier_plan(FAMILIES["qwen3"]), names)
    assert dims["score.weight"] == ("labels", "embed")


def test_head_on_a_family_without_a_backbone_is_refused():
    import dataclasses

    family = dataclasses.replace(FAMILIES["qwen3"], name="toy", backbone=None)
    with pytest.raises(ValueError, match="family 'toy' has no backbone"):
        SequenceClassifier(family, Qwen3Config.tiny(), num_labels=2)


def _tiny_fields() -> dict:
    return {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "max_seq_len": 16,
    }


transformers = pytest.importorskip("transformers")  # the `hf` extra


def _hf_classifier(family: str, num_labels: int) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=50_000.0,
        rms_norm_eps=1e-5,
        num_labels=num_labels,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():  # norms start at ones, biases at zeros: perturb them so a skipped one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hf_sequence_classification_to_d9dfn_and_back_has_bitwise_equal_logits(tmp_path, family):
    source = _hf_classifier(family, num_labels=3)
    source.save_pretrained(tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config, num_labels, pad = from_hf_classifier_config(hf_config, max_seq_len=32)
    assert (num_labels, pad) == (3, PAD)
    model = SequenceClassifier(FAMILIES[family], config, num_labels, pooling="last", pad_token_id=pad).eval()
    state = load_file(tmp_path / "hf" / "model.safetensors")
    model.load_state_dict(classifier_from_hf_state(state, FAMILIES[family], config), strict=True)
    with torch.no_grad():
        expected = source(input_ids=IDS).logits
        ours = model(IDS)["logits"]
    assert expected.shape == (4, 3)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)  # HF -> d9dfn, bit for bit

    # d9dfn -> HF: another head (so the file is ours, not the source's), written by our mapping and config.
    with torch.no_grad():
        model.score.weight.add_(0.5)
        ours = model(IDS)["logits"]
    assert not torch.equal(ours, expected)
    (tmp_path / "out").mkdir()
    save_file(
        classifier_to_hf_state(model.state_dict(), FAMILIES[family], config), tmp_path / "out" / "model.safetensors"
    )
    out_config = to_hf_classifier_config(config, family, num_labels=3, pad_token_id=PAD)
    (tmp_path / "out" / "config.json").write_text(json.dumps(out_config))
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == f"{type(source).__name__}"
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=IDS).logits, ours, rtol=0, atol=0)


def test_classifier_to_hf_state_refuses_a_name_of_neither_part():
    with pytest.raises(ValueError, match=r"\['lm_head.weight'\] are neither the backbone's"):
        classifier_to_hf_state({"lm_head.weight": torch.zeros(1)}, FAMILIES["qwen3"], Qwen3Config.tiny())


def test_classification_task_step_loss_and_metrics_match_a_hand_computation():
    from d9dfn import init_train_state, make_train_step, metrics, optim
    from d9dfn.tasks import ClassificationTask

    torch.manual_seed(0)
    model = SequenceClassifier(FAMILIES["qwen3"], Qwen3Config.tiny(), num_labels=3, pad_token_id=PAD)
    task, opt = ClassificationTask(3), optim.sgd(0.0)
    labels = torch.tensor([0, 2, 1, 2])
    state = init_train_state(model, opt, metric_state=task.create_metrics().init())
    step = make_train_step(model, task, opt, num_microbatches=2, compile=False)
    new_state, output = step(state, {"input_ids": IDS, "labels": labels})
    with torch.no_grad():
        logits = model(IDS)["logits"]
    torch.testing.assert_close(output.loss, torch.nn.functional.cross_entropy(logits, labels))
    got = task.create_metrics().compute(new_state.metric_state)
    torch.testing.assert_close(got["loss"], output.loss)
    predicted = logits.argmax(-1)
    assert float(got["accuracy"]) == float((predicted == labels).float().mean())
    f1 = metrics.confusion_matrix(3, metrics=("f1",))
    expected_f1 = f1.compute(f1.update(f1.init(), logits, labels))["f1"]
    torch.testing.assert_close(got["f1"], expected_f1)
    auroc = metrics.multiclass_auroc(3, num_bins=1000)
    expected_auroc = auroc.compute(auroc.update(auroc.init(), logits.softmax(-1), labels))
    torch.testing.assert_close(got["auroc"], expected_auroc)


def test_multiclass_auroc_is_the_mean_of_one_vs_rest_binary_aurocs():
    from d9dfn import metrics

    torch.manual_seed(1)
    probs, target = torch.rand(50, 4).softmax(-1), torch.randint(0, 4, (50,))
    multi = metrics.multiclass_auroc(4, num_bins=500)
    got = multi.compute(multi.update(multi.init(), probs, target))
    binary = metrics.binary_auroc(num_bins=500)
    per_class = [binary.compute(binary.update(binary.init(), probs[:, c], (target == c).long())) for c in range(4)]
    torch.testing.assert_close(got, torch.stack(per_class).mean())
