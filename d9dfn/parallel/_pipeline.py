"""The pipeline-parallel reductions in the step's tail: global quantities made global over the ``pp`` group.

On a pipeline rank the tail sees only its own stages' gradients and, unless it holds the last stage, no loss at
all. Three things must nevertheless be the same on every rank, so that every rank takes the same update:

* ``Σwᵢℓᵢ`` and ``Σwᵢ``: summed over ``pp`` after the data-parallel reduction, with zeros from the ranks
  without the last stage, so every rank scales by the same ``1/Σw`` and reports the same loss (``x + 0`` is
  exact, so the last stage's sums arrive bitwise);
* the gradient norm that clipping uses: over **all** stages, not this rank's (torchtitan#596). Each rank
  writes its params' per-leaf norms into a vector indexed by the whole model's param order (zeros
  elsewhere), the vector is summed over ``pp`` (again exact) and its norm taken: the same vector, hence the
  same bits, as ``optim.global_norm`` over the whole model in one process;
* the non-finite flag, which then follows: the loss and the norm it is computed from are global.

Traceable like the data-parallel reduction (functional all-reduce; ``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from d9dfn._types import Grads
from d9dfn.parallel._grads import leaf_norms
from d9dfn.parallel._reduce import all_reduce_sum, group_name

__all__ = ["PipelineReduction", "pipeline_reduction"]


class PipelineReduction(NamedTuple):
    """The step tail's ``pp`` hooks (``make_train_step`` builds one for a ``d9dfn.pipeline.PipelineRank``).

    Attributes:
        sums: ``(Σwℓ, Σw) -> (Σwℓ, Σw)`` summed over ``pp`` (after the data-parallel reduction); given a third
            argument, a state update's statistics (``{name: tensor}``), those too, in the same collective:
            ``(Σwℓ, Σw, stats)``.
        global_norm: the L2 norm of every stage's (already reduced, ``1/Σw``-scaled) gradients.
        total_norm: the same from this rank's per-leaf norms (``d9dfn.parallel.leaf_norms``).
    """

    sums: Callable[..., tuple[Any, ...]]
    global_norm: Callable[[Grads], torch.Tensor]
    total_norm: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def _norm_vector(norms: Mapping[str, torch.Tensor], index: Mapping[str, int], size: int) -> torch.Tensor:
    """``(size,)`` float32: each leaf norm at its param's position in the whole model, zeros elsewhere."""
    unknown = [name for name in norms if name not in index]
    if unknown:
        raise ValueError(
            f"pipeline_reduction: gradient {unknown[0]!r} is not a param of any stage; build the stages from the "
            "model whose params the train state holds"
        )
    device = next(iter(norms.values())).device if norms else torch.device("cpu")
    vector = torch.zeros(size, dtype=torch.float32, device=device)
    if norms:
        positions = torch.tensor([index[name] for name in norms], device=device)
        vector = vector.index_put((positions,), torch.stack(list(norms.values())))
    return vector


def pipeline_reduction(group: Any, param_names: Sequence[str]) -> PipelineReduction:
    """The tail's ``pp`` reductions over ``group`` (the pipeline group of this rank).

    Args:
        group: the ``pp`` process group (``d9dfn.parallel.pipeline_group(mesh)``), a 1-D mesh or a group name.
        param_names: the whole model's trainable param names in the model's order (every stage's, every rank
            passes the same). The norm is bitwise the one-process ``optim.global_norm`` when this is the order
            of the one-process ``train_state.params``; any fixed order gives the same value up to rounding.

    Returns:
        A :class:`PipelineReduction`.

    Raises:
        TypeError, ValueError: as :func:`~d9dfn.parallel.group_name`; a repeated name.
    """
    name = group_name(group, "pipeline_reduction")
    index = {param: position for position, param in enumerate(param_names)}
    if len(index) != len(param_names):
        twice = next(p for p in param_names if list(param_names).count(p) > 1)
        raise ValueError(f"pipeline_reduction: param {twice!r} is named twice; pass each param name once")

    def sums(loss_sum: torch.Tensor, weight_sum: torch.Tensor, *stats: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
        reduced: tuple[Any, ...] = all_reduce_sum((loss_sum, weight_sum, *(dict(s) for s in stats)), name)
        return reduced

    def total_norm(norms: Mapping[str, torch.Tensor]) -> torch.Tensor:
        vector: torch.Tensor = all_reduce_sum(_norm_vector(norms, index, len(index)), name)
        norm: torch.Tensor = torch.linalg.vector_norm(vector)
        return norm

    def global_norm(grads: Grads) -> torch.Tensor:
        return total_norm(leaf_norms(grads))

    return PipelineReduction(sums, global_norm, total_norm)
