"""Tests of d9dfn.metrics: every metric against a direct NumPy reference, merge laws, purity, compile, reduce."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from d9dfn import metrics
from d9dfn._pytree import tree_leaves, tree_map
from d9dfn.metrics import ConfusionMatrixState

IGNORE = -100


# --------------------------------------------------------------------------------------------------------------------
# Inputs: a zoo of metric cases, each with a generator of one batch of inputs from a seed and a batch size.
# --------------------------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tie_heavy_logits(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Logits from a 5-value grid, so that rows often tie and the tie rule is exercised."""
    return torch.randint(-2, 3, shape, generator=g).to(torch.float32)


def _targets(g: torch.Generator, num_classes: int, *shape: int, ignore: bool = True) -> torch.Tensor:
    target = torch.randint(0, num_classes, shape, generator=g)
    if ignore:
        target = torch.where(torch.rand(shape, generator=g) < 0.2, IGNORE, target)
    return target


class Case(NamedTuple):
    make: Callable[[], metrics.Metric]
    inputs: Callable[[int, int], tuple[Any, ...]]  # (seed, n) -> update's args after the state


CASES: dict[str, Case] = {
    "sum": Case(metrics.sum_metric, lambda s, n: (torch.randn(n, 3, generator=_gen(s)),)),
    "mean": Case(metrics.mean, lambda s, n: (torch.randn(n, generator=_gen(s)),)),
    "weighted_mean": Case(
        metrics.weighted_mean,
        lambda s, n: (torch.randn(n, 4, generator=_gen(s)), torch.rand(n, 1, generator=_gen(s + 1))),
    ),
    "accuracy_top2": Case(
        lambda: metrics.accuracy(top_k=2, ignore_index=IGNORE),
        lambda s, n: (_tie_heavy_logits(_gen(s), n, 3, 5), _targets(_gen(s + 1), 5, n, 3)),
    ),
    "binary_auroc": Case(
        lambda: metrics.binary_auroc(num_bins=64, ignore_index=IGNORE),
        lambda s, n: (torch.rand(n, generator=_gen(s)), _targets(_gen(s + 1), 2, n)),
    ),
    "confusion_multiclass_top2": Case(
        lambda: metrics.confusion_matrix(5, top_k=2, ignore_index=IGNORE, metrics=("precision", "recall", "fbeta")),
        lambda s, n: (_tie_heavy_logits(_gen(s), n, 2, 5), _targets(_gen(s + 1), 5, n, 2)),
    ),
    "confusion_multiclass_labels": Case(
        lambda: metrics.confusion_matrix(4, ignore_index=IGNORE, average="none"),
        lambda s, n: (torch.randint(0, 4, (n,), generator=_gen(s)), _targets(_gen(s + 1), 4, n)),
    ),
    "confusion_binary": Case(
        lambda: metrics.confusion_matrix(task="binary", ignore_index=IGNORE, average="micro"),
        lambda s, n: (torch.rand(n, generator=_gen(s)), _targets(_gen(s + 1), 2, n)),
    ),
    "confusion_multilabel": Case(
        lambda: metrics.confusion_matrix(3, task="multilabel", threshold=0.3, average="weighted"),
        lambda s, n: (torch.rand(n, 3, generator=_gen(s)), torch.randint(0, 2, (n, 3), generator=_gen(s + 1))),
    ),
    "compose": Case(
        lambda: metrics.compose({"loss": metrics.mean(), "acc": metrics.accuracy()}),
        lambda s, n: (
            {
                "loss": (torch.randn(n, generator=_gen(s)),),
                "acc": {"logits": torch.randn(n, 3), "target": torch.zeros(n, dtype=torch.long)},
            },
        ),
    ),
}


def _assert_states_equal(actual: Any, expected: Any) -> None:
    """Integer leaves equal exactly; float leaves up to rounding (addition order differs)."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _run(metric: metrics.Metric, state: Any, batches: list[tuple[Any, ...]]) -> Any:
    for args in batches:
        state = metric.update(state, *args)
    return state


# --------------------------------------------------------------------------------------------------------------------
# NumPy references, written independently of the implementation.
# --------------------------------------------------------------------------------------------------------------------


def _ratio(num: float, den: float) -> float:
    return 0.0 if den == 0 else num / den


def _stable_ranks(row: np.ndarray) -> np.ndarray:
    """Rank of every class in a stable descending order (ties: smaller index first)."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    ranks = np.empty(len(row), dtype=np.int64)
    ranks[order] = np.arange(len(row))
    return ranks


def _ref_accuracy(batches: list[tuple[np.ndarray, np.ndarray]], top_k: int, ignore: int | None) -> float:
    correct = total = 0
    for logits, target in batches:
        rows, targets = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        for row, t in zip(rows, targets, strict=True):
            if ignore is not None and t == ignore:
                continue
            total += 1
            correct += int(_stable_ranks(row)[t] < top_k)
    return _ratio(correct, total)


def _ref_multiclass_counts(preds: np.ndarray, target: np.ndarray, num_classes: int, top_k: int, ignore: int | None):
    tp, fp, fn, tn = (np.zeros(num_classes, dtype=np.int64) for _ in range(4))
    labels = preds.ndim == target.ndim
    rows = preds.reshape(-1) if labels else preds.reshape(-1, num_classes)
    for row, t in zip(rows, target.reshape(-1), strict=True):
        if ignore is not None and t == ignore:
            continue
        predicted = {int(row)} if labels else {c for c, r in enumerate(_stable_ranks(row)) if r < top_k}
        for c in range(num_classes):
            is_pred, is_pos = c in predicted, c == t
            tp[c] += is_pred and is_pos
            fp[c] += is_pred and not is_pos
            fn[c] += (not is_pred) and is_pos
            tn[c] += (not is_pred) and not is_pos
    return tp, fp, fn, tn


def _ref_elementwise_counts(preds: np.ndarray, target: np.ndarray, width: int, threshold: float, ignore: int | None):
    tp, fp, fn, tn = (np.zeros(width, dtype=np.int64) for _ in range(4))
    for p_row, t_row in zip(preds.reshape(-1, width), target.reshape(-1, width), strict=True):
        for c in range(width):
            if ignore is not None and t_row[c] == ignore:
                continue
            is_pred, is_pos = bool(p_row[c] > threshold), bool(t_row[c] != 0)
            tp[c] += is_pred and is_pos
            fp[c] += is_pred and not is_pos
            fn[c] += (not is_pred) and is_pos
            tn[c] += (not is_pred) and not is_pos
    return tp, fp, fn, tn


def _ref_score(counts, name: str, average: str, beta: float = 1.0):
    tp, fp, fn, _ = (np.asarray(c, dtype=np.int64) for c in counts)

    def score(tp_c, fp_c, fn_c):
        if name == "precision":
            return _ratio(tp_c, tp_c + fp_c)
        if name == "recall":
            return _ratio(tp_c, tp_c + fn_c)
        b2 = 1.0 if name == "f1" else beta * beta
        return _ratio((1 + b2) * tp_c, (1 + b2) * tp_c + b2 * fn_c + fp_c)

    if average == "micro":
        return score(tp.sum(), fp.sum(), fn.sum())
    per_class = np.array([score(*c) for c in zip(tp, fp, fn, strict=True)])
    if average == "none":
        return per_class
    if average == "macro":
        seen = [c for c in range(len(tp)) if tp[c] + fp[c] + fn[c] > 0]
        return _ratio(sum(per_class[c] for c in seen), len(seen))
    support = tp + fn
    return _ratio(float((per_class * support).sum()), float(support.sum()))


def _ref_auroc_exact(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney: P(score_pos > score_neg) + ½·P(equal), over every (positive, negative) pair."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    if len(pos) == 0 or len(neg) == 0:
        return 0.0
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (len(pos) * len(neg)))


def _bins(scores: np.ndarray, num_bins: int) -> np.ndarray:
    return np.minimum((np.clip(scores, 0, 1) * num_bins).astype(np.int64), num_bins - 1)


# --------------------------------------------------------------------------------------------------------------------
# Sums and means.
# --------------------------------------------------------------------------------------------------------------------

_batch_sizes = st.lists(st.integers(0, 6), min_size=0, max_size=4)


@given(sizes=_batch_sizes, seed=st.integers(0, 2**16))
def test_sum_metric_matches_numpy(sizes: list[int], seed: int) -> None:
    values = [torch.randn(n, 2, generator=_gen(seed + i)) for i, n in enumerate(sizes)]
    m = metrics.sum_metric()
    result = m.compute(_run(m, m.init(), [(v,) for v in values]))
    expected = sum(float(v.double().sum()) for v in values)
    assert result.shape == ()
    assert result.dtype == torch.float32
    np.testing.assert_allclose(float(result), expected, rtol=1e-5, atol=1e-5)


@given(sizes=_batch_sizes, seed=st.integers(0, 2**16))
def test_mean_matches_numpy(sizes: list[int], seed: int) -> None:
    values = [torch.randn(n, generator=_gen(seed + i)).to(torch.bfloat16) for i, n in enumerate(sizes)]
    m = metrics.mean()
    result = m.compute(_run(m, m.init(), [(v,) for v in values]))
    flat = np.concatenate([v.float().numpy() for v in values]) if values else np.zeros(0)
    expected = float(flat.mean()) if flat.size else 0.0  # no element: 0, not NaN
    assert result.dtype == torch.float32
    np.testing.assert_allclose(float(result), expected, rtol=1e-5, atol=1e-6)


@given(sizes=_batch_sizes, seed=st.integers(0, 2**16), zero_weights=st.booleans())
def test_weighted_mean_matches_numpy(sizes: list[int], seed: int, zero_weights: bool) -> None:
    g = _gen(seed)
    batches = [(torch.randn(n, 3, generator=g), torch.rand(n, 1, generator=g) * (not zero_weights)) for n in sizes]
    m = metrics.weighted_mean()
    result = m.compute(_run(m, m.init(), batches))
    num = sum(float((v.double() * w.double()).sum()) for v, w in batches)
    den = sum(float(w.double().expand_as(v).sum()) for v, w in batches)
    np.testing.assert_allclose(float(result), _ratio(num, den), rtol=1e-4, atol=1e-5)


def test_weighted_mean_without_weight_is_mean_and_takes_python_numbers() -> None:
    m = metrics.weighted_mean()
    state = m.update(m.init(), torch.tensor([1.0, 2.0, 6.0]))
    assert float(m.compute(state)) == pytest.approx(3.0)
    state = m.update(m.init(), 2.0, 3.0)
    assert state.weight.item() == 3.0
    assert float(m.compute(state)) == pytest.approx(2.0)


def test_weighted_mean_rejects_weight_that_does_not_broadcast() -> None:
    m = metrics.weighted_mean()
    with pytest.raises(ValueError, match=r"weighted_mean.update: weight of shape \(3,\) .* value of shape \(4,\)"):
        m.update(m.init(), torch.ones(4), torch.ones(3))


def test_sum_metric_rejects_non_float_dtype_and_non_tensor_value() -> None:
    with pytest.raises(TypeError, match="sum_metric: dtype must be a floating dtype"):
        metrics.sum_metric(dtype=torch.int64)
    m = metrics.sum_metric()
    with pytest.raises(TypeError, match=r"sum_metric\.update: value: expected a tensor"):
        m.update(m.init(), [1.0, 2.0])


# --------------------------------------------------------------------------------------------------------------------
# Accuracy.
# --------------------------------------------------------------------------------------------------------------------


@given(
    sizes=_batch_sizes,
    num_classes=st.integers(1, 6),
    extra_dims=st.lists(st.integers(1, 3), max_size=2),
    top_k=st.integers(1, 3),
    ignore=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_accuracy_matches_reference(
    sizes: list[int], num_classes: int, extra_dims: list[int], top_k: int, ignore: bool, seed: int
) -> None:
    g = _gen(seed)
    batches = [
        (_tie_heavy_logits(g, n, *extra_dims, num_classes), _targets(g, num_classes, n, *extra_dims, ignore=ignore))
        for n in sizes
    ]
    m = metrics.accuracy(top_k=top_k, ignore_index=IGNORE if ignore else None)
    result = m.compute(_run(m, m.init(), batches))
    expected = _ref_accuracy([(x.numpy(), t.numpy()) for x, t in batches], top_k, IGNORE if ignore else None)
    assert result.shape == ()
    np.testing.assert_allclose(float(result), expected, rtol=1e-6)


def test_accuracy_top1_breaks_ties_like_argmax() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    m = metrics.accuracy()
    state = m.update(m.init(), logits, logits.argmax(-1))
    assert state == metrics.AccuracyState(correct=torch.tensor(2), total=torch.tensor(2))
    state = m.update(m.init(), logits, torch.tensor([1, 2]))  # tied with a smaller index: not predicted
    assert int(state.correct) == 0


def test_accuracy_counts_a_nan_target_logit_as_wrong() -> None:
    m = metrics.accuracy(top_k=2)
    state = m.update(m.init(), torch.tensor([[float("nan"), 0.0, 1.0]]), torch.tensor([0]))
    assert (int(state.correct), int(state.total)) == (0, 1)


@pytest.mark.parametrize(
    ("logits", "target", "match"),
    [
        (torch.zeros(4, 3), torch.zeros(3, dtype=torch.long), r"target of shape \(3,\) does not match .* \(4,\)"),
        (torch.zeros(4, 3), torch.zeros(4), "target must hold integer class indices, got dtype torch.float32"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), "logits must be a floating tensor"),
    ],
)
def test_accuracy_update_rejects_bad_inputs(logits: torch.Tensor, target: torch.Tensor, match: str) -> None:
    m = metrics.accuracy()
    with pytest.raises(ValueError, match=f"accuracy.update: {match}"):
        m.update(m.init(), logits, target)


def test_accuracy_rejects_top_k_below_one() -> None:
    with pytest.raises(ValueError, match="accuracy: top_k must be an int >= 1, got 0"):
        metrics.accuracy(top_k=0)


# --------------------------------------------------------------------------------------------------------------------
# Binary AUROC.
# --------------------------------------------------------------------------------------------------------------------


@given(
    sizes=_batch_sizes,
    num_bins=st.integers(1, 40),
    ignore=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_binary_auroc_equals_exact_auroc_of_binned_scores_and_stays_within_bound(
    sizes: list[int], num_bins: int, ignore: bool, seed: int
) -> None:
    g = _gen(seed)
    # Scores a little outside [0, 1] too: they must be clamped into the end bins.
    batches = [(torch.rand(n, generator=g) * 1.2 - 0.1, _targets(g, 2, n, ignore=ignore)) for n in sizes]
    m = metrics.binary_auroc(num_bins=num_bins, ignore_index=IGNORE if ignore else None)
    result = float(m.compute(_run(m, m.init(), batches)))
    scores = np.concatenate([s.numpy() for s, _ in batches]) if batches else np.zeros(0, np.float32)
    labels = np.concatenate([t.numpy() for _, t in batches]) if batches else np.zeros(0, np.int64)
    keep = labels != IGNORE
    scores, labels = scores[keep], labels[keep]
    bins = _bins(scores, num_bins)
    np.testing.assert_allclose(result, _ref_auroc_exact(bins, labels), rtol=1e-6, atol=1e-7)
    # Only the order within a bin is lost: the error is at most half the share of same-bin pairs.
    num_pos, num_neg = int((labels == 1).sum()), int((labels == 0).sum())
    same_bin = sum(int((bins[labels == 1] == b).sum()) * int((bins[labels == 0] == b).sum()) for b in range(num_bins))
    bound = 0.5 * _ratio(same_bin, num_pos * num_neg)
    assert abs(result - _ref_auroc_exact(scores, labels)) <= bound + 1e-6


def test_binary_auroc_within_1e_3_of_exact_with_default_bins() -> None:
    g = _gen(0)
    labels = torch.randint(0, 2, (4000,), generator=g)
    scores = torch.sigmoid(torch.randn(4000, generator=g) + labels)  # informative, continuous scores
    m = metrics.binary_auroc()
    result = float(m.compute(m.update(m.init(), scores, labels)))
    exact = _ref_auroc_exact(scores.numpy(), labels.numpy())
    assert 0.6 < exact < 0.9
    assert abs(result - exact) < 1e-3


def test_binary_auroc_skips_nan_scores_and_is_zero_without_both_classes() -> None:
    m = metrics.binary_auroc(num_bins=10)
    state = m.update(m.init(), torch.tensor([0.9, float("nan"), 0.1]), torch.tensor([1, 0, 0]))
    assert int(state.negatives.sum()) == 1
    assert float(m.compute(state)) == 1.0
    only_positives = m.update(m.init(), torch.tensor([0.2, 0.7]), torch.tensor([1, 1]))
    assert float(m.compute(only_positives)) == 0.0


def test_binary_auroc_bins_a_float64_score_in_float64() -> None:
    # 0.3 - 1e-12 lies in bin 2 of 10; cast to float32 it becomes 0.3f, whose product with 10 rounds to bin 3.
    score = 0.3 - 1e-12
    assert int(torch.tensor(score, dtype=torch.float32) * 10) == 3  # the cast would move it
    m = metrics.binary_auroc(num_bins=10)
    state = m.update(m.init(), torch.tensor([score], dtype=torch.float64), torch.tensor([1]))
    assert state.positives.tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    half = m.update(m.init(), torch.tensor([score], dtype=torch.float16), torch.tensor([0]))  # lower: float32
    assert half.negatives.sum().item() == 1


def test_binary_auroc_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="binary_auroc: num_bins must be an int >= 1, got 0"):
        metrics.binary_auroc(num_bins=0)
    m = metrics.binary_auroc()
    with pytest.raises(ValueError, match=r"binary_auroc.update: target of shape \(3,\) does not match preds .*\(4,\)"):
        m.update(m.init(), torch.rand(4), torch.ones(3))
    with pytest.raises(ValueError, match=r"binary_auroc\.update: preds must be a floating tensor"):
        m.update(m.init(), torch.ones(4, dtype=torch.long), torch.ones(4))


# --------------------------------------------------------------------------------------------------------------------
# Confusion counts and scores.
# --------------------------------------------------------------------------------------------------------------------


def _state_counts(state: ConfusionMatrixState) -> tuple[np.ndarray, ...]:
    return tuple(field.numpy() for field in state)


@given(
    sizes=_batch_sizes,
    num_classes=st.integers(1, 5),
    extra_dims=st.lists(st.integers(1, 2), max_size=1),
    top_k=st.integers(1, 3),
    labels=st.booleans(),
    ignore=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_confusion_matrix_multiclass_counts_match_reference(
    sizes: list[int], num_classes: int, extra_dims: list[int], top_k: int, labels: bool, ignore: bool, seed: int
) -> None:
    top_k = 1 if labels else min(top_k, num_classes)
    g = _gen(seed)
    batches = []
    for n in sizes:
        target = _targets(g, num_classes, n, *extra_dims, ignore=ignore)
        if labels:
            preds = torch.randint(0, num_classes, target.shape, generator=g)
            preds = torch.where(target == IGNORE, IGNORE, preds)  # labels may hold ignore_index where ignored
        else:
            preds = _tie_heavy_logits(g, n, *extra_dims, num_classes)
        batches.append((preds, target))
    m = metrics.confusion_matrix(num_classes, top_k=top_k, ignore_index=IGNORE if ignore else None)
    state = _run(m, m.init(), batches)
    expected = [np.zeros(num_classes, dtype=np.int64) for _ in range(4)]
    for preds, target in batches:
        counts = _ref_multiclass_counts(preds.numpy(), target.numpy(), num_classes, top_k, IGNORE if ignore else None)
        expected = [e + c for e, c in zip(expected, counts, strict=True)]
    for actual, want in zip(_state_counts(state), expected, strict=True):
        np.testing.assert_array_equal(actual, want)


@given(
    sizes=_batch_sizes,
    multilabel=st.booleans(),
    threshold=st.sampled_from([0.25, 0.5, 0.75]),
    ignore=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_confusion_matrix_binary_and_multilabel_counts_match_reference(
    sizes: list[int], multilabel: bool, threshold: float, ignore: bool, seed: int
) -> None:
    width = 3 if multilabel else 1
    shape = (3,) if multilabel else ()
    g = _gen(seed)
    batches = [(torch.rand(n, *shape, generator=g), _targets(g, 2, n, *shape, ignore=ignore)) for n in sizes]
    m = metrics.confusion_matrix(
        width if multilabel else None,
        task="multilabel" if multilabel else "binary",
        threshold=threshold,
        ignore_index=IGNORE if ignore else None,
    )
    state = _run(m, m.init(), batches)
    expected = [np.zeros(width, dtype=np.int64) for _ in range(4)]
    for preds, target in batches:
        counts = _ref_elementwise_counts(preds.numpy(), target.numpy(), width, threshold, IGNORE if ignore else None)
        expected = [e + c for e, c in zip(expected, counts, strict=True)]
    for actual, want in zip(_state_counts(state), expected, strict=True):
        np.testing.assert_array_equal(actual, want)


_counts = st.integers(1, 5).flatmap(
    lambda c: st.lists(st.lists(st.integers(0, 4), min_size=c, max_size=c), min_size=4, max_size=4)
)


@given(
    counts=_counts,
    average=st.sampled_from(["micro", "macro", "weighted", "none"]),
    beta=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_scores_match_reference_including_zero_division(counts: list[list[int]], average: str, beta: float) -> None:
    state = ConfusionMatrixState(*(torch.tensor(c, dtype=torch.int64) for c in counts))
    results = {
        "precision": metrics.precision_score(state, average),
        "recall": metrics.recall_score(state, average),
        "f1": metrics.f1_score(state, average),
        "fbeta": metrics.fbeta_score(state, beta, average),
    }
    for name, result in results.items():
        assert result.dtype == torch.float32
        assert result.ndim == (1 if average == "none" else 0)
        assert not result.isnan().any()
        np.testing.assert_allclose(result.numpy(), _ref_score(counts, name, average, beta), rtol=1e-6, atol=1e-7)


def test_confusion_matrix_compute_reports_the_chosen_scores() -> None:
    m = metrics.confusion_matrix(3, metrics=("f1", "fbeta"), average="none", beta=2.0)
    state = m.update(m.init(), torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 2]))
    result = m.compute(state)
    assert list(result) == ["f1", "fbeta"]
    torch.testing.assert_close(result["f1"], metrics.f1_score(state, "none"))
    torch.testing.assert_close(result["fbeta"], metrics.fbeta_score(state, 2.0, "none"))
    assert result["f1"].shape == (3,)


def test_confusion_matrix_micro_precision_of_top1_multiclass_is_accuracy() -> None:
    g = _gen(3)
    logits, target = torch.randn(50, 4, generator=g), torch.randint(0, 4, (50,), generator=g)
    cm = metrics.confusion_matrix(4, metrics=("precision", "recall"), average="micro")
    acc = metrics.accuracy()
    result = cm.compute(cm.update(cm.init(), logits, target))
    expected = acc.compute(acc.update(acc.init(), logits, target))
    torch.testing.assert_close(result["precision"], expected)
    torch.testing.assert_close(result["recall"], expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_classes": 3, "task": "regression"}, "task must be one of"),
        ({"num_classes": None}, "task='multiclass' needs num_classes"),
        ({"num_classes": 3, "task": "binary"}, "task='binary' counts the positive class only"),
        ({"num_classes": 3, "top_k": 4}, "top_k=4 exceeds num_classes=3"),
        ({"num_classes": 3, "task": "multilabel", "top_k": 2}, "top_k=2 applies to task='multiclass' only"),
        ({"num_classes": 3, "metrics": ("accuracy",)}, "metrics must be a non-empty sequence"),
        ({"num_classes": 3, "metrics": "f1"}, "metrics must be a non-empty sequence"),
        ({"num_classes": 3, "average": "samples"}, "average must be one of"),
        ({"num_classes": 3, "beta": 0.0}, "beta must be > 0"),
    ],
)
def test_confusion_matrix_rejects_bad_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=f"confusion_matrix: {match}"):
        metrics.confusion_matrix(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "preds", "target", "match"),
    [
        ({"num_classes": 3}, torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), "preds have 2 classes"),
        ({"num_classes": 3}, torch.zeros(4, 3), torch.zeros(5, dtype=torch.long), r"target of shape \(5,\)"),
        ({"num_classes": 3, "top_k": 2}, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), "labels"),
        ({"task": "binary"}, torch.zeros(4), torch.zeros(3), "needs preds and target of one shape"),
        ({"num_classes": 3, "task": "multilabel"}, torch.zeros(4, 2), torch.zeros(4, 2), r"must be \(\.\.\., 3\)"),
    ],
)
def test_confusion_matrix_update_rejects_bad_inputs(
    kwargs: dict[str, Any], preds: torch.Tensor, target: torch.Tensor, match: str
) -> None:
    m = metrics.confusion_matrix(**kwargs)
    with pytest.raises(ValueError, match=f"confusion_matrix.update: .*{match}"):
        m.update(m.init(), preds, target)


def test_fbeta_score_rejects_non_positive_beta() -> None:
    state = ConfusionMatrixState(*(torch.zeros(2, dtype=torch.long) for _ in range(4)))
    with pytest.raises(ValueError, match="fbeta_score: beta must be > 0, got -1"):
        metrics.fbeta_score(state, beta=-1)


# --------------------------------------------------------------------------------------------------------------------
# Compose.
# --------------------------------------------------------------------------------------------------------------------


def test_compose_updates_only_the_named_metrics_and_keeps_order() -> None:
    m = metrics.compose({"total": metrics.sum_metric(), "avg": metrics.mean()})
    state = m.update(m.init(), {"avg": {"value": torch.tensor([1.0, 3.0])}})
    assert list(state) == ["total", "avg"]
    assert float(state["total"].total) == 0.0
    state = m.update(state, {"total": (torch.tensor(5.0),)})
    assert m.compute(state) == {"total": torch.tensor(5.0), "avg": torch.tensor(2.0)}


def test_compose_rejects_unknown_names_bad_args_and_non_metrics() -> None:
    m = metrics.compose({"avg": metrics.mean()})
    with pytest.raises(ValueError, match=r"compose.update: inputs name metrics \['acc'\] .* known: \['avg'\]"):
        m.update(m.init(), {"acc": (torch.ones(1),)})
    with pytest.raises(TypeError, match=r"compose.update: inputs\['avg'\] is a Tensor; pass a tuple"):
        m.update(m.init(), {"avg": torch.ones(1)})
    with pytest.raises(TypeError, match=r"compose: metrics\['avg'\] is a function, not a Metric"):
        metrics.compose({"avg": metrics.mean})


# --------------------------------------------------------------------------------------------------------------------
# Laws every metric obeys: merge, purity, shapes of results, compile.
# --------------------------------------------------------------------------------------------------------------------


@given(
    name=st.sampled_from(sorted(CASES)),
    sizes=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_merge_of_separate_updates_equals_sequential_updates(name: str, sizes: list[int], seed: int) -> None:
    case = CASES[name]
    m = case.make()
    w, x, y, z = (case.inputs(seed + 10 * i, n) for i, n in enumerate(sizes))
    a, b = m.update(m.init(), *w), m.update(m.init(), *x)  # two ranks' (or microbatches') earlier states
    merged = m.merge(m.update(a, *y), m.update(b, *z))
    sequential = _run(m, m.merge(a, b), [y, z])
    _assert_states_equal(merged, sequential)
    _assert_states_equal(m.merge(merged, m.init()), merged)  # init is the identity
    _assert_states_equal(m.merge(a, b), m.merge(b, a))


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_never_mutates_state_or_inputs(name: str) -> None:
    case = CASES[name]
    m = case.make()
    state = m.update(m.init(), *case.inputs(0, 4))
    args = case.inputs(1, 5)
    before = tree_map(torch.clone, (state, args))
    versions = [leaf._version for leaf in tree_leaves((state, args))]
    new_state = m.update(state, *args)
    merged = m.merge(state, new_state)
    m.compute(merged)
    assert [leaf._version for leaf in tree_leaves((state, args))] == versions
    torch.testing.assert_close((state, args), before, rtol=0, atol=0)
    storages = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves(state)}
    assert not storages & {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((new_state, merged))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compute_gives_0d_or_1d_tensors_on_empty_and_full_states(name: str) -> None:
    case = CASES[name]
    m = case.make()
    for state in (m.init(), m.update(m.init(), *case.inputs(0, 0)), m.update(m.init(), *case.inputs(0, 6))):
        for result in tree_leaves(m.compute(state)):
            assert isinstance(result, torch.Tensor)
            assert result.ndim <= 1
            assert not result.isnan().any()


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_compiles_without_graph_breaks_or_recompiles_and_matches_eager(name: str) -> None:
    case = CASES[name]
    m = case.make()
    state, first, second = m.init(), case.inputs(0, 6), case.inputs(1, 6)
    explanation = torch._dynamo.explain(m.update)(state, *first)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(m.update, fullgraph=True, backend="aot_eager")
    state_1 = compiled(state, *first)
    _assert_states_equal(state_1, m.update(state, *first))
    with torch.compiler.set_stance("fail_on_recompile"):
        state_2 = compiled(state_1, *second)
    _assert_states_equal(state_2, m.update(m.update(state, *first), *second))


# Importing inductor's CPU backend touches torch.jit.script_method, which warns; not ours to fix.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.slow
@pytest.mark.parametrize("name", ["confusion_multiclass_top2", "binary_auroc"])
@pytest.mark.compiled
def test_update_and_compute_compile_with_inductor(name: str) -> None:
    case = CASES[name]
    m = case.make()
    state = m.update(m.init(), *case.inputs(2, 7))
    args = case.inputs(3, 7)
    _assert_states_equal(torch.compile(m.update, fullgraph=True)(state, *args), m.update(state, *args))
    torch.testing.assert_close(torch.compile(m.compute, fullgraph=True)(state), m.compute(state))


def test_init_places_state_on_the_given_device() -> None:
    m = metrics.compose({"auroc": metrics.binary_auroc(num_bins=8), "avg": metrics.mean()})
    state = m.init("meta")
    assert all(leaf.device.type == "meta" for leaf in tree_leaves(state))
    assert state["auroc"].positives.shape == (8,)


def test_public_names_resolve() -> None:
    assert sorted(metrics.__all__) == metrics.__all__
    for name in metrics.__all__:
        assert getattr(metrics, name) is not None


# --------------------------------------------------------------------------------------------------------------------
# reduce: a real 2-rank gloo group.
# --------------------------------------------------------------------------------------------------------------------


def _reduce_worker(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        m = metrics.compose({name: CASES[name].make() for name in ("mean", "accuracy_top2", "binary_auroc")})
        inputs = {name: CASES[name].inputs(100 + rank, 3 + rank) for name in ("mean", "accuracy_top2", "binary_auroc")}
        state = m.update(m.init(), inputs)
        before = tree_map(torch.clone, state)
        reduced = metrics.reduce(state, group=dist.group.WORLD)
        torch.testing.assert_close(state, before, rtol=0, atol=0)  # the local state is untouched
        everyone = [m.update(m.init(), {n: CASES[n].inputs(100 + r, 3 + r) for n in inputs}) for r in range(world_size)]
        expected = everyone[0]
        for other in everyone[1:]:
            expected = m.merge(expected, other)
        _assert_states_equal(reduced, expected)
        assert [leaf.dtype for leaf in tree_leaves(reduced)] == [leaf.dtype for leaf in tree_leaves(state)]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_reduce_sums_states_over_two_gloo_ranks(tmp_path: Any) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # fork, not spawn: two children that re-import torch take ~15 s on a 2-core runner, forked ones start at once.
    mp.start_processes(_reduce_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True, start_method="fork")


def test_reduce_rejects_non_tensor_leaves_missing_group_and_missing_process_group() -> None:
    with pytest.raises(TypeError, match=r"reduce: leaf \['count'\] is a int, not a tensor"):
        metrics.reduce({"total": torch.zeros(()), "count": 3}, "0")
    with pytest.raises(TypeError, match=r"reduce: group is None; pass the data-parallel process group"):
        metrics.reduce(metrics.mean().init(), None)
    with pytest.raises(ValueError, match=r"reduce: torch\.distributed is not initialized"):
        metrics.reduce(metrics.mean().init(), object())
    with pytest.raises(ValueError, match=r"reduce: torch\.distributed is not initialized"):
        metrics.reduce(metrics.mean().init(), "0")
