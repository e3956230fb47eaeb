"""Mesh axes with roles: what each axis of a ``DeviceMesh`` means, and what follows from it, decided in one place.

A mesh is a tuple of named axes, each with one role:

| role | torch name | ranks along it | params | Σw, the loss, metrics |
|---|---|---|---|---|
| ``pipeline`` | ``pp`` | hold different stages | their stage's only | summed by the pipeline's own reduction |
| ``data_replicate`` | ``dp_replicate`` | see different samples | whole (DDP) | summed |
| ``data_shard`` | ``dp_shard`` | see different samples | stored ``Shard(0)``, gathered to compute (FSDP) | summed |
| ``context`` | ``cp`` | see different tokens of the same samples | whole | summed |
| ``tensor`` | ``tp`` | see the same tokens | split by the plan's rules | not summed |
| ``expert`` | ``ep`` | see different samples | experts split by the rules; others as where it was carved | summed |

The expert axis is carved out of the data-parallel ranks (d9d's expert domain, torchtitan's ``dp2ep``): its ranks
take different rows of the batch like the data-parallel ranks they were, and the plan's rules split the stacked
experts (dim 0) over it. Every other param is placed on it as on the data-parallel axis it was carved from, which its
position says: right after ``dp_replicate`` it was carved from the replicas (those params whole on it, DDP); anywhere
else (the canonical place, innermost) from ``dp_shard`` (those params ``Shard(0)`` over it too, FSDP).

Everything the step and the loop ask of the mesh (which group sums ``Σw``, over which axes a gradient is a partial
sum, which ranks are data-parallel peers and this rank's index among them) is a property of :class:`MeshAxes`,
derived from the roles here and nowhere else; a new role is a row of :data:`ROLES` and the sets below it.

Pure: no process group is created or read here; :meth:`MeshAxes.of_mesh` only reads a mesh's names and sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

__all__ = ["AXIS_NAMES", "ROLES", "ExpertFrom", "MeshAxes", "MeshAxis", "Role"]

Role = Literal["pipeline", "data_replicate", "data_shard", "context", "tensor", "expert"]
"""What an axis of the mesh does (the table of this module's docstring)."""

ExpertFrom = Literal["data_shard", "data_replicate"]
"""The data-parallel role an expert axis was carved from (:attr:`MeshAxes.expert_from`)."""

ROLES: tuple[Role, ...] = get_args(Role)
"""Every role, in the mesh's canonical order (outermost first): the pipeline hops are the long ones, tensor
parallelism the innermost (torchtitan's and Megatron's order)."""

AXIS_NAMES: dict[Role, str] = {
    "pipeline": "pp",
    "data_replicate": "dp_replicate",
    "data_shard": "dp_shard",
    "context": "cp",
    "tensor": "tp",
    "expert": "ep",
}
"""The ``DeviceMesh`` dimension name of each role (``mesh.mesh_dim_names``), d9d's and torchtitan's short names."""

_SEES_OTHER_TOKENS: frozenset[Role] = frozenset({"data_replicate", "data_shard", "context", "expert"})
"""Ranks along these axes compute on different tokens: their ``Σw``, losses and metric states are summed over them, and
the gradient of a param they all compute with whole is a partial sum over them."""
_SEES_OTHER_SAMPLES: frozenset[Role] = frozenset({"data_replicate", "data_shard", "expert"})
"""Ranks along these axes take different rows of each global batch (the data-parallel ranks)."""
_STORES_SHARDED: frozenset[Role] = frozenset({"data_shard"})
"""Params are stored split along dim 0 over these axes and gathered to compute (FSDP, ZeRO-3)."""


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One axis of a mesh: its ``DeviceMesh`` name, its role and its number of ranks."""

    name: str
    role: Role
    size: int


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """A mesh's axes, outermost first, and what follows from their roles.

    >>> axes = MeshAxes.of(data_replicate=2, data_shard=4)
    >>> axes.names, axes.sizes, axes.data_parallel_size
    (('dp_replicate', 'dp_shard'), (2, 4), 8)
    >>> axes.token_axes, axes.storage_shard_axes
    (('dp_replicate', 'dp_shard'), ('dp_shard',))
    """

    axes: tuple[MeshAxis, ...]

    def __post_init__(self) -> None:
        names = [axis.name for axis in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"MeshAxes: axis names {names} repeat; name each axis once")
        roles = [axis.role for axis in self.axes]
        for axis in self.axes:
            if axis.role not in ROLES:
                raise ValueError(f"MeshAxes: axis {axis.name!r} has role {axis.role!r}; use one of {', '.join(ROLES)}")
            if roles.count(axis.role) > 1:
                raise ValueError(f"MeshAxes: role {axis.role!r} is on two axes; give each role one axis")
            if isinstance(axis.size, bool) or not isinstance(axis.size, int) or axis.size < 1:
                raise ValueError(f"MeshAxes: axis {axis.name!r} has size {axis.size!r}; pass a positive int")

    @classmethod
    def of(cls, *, expert_from: ExpertFrom = "data_shard", **degrees: int) -> MeshAxes:
        """Axes in the canonical order from degrees by role (``data_shard=2``). The two data-parallel axes are always
        there (size 1 when unused), as ``d9dfn.loop.init_distributed`` builds them; any other role only when given.
        ``expert_from="data_replicate"`` puts the expert axis right after ``dp_replicate`` (carved from the replicas:
        the module docstring), instead of innermost.

        >>> MeshAxes.of(pipeline=2).names
        ('pp', 'dp_replicate', 'dp_shard')
        >>> MeshAxes.of(expert=2, expert_from="data_replicate").names
        ('dp_replicate', 'ep', 'dp_shard')
        """
        unknown = sorted(set(degrees) - set(ROLES))
        if unknown:
            raise ValueError(f"MeshAxes.of: {unknown[0]!r} is not a role; pass degrees by role: {', '.join(ROLES)}")
        if expert_from not in ("data_shard", "data_replicate"):
            raise ValueError(f"MeshAxes.of: expert_from={expert_from!r}; pass 'data_shard' or 'data_replicate'")
        always = {"data_replicate": 1, "data_shard": 1}
        sizes = {**always, **degrees}
        order = list(ROLES)
        if expert_from == "data_replicate":
            order.remove("expert")
            order.insert(order.index("data_replicate") + 1, "expert")
        return cls(tuple(MeshAxis(AXIS_NAMES[role], role, sizes[role]) for role in order if role in sizes))

    @classmethod
    def of_mesh(cls, mesh: Any) -> MeshAxes:
        """The axes of a ``DeviceMesh``, each role read from its dimension name (:data:`AXIS_NAMES`).

        Raises:
            ValueError: an unnamed mesh, or a dimension name that is no role's.
        """
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(
                "MeshAxes.of_mesh: the mesh has no dimension names; build it with d9dfn.loop.init_distributed or name "
                f"its dimensions by role ({', '.join(AXIS_NAMES.values())})"
            )
        by_name = {name: role for role, name in AXIS_NAMES.items()}
        for name in names:
            if name not in by_name:
                raise ValueError(
                    f"MeshAxes.of_mesh: mesh dimension {name!r} names no role; name it one of "
                    f"{', '.join(AXIS_NAMES.values())}"
                )
        return cls(tuple(MeshAxis(name, by_name[name], int(mesh.size(i))) for i, name in enumerate(names)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(axis.name for axis in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(axis.size for axis in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    def size_of(self, role: Role) -> int:
        """The number of ranks along the axis of ``role`` (1 when the mesh has no such axis)."""
        return next((axis.size for axis in self.axes if axis.role == role), 1)

    def name_of(self, role: Role) -> str | None:
        """The name of the axis of ``role``, or ``None`` when the mesh has none."""
        return next((axis.name for axis in self.axes if axis.role == role), None)

    def without(self, *roles: Role) -> MeshAxes:
        """These axes without those of ``roles`` (a pipeline rank's slice: ``without("pipeline")``)."""
        return MeshAxes(tuple(axis for axis in self.axes if axis.role not in roles))

    def _with(self, roles: frozenset[Role]) -> tuple[str, ...]:
        return tuple(axis.name for axis in self.axes if axis.role in roles)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The axes whose ranks compute on different tokens: ``Σw``, the loss sums and metric states are summed over
        them, and a gradient w.r.t. a param computed whole on all of them is partial over them."""
        return self._with(_SEES_OTHER_TOKENS)

    @property
    def sample_axes(self) -> tuple[str, ...]:
        """The data-parallel axes: their ranks take different rows of every global batch."""
        return self._with(_SEES_OTHER_SAMPLES)

    @property
    def expert_from(self) -> ExpertFrom | None:
        """The data-parallel role the expert axis was carved from (its position: the module docstring); ``None``
        without an expert axis.

        >>> MeshAxes.of(data_shard=2, expert=2).expert_from, MeshAxes.of().expert_from
        ('data_shard', None)
        """
        roles = [axis.role for axis in self.axes]
        if "expert" not in roles:
            return None
        index = roles.index("expert")
        return "data_replicate" if index > 0 and roles[index - 1] == "data_replicate" else "data_shard"

    @property
    def storage_shard_axes(self) -> tuple[str, ...]:
        """The axes over which params are stored split along dim 0 and gathered to compute (FSDP): ``dp_shard``, and
        the expert axis when it was carved from it."""
        carved: frozenset[Role] = frozenset({"expert"}) if self.expert_from == "data_shard" else frozenset()
        return self._with(_STORES_SHARDED | carved)

    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that take different rows of each global batch."""
        return math.prod(axis.size for axis in self.axes if axis.role in _SEES_OTHER_SAMPLES)

    def data_parallel_rank(self, coordinates: dict[str, int]) -> int:
        """This rank's index among the data-parallel ranks (row-major over :attr:`sample_axes`, outermost first: the
        order in which they take consecutive rows of a global batch), from its coordinate on each axis.

        >>> MeshAxes.of(data_replicate=2, data_shard=3).data_parallel_rank({"dp_replicate": 1, "dp_shard": 2})
        5
        """
        rank = 0
        for axis in self.axes:
            if axis.role in _SEES_OTHER_SAMPLES:
                rank = rank * axis.size + coordinates[axis.name]
        return rank
