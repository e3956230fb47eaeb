"""Binary AUROC from two fixed-size score histograms (positives and negatives)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from d9dfn.metrics._base import Metric, add_states, safe_divide

__all__ = ["BinaryAUROCState", "auroc_from_histograms", "binary_auroc", "multiclass_auroc"]


class BinaryAUROCState(NamedTuple):
    """How many negatives and positives fell into each of the ``num_bins`` equal score bins of [0, 1]."""

    negatives: torch.Tensor  # (num_bins,) int64
    positives: torch.Tensor  # (num_bins,) int64


def auroc_from_histograms(negatives: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """The area under the ROC curve of binned scores: P(pos > neg) + ½·P(pos and neg share a bin).

    This is the Mann-Whitney statistic with every score replaced by its bin, so pairs in the same bin
    count as ties. It differs from the exact AUROC of the raw scores by at most
    ``½ · Σ_b positives[b]·negatives[b] / (P·N)``: only the order inside a bin is lost. 0 if there are
    no positives or no negatives.

    >>> auroc_from_histograms(torch.tensor([2, 1, 0]), torch.tensor([0, 1, 2]))
    tensor(0.9444)
    """
    # Float64 products: P·N reaches 1e18 long before int64 counts overflow, and float32 would lose digits.
    negatives = negatives.to(torch.float64)
    positives = positives.to(torch.float64)
    negatives_below = negatives.cumsum(0) - negatives  # negatives in strictly lower bins
    pairs_ordered = (positives * (negatives_below + 0.5 * negatives)).sum()
    return safe_divide(pairs_ordered, positives.sum() * negatives.sum()).to(torch.float32)


def binary_auroc(num_bins: int = 10000, ignore_index: int | None = None) -> Metric:
    """The area under the ROC curve, approximated with score histograms (d9d's ``BinaryAUROCMetric``).

    ``update(state, preds, target)``: ``preds`` are probabilities in [0, 1] (apply ``sigmoid`` to
    logits first; values outside are clamped into the end bins, NaN scores are skipped), ``target``
    has the same shape, nonzero (or ``True``) for positives and 0 for negatives; targets equal to
    ``ignore_index`` are skipped. The state is two (num_bins,) int64 histograms, so memory and merge
    cost do not grow with the data. The approximation error is bounded by the share of
    (positive, negative) pairs that fall into one bin (:func:`auroc_from_histograms`); for scores
    spread over [0, 1] it is about ``1 / num_bins``. Scores are binned in float32, or in float64 when they are
    float64 (no cast that could move a score across a bin edge); bf16/fp16 scores are widened to float32.

    Args:
        num_bins: the number of equal-width bins of [0, 1].
        ignore_index: a target value to skip, or ``None``.

    Returns:
        A :class:`Metric` over a :class:`BinaryAUROCState`; ``compute`` gives a 0-d float32 tensor.

    Raises:
        ValueError: if ``num_bins < 1``; from ``update``, if ``preds`` and ``target`` differ in shape.

    >>> m = binary_auroc(num_bins=100)
    >>> state = m.update(m.init(), torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    >>> m.compute(state)
    tensor(0.7500)
    """
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"binary_auroc: num_bins must be an int >= 1, got {num_bins!r}; the default is 10000")

    def init(device: torch.device | str | None = None) -> BinaryAUROCState:
        zeros = torch.zeros(num_bins, dtype=torch.int64, device=device)
        return BinaryAUROCState(negatives=zeros, positives=zeros.clone())

    def update(state: BinaryAUROCState, preds: torch.Tensor, target: torch.Tensor) -> BinaryAUROCState:
        if not isinstance(preds, torch.Tensor) or not preds.is_floating_point():
            raise ValueError(
                f"binary_auroc.update: preds must be a floating tensor of probabilities, got "
                f"{getattr(preds, 'dtype', type(preds).__name__)}; pass torch.sigmoid(logits)"
            )
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(preds.shape):
            raise ValueError(
                f"binary_auroc.update: target of shape {tuple(getattr(target, 'shape', ()))} does not match preds of "
                f"shape {tuple(preds.shape)}; pass one 0/1 target per score"
            )
        # Binned in float32, or in float64 when given it: a float64 score just under a bin edge stays in its bin
        # (a cast to float32 could round it over the edge).
        preds = preds.reshape(-1).to(torch.promote_types(preds.dtype, torch.float32))
        target = target.reshape(-1)
        valid = ~preds.isnan()
        if ignore_index is not None:
            valid = valid & (target != ignore_index)
        # Bin b holds scores in [b/num_bins, (b+1)/num_bins); a score of exactly 1 joins the last bin.
        bins = (preds.clamp(0.0, 1.0) * num_bins).to(torch.int64).clamp(max=num_bins - 1)
        bins = torch.where(valid, bins, 0)  # NaN casts to an arbitrary integer; its weight below is 0 anyway
        positive = target != 0
        return BinaryAUROCState(
            negatives=state.negatives.index_add(0, bins, (valid & ~positive).to(torch.int64)),
            positives=state.positives.index_add(0, bins, (valid & positive).to(torch.int64)),
        )

    def compute(state: BinaryAUROCState) -> torch.Tensor:
        return auroc_from_histograms(state.negatives, state.positives)

    return Metric(init=init, update=update, compute=compute, merge=add_states)


def multiclass_auroc(num_classes: int, num_bins: int = 10000, ignore_index: int | None = None) -> Metric:
    """The macro mean of one-vs-rest AUROCs: for each class, :func:`binary_auroc` of its probability with that class
    as the positive one, averaged over the classes (d9d's multiclass AUROC, binned the same way).

    ``update(state, probs, target)``: ``probs`` (N, C) class probabilities (``softmax`` of the logits), ``target``
    (N,) class indices; targets equal to ``ignore_index`` are skipped. The state is a :class:`BinaryAUROCState` of
    (C, num_bins) histograms. A class with no positive or no negative counts as 0, as in :func:`binary_auroc`.

    Raises:
        ValueError: ``num_classes < 2`` or ``num_bins < 1``; from ``update``, ``probs`` not (N, C) or ``target`` not
            (N,).

    >>> m = multiclass_auroc(3, num_bins=100)
    >>> probs = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])
    >>> m.compute(m.update(m.init(), probs, torch.tensor([0, 1, 2, 2])))
    tensor(1.)
    """
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"multiclass_auroc: num_classes must be an int >= 2, got {num_classes!r}")
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"multiclass_auroc: num_bins must be an int >= 1, got {num_bins!r}; the default is 10000")

    def init(device: torch.device | str | None = None) -> BinaryAUROCState:
        zeros = torch.zeros(num_classes, num_bins, dtype=torch.int64, device=device)
        return BinaryAUROCState(negatives=zeros, positives=zeros.clone())

    def update(state: BinaryAUROCState, probs: torch.Tensor, target: torch.Tensor) -> BinaryAUROCState:
        if not isinstance(probs, torch.Tensor) or probs.ndim != 2 or probs.shape[1] != num_classes:
            raise ValueError(
                f"multiclass_auroc.update: probs must be (N, {num_classes}) class probabilities, got shape "
                f"{tuple(getattr(probs, 'shape', ()))}; pass torch.softmax(logits, -1)"
            )
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != (probs.shape[0],):
            raise ValueError(
                f"multiclass_auroc.update: target of shape {tuple(getattr(target, 'shape', ()))} does not match probs "
                f"of shape {tuple(probs.shape)}; pass one class index per row"
            )
        probs = probs.to(torch.promote_types(probs.dtype, torch.float32))
        valid = ~probs.isnan()  # (N, C)
        if ignore_index is not None:
            valid = valid & (target != ignore_index).unsqueeze(-1)
        bins = (probs.clamp(0.0, 1.0) * num_bins).to(torch.int64).clamp(max=num_bins - 1)
        bins = torch.where(valid, bins, 0)
        classes = torch.arange(num_classes, device=probs.device)
        flat = (classes * num_bins + bins).reshape(-1)  # (N·C,) index into the flattened (C, num_bins) histograms
        positive = target.unsqueeze(-1) == classes  # (N, C): one-vs-rest
        negatives = state.negatives.reshape(-1).index_add(0, flat, (valid & ~positive).reshape(-1).to(torch.int64))
        positives = state.positives.reshape(-1).index_add(0, flat, (valid & positive).reshape(-1).to(torch.int64))
        return BinaryAUROCState(negatives.reshape(num_classes, num_bins), positives.reshape(num_classes, num_bins))

    def compute(state: BinaryAUROCState) -> torch.Tensor:
        per_class = [auroc_from_histograms(state.negatives[c], state.positives[c]) for c in range(num_classes)]
        return torch.stack(per_class).mean()

    return Metric(init=init, update=update, compute=compute, merge=add_states)
