"""The parallel plan: where each param is stored, how the model computes with it, and what its gradient is.

A plan is a value computed once, before the step is built, from plain data: the params' shapes, the mesh's axes with
their roles (:class:`~d9dfn.parallel.MeshAxes`), the params' logical dimensions (a model family's plan:
``d9dfn.models.logical_dims``) and an ordered rules table (logical dimension → roles, first match wins, as MaxText's
and Flax's logical axis rules). For each param it answers the questions the step used to ask of the tensors at its
first call:

* **storage**: its placement on each mesh axis at rest (``R`` replicated, ``S(d)`` split along dim ``d``): what
  ``init_train_state`` distributes, what the optimizer state follows, what a checkpoint holds per rank (the compute
  placement, FSDP-split over the ``data_shard`` ranks along dim 0, or, for the stacked experts that the expert axis
  already splits along dim 0, along their next dim);
* **compute**: its placement as the model computes with it (the rules' answer: data parallelism computes every param
  whole; tensor parallelism would split heads and the MLP);
* **gathered**: whether the step must gather storage into compute (an FSDP all-gather), and whether it can do so per
  block (``Shard(0)`` over exactly one axis: :meth:`ParallelPlan.gathers_per_block`); otherwise the step's head
  gathers it;
* **partial**: the axes over which the gradient w.r.t. the compute param is a partial sum (the axes whose ranks see
  other tokens and compute with the param whole): the tail reduces it to the storage placement from there.

Besides, the plan names the axes over which ``Σw``, the loss sums and metric states are summed (:attr:`~ParallelPlan.
token_axes`), and places the model's buffers (state that is not a parameter: an MoE layer's balancing bias): each is
replicated, a plain tensor equal on every rank, unless a rule splits one of its logical dimensions
(:attr:`~ParallelPlan.buffers`; the step refuses such a split until it has a path for it). Data parallelism —
replicated, sharded, hybrid, with or without a pipeline — is the plan of the empty rules table on a data-parallel
mesh; ``tests/golden/plans/`` holds each model family's plan on a few meshes, so a plan change shows in a diff.

Placements are written as short strings here (``"R"``, ``"S(0)"``), so a plan is hashable and prints as JSON;
:func:`placement` turns one into torch's ``Placement``. Pure: the plan reads no process group; binding it to a
``DeviceMesh`` (:meth:`ParallelPlan.on`) only stores the mesh.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from d9dfn._types import DataParallel
from d9dfn.parallel._axes import MeshAxes, Role
from d9dfn.parallel._placement import PlacementFn

StorageFn = Callable[[str, Any, Any], Sequence[Any] | None]
"""``(name, tensor, mesh) -> placements``, or ``None`` for the plan's default: ``make_plan``'s storage override."""

__all__ = [
    "DATA_PARALLEL_RULES",
    "EXPERT_PARALLEL_RULES",
    "ParallelPlan",
    "ParamLayout",
    "Rules",
    "SEQUENCE_PARALLEL_RULES",
    "TENSOR_PARALLEL_RULES",
    "VOCAB_PARALLEL_RULES",
    "make_plan",
    "placement",
    "placement_text",
    "plan_data_parallel",
    "plan_for",
    "token_group",
]

Rules = tuple[tuple[str, tuple[Role, ...]], ...]
"""``((logical dimension, roles), ...)``: a tensor dimension named by the first rule of its logical dimension whose
roles are all on the mesh (with more than one rank) and not yet used by another of its dimensions is split over those
roles' axes. Order matters: earlier rules win."""

DATA_PARALLEL_RULES: Rules = ()
"""Data parallelism splits no dimension for compute: every param is computed whole (gathered from its ``Shard(0)``
storage over ``data_shard``)."""

EXPERT_PARALLEL_RULES: Rules = (("experts", ("expert",)),)
"""Expert parallelism: a param's ``experts`` dimension (the stacked experts, dim 0 of a family's expert weights) is
split over the expert axis, for compute and storage alike (each rank computes its own experts; tokens travel to them:
``d9dfn.parallel.dispatch_experts``); where ``data_shard`` ranks remain beside the expert axis, the experts are stored
FSDP-split over them too, along their next dim (``S(1)``), and gathered over them to compute, as the dense params are.
Every other param is placed as data parallelism places it; on a mesh without an expert axis these rules are
:data:`DATA_PARALLEL_RULES`."""

TENSOR_PARALLEL_RULES: Rules = (("heads", ("tensor",)), ("kv_heads", ("tensor",)), ("mlp", ("tensor",)))
"""Tensor parallelism (Megatron's split of a decoder block): the attention heads, kv-heads and the MLP width are split
over the tensor axis for compute and storage alike: q/k/v and gate/up by output rows (``S(0)`` of a Linear weight,
column-parallel), o and down by input columns (``S(1)``, row-parallel); every other param is computed whole
(``d9dfn.parallel.enter_tensor_parallel`` says what runs between them). On a mesh without a tensor axis these rules
are :data:`DATA_PARALLEL_RULES`."""

SEQUENCE_PARALLEL_RULES: Rules = (*TENSOR_PARALLEL_RULES, ("sequence", ("tensor",)))
"""Tensor parallelism with sequence parallelism (Korthikanti et al. 2022, §4.2.2): the residual stream between the
blocks' column/row pairs split over the tensor axis along the sequence. No param has a ``sequence`` dimension; the
rule marks the gradients of the params applied to every position there (the blocks' norms, o's bias: a family's
``sums_over``) partial over the tensor axis, and ``d9dfn.parallel.tensor_parallel_of`` reads it to switch the blocks'
all-reduces to an all-gather and a reduce-scatter."""

VOCAB_PARALLEL_RULES: Rules = (("vocab", ("tensor",)),)
"""Vocabulary parallelism, added to :data:`TENSOR_PARALLEL_RULES` (or :data:`SEQUENCE_PARALLEL_RULES`): the
``vocab`` dimension (dim 0 of the embedding and of the LM head, tied or not) split over the tensor axis for compute
and storage (``S(0)``); the embedding sums each rank's rows' part over the group, the head's logits stay split and
the cross-entropy runs on the shards (``d9dfn.parallel.vocab_parallel_nll``). Opt-in, not yet in the tensor rules
(``docs/design/layout.md``)."""

_SHARD = re.compile(r"S\((-?\d+)\)")


def placement(text: str) -> Any:
    """torch's ``Placement`` for a plan's ``"R"`` or ``"S(d)"``.

    >>> placement("S(0)"), placement("R")
    (Shard(dim=0), Replicate())
    """
    from torch.distributed.tensor import Replicate, Shard

    if text == "R":
        return Replicate()
    match = _SHARD.fullmatch(text)
    if match is None:
        raise ValueError(f"placement: {text!r} is not 'R' or 'S(d)'")
    return Shard(int(match.group(1)))


def placement_text(value: Any) -> str:
    """A torch ``Placement`` (``Replicate``, ``Shard``) as the plan writes it.

    Raises:
        ValueError: a ``Partial`` or another placement a param cannot have.
    """
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(value, Replicate):
        return "R"
    if isinstance(value, Shard):
        return f"S({value.dim})"
    raise ValueError(f"placement_text: {value!r}; a param is placed Replicate() or Shard(dim)")


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How one param is laid out and computed (the module docstring says what each answer means).

    Attributes:
        storage: its placement at rest on each mesh axis, ``"R"`` or ``"S(d)"``.
        compute: its placement on each mesh axis as the model computes with it.
        partial: the names of the axes over which its gradient w.r.t. the compute param is a partial sum.
    """

    storage: tuple[str, ...]
    compute: tuple[str, ...]
    partial: tuple[str, ...]

    @property
    def gathered(self) -> bool:
        """Whether the step gathers the stored shards into the compute layout."""
        return self.storage != self.compute

    def split_axes(self, axes: MeshAxes) -> tuple[int, ...]:
        """The axes (indices) the storage really splits the param over: ``S(d)`` on an axis of more than 1 rank."""
        return tuple(i for i, (p, a) in enumerate(zip(self.storage, axes.axes, strict=True)) if p != "R" and a.size > 1)

    def to_json(self) -> dict[str, Any]:
        return {"storage": list(self.storage), "compute": list(self.compute), "partial": list(self.partial)}


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelPlan:
    """Every param's :class:`ParamLayout` on a mesh of :class:`~d9dfn.parallel.MeshAxes`, and the mesh itself once
    bound (:meth:`on`).

    Attributes:
        axes: the mesh's axes and roles (the data-parallel slice of a pipeline rank: the params' mesh).
        params: param name → layout, in the model's order.
        mesh: the ``DeviceMesh`` the params live on (``None`` until :meth:`on`).
        buffers: buffer name → its placement on each mesh axis (``"R"`` everywhere: replicated, a plain tensor equal
            on every rank; the rules may split a buffer with logical dimensions, as they split params for compute).
    """

    axes: MeshAxes
    params: Mapping[str, ParamLayout]
    mesh: Any = None
    buffers: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # A plain dict of its own (dynamo reads it inside the traced tail); the plan is never changed after this.
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "buffers", dict(self.buffers))
        # torch's placements of each gradient, made once here: the traced tail only looks them up.
        partials = {}
        if self.mesh is not None:
            from torch.distributed.tensor import Partial

            for name, layout in self.params.items():
                partials[name] = tuple(
                    Partial() if axis in layout.partial else placement(p)
                    for axis, p in zip(self.axes.names, layout.compute, strict=True)
                )
        object.__setattr__(self, "_partials", partials)

    def on(self, mesh: Any) -> ParallelPlan:
        """This plan bound to ``mesh`` (whose names and sizes must be :attr:`axes`')."""
        found = MeshAxes.of_mesh(mesh)
        if found != self.axes:
            raise ValueError(
                f"ParallelPlan.on: the mesh's axes are {found.names} of sizes {found.sizes}, the plan's "
                f"{self.axes.names} of sizes {self.axes.sizes}; make the plan for this mesh (make_plan(..., axes="
                "MeshAxes.of_mesh(mesh)))"
            )
        return dataclasses.replace(self, mesh=mesh)

    @property
    def distributed(self) -> bool:
        """Whether the params live on a mesh (are ``DTensor`` s), so the step gathers and reduces."""
        return self.mesh is not None

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes over which ``Σw``, the loss sums and metric states are summed (``MeshAxes.token_axes``)."""
        return self.axes.token_axes

    def layout(self, name: str) -> ParamLayout:
        """The layout of param ``name``.

        Raises:
            KeyError: a name the plan does not know, naming the fix.
        """
        try:
            return self.params[name]
        except KeyError:
            raise KeyError(
                f"ParallelPlan: param {name!r} is not in the plan (it has {len(self.params)} params, e.g. "
                f"{next(iter(self.params), None)!r}); make the plan from the model the train state holds"
            ) from None

    def placements(self, name: str, tensor: Any = None, mesh: Any = None) -> tuple[Any, ...]:
        """Param ``name`` 's storage placements as torch's ``Placement`` s: a ``d9dfn.parallel.PlacementFn`` for
        ``init_train_state(placements=plan.placements)`` (``tensor`` and ``mesh`` are not read)."""
        return tuple(placement(p) for p in self.layout(name).storage)

    def gathers_per_block(self, names: Iterable[str]) -> int | None:
        """The one mesh axis (index) over which a block whose params are ``names`` can gather them per block: every
        one of them stored ``S(0)`` on that axis alone and computed whole; ``None`` when they cannot (the head then
        gathers them)."""
        axes = set()
        for name in names:
            layout = self.layout(name)
            split = layout.split_axes(self.axes)
            whole = all(p == "R" for p in layout.compute)
            if len(split) != 1 or layout.storage[split[0]] != "S(0)" or not whole:
                return None
            axes.add(split[0])
        return axes.pop() if len(axes) == 1 else None

    def partial_placements(self, name: str) -> tuple[Any, ...]:
        """The placements of this rank's gradient w.r.t. the compute param: ``Partial`` over :attr:`ParamLayout.
        partial`, its compute placement elsewhere (a plan bound to a mesh)."""
        partials: dict[str, tuple[Any, ...]] = self._partials  # type: ignore[attr-defined]
        if name not in partials:
            self.layout(name)  # the error that names the param
            raise ValueError("ParallelPlan.partial_placements: the plan is not bound to a mesh; bind it with on(mesh)")
        return partials[name]

    def compute_params(self, params: Mapping[str, Any], local: Iterable[str] = ()) -> dict[str, Any]:
        """The params as the model computes with them, plain tensors: each ``DTensor`` in its compute layout (gathered
        from its storage: an all-gather over the axes that split it), this rank's stored shard for the names in
        ``local`` (the step gathers those per block itself); plain tensors as they are. A collective where gathered."""
        from d9dfn.parallel._placement import is_distributed_tensor

        keep = frozenset(local)
        out = {}
        for name, p in params.items():
            if not is_distributed_tensor(p) or name in keep:
                out[name] = p.to_local() if is_distributed_tensor(p) else p
                continue
            layout = self.layout(name)
            if all(c == "R" for c in layout.compute):
                out[name] = p.full_tensor()  # whole on every rank (free where it is stored whole)
            else:
                out[name] = p.redistribute(p.device_mesh, [placement(c) for c in layout.compute]).to_local()
        return out

    def split_buffers(self) -> dict[str, tuple[str, ...]]:
        """The buffers the plan does not replicate (a rule splits them over an axis of more than one rank)."""
        sizes = dict(zip(self.axes.names, self.axes.sizes, strict=True))
        return {
            name: placed
            for name, placed in self.buffers.items()
            if any(p != "R" and sizes[axis] > 1 for axis, p in zip(self.axes.names, placed, strict=True))
        }

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON data: the axes (name, role, size), each param's layout and, when the model has any, each
        buffer's placements (the golden files' format)."""
        out = {
            "axes": [{"name": a.name, "role": a.role, "size": a.size} for a in self.axes.axes],
            "token_axes": list(self.token_axes),
            "params": {name: layout.to_json() for name, layout in self.params.items()},
        }
        if self.buffers:
            out["buffers"] = {name: list(placed) for name, placed in self.buffers.items()}
        return out


def _compute(dims: Sequence[str] | None, axes: MeshAxes, rules: Rules) -> list[str]:
    """One placement per mesh axis for a param of logical ``dims`` under ``rules`` (all ``"R"`` without dims)."""
    out = ["R"] * axes.ndim
    if dims is None:
        return out
    used: set[str] = set()
    for dim, logical in enumerate(dims):
        for rule, roles in rules:
            if rule != logical:
                continue
            names = [axes.name_of(role) for role in roles]
            if any(n is None or n in used or axes.size_of(role) == 1 for n, role in zip(names, roles, strict=True)):
                continue
            for n in names:
                assert n is not None
                out[axes.names.index(n)] = f"S({dim})"
                used.add(n)
            break
    return out


def _storage(compute: Sequence[str], ndim: int, axes: MeshAxes) -> list[str]:
    """The default storage of a param of ``ndim`` dims computed as ``compute``: that placement, further split over the
    storage-sharding axes (FSDP) along dim 0 where the compute leaves dim 0 whole; a param the compute splits over the
    expert axis only (the stacked experts: :data:`EXPERT_PARALLEL_RULES`) along its first dim the compute leaves whole,
    over each such axis of more than one rank (the data-parallel shard ranks left beside the expert axis: each rank
    stores ``1 / (N · M)`` of it, ``N`` the expert degree and ``M`` those ranks). Any other split param (tensor
    parallelism's column-parallel weights) is stored as computed there.

    >>> axes = MeshAxes.of(data_shard=2, expert=2)
    >>> _storage(["R", "R", "S(0)"], 3, axes), _storage(["R", "R", "R"], 2, axes)
    (['R', 'S(1)', 'S(0)'], ['R', 'S(0)', 'S(0)'])
    """
    stored = list(compute)
    split = {int(m.group(1)) % max(ndim, 1) for p in compute if (m := _SHARD.fullmatch(p)) is not None}
    experts_only = bool(split) and all(p == "R" or a.role == "expert" for p, a in zip(compute, axes.axes, strict=True))
    whole = [d for d in range(ndim) if d not in split]
    for axis_name in axes.storage_shard_axes:
        index = axes.names.index(axis_name)
        if ndim == 0 or stored[index] != "R":
            continue
        if 0 not in split:
            stored[index] = "S(0)"
        elif experts_only and whole and axes.sizes[index] > 1:
            stored[index] = f"S({whole[0]})"
    return stored


def _split_by(logical: Sequence[str], axes: MeshAxes, rules: Rules) -> set[str]:
    """The axes ``rules`` split any of the ``logical`` dimensions over (each on its own, as in :func:`_compute`)."""
    split: set[str] = set()
    for dim in logical:
        split.update(n for n, p in zip(axes.names, _compute((dim,), axes, rules), strict=True) if p != "R")
    return split


def make_plan(
    params: Mapping[str, Any],
    axes: MeshAxes,
    *,
    dims: Mapping[str, Sequence[str]] | None = None,
    rules: Rules = DATA_PARALLEL_RULES,
    placements: StorageFn | None = None,
    mesh: Any = None,
    buffers: Mapping[str, Any] | None = None,
    sums_over: Mapping[str, Sequence[str]] | None = None,
) -> ParallelPlan:
    """The plan of ``params`` (name → tensor, meta tensors do: only shapes are read; in the model's order) on a mesh
    of ``axes``.

    Args:
        params: every param, with its full shape.
        axes: the mesh's axes and roles (the params' mesh: a pipeline rank's data-parallel slice).
        dims: each param's logical dimensions (``d9dfn.models.logical_dims`` of its family's plan); read by
            ``rules`` only, so data parallelism needs none.
        rules: the rules table (:data:`Rules`); the default splits nothing for compute.
        placements: ``(name, tensor, mesh) -> placements`` overriding the storage placements (a model provider's
            ``parallelize_model_stage`` choice; called with ``mesh``; ``None`` back: the default); default: the
            compute placements, further split
            along dim 0 over the mesh's storage-sharding axes (``data_shard``) where dim 0 is still whole and the
            param has one (``d9dfn.parallel.data_parallel_placements`` for data parallelism); the stacked experts,
            split along dim 0 over the expert axis, along their next whole dim over the remaining shard ranks.
        mesh: the ``DeviceMesh`` to bind the plan to (:meth:`ParallelPlan.on`); ``None``: unbound.
        buffers: the model's buffers (name → tensor): each placed by ``rules`` from its ``dims`` (replicated without
            any), never sharded for storage (a buffer has no optimizer state to save memory on).
        sums_over: param name → the logical dimensions its gradient sums over beyond its own (a param applied to
            each of them, as a per-head norm to every head: ``d9dfn.models.summed_dims``): where ``rules`` split one of
            them over an axis, each rank sums over its part only, so the gradient is partial over that axis too.

    Returns:
        The :class:`ParallelPlan`.

    Raises:
        ValueError: an override of the wrong length, a ``Partial``, or a ``Shard(d)`` on a dim the param lacks.

    >>> import torch
    >>> params = {"w": torch.empty(4, 2), "b": torch.empty(2), "scale": torch.empty(())}
    >>> plan = make_plan(params, MeshAxes.of(data_replicate=2, data_shard=2))
    >>> plan.params["w"].storage, plan.params["scale"].storage, plan.params["w"].compute, plan.params["w"].partial
    (('R', 'S(0)'), ('R', 'R'), ('R', 'R'), ('dp_replicate', 'dp_shard'))
    """
    layouts: dict[str, ParamLayout] = {}
    for name, tensor in params.items():
        ndim = len(tensor.shape)
        compute = _compute(None if dims is None else dims.get(name), axes, rules)
        chosen = None if placements is None else placements(name, tensor, mesh)
        if chosen is not None:
            stored = [_text(name, p) for p in chosen]
            _check_storage(name, stored, ndim, axes)
        else:
            stored = _storage(compute, ndim, axes)
        summed = _split_by(() if sums_over is None else sums_over.get(name, ()), axes, rules)
        partial = tuple(
            n for n, p in zip(axes.names, compute, strict=True) if p == "R" and (n in axes.token_axes or n in summed)
        )
        layouts[name] = ParamLayout(tuple(stored), tuple(compute), partial)
    placed = {name: tuple(_compute(None if dims is None else dims.get(name), axes, rules)) for name in (buffers or {})}
    plan = ParallelPlan(axes, layouts, buffers=placed)
    return plan if mesh is None else plan.on(mesh)


def plan_for(
    params: Mapping[str, Any] | Any,
    mesh: Any,
    *,
    placements: PlacementFn | None = None,
    dims: Mapping[str, Sequence[str]] | None = None,
    rules: Rules = DATA_PARALLEL_RULES,
    buffers: Mapping[str, Any] | None = None,
    sums_over: Mapping[str, Sequence[str]] | None = None,
) -> ParallelPlan:
    """The plan of ``params`` on ``mesh`` (a ``DeviceMesh`` whose dimension names are roles'), bound to it: a
    ``DTensor`` param keeps the placements it has as its storage (so the plan of a train state's params describes
    that state), any other takes ``placements``' choice or the default (:func:`make_plan`).

    Args:
        params: a train state's params, or a module (its parameters, frozen ones too: ``init_train_state`` places
            every param, trainable or not; and its buffers, unless ``buffers`` is given).
        mesh: the params' ``DeviceMesh``.
        placements, dims, rules, buffers, sums_over: as :func:`make_plan`'s.

    The step builders take it (``make_train_step(plan=...)``); ``init_train_state(placements=plan.placements)``
    distributes a model's params as it says.
    """
    from torch import nn

    from d9dfn.parallel._placement import is_distributed_tensor

    if isinstance(params, nn.Module):
        buffers = dict(params.named_buffers()) if buffers is None else buffers
        params = dict(params.named_parameters())

    def stored(name: str, tensor: Any, mesh_: Any) -> Sequence[Any] | None:
        if is_distributed_tensor(tensor):
            return tuple(tensor.placements)
        return None if placements is None else placements(name, tensor, mesh_)

    axes = MeshAxes.of_mesh(mesh)
    return make_plan(
        params, axes, dims=dims, rules=rules, placements=stored, mesh=mesh, buffers=buffers, sums_over=sums_over
    )


def plan_data_parallel(plan: ParallelPlan) -> DataParallel:
    """The step's ``DataParallel`` for a plan bound to a mesh: the sum over the mesh's token axes (the whole mesh when
    every axis is one: one group of all its ranks) and this rank's index among the data-parallel ranks."""
    from d9dfn.parallel._reduce import data_parallel_reduction

    mesh, axes = plan.mesh, plan.axes
    rank = axes.data_parallel_rank({name: int(mesh.get_local_rank(name)) for name in axes.names})
    return DataParallel(data_parallel_reduction(token_group(plan)), rank)


def token_group(plan: ParallelPlan) -> Any:
    """The process group of the ranks over which ``Σw``, the loss sums and metric states are summed: the plan's mesh
    over its token axes, flattened (a collective that creates the group: call it when a step or loop is built).

    Raises:
        ValueError: an unbound plan.
    """
    from d9dfn.parallel._mesh import data_parallel_group

    mesh, axes = plan.mesh, plan.axes
    if mesh is None:
        raise ValueError("token_group: the plan is not bound to a mesh; bind it with plan.on(mesh)")
    tokens = axes.token_axes
    return data_parallel_group(mesh if tokens == axes.names else mesh[tokens])


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return placement_text(value)
    except ValueError:
        raise ValueError(
            f"make_plan: params[{name!r}] got placement {value!r}; a parameter is Replicate() or Shard(dim), never "
            "Partial"
        ) from None


def _check_storage(name: str, stored: Sequence[str], ndim: int, axes: MeshAxes) -> None:
    if len(stored) != axes.ndim:
        raise ValueError(
            f"make_plan: params[{name!r}] got placements {tuple(stored)} for a {axes.ndim}-axis mesh {axes.names}; "
            "return one placement per mesh axis"
        )
    for text in stored:
        match = _SHARD.fullmatch(text)
        if text != "R" and match is None:
            raise ValueError(
                f"make_plan: params[{name!r}] got placement {text!r}; a parameter is Replicate() or Shard(dim), never "
                "Partial"
            )
        if match is not None and not -ndim <= int(match.group(1)) < max(ndim, 1):
            raise ValueError(
                f"make_plan: params[{name!r}] has {ndim} dims but got {text}; shard a dimension it has, or "
                "Replicate() it"
            )
