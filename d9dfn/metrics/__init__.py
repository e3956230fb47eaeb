"""Pure metric states: ``init / update / compute / merge`` made by factories, and ``reduce`` across ranks.

>>> import torch
>>> from d9dfn import metrics
>>> m = metrics.compose({"loss": metrics.weighted_mean(), "acc": metrics.accuracy(top_k=1)})
>>> state = m.init()
>>> state = m.update(state, {"loss": (torch.tensor(2.0), torch.tensor(4.0))})
>>> m.compute(state)["loss"]
tensor(2.)
"""

from d9dfn.metrics._accuracy import AccuracyState, accuracy
from d9dfn.metrics._aggregate import MeanState, SumState, WeightedMeanState, mean, sum_metric, weighted_mean
from d9dfn.metrics._auroc import BinaryAUROCState, auroc_from_histograms, binary_auroc, multiclass_auroc
from d9dfn.metrics._base import (
    Metric,
    MetricComputeFn,
    MetricInitFn,
    MetricMergeFn,
    MetricUpdateFn,
    safe_divide,
)
from d9dfn.metrics._compose import compose
from d9dfn.metrics._confusion import (
    ConfusionMatrixState,
    confusion_matrix,
    f1_score,
    fbeta_score,
    precision_score,
    recall_score,
)
from d9dfn.metrics._distributed import reduce

__all__ = [
    "AccuracyState",
    "BinaryAUROCState",
    "ConfusionMatrixState",
    "MeanState",
    "Metric",
    "MetricComputeFn",
    "MetricInitFn",
    "MetricMergeFn",
    "MetricUpdateFn",
    "SumState",
    "WeightedMeanState",
    "accuracy",
    "auroc_from_histograms",
    "binary_auroc",
    "compose",
    "confusion_matrix",
    "f1_score",
    "fbeta_score",
    "mean",
    "multiclass_auroc",
    "precision_score",
    "recall_score",
    "reduce",
    "safe_divide",
    "sum_metric",
    "weighted_mean",
]
