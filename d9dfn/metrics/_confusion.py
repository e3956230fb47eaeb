"""Per-class confusion counts (tp, fp, fn, tn) and the precision / recall / F-beta scores they give."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from d9dfn.metrics._accuracy import check_logits_and_target
from d9dfn.metrics._base import Metric, add_states, safe_divide

__all__ = [
    "AVERAGES",
    "SCORES",
    "TASKS",
    "ConfusionMatrixState",
    "confusion_matrix",
    "f1_score",
    "fbeta_score",
    "precision_score",
    "recall_score",
]

Task = Literal["multiclass", "binary", "multilabel"]
Average = Literal["micro", "macro", "weighted", "none"]

TASKS = ("multiclass", "binary", "multilabel")
"""The kinds of classification :func:`confusion_matrix` counts."""
AVERAGES = ("micro", "macro", "weighted", "none")
"""How per-class scores become one number; ``"none"`` keeps the (C,) vector."""
SCORES = ("precision", "recall", "f1", "fbeta")
"""The results :func:`confusion_matrix`'s ``compute`` can report."""


class ConfusionMatrixState(NamedTuple):
    """Per-class counts of true positives, false positives, false negatives and true negatives.

    For ``"binary"`` there is one class, the positive one. Every field is (C,) int64; for each class
    ``tp + fp + fn + tn`` is the number of counted samples (multilabel: of counted labels).
    """

    tp: torch.Tensor  # (C,) int64
    fp: torch.Tensor  # (C,) int64
    fn: torch.Tensor  # (C,) int64
    tn: torch.Tensor  # (C,) int64


def _average(fn: str, per_class: torch.Tensor, state: ConfusionMatrixState, average: str) -> torch.Tensor:
    """Average a (C,) score over classes: ``none`` keeps it, ``macro``/``weighted`` weigh classes."""
    match average:
        case "none":
            return per_class
        case "macro":
            # A class never seen in targets nor predictions has no defined score (0/0): leave it out.
            seen = (state.tp + state.fp + state.fn) > 0
            return safe_divide((per_class * seen).sum(), seen.sum())
        case "weighted":
            support = state.tp + state.fn
            return safe_divide((per_class * support).sum(), support.sum())
        case _:
            raise ValueError(f"{fn}: average must be one of {AVERAGES}, got {average!r}")


def _counts(state: ConfusionMatrixState, average: str) -> ConfusionMatrixState:
    """The counts the score is computed from: summed over classes for ``micro``, per class otherwise."""
    if average == "micro":
        return ConfusionMatrixState(*(field.sum() for field in state))
    return state


def fbeta_score(state: ConfusionMatrixState, beta: float = 1.0, average: Average = "macro") -> torch.Tensor:
    """F-beta = (1+β²)·tp / ((1+β²)·tp + β²·fn + fp) from a confusion state; 0 where that is 0/0.

    Args:
        state: a :func:`confusion_matrix` state.
        beta: weight of recall against precision (β > 1 favours recall).
        average: ``"micro"`` pools the counts of all classes, ``"macro"`` is the plain mean over the
            classes seen in targets or predictions, ``"weighted"`` weighs classes by support
            (tp + fn), ``"none"`` returns the (C,) per-class scores.

    Returns:
        A 0-d float32 tensor, or (C,) for ``average="none"``.

    >>> s = ConfusionMatrixState(*(torch.tensor([v]) for v in (3, 1, 2, 4)))
    >>> fbeta_score(s, beta=1.0, average="micro")
    tensor(0.6667)
    """
    if not beta > 0:
        raise ValueError(f"fbeta_score: beta must be > 0, got {beta!r}; beta=1 gives F1")
    counts = _counts(state, average)
    b2 = beta * beta
    per_class = safe_divide((1 + b2) * counts.tp, (1 + b2) * counts.tp + b2 * counts.fn + counts.fp)
    return per_class if average == "micro" else _average("fbeta_score", per_class, state, average)


def f1_score(state: ConfusionMatrixState, average: Average = "macro") -> torch.Tensor:
    """F1 = 2·tp / (2·tp + fn + fp): :func:`fbeta_score` with β = 1.

    >>> s = ConfusionMatrixState(*(torch.tensor(v) for v in ([1, 0], [0, 0], [1, 0], [2, 4])))
    >>> f1_score(s, average="none"), f1_score(s, average="macro")
    (tensor([0.6667, 0.0000]), tensor(0.6667))
    """
    return fbeta_score(state, 1.0, average)


def precision_score(state: ConfusionMatrixState, average: Average = "macro") -> torch.Tensor:
    """Precision = tp / (tp + fp) from a confusion state; 0 where no sample was predicted positive.

    ``average`` as in :func:`fbeta_score`.

    >>> s = ConfusionMatrixState(*(torch.tensor(v) for v in ([3, 1], [1, 3], [2, 0], [4, 6])))
    >>> precision_score(s, average="none")
    tensor([0.7500, 0.2500])
    """
    counts = _counts(state, average)
    per_class = safe_divide(counts.tp, counts.tp + counts.fp)
    return per_class if average == "micro" else _average("precision_score", per_class, state, average)


def recall_score(state: ConfusionMatrixState, average: Average = "macro") -> torch.Tensor:
    """Recall = tp / (tp + fn) from a confusion state; 0 where a class has no positive target.

    ``average`` as in :func:`fbeta_score`.

    >>> s = ConfusionMatrixState(*(torch.tensor(v) for v in ([3, 1], [1, 3], [2, 0], [4, 6])))
    >>> recall_score(s, average="weighted")
    tensor(0.6667)
    """
    counts = _counts(state, average)
    per_class = safe_divide(counts.tp, counts.tp + counts.fn)
    return per_class if average == "micro" else _average("recall_score", per_class, state, average)


def _check_config(
    num_classes: int | None, task: str, top_k: int, metrics: Sequence[str], average: str, beta: float
) -> int:
    """Validate :func:`confusion_matrix`'s arguments; return the number of classes counted."""
    fn = "confusion_matrix"
    if task not in TASKS:
        raise ValueError(f"{fn}: task must be one of {TASKS}, got {task!r}")
    if task == "binary":
        if num_classes not in (None, 1):
            raise ValueError(
                f"{fn}: task='binary' counts the positive class only, got num_classes={num_classes!r}; pass "
                f"num_classes=None, or task='multiclass' with num_classes=2 for both classes"
            )
        num_classes = 1
    elif not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"{fn}: task={task!r} needs num_classes, an int >= 1, got {num_classes!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{fn}: top_k must be an int >= 1, got {top_k!r}")
    if top_k != 1 and task != "multiclass":
        raise ValueError(f"{fn}: top_k={top_k} applies to task='multiclass' only, got task={task!r}; drop top_k")
    if top_k > num_classes:
        raise ValueError(f"{fn}: top_k={top_k} exceeds num_classes={num_classes}; pass top_k <= num_classes")
    if isinstance(metrics, str) or not metrics or any(name not in SCORES for name in metrics):
        raise ValueError(f"{fn}: metrics must be a non-empty sequence of names from {SCORES}, got {metrics!r}")
    if average not in AVERAGES:
        raise ValueError(f"{fn}: average must be one of {AVERAGES}, got {average!r}")
    if not beta > 0:
        raise ValueError(f"{fn}: beta must be > 0, got {beta!r}; beta=1 gives F1")
    return num_classes


def _counts_from_labels(
    num_classes: int, target: torch.Tensor, predicted: torch.Tensor, hit: torch.Tensor, valid: torch.Tensor
) -> ConfusionMatrixState:
    """Per-class counts of one multiclass batch, by scatter-adds (memory O(N·k + C), not O(N·C)).

    ``target`` (N,) holds class indices, ``predicted`` (N, k) the classes predicted for each sample,
    ``hit`` (N,) whether the target is among them, ``valid`` (N,) which samples count.
    """
    zeros = torch.zeros(num_classes, dtype=torch.int64, device=target.device)
    ones = valid.to(torch.int64)
    tp = zeros.index_add(0, target, ones * hit)
    num_predicted = zeros.index_add(0, predicted.reshape(-1), ones.unsqueeze(-1).expand_as(predicted).reshape(-1))
    num_target = zeros.index_add(0, target, ones)
    fp = num_predicted - tp
    fn = num_target - tp
    return ConfusionMatrixState(tp=tp, fp=fp, fn=fn, tn=ones.sum() - tp - fp - fn)


def _counts_from_masks(predicted: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor) -> ConfusionMatrixState:
    """Per-class counts from (N, C) boolean masks of predictions, positive targets and counted entries."""
    return ConfusionMatrixState(
        tp=(predicted & positive & valid).sum(0),
        fp=(predicted & ~positive & valid).sum(0),
        fn=(~predicted & positive & valid).sum(0),
        tn=(~predicted & ~positive & valid).sum(0),
    )


def confusion_matrix(
    num_classes: int | None = None,
    *,
    task: Task = "multiclass",
    threshold: float = 0.5,
    top_k: int = 1,
    ignore_index: int | None = None,
    metrics: Sequence[str] = ("precision", "recall", "f1"),
    average: Average = "macro",
    beta: float = 1.0,
) -> Metric:
    """Precision, recall, F1 and F-beta from per-class confusion counts (d9d's ``ConfusionMatrixMetric``).

    ``update(state, preds, target)`` by ``task``:

    * ``"multiclass"``: ``preds`` are scores (N, ..., C), classes last, or predicted labels shaped
      like ``target``; ``target`` holds class indices (N, ...). The ``top_k`` highest scores are the
      predictions (ties go to the smaller index, as in ``argmax``): a sample adds a tp to its target
      class if the target is among them, else an fn, and an fp to every other predicted class.
    * ``"binary"``: ``preds`` are probabilities (or 0/1 labels), ``target`` is 0/1, same shape;
      ``preds > threshold`` predicts positive. One class: the positive one.
    * ``"multilabel"``: ``preds`` and ``target`` are (N, ..., C); each entry is a binary decision.

    Targets equal to ``ignore_index`` are not counted (multilabel: per entry). ``compute`` returns
    ``{name: score for name in metrics}``, each averaged by ``average`` (see :func:`fbeta_score`;
    ``"fbeta"`` uses ``beta``). Every score is 0 where its denominator is 0. For other views of the
    same counts call :func:`precision_score` and friends on the state, or replace ``compute``.

    Args:
        num_classes: C; required for multiclass and multilabel, ``None`` (or 1) for binary.
        task: ``"multiclass"``, ``"binary"`` or ``"multilabel"``.
        threshold: the probability above which a binary or multilabel prediction is positive.
        top_k: how many classes a multiclass sample predicts.
        ignore_index: a target value to skip, or ``None``.
        metrics: the names (from ``SCORES``) that ``compute`` reports.
        average: ``"micro"``, ``"macro"``, ``"weighted"`` or ``"none"`` (per-class (C,) vectors).
        beta: β of ``"fbeta"``.

    Returns:
        A :class:`Metric` over a :class:`ConfusionMatrixState` of (C,) int64 counts.

    Raises:
        ValueError: for an unknown task, average or score name, a missing ``num_classes``, a
            ``top_k`` outside [1, C] or not multiclass; from ``update``, for mismatched shapes.

    >>> m = confusion_matrix(3, average="none", metrics=("recall",))
    >>> logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    >>> m.compute(m.update(m.init(), logits, torch.tensor([0, 1, 2])))
    {'recall': tensor([1., 1., 0.])}
    """
    num_classes = _check_config(num_classes, task, top_k, metrics, average, beta)
    metrics = tuple(metrics)

    def init(device: torch.device | str | None = None) -> ConfusionMatrixState:
        zeros = torch.zeros(num_classes, dtype=torch.int64, device=device)
        return ConfusionMatrixState(tp=zeros, fp=zeros.clone(), fn=zeros.clone(), tn=zeros.clone())

    def valid_of(target: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(target, dtype=torch.bool) if ignore_index is None else target != ignore_index

    def update_multiclass(preds: torch.Tensor, target: torch.Tensor) -> ConfusionMatrixState:
        if preds.is_floating_point():
            check_logits_and_target("confusion_matrix.update", preds, target)
            if preds.shape[-1] != num_classes:
                raise ValueError(
                    f"confusion_matrix.update: preds have {preds.shape[-1]} classes in their last dimension, the "
                    f"metric counts num_classes={num_classes}; pass scores (..., {num_classes})"
                )
            scores = preds.reshape(-1, num_classes)  # (N, C)
            if top_k == 1:
                predicted = scores.argmax(-1, keepdim=True)  # (N, 1)
            else:
                # A stable descending sort orders ties by class index, like argmax (topk does not promise to).
                predicted = scores.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]  # (N, k)
        else:
            if tuple(preds.shape) != tuple(target.shape) or top_k != 1:
                raise ValueError(
                    f"confusion_matrix.update: integer preds are labels and must match target's shape "
                    f"{tuple(target.shape)} with top_k=1, got shape {tuple(preds.shape)} and top_k={top_k}; "
                    f"pass float scores (..., {num_classes}) instead"
                )
            predicted = preds.reshape(-1, 1).to(torch.int64)
        target = target.reshape(-1)
        valid = valid_of(target)
        safe_target = torch.where(valid, target, 0).to(torch.int64)
        # Skipped samples add weight 0, but their indices must still be in range (labels may hold ignore_index).
        predicted = torch.where(valid.unsqueeze(-1), predicted, 0)
        hit = (predicted == safe_target.unsqueeze(-1)).any(-1)
        return _counts_from_labels(num_classes, safe_target, predicted, hit, valid)

    def update_binary(preds: torch.Tensor, target: torch.Tensor) -> ConfusionMatrixState:
        if tuple(preds.shape) != tuple(target.shape):
            raise ValueError(
                f"confusion_matrix.update: task={task!r} needs preds and target of one shape, got "
                f"{tuple(preds.shape)} and {tuple(target.shape)}"
            )
        if task == "multilabel" and (preds.ndim < 1 or preds.shape[-1] != num_classes):
            raise ValueError(
                f"confusion_matrix.update: multilabel preds must be (..., {num_classes}), got {tuple(preds.shape)}; "
                f"put the labels in the last dimension"
            )
        width = num_classes if task == "multilabel" else 1
        predicted = preds > threshold if preds.is_floating_point() else preds != 0
        return _counts_from_masks(
            predicted.reshape(-1, width), (target != 0).reshape(-1, width), valid_of(target).reshape(-1, width)
        )

    def update(state: ConfusionMatrixState, preds: torch.Tensor, target: torch.Tensor) -> ConfusionMatrixState:
        if not isinstance(preds, torch.Tensor) or not isinstance(target, torch.Tensor):
            raise TypeError(
                f"confusion_matrix.update: preds and target must be tensors, got {type(preds).__name__} and "
                f"{type(target).__name__}"
            )
        batch = update_multiclass(preds, target) if task == "multiclass" else update_binary(preds, target)
        return add_states(state, batch)

    def compute(state: ConfusionMatrixState) -> dict[str, torch.Tensor]:
        scores = {
            "precision": lambda: precision_score(state, average),
            "recall": lambda: recall_score(state, average),
            "f1": lambda: f1_score(state, average),
            "fbeta": lambda: fbeta_score(state, beta, average),
        }
        return {name: scores[name]() for name in metrics}

    return Metric(init=init, update=update, compute=compute, merge=add_states)
