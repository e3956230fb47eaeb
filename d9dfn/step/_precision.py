"""The precision policy: which dtype parameters are kept in, computed in, and reduced in.

Anchors: FSDP2's ``MixedPrecisionPolicy`` (``param_dtype`` there is this ``compute_dtype``) and JAX's jmp
(``param_dtype`` / ``compute_dtype`` / ``output_dtype``). In a d9dfn step:

- parameters (and the optimizer's state) stay in ``param_dtype``: float32 master weights by default;
- inside the compiled step each floating parameter, and each floating input tensor, is cast to
  ``compute_dtype`` right before the model runs; the cast is part of the graph, so its backward hands the
  gradients back in ``param_dtype`` (float32 gradients into a float32 optimizer, no autocast);
- the loss, ``Σw`` and the norms are float32 whatever the policy (``make_train_step`` computes them so);
- gradients cross the data-parallel group in ``reduce_dtype`` (``None``: their own dtype) and come back in
  ``param_dtype``.

>>> policy = Precision.bf16_mixed()
>>> policy.compute_dtype, policy.param_dtype
(torch.bfloat16, torch.float32)
>>> cast = policy.cast_params({"w": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)})
>>> cast["w"].dtype, cast["ids"].dtype
(torch.bfloat16, torch.int64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import torch

from d9dfn._pytree import tree_map

__all__ = ["DTYPES", "Precision", "cast_params", "cast_params_tree"]

DTYPES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes a policy takes, by name (configs name them). float16 needs loss scaling, which d9dfn lacks."""

_T = TypeVar("_T")


def _check_dtype(field: str, dtype: torch.dtype | None, optional: bool = False) -> None:
    if dtype is None and optional:
        return
    if dtype not in DTYPES.values():
        raise ValueError(
            f"Precision: {field}={dtype}; choose one of {', '.join(str(d) for d in DTYPES.values())} "
            "(float16 would need loss scaling)"
        )


@dataclasses.dataclass(frozen=True)
class Precision:
    """A precision policy for ``make_train_step`` / ``make_eval_step`` / ``make_inference_step``.

    Attributes:
        param_dtype: the dtype of the parameters in the train state (the master weights) and of their
            gradients; the step checks the state's floating params have it.
        compute_dtype: the dtype the model runs in: floating params and inputs are cast to it in the step.
        reduce_dtype: the dtype gradients are reduced in across data-parallel ranks; ``None``: their own.

    Raises:
        ValueError: a dtype other than float32 or bfloat16.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)
        _check_dtype("compute_dtype", self.compute_dtype)
        _check_dtype("reduce_dtype", self.reduce_dtype, optional=True)

    @classmethod
    def fp32(cls) -> Precision:
        """Everything in float32 (the default: the step casts nothing)."""
        return cls()

    @classmethod
    def bf16_mixed(cls) -> Precision:
        """float32 master weights, gradients, optimizer and reductions; the model computes in bfloat16."""
        return cls(compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    @classmethod
    def bf16_pure(cls) -> Precision:
        """bfloat16 params and compute, gradients reduced in float32; pair it with ``optim.stochastic_adamw``
        (stochastic rounding keeps small updates that round-to-nearest would drop)."""
        return cls(param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    @property
    def casts(self) -> bool:
        """Whether the model's params and inputs are cast (``compute_dtype`` differs from ``param_dtype``)."""
        return self.compute_dtype != self.param_dtype

    def cast_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Floating ``params`` in ``compute_dtype``; other tensors as they are."""
        return {name: self._to_compute(p) for name, p in params.items()}

    def cast_inputs(self, tree: _T) -> _T:
        """Every floating tensor of ``tree`` in ``compute_dtype`` (token ids, masks and keys stay as they are)."""
        return cast(_T, tree_map(lambda x: self._to_compute(x) if isinstance(x, torch.Tensor) else x, tree))

    def _to_compute(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != self.compute_dtype:
            return tensor.to(self.compute_dtype)
        return tensor

    def check_params(self, owner: str, params: Mapping[str, Any]) -> None:
        """Raise unless every floating param is in ``param_dtype`` (a static check: dtypes cost no sync)."""
        for name, p in params.items():
            if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dtype != self.param_dtype:
                raise ValueError(
                    f"{owner}: params[{name!r}] is {p.dtype} but precision.param_dtype is {self.param_dtype}; cast "
                    f"the model's parameters first (d9dfn.cast_params(model, {self.param_dtype})) or set "
                    f"param_dtype={p.dtype}"
                )

    def reduce(self, grads: dict[str, Any]) -> dict[str, Any]:
        """Gradients in ``reduce_dtype`` for the data-parallel reduction (unchanged when ``None``)."""
        if self.reduce_dtype is None:
            return grads
        return {n: g.to(self.reduce_dtype) if g.is_floating_point() else g for n, g in grads.items()}

    def unreduce(self, grads: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
        """Reduced gradients back in their params' dtypes."""
        if self.reduce_dtype is None:
            return grads
        return {n: g.to(params[n].dtype) if g.is_floating_point() else g for n, g in grads.items()}


@torch.no_grad()
def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``model``'s floating parameters (not its buffers) to ``dtype`` in place; returns ``model``.

    For ``Precision(param_dtype=torch.bfloat16)`` (pure bf16 training): call it before ``init_train_state``.
    """
    _check_dtype("dtype", dtype)
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def cast_params_tree(params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``params`` with every floating tensor in ``dtype`` (a new dict; the tensors are not touched)."""
    _check_dtype("dtype", dtype)
    return {n: p.to(dtype) if p.is_floating_point() and p.dtype != dtype else p for n, p in params.items()}
