"""Plumbing shared by the optimizer transforms: leaves, learning rates, checks and bias corrections.

Every transform flattens its trees once with d9dfn's conventions, works on lists of tensors (so that
eager code can use ``torch._foreach_*`` and inductor can fuse them), and rebuilds the tree at the end.
Checks here look only at structure, shapes and dtypes, which are static under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, cast

import optree
import torch

from d9dfn._pytree import format_path, tree_flatten, tree_leaves, tree_structure
from d9dfn._types import OptState, Params, PathPredicate, PyTree, Schedule

LearningRate: TypeAlias = float | Schedule
"""A constant learning rate, or a schedule evaluated at the transform's step count."""

TensorList: TypeAlias = list[torch.Tensor] | tuple[torch.Tensor, ...]
"""Leaves as the transforms hold them: ``torch._foreach_*`` take either and return tuples."""


def path_name(path: Sequence[Any]) -> str:
    """The name a predicate sees for a leaf: its keys joined with dots, as module names are.

    For d9dfn's flat params (``{"layers.0.weight": ...}``) this is the dict key itself.

    >>> path_name(("layers.0.weight",)), path_name(("blocks", 0, "bias"))
    ('layers.0.weight', 'blocks.0.bias')
    """
    return ".".join(str(key) for key in path)


def check_lr(fn: str, lr: Any) -> LearningRate:
    """Validate a learning rate given to a factory: a non-negative finite float, or a schedule."""
    if callable(lr):
        return cast(Schedule, lr)  # any callable is taken as a schedule: a Protocol cannot be checked at runtime
    if isinstance(lr, bool) or not isinstance(lr, int | float):
        raise TypeError(f"{fn}: lr={lr!r} is a {type(lr).__name__}; pass a float or a Schedule (a function of step)")
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"{fn}: lr={lr} must be finite and >= 0; pass a non-negative float or a Schedule")
    return float(lr)


def check_range(fn: str, name: str, value: float, low: float, high: float, *, high_open: bool = False) -> float:
    """Validate a Python hyperparameter against ``[low, high]`` (or ``[low, high)``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{fn}: {name}={value!r} is a {type(value).__name__}; pass a float")
    inside = low <= value < high if high_open else low <= value <= high
    if not (math.isfinite(value) and inside):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{fn}: {name}={value} is outside [{low}, {high}{bracket}; pass a value in that range")
    return float(value)


def lr_at(lr: LearningRate, count: torch.Tensor) -> float | torch.Tensor:
    """The learning rate for the update that ``count`` updates have preceded (a 0-d tensor for schedules).

    Evaluating at the count *before* the update matches ``torch.optim.lr_scheduler``: the first update
    uses ``schedule(0)``.
    """
    if callable(lr):
        return lr(count)
    return lr


def record_lr(lr: float | torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``lr`` as the 0-d float32 tensor a state keeps in its ``lr`` field, on the device of ``count``.

    Every transform that has a learning rate records in its state the rate its last update used (at
    ``init``, the rate the first update will use), so that the step reports the rate, not a recomputation
    of it: optax's ``inject_hyperparams`` pattern. A tensor, never a Python float: a float would be a
    guard in ``torch.compile``.
    """
    return torch.as_tensor(lr, dtype=torch.float32, device=count.device)


def learning_rate(opt_state: OptState) -> torch.Tensor:
    """The learning rate that the last update used, read from an optimizer state (a 0-d float32 tensor).

    Looks through chained (tuple) and masked states for the first state, in tree order, that records one
    in a field named ``lr`` (every d9dfn optimizer's state does; a custom transform's state can too). Before
    any update it is the rate the first update will use. Pure: no host sync, safe inside a compiled step.

    Args:
        opt_state: a transform's state, e.g. ``train_state.opt_state``.

    Returns:
        The recorded rate, or NaN (on the state's device) when no transform in the state records one.

    >>> import torch
    >>> from d9dfn import optim, schedules
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(schedules.warmup_cosine(0.1, 10, 100)))
    >>> params = {"w": torch.zeros(2)}
    >>> _, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    >>> _, state = opt.update({"w": torch.ones(2)}, state, params)
    >>> optim.learning_rate(state), optim.learning_rate(optim.clip_by_global_norm(1.0).init(params))
    (tensor(0.0100), tensor(nan))
    """
    found = _find_lr(opt_state)
    if found is not None:
        return found
    device = next((leaf.device for leaf in tree_leaves(opt_state) if isinstance(leaf, torch.Tensor)), None)
    return torch.full((), float("nan"), dtype=torch.float32, device=device)


def _find_lr(node: Any) -> torch.Tensor | None:
    fields = getattr(node, "_fields", None)  # a NamedTuple state (AdamWState, MaskedState, ...)
    if isinstance(node, tuple) and fields is not None:
        lr = getattr(node, "lr", None) if "lr" in fields else None
        if isinstance(lr, torch.Tensor):
            return lr
        children: Any = tuple(node)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):  # a pytree_dataclass state
        lr = getattr(node, "lr", None)
        if isinstance(lr, torch.Tensor):
            return lr
        children = [getattr(node, f.name) for f in dataclasses.fields(node)]
    elif isinstance(node, tuple | list):  # chain's tuple of states
        children = node
    elif isinstance(node, dict):
        children = node.values()
    else:
        return None
    return next((lr for lr in map(_find_lr, children) if lr is not None), None)


def bias_correction(beta: float, t: torch.Tensor) -> float | torch.Tensor:
    """``1 - beta**t`` for a float ``t`` tensor, accurate in float32 (``-expm1(t·log beta)``).

    The direct form loses five digits in float32 at small ``t`` (``1 - 0.999`` cancels).
    """
    if beta == 0.0:
        return 1.0
    return -torch.expm1(t * math.log(beta))


def new_count(leaves: Sequence[Any]) -> torch.Tensor:
    """A 0-d ``int64`` step counter on the device of the first tensor leaf (CPU for an empty tree)."""
    device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    return torch.zeros((), dtype=torch.int64, device=device)


class FlatDict:
    """The structure of a dict whose values are all leaves (tensors, or ``None``): d9dfn's params, gradients and
    moments. It stands in for optree's treespec of such a dict (:func:`same_structure` compares the two): flattening
    one is taking the dict's values, which ``torch.compile`` traces in a few lines, where optree's flatten runs
    dynamo's Python version of it, leaf by leaf (most of the lines a second start traces in the per-block optimizer
    tail: ``docs/design/step.md``, "What the compiled tail keeps out of its trace").

    >>> import torch
    >>> leaves, structure = flatten_tensors("doc", "params", {"w": torch.ones(1), "b": torch.zeros(1)})
    >>> structure, structure.paths(), structure.unflatten(leaves)["b"]
    (FlatDict(keys=('w', 'b')), [('w',), ('b',)], tensor([0.]))
    """

    def __init__(self, keys: tuple[Any, ...]) -> None:
        self.keys = keys

    def unflatten(self, leaves: Iterable[Any]) -> dict[Any, Any]:
        return dict(zip(self.keys, leaves, strict=True))

    def paths(self) -> list[tuple[Any, ...]]:
        return [(key,) for key in self.keys]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatDict) and self.keys == other.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return f"FlatDict(keys={self.keys!r})"


Structure: TypeAlias = optree.PyTreeSpec | FlatDict
"""A tree's structure as the transforms keep it: optree's treespec, or a :class:`FlatDict` for a flat dict."""


def flatten_leaves(tree: PyTree) -> tuple[list[Any], Structure]:
    """``tree``'s leaves and structure with d9dfn's conventions (``None`` is a leaf); a dict whose values are all
    tensors or ``None`` as a :class:`FlatDict`."""
    if type(tree) is dict and all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in tree.values()):
        return list(tree.values()), FlatDict(tuple(tree))
    return tree_flatten(tree)


def same_structure(a: Structure, b: Structure) -> bool:
    """Whether two structures are the same tree's (a :class:`FlatDict` and optree's treespec of the same dict are)."""
    if isinstance(a, FlatDict) is isinstance(b, FlatDict):
        return a == b
    return _treespec(a) == _treespec(b)


def _treespec(structure: Structure) -> optree.PyTreeSpec:
    return tree_structure(dict.fromkeys(structure.keys)) if isinstance(structure, FlatDict) else structure


def flatten_tensors(fn: str, what: str, tree: PyTree) -> tuple[list[torch.Tensor], Structure]:
    """The leaves of ``tree``, which must all be tensors, and its structure."""
    leaves, structure = flatten_leaves(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{fn}: {what}{format_path(structure.paths()[i])} is a {type(leaf).__name__}, not a tensor; "
                f"pass a tree whose leaves are all tensors (drop frozen params before the optimizer)"
            )
    return leaves, structure


def unflatten(spec: Structure, leaves: Iterable[torch.Tensor]) -> Params:
    """The tree of ``spec`` (from :func:`flatten_tensors` of params, grads or moments) rebuilt from ``leaves``.

    Typed as the :data:`~d9dfn.Params` the transforms are declared over: optree types ``unflatten`` as its own
    ``PyTree[Tensor]``, which is not a ``dict``. The structure is ``spec``'s, whatever it is.
    """
    return cast(Params, spec.unflatten(leaves))


def flatten_like(
    fn: str, what: str, tree: PyTree, spec: Structure, reference: Sequence[torch.Tensor], reference_name: str
) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked to have ``spec``'s structure and ``reference``'s shapes."""
    leaves, tree_spec = flatten_tensors(fn, what, tree)
    if not same_structure(tree_spec, spec):
        raise ValueError(
            f"{fn}: {what} does not match the structure of {reference_name}: {_structure_diff(tree_spec, spec)}; "
            f"pass {what} with exactly the keys of the params that init was given"
        )
    for i, (leaf, ref) in enumerate(zip(leaves, reference, strict=True)):
        if leaf.shape != ref.shape:
            path = format_path(spec.paths()[i])
            raise ValueError(
                f"{fn}: {what}{path} has shape {tuple(leaf.shape)} but {reference_name}"
                f"{path} has shape {tuple(ref.shape)}; pass {what} shaped like the params given to init"
            )
    return leaves


def _structure_diff(got: Structure, expected: Structure) -> str:
    got_paths = [format_path(p) for p in got.paths()]
    expected_paths = [format_path(p) for p in expected.paths()]
    missing = [p for p in expected_paths if p not in set(got_paths)]
    extra = [p for p in got_paths if p not in set(expected_paths)]
    if not missing and not extra:
        return f"same leaves in a different container or order ({got} vs {expected})"
    parts = []
    if missing:
        parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if extra:
        parts.append(f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return "; ".join(parts)


def select_flags(
    fn: str, predicate: PathPredicate | None, paths: Sequence[Sequence[Any]], leaves: Sequence[torch.Tensor]
) -> list[bool]:
    """Evaluate ``predicate(name, leaf)`` per leaf; it must return a Python bool (decided from names, shapes, dtypes).

    ``None`` selects every leaf.
    """
    if predicate is None:
        return [True] * len(leaves)
    flags = []
    for path, leaf in zip(paths, leaves, strict=True):
        flag = predicate(path_name(path), leaf)
        if not isinstance(flag, bool):
            raise TypeError(
                f"{fn}: the predicate returned a {type(flag).__name__} for {format_path(path)}; it must return a "
                f"Python bool decided from the name, shape and dtype (tensor values would need a host sync)"
            )
        flags.append(flag)
    return flags


def with_dtypes(tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` cast to the dtypes of ``like`` where they differ (mixed-precision grads)."""
    return [t if t.dtype == ref.dtype else t.to(ref.dtype) for t, ref in zip(tensors, like, strict=True)]
