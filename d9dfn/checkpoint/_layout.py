"""What a checkpoint holds, leaf by leaf: the pure half of ``CheckpointStore`` (no files, no collectives).

A rank's part of a state becomes numpy arrays plus a manifest entry per leaf that places the rank's piece
in the full tensor (``global_shape``, ``offsets``, ``shape``). Reading inverts that for any layout: the
manifests of all ranks are indexed by key, each rank works out the region of every tensor it needs (the
local shard of a DTensor template, or the whole tensor), which saved pieces overlap it, and copies the
overlaps into place. The layout and the rules are in ``docs/design/checkpoints.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import torch

from d9dfn._pytree import format_path, tree_flatten_with_path, tree_unflatten
from d9dfn._types import PyTree
from d9dfn.checkpoint._integrity import crc32
from d9dfn.parallel import is_distributed_tensor

VALUE_TYPES = (bool, int, float, str, type(None))
"""Python leaves stored in the manifest itself."""


class _AsSaved:
    """The type of :data:`AS_SAVED` (one instance)."""

    def __repr__(self) -> str:
        return "AS_SAVED"


AS_SAVED = _AsSaved()
"""A template leaf that restores its key as it was saved, whatever its dtype and shape: the whole tensor on the CPU
(or the saved Python value). For a part whose shape depends on the run that saved it (the loop's per-rank metric
states have one row per data-parallel rank of that run); the caller checks what comes back."""

# torch dtypes that numpy has no type for: stored as ml_dtypes arrays of the same bits.
_ML_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
    torch.float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
}
_SAME_SIZE_INT = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16)}


class Region(NamedTuple):
    """A box of a tensor: where it starts in the full tensor and its size along every dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class Piece(NamedTuple):
    """One rank's stored part of one tensor, as its manifest lists it."""

    rank: int
    region: Region
    stored: bool  # False for zero-size pieces, which have no array on disk
    crc32: int


class SavedArray(NamedTuple):
    """A tensor leaf of a checkpoint: its dtype, full shape and the pieces that tile it."""

    dtype: str
    global_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


class SavedValue(NamedTuple):
    """A Python-scalar leaf of a checkpoint."""

    value: Any


# ------------------------------------------------------------------------------------------ tensors <-> numpy


def key_of(path: tuple[Any, ...]) -> str:
    """The key a leaf is stored under: its key path joined by ``/``."""
    return "/".join(str(k) for k in path) if path else "<root>"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return _ML_DTYPES[dtype] if dtype in _ML_DTYPES else torch.empty(0, dtype=dtype).numpy().dtype


def tensor_to_numpy(tensor: torch.Tensor, path: tuple[Any, ...]) -> np.ndarray:
    """The bits of a local ``tensor`` as a numpy array on the host (sharing memory with CPU tensors)."""
    if tensor.is_meta:
        raise TypeError(
            f"CheckpointStore.save: leaf {format_path(path)} is a {type(tensor).__name__} on meta, which holds no "
            f"data; materialize it (e.g. to_empty + init) before saving"
        )
    host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if host.dtype in _ML_DTYPES:
        as_int, np_int = _SAME_SIZE_INT[host.element_size()]
        return host.view(as_int).numpy().view(np_int).view(_ML_DTYPES[host.dtype])
    try:
        return host.numpy()
    except TypeError as error:
        raise TypeError(
            f"CheckpointStore.save: leaf {format_path(path)} has dtype {host.dtype}, which has no numpy "
            f"equivalent; convert it (e.g. complex32 -> complex64) before saving"
        ) from error


def numpy_to_tensor(array: np.ndarray, name: str) -> torch.Tensor:
    """A CPU tensor of dtype ``name`` with the bits of ``array`` (copied only when not writable/contiguous)."""
    dtype = getattr(torch, name)
    if not (array.flags.c_contiguous and array.flags.writeable):  # (np.ascontiguousarray makes 0-d arrays 1-d)
        array = array.copy(order="C")
    if dtype in _ML_DTYPES:
        _, np_int = _SAME_SIZE_INT[torch.empty((), dtype=dtype).element_size()]
        return torch.from_numpy(array.view(np_int)).view(dtype)
    return torch.from_numpy(array)


# ------------------------------------------------------------------------------------------ DTensor placements


def _check_placements(value: Any, path: tuple[Any, ...], where: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for axis, placement in enumerate(value.placements):
        if type(placement) not in (Shard, Replicate):  # Partial, _StridedShard, custom placements
            raise TypeError(
                f"CheckpointStore.{where}: leaf {format_path(path)} is a DTensor with placement {placement} on mesh "
                f"dim {axis} ({value.device_mesh}); only Shard(dim) and Replicate() are stored; redistribute it "
                f"(e.g. dtensor.redistribute(placements=[Replicate(), Shard(0)])) first"
            )


def dtensor_region(value: Any, path: tuple[Any, ...], where: str) -> Region:
    """The box of the full tensor that this rank's local shard of the DTensor ``value`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _check_placements(value, path, where)
    shape, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return Region(tuple(offsets), tuple(shape))


def _replica_writes(value: Any) -> bool:
    """Whether this rank writes its shard of ``value``: the first replica along every replicated mesh dim."""
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the DTensor's mesh
        return False
    return all(c == 0 for c, placement in zip(coordinate, value.placements, strict=True) if placement.is_replicate())


def leaf_keys(tree: PyTree) -> list[str]:
    """The keys of all of ``tree``'s leaves."""
    return [key_of(path) for path in tree_flatten_with_path(tree)[0]]


def plain_keys(state: PyTree) -> list[str]:
    """The keys of ``state``'s leaves that are not DTensors: what ranks exchange to pick each one's writer."""
    paths, values, _ = tree_flatten_with_path(state)
    return [key_of(path) for path, value in zip(paths, values, strict=True) if not is_distributed_tensor(value)]


def first_holder_keys(held: Sequence[Sequence[str]], rank: int) -> set[str]:
    """The plain keys ``rank`` writes: those it holds (``held[rank]``) that no lower rank holds.

    >>> held = [["params/a", "step"], ["params/a", "step"], ["params/b", "step"], ["params/b", "step"]]
    >>> [sorted(first_holder_keys(held, r)) for r in range(4)]  # pp2 x dp2: each leaf written once
    [['params/a', 'step'], [], ['params/b'], []]
    """
    lower: set[str] = set().union(*held[:rank])
    return set(held[rank]) - lower


def encode(
    state: PyTree, rank: int = 0, writes: Collection[str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Rank ``rank``'s part of ``state``: the arrays it stores and its manifest, by leaf key.

    A DTensor leaf is written by the first replica of each shard (the rank at coordinate 0 of every
    replicated mesh dim), so every element is stored exactly once. A plain tensor or Python value is written
    by the lowest rank that holds its key: ``writes`` lists the plain keys this rank writes
    (:func:`first_holder_keys`); ``None`` means all of them on rank 0 and none elsewhere. The ranks that
    hold one key must hold the same value there. Leaves a rank does not write are absent from its manifest.

    Raises:
        ValueError: two leaves share a key, or a DTensor's local shard is not where its placements put it.
        TypeError: a leaf that is neither a tensor with data nor a Python scalar, or an unsupported placement.
    """
    arrays: dict[str, np.ndarray] = {}
    leaves: dict[str, dict[str, Any]] = {}
    seen: dict[str, tuple[Any, ...]] = {}
    paths, values, _ = tree_flatten_with_path(state)
    for path, value in zip(paths, values, strict=True):
        key = key_of(path)
        if key in seen:
            raise ValueError(
                f"CheckpointStore.save: leaves {format_path(seen[key])} and {format_path(path)} both have the key "
                f"{key!r}; rename one (a dict key containing '/' collides with nesting)"
            )
        seen[key] = path
        if is_distributed_tensor(value):
            region = dtensor_region(value, path, "save")
            local = value.to_local()
            if tuple(local.shape) != region.shape:
                raise ValueError(
                    f"CheckpointStore.save: leaf {format_path(path)} is a DTensor whose local shard has shape "
                    f"{tuple(local.shape)}, but its placements {value.placements} give this rank {region.shape}; "
                    f"redistribute it to the standard (torch.chunk) sharding first"
                )
            if not _replica_writes(value):
                continue
            global_shape = tuple(value.shape)
        elif isinstance(value, torch.Tensor):
            if not (rank == 0 if writes is None else key in writes):
                continue
            local, global_shape = value, tuple(value.shape)
            region = Region((0,) * value.dim(), global_shape)
        elif isinstance(value, VALUE_TYPES):
            if rank == 0 if writes is None else key in writes:
                leaves[key] = {"kind": "value", "value": value}
            continue
        else:
            raise TypeError(
                f"CheckpointStore.save: leaf {format_path(path)} is a {type(value).__name__}; a state holds torch "
                f"tensors and int/float/bool/str/None only (wrap other data in a tensor or in metadata)"
            )
        array = tensor_to_numpy(local, path)
        leaves[key] = {
            "kind": "array",
            "dtype": dtype_name(value.dtype),
            "shape": list(region.shape),
            "global_shape": list(global_shape),
            "offsets": list(region.offsets),
            "stored": array.size > 0,
            "crc32": crc32(array),
        }
        if array.size > 0:  # orbax refuses zero-size arrays; the manifest alone rebuilds them.
            arrays[key] = array
    return arrays, leaves


# ------------------------------------------------------------------------------------------ reading back


def volume(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def intersect(a: Region, b: Region) -> Region | None:
    """The common box of ``a`` and ``b``, or ``None`` when they share no element."""
    starts = tuple(max(p, q) for p, q in zip(a.offsets, b.offsets, strict=True))
    ends = tuple(min(p + m, q + n) for p, m, q, n in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True))
    if any(e <= s for s, e in zip(starts, ends, strict=True)):
        return None
    return Region(starts, tuple(e - s for s, e in zip(starts, ends, strict=True)))


def index_manifests(manifests: Sequence[dict[str, Any]]) -> dict[str, SavedArray | SavedValue]:
    """Every saved leaf by key (in rank 0's order, then the others'), checking that the pieces tile it.

    Raises:
        ValueError: the manifests contradict each other or do not cover a tensor; the message is the problem
            (the store wraps it into a ``CheckpointCorruptedError``).
    """
    index: dict[str, SavedArray | SavedValue] = {}
    for rank, manifest in enumerate(manifests):
        for key, leaf in manifest["leaves"].items():
            known = index.get(key)
            if leaf["kind"] == "value":
                if known is not None:
                    raise ValueError(f"leaf {key!r} is listed twice (again by manifest_{rank:05d}, as a value)")
                index[key] = SavedValue(leaf["value"])
                continue
            global_shape = tuple(leaf["global_shape"])
            region = Region(tuple(leaf["offsets"]), tuple(leaf["shape"]))
            inside = len(region.offsets) == len(region.shape) == len(global_shape) and all(
                o >= 0 and o + n <= g for o, n, g in zip(region.offsets, region.shape, global_shape, strict=True)
            )
            if not inside:
                raise ValueError(f"manifest_{rank:05d} puts leaf {key!r} at {region}, outside {list(global_shape)}")
            piece = Piece(rank, region, leaf["stored"], leaf["crc32"])
            if known is None:
                index[key] = SavedArray(leaf["dtype"], global_shape, (piece,))
            elif isinstance(known, SavedValue) or (known.dtype, known.global_shape) != (leaf["dtype"], global_shape):
                raise ValueError(f"manifest_{rank:05d} lists leaf {key!r} unlike the manifests before it ({known})")
            else:
                index[key] = known._replace(pieces=(*known.pieces, piece))
    for key, saved in index.items():
        if isinstance(saved, SavedArray):
            covered = sum(volume(piece.region.shape) for piece in saved.pieces)
            if covered != volume(saved.global_shape):
                raise ValueError(
                    f"the pieces of leaf {key!r} hold {covered} elements, not the {volume(saved.global_shape)} of "
                    f"its shape {list(saved.global_shape)}"
                )
    return index


def describe_saved(saved: SavedArray | SavedValue) -> str:
    if isinstance(saved, SavedArray):
        return f"tensor(dtype={saved.dtype}, shape={saved.global_shape})"
    return f"{type(saved.value).__name__}({saved.value!r})"


def describe(value: Any) -> str:
    if is_distributed_tensor(value):
        return f"DTensor(dtype={dtype_name(value.dtype)}, shape={tuple(value.shape)}, placements={value.placements})"
    if isinstance(value, torch.Tensor):
        return f"tensor(dtype={dtype_name(value.dtype)}, shape={tuple(value.shape)})"
    return f"{type(value).__name__}({value!r})"


class CheckpointMismatchError(ValueError):
    """A step that does not fit the template it is restored into: other leaves, or a leaf of another dtype or shape.

    The message speaks of ``CheckpointStore.restore``'s arguments; a caller that knows why the template differs
    (another model's settings) says so in its own terms from the attributes.

    Attributes (on the ranks that found the mismatch; another rank re-raises it from the message alone):
        step: the step read.
        missing: the template's key paths that the step lacks (formatted, e.g. ``['params']['layers.4.w']``).
        unexpected: the step's keys that no template has a place for (under ``strict``).
        mismatched: ``(key, what the step holds, what the template has)`` of a leaf found in both.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.step = step
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)

    @property
    def which(self) -> str:
        """``"step N"``, or ``"the step"`` where the step is not known (another rank's error)."""
        return "the step" if self.step is None else f"step {self.step}"

    def difference(self) -> str:
        """What differs between the step and the template, a few names of each (for a one-line message).

        >>> CheckpointMismatchError("", step=1, missing=["['params']['a']"], unexpected=["params/b"]).difference()
        "the model has ['params']['a'] that the checkpoint lacks; the checkpoint has params/b that the model lacks"
        """
        parts = []
        if self.missing:
            more = f" (and {len(self.missing) - 3} more)" if len(self.missing) > 3 else ""
            parts.append(f"the model has {', '.join(self.missing[:3])}{more} that the checkpoint lacks")
        if self.unexpected:
            more = f" (and {len(self.unexpected) - 3} more)" if len(self.unexpected) > 3 else ""
            parts.append(f"the checkpoint has {', '.join(self.unexpected[:3])}{more} that the model lacks")
        parts.extend(
            f"{key} is {saved} in the checkpoint but {ours} in the model" for key, saved, ours in self.mismatched
        )
        return "; ".join(parts)


Strict = bool | tuple[str, ...]
"""``CheckpointStore.restore``'s ``strict``: refuse every saved leaf the template has no place for (``True``), none
(``False``), or those under these top-level keys only (``("params", "buffers")``: the weights of a training state,
its optimizer state aside)."""


def _strict_about(key: str, strict: Strict) -> bool:
    return strict is True or (isinstance(strict, tuple) and key.split("/", 1)[0] in strict)


class Target(NamedTuple):
    """What one template leaf asks of the checkpoint: the saved key, and the box this rank needs (tensors)."""

    path: tuple[Any, ...]
    key: str
    template: Any
    region: Region | None  # None for Python values


def targets_for(
    index: dict[str, SavedArray | SavedValue],
    like: PyTree,
    *,
    strict: Strict,
    step: int,
    claimed: Collection[str] | None = None,
) -> tuple[list[Target], Any]:
    """Match the template ``like`` against the saved leaves; return what to read, and ``like``'s treespec.

    ``like=None`` asks for every saved leaf, whole, as a flat ``{key: leaf}`` dict (treespec ``None``); an
    :data:`AS_SAVED` leaf of ``like`` asks for its key whole, whatever its kind, dtype and shape.
    ``strict`` refuses saved leaves outside ``claimed``: the keys of every rank's template together (default:
    ``like``'s), so pipeline ranks whose templates hold only their stages' leaves restore strictly; a tuple of
    top-level keys refuses only the saved leaves under them (:data:`Strict`).

    Raises:
        CheckpointMismatchError: keys, kinds, dtypes or (global) shapes differ; the message names the key path and
            the fix.
    """
    if like is None:
        full = [
            Target(
                (key,),
                key,
                None,
                Region((0,) * len(s.global_shape), s.global_shape) if isinstance(s, SavedArray) else None,
            )
            for key, s in index.items()
        ]
        return full, None
    paths, templates, treespec = tree_flatten_with_path(like)
    keys = [key_of(path) for path in paths]
    missing = [path for path, key in zip(paths, keys, strict=True) if key not in index]
    placed = set(keys if claimed is None else claimed)
    unexpected = sorted(key for key in index if key not in placed and _strict_about(key, strict)) if strict else []
    if missing or unexpected:
        lacking = "the template lacks" if claimed is None else "no rank's template has"
        raise CheckpointMismatchError(
            f"CheckpointStore.restore: step {step} does not fit the template: the template has "
            f"{[format_path(p) for p in missing[:5]]}{' ...' if len(missing) > 5 else ''} that the checkpoint lacks, "
            f"and the checkpoint has {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} that "
            f"{lacking}; "
            f"pass like= a tree of the saved structure (saved keys: {list(index)[:8]}"
            f"{' ...' if len(index) > 8 else ''}), or strict=False to ignore extra saved leaves",
            step=step,
            missing=[format_path(p) for p in missing],
            unexpected=unexpected,
        )
    targets = []
    for path, key, template in zip(paths, keys, templates, strict=True):
        saved = index[key]
        if template is AS_SAVED:  # the whole saved leaf, unchecked: the caller asked for it as it is
            whole = (
                Region((0,) * len(saved.global_shape), saved.global_shape) if isinstance(saved, SavedArray) else None
            )
            targets.append(Target(path, key, template, whole))
            continue
        if isinstance(template, torch.Tensor):
            fits = (
                isinstance(saved, SavedArray)
                and saved.dtype == dtype_name(template.dtype)
                and saved.global_shape == tuple(template.shape)
            )
        else:
            fits = isinstance(saved, SavedValue) and type(saved.value) is type(template)
            fits = fits and isinstance(template, VALUE_TYPES)
        if not fits:
            raise CheckpointMismatchError(
                f"CheckpointStore.restore: leaf {format_path(path)} of step {step} is {describe_saved(saved)} but the "
                f"template has {describe(template)}; make the template leaf match the saved one (convert after "
                f"restoring), or restore a step saved with this structure",
                step=step,
                mismatched=[(key, describe_saved(saved), describe(template))],
            )
        if is_distributed_tensor(template):
            region = dtensor_region(template, path, "restore")
        elif isinstance(template, torch.Tensor):
            region = Region((0,) * template.dim(), tuple(template.shape))
        else:
            region = None
        targets.append(Target(path, key, template, region))
    return targets, treespec


def reads_needed(index: dict[str, SavedArray | SavedValue], targets: Sequence[Target]) -> dict[int, list[str]]:
    """Which keys to read from which rank's item: the stored pieces that overlap a needed region."""
    needed: dict[int, list[str]] = {}
    for target in targets:
        saved = index[target.key]
        if target.region is None or not isinstance(saved, SavedArray):
            continue
        for piece in saved.pieces:
            if piece.stored and intersect(piece.region, target.region) is not None:
                keys = needed.setdefault(piece.rank, [])
                if target.key not in keys:
                    keys.append(target.key)
    return needed


def check_cover(saved: SavedArray, region: Region) -> None:
    """Check that the saved pieces overlapping ``region`` tile it exactly (no gaps, no double cover).

    Raises:
        ValueError: two overlapping pieces overlap each other, or part of ``region`` is in no piece.
    """
    boxes = [box for piece in saved.pieces if (box := intersect(piece.region, region)) is not None]
    for i, a in enumerate(boxes):
        if any(intersect(a, b) is not None for b in boxes[i + 1 :]):
            raise ValueError(f"two saved pieces overlap in {a}")
    if sum(volume(box.shape) for box in boxes) != volume(region.shape):
        raise ValueError(f"the saved pieces do not cover {region}")


def copy_overlap(out: torch.Tensor, region: Region, piece: Region, array: torch.Tensor) -> None:
    """Copy the part of a saved ``piece`` (its data ``array``) that lies in ``region`` into ``out`` (in place)."""
    box = intersect(piece, region)
    if box is None:
        return
    source = tuple(slice(s - o, s - o + n) for s, o, n in zip(box.offsets, piece.offsets, box.shape, strict=True))
    dest = tuple(slice(s - o, s - o + n) for s, o, n in zip(box.offsets, region.offsets, box.shape, strict=True))
    out[dest] = array[source]


def place(target: Target, local: torch.Tensor) -> Any:
    """The restored leaf for ``target``: ``local`` on the template's device, as a DTensor for DTensor templates
    (on the CPU for :data:`AS_SAVED`)."""
    template = target.template
    if is_distributed_tensor(template):
        from torch.distributed.tensor import DTensor

        mesh = template.device_mesh
        device = torch.device(mesh.device_type) if template.to_local().is_meta else template.to_local().device
        return DTensor.from_local(
            local.to(device), mesh, template.placements, run_check=False, shape=template.shape, stride=template.stride()
        )
    if isinstance(template, torch.Tensor):
        return local.to(torch.device("cpu") if template.is_meta else template.device)
    return local


def unflatten(treespec: Any, targets: Sequence[Target], leaves: Sequence[Any]) -> PyTree:
    """``leaves`` in the template's structure, or as the flat ``{key: leaf}`` dict when there was no template."""
    if treespec is None:
        return {target.key: leaf for target, leaf in zip(targets, leaves, strict=True)}
    return tree_unflatten(treespec, list(leaves))
