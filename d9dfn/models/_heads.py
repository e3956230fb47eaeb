"""Heads on any decoder family of the catalogue: sequence classification and embedding, over the family's backbone
(its model without the LM head, ``Family.backbone``).

Parameter names are Hugging Face's ``*ForSequenceClassification``'s: the backbone under ``model.`` and the
classifier's ``score.weight`` (``Linear(hidden_size, num_labels, bias=False)``), so a state dict maps to and from
``transformers`` by the family's own tensor-name mapping (``models/_heads_hf.py``). The embedding head's optional
projection is ``projection.weight`` (d9d's ``EmbeddingHead``).

Pooling (:func:`pool`) picks one vector per sequence out of ``(B, T, ...)``:

- ``"last"``: the last non-pad token, as Hugging Face's ``*ForSequenceClassification`` finds it: the rightmost
  position whose id is not ``pad_token_id`` (so right and left padding both work); the last position when
  ``pad_token_id`` is ``None``.
- ``"first"``: the first non-pad token (position 0 when ``pad_token_id`` is ``None``).
- ``"mean"``: the mean over the non-pad tokens (over all when ``pad_token_id`` is ``None``).

The classifier scores every position and then pools the scores, in that order, as ``transformers`` does: for
``last`` and ``first`` the pooled logits are then bit for bit those of Hugging Face's model (``tests/test_heads.py``);
for ``mean``, pooling the scores equals scoring the pooled states (the score has no bias).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from d9dfn.models._family import Family, Plan
from d9dfn.models._layers import Linear

__all__ = [
    "POOLINGS",
    "Pooling",
    "SequenceClassifier",
    "SequenceEmbedder",
    "classifier_plan",
    "embedder_plan",
    "pool",
]

Pooling: TypeAlias = Literal["last", "first", "mean"]
POOLINGS: tuple[Pooling, ...] = ("last", "first", "mean")
"""The poolings :func:`pool` implements."""

_BACKBONE = "model"  # HF's base_model_prefix of *ForSequenceClassification


def pool(
    values: torch.Tensor, input_ids: torch.Tensor, pooling: Pooling, pad_token_id: int | None = None
) -> torch.Tensor:
    """One vector per sequence: ``values`` (B, T, ...) pooled over T as ``pooling`` says, non-pad tokens found in
    ``input_ids`` (B, T) by ``pad_token_id``.

    Args:
        values: (B, T, ...) per-token values (hidden states or scores).
        input_ids: (B, T) the tokens the values belong to.
        pooling: ``"last"`` (Hugging Face's rule: the rightmost non-pad token), ``"first"`` (the leftmost non-pad
            token) or ``"mean"`` (over the non-pad tokens; a row of pads only gives zeros).
        pad_token_id: the pad id; ``None``: no token is padding.

    Returns:
        (B, ...).

    Raises:
        ValueError: an unknown pooling, or ``values`` and ``input_ids`` of other leading shapes.

    >>> ids = torch.tensor([[5, 6, 0, 0]])
    >>> values = torch.tensor([[[1.0], [3.0], [9.0], [9.0]]])
    >>> pool(values, ids, "last", 0), pool(values, ids, "first", 0), pool(values, ids, "mean", 0)
    (tensor([[3.]]), tensor([[1.]]), tensor([[2.]]))
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pool: pooling={pooling!r}; choose one of {', '.join(POOLINGS)}")
    if tuple(values.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"pool: values of shape {tuple(values.shape)} do not start with input_ids' shape {tuple(input_ids.shape)}; "
            "pass (batch, seq, ...) values of those tokens"
        )
    batch, seq = input_ids.shape
    rows = torch.arange(batch, device=values.device)
    if pad_token_id is None:
        if pooling == "mean":
            return values.mean(1)
        return values[:, -1] if pooling == "last" else values[:, 0]
    # int32 as transformers computes it: arange * mask, argmax gives the rightmost non-pad position.
    non_pad = (input_ids != pad_token_id).to(values.device, torch.int32)  # (B, T)
    if pooling == "last":
        last = (torch.arange(seq, device=values.device, dtype=torch.int32) * non_pad).argmax(-1)
        return values[rows, last]
    if pooling == "first":
        return values[rows, non_pad.argmax(-1)]  # argmax returns the first maximal index
    mask = non_pad.to(values.dtype).reshape(batch, seq, *([1] * (values.ndim - 2)))  # (B, T, 1...)
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _check_backbone(family: Family[Any], what: str) -> Any:
    if family.backbone is None:
        raise ValueError(
            f"{what}: family {family.name!r} has no backbone (Family.backbone), so no head can sit on it; use a family "
            "whose Family names one (the shared decoder's: qwen3, llama, mistral, qwen2)"
        )
    return family.backbone


class SequenceClassifier(nn.Module):
    """A family's backbone with a classification head: ``input_ids`` (B, T) → ``{"logits": (B, num_labels)}``.

    Hugging Face's ``*ForSequenceClassification``: the backbone's final hidden states (B, T, H), scored at every
    position by ``score`` (``Linear(H, num_labels, bias=False)``), then pooled (:func:`pool`). Names: ``model.…``
    (the backbone's) and ``score.weight``.

    Args:
        family: the decoder family (``d9dfn.models.FAMILIES[name]``), whose ``backbone`` is built.
        config: the family's config (for the shared decoder, a :class:`~d9dfn.models.Qwen3Config`).
        num_labels: the classes.
        pooling: ``"last"`` (Hugging Face's), ``"first"`` or ``"mean"``.
        pad_token_id: the id that marks padding; ``None``: none (``last`` then takes the last position).

    Raises:
        ValueError: ``num_labels < 1``, an unknown pooling, a family without a backbone.

    >>> from d9dfn.models import FAMILIES, Qwen3Config
    >>> torch.manual_seed(0) and None
    >>> model = SequenceClassifier(FAMILIES["qwen3"], Qwen3Config.tiny(), num_labels=3, pad_token_id=0)
    >>> model(torch.tensor([[5, 6, 0], [7, 8, 9]]))["logits"].shape
    torch.Size([2, 3])
    """

    def __init__(
        self,
        family: Family[Any],
        config: Any,
        num_labels: int,
        *,
        pooling: Pooling = "last",
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"SequenceClassifier: num_labels={num_labels!r}; pass the number of classes (>= 1)")
        if pooling not in POOLINGS:
            raise ValueError(f"SequenceClassifier: pooling={pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.config, self.num_labels, self.pooling, self.pad_token_id = config, num_labels, pooling, pad_token_id
        self.model = _check_backbone(family, "SequenceClassifier")(config)
        self.score = Linear(config.hidden_size, num_labels, init_std=config.initializer_range)
        self.score.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re-)initialize the backbone, then the score."""
        self.model.reset_parameters()
        self.score.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        dropout_key: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``input_ids`` (B, T) → ``{"logits": (B, num_labels)}`` in the weights' dtype; ``position_ids`` and
        ``dropout_key`` go to the backbone."""
        hidden = self.model(input_ids, position_ids=position_ids, dropout_key=dropout_key)["hidden_states"]
        scores = self.score(hidden)  # (B, T, H) -> (B, T, C), then pooled: transformers' order, bit for bit
        return {"logits": pool(scores, input_ids, self.pooling, self.pad_token_id)}


class SequenceEmbedder(nn.Module):
    """A family's backbone with an embedding head: ``input_ids`` (B, T) → ``{"embeddings": (B, D)}``.

    The final hidden states pooled (:func:`pool`), projected by ``projection`` (``Linear(H, embedding_dim,
    bias=False)``) when ``embedding_dim`` is given (else ``D = H``), cast to float32 and, with ``normalize``,
    scaled to unit L2 norm (d9d's ``EmbeddingHead``). Names: ``model.…`` and ``projection.weight``.

    Args:
        family: the decoder family, whose ``backbone`` is built.
        config: the family's config.
        embedding_dim: the projection's width; ``None``: no projection.
        normalize: divide each embedding by its L2 norm.
        pooling: ``"last"``, ``"first"`` or ``"mean"``.
        pad_token_id: the id that marks padding; ``None``: none.

    >>> from d9dfn.models import FAMILIES, Qwen3Config
    >>> model = SequenceEmbedder(FAMILIES["qwen3"], Qwen3Config.tiny(), normalize=True, pooling="mean")
    >>> out = model(torch.tensor([[5, 6, 7]]))["embeddings"]
    >>> out.shape, round(float(out.detach().norm()), 4)
    (torch.Size([1, 32]), 1.0)
    """

    def __init__(
        self,
        family: Family[Any],
        config: Any,
        *,
        embedding_dim: int | None = None,
        normalize: bool = False,
        pooling: Pooling = "last",
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        if embedding_dim is not None and (not isinstance(embedding_dim, int) or embedding_dim < 1):
            raise ValueError(f"SequenceEmbedder: embedding_dim={embedding_dim!r}; pass a width >= 1, or None")
        if pooling not in POOLINGS:
            raise ValueError(f"SequenceEmbedder: pooling={pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.config, self.normalize, self.pooling, self.pad_token_id = config, normalize, pooling, pad_token_id
        self.model = _check_backbone(family, "SequenceEmbedder")(config)
        self.projection = (
            None
            if embedding_dim is None
            else Linear(config.hidden_size, embedding_dim, init_std=config.initializer_range)
        )
        if self.projection is not None:
            self.projection.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re-)initialize the backbone, then the projection."""
        self.model.reset_parameters()
        if self.projection is not None:
            self.projection.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        dropout_key: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``input_ids`` (B, T) → ``{"embeddings": (B, D)}`` in float32."""
        hidden = self.model(input_ids, position_ids=position_ids, dropout_key=dropout_key)["hidden_states"]
        pooled = pool(hidden, input_ids, self.pooling, self.pad_token_id)  # (B, T, H) -> (B, H)
        if self.projection is not None:
            pooled = self.projection(pooled)  # (B, H) -> (B, D)
        pooled = pooled.float()
        return {"embeddings": F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled}


def _prefixed(plan: Plan) -> dict[str, tuple[str, ...]]:
    return {f"{_BACKBONE}.{pattern}": dims for pattern, dims in plan.items() if not pattern.startswith("lm_head.")}


def classifier_plan(family: Family[Any]) -> Mapping[str, tuple[str, ...]]:
    """The plan of a :class:`SequenceClassifier` on ``family``: the backbone's patterns under ``model.`` (the LM head's
    left out), and ``score.weight`` as ``("labels", "embed")``.

    >>> from d9dfn.models import FAMILIES
    >>> classifier_plan(FAMILIES["qwen3"])["score.weight"]
    ('labels', 'embed')
    """
    return {**_prefixed(family.plan), "score.weight": ("labels", "embed")}


def embedder_plan(family: Family[Any]) -> Mapping[str, tuple[str, ...]]:
    """The plan of a :class:`SequenceEmbedder` on ``family``: the backbone's, and ``projection.weight`` as
    ``("embedding", "embed")``."""
    return {**_prefixed(family.plan), "projection.weight": ("embedding", "embed")}
