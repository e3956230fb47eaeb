"""Checkpoints on disk: orbax's ``CheckpointManager`` holding torch state as numpy arrays, one item per rank.

orbax gives the step directories, keep-N retention, the atomic commit (write to
``<step>.orbax-checkpoint-tmp``, rename when complete) and async saves. d9dfn decides what goes in a step
directory (``docs/design/checkpoints.md``)::

    <directory>/<step>/
        d9dfn/            JSON  {"format": "d9dfn.checkpoint", "version": 1, "num_ranks": W}
        metadata/         JSON  the caller's metadata, as given
        manifest_00000/   JSON  rank 0's leaves, in tree order: key -> dtype, shape, placement, crc32 | value
        rank_00000/       orbax PyTree  rank 0's non-empty arrays, keyed by key-path string

A leaf's key is its key path joined by ``/`` (``"params/layers.0.weight"``, ``"opt_state/0/1/w"``), so
the format never depends on Python class names: any tree whose paths give the same keys restores it.
Tensors go to numpy; dtypes numpy lacks (bfloat16, float8) travel as ``ml_dtypes`` arrays, bit-exact.
Python scalars (``int``, ``float``, ``bool``, ``str``, ``None``) are stored in the manifest.

Only one process is implemented. The per-rank items are named that way from the start so that the
distributed issue can write one ``rank_r`` / ``manifest_r`` pair per rank without a format change.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import torch

from d9dfn._pytree import format_path, tree_flatten_with_path, tree_unflatten
from d9dfn._types import PyTree

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointCorruptedError", "CheckpointStore"]

FORMAT = "d9dfn.checkpoint"
"""The name written in every step's ``d9dfn`` item."""

FORMAT_VERSION = 1
"""Bumped on any change a reader of the previous version could not read."""

_LOG = logging.getLogger("d9dfn.checkpoint")

_TRASH = ".d9dfn-deleted"
"""Where retention moves old steps (one atomic rename) before d9dfn deletes them."""

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
_VALUE_TYPES = (bool, int, float, str, type(None))


class CheckpointCorruptedError(ValueError):
    """A committed step directory that cannot be read back as it was written."""


def _orbax() -> ModuleType:
    """Import orbax on first use (it imports JAX, about a second), on JAX's CPU backend only."""
    # orbax asks JAX for the process index; JAX must not probe or grab the accelerators torch uses.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp

    # orbax logs every save at INFO through absl; keep that out of an application that logs at INFO
    # unless someone chose a level for absl already.
    absl_logger = logging.getLogger("absl")
    if absl_logger.level == logging.NOTSET:
        absl_logger.setLevel(logging.WARNING)
    return ocp


def _rank_item(rank: int) -> str:
    return f"rank_{rank:05d}"


def _manifest_item(rank: int) -> str:
    return f"manifest_{rank:05d}"


def _key(path: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in path) if path else "<root>"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return _ML_DTYPES[dtype] if dtype in _ML_DTYPES else torch.empty(0, dtype=dtype).numpy().dtype


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def _tensor_to_numpy(tensor: torch.Tensor, path: tuple[Any, ...]) -> np.ndarray:
    """The bits of ``tensor`` as a numpy array on the host (sharing memory with CPU tensors)."""
    if type(tensor).__name__ == "DTensor" or tensor.is_meta:
        raise TypeError(
            f"CheckpointStore.save: leaf {format_path(path)} is a {type(tensor).__name__} on {tensor.device}; "
            f"only local tensors with data can be saved for now (DTensor saving is the distributed issue's)"
        )
    host = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if host.dtype in _ML_DTYPES:
        as_int, np_int = _SAME_SIZE_INT[host.element_size()]
        array = host.view(as_int).numpy().view(np_int).view(_ML_DTYPES[host.dtype])
    else:
        try:
            array = host.numpy()
        except TypeError as error:
            raise TypeError(
                f"CheckpointStore.save: leaf {format_path(path)} has dtype {host.dtype}, which has no numpy "
                f"equivalent; convert it (e.g. complex32 -> complex64) before saving"
            ) from error
    return array


def _numpy_to_tensor(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if not (array.flags.c_contiguous and array.flags.writeable):  # (np.ascontiguousarray makes 0-d arrays 1-d)
        array = array.copy(order="C")
    if dtype in _ML_DTYPES:
        _, np_int = _SAME_SIZE_INT[torch.empty((), dtype=dtype).element_size()]
        return torch.from_numpy(array.view(np_int)).view(dtype)
    return torch.from_numpy(array)


def _encode(state: PyTree) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    """Split ``state`` into the arrays to store and the manifest describing every leaf, by key."""
    arrays: dict[str, np.ndarray] = {}
    leaves: dict[str, dict[str, Any]] = {}
    seen: dict[str, tuple[Any, ...]] = {}
    paths, values, _ = tree_flatten_with_path(state)
    for path, value in zip(paths, values, strict=True):
        key = _key(path)
        if key in seen:
            raise ValueError(
                f"CheckpointStore.save: leaves {format_path(seen[key])} and {format_path(path)} both have the key "
                f"{key!r}; rename one (a dict key containing '/' collides with nesting)"
            )
        seen[key] = path
        if isinstance(value, torch.Tensor):
            array = _tensor_to_numpy(value, path)
            shape = list(array.shape)
            leaves[key] = {
                "kind": "array",
                "dtype": _dtype_name(value.dtype),
                "shape": shape,
                "global_shape": shape,
                "offsets": [0] * len(shape),
                "stored": array.size > 0,
                "crc32": _crc32(array),
            }
            if array.size > 0:  # orbax refuses zero-size arrays; the manifest alone rebuilds them.
                arrays[key] = array
        elif isinstance(value, _VALUE_TYPES):
            leaves[key] = {"kind": "value", "value": value}
        else:
            raise TypeError(
                f"CheckpointStore.save: leaf {format_path(path)} is a {type(value).__name__}; a state holds torch "
                f"tensors and int/float/bool/str/None only (wrap other data in a tensor or in metadata)"
            )
    return arrays, leaves


class CheckpointStore:
    """Numbered checkpoints of a torch state tree and JSON metadata in ``directory``, through orbax.

    Args:
        directory: where the step directories live; created unless ``create=False``.
        keep: how many of the newest steps to keep (``None``: all).
        async_save: return from :meth:`save` once the arrays are copied to the host and write them in a
            background thread; call :meth:`wait` (or :meth:`close`) before reading them back.
        create: create ``directory`` if it is missing (``False`` for read-only use: a missing directory
            is then an error).

    Raises:
        ValueError: ``keep < 1``.
        FileNotFoundError: ``directory`` is missing and ``create=False``.
        NotImplementedError: more than one torch.distributed process (see docs/design/checkpoints.md).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp, CheckpointStore(tmp, keep=2) as store:
    ...     store.save(3, {"w": torch.ones(2, dtype=torch.bfloat16), "step": 3}, {"note": "hi"})
    ...     store.restore(None, like={"w": torch.zeros(2, dtype=torch.bfloat16), "step": 0})
    ({'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': 3}, {'note': 'hi'})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = None,
        async_save: bool = False,
        create: bool = True,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"CheckpointStore: keep is {keep}; pass None (keep all) or an int >= 1")
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise FileNotFoundError(
                f"CheckpointStore: checkpoint directory {self.directory} does not exist; check the path (or the "
                f"run name), or train first so that checkpoints are written there"
            )
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_world_size() > 1:
            raise NotImplementedError(
                f"CheckpointStore: {torch.distributed.get_world_size()} processes would all write rank 0's items "
                f"into {self.directory}; multi-process saving is specified in docs/design/checkpoints.md but "
                f"not implemented yet"
            )
        self.keep = keep
        self.async_save = async_save
        ocp = _orbax()
        policy = None if keep is None else ocp.checkpoint_managers.LatestN(n=keep)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy,
            enable_async_checkpointing=async_save,
            create=create,
            cleanup_tmp_directories=True,  # a save killed midway leaves <step>.orbax-checkpoint-tmp behind.
            # orbax deletes an old step file by file: a kill midway would leave a half-deleted step that
            # still looks committed. Renamed into the trash (atomic) instead, it is purged by d9dfn.
            todelete_subdir=_TRASH,
            save_root_metadata=False,
        )
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._wrote = False  # only a store that saves purges the trash (readers never race a writer's rename)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first (partial saves are never listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_directory(self, step: int) -> Path:
        """Where ``step`` is (or would be) stored."""
        return self.directory / str(step)

    def save(self, step: int, state: PyTree, metadata: dict[str, Any] | None = None) -> None:
        """Write ``state`` (torch tensors and Python scalars) and ``metadata`` (JSON) as ``step``.

        The step directory appears only once complete, so a crash mid-save leaves the earlier steps as
        they were; after the save, all but the newest ``keep`` steps are deleted.

        Raises:
            ValueError: ``step`` is negative or not above every saved step, two leaves share a key, or
                ``metadata`` is not JSON.
            TypeError: a leaf that is neither a local tensor nor a Python scalar.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointStore.save: step is {step!r}; pass the optimizer step as an int >= 0")
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"CheckpointStore.save: step {step} is not above the newest saved step {latest} in "
                f"{self.directory}; save increasing steps, or delete {self.step_directory(latest)} to rewrite it"
            )
        metadata = {} if metadata is None else metadata
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"CheckpointStore.save: metadata is not JSON ({error}); pass a dict of str keys and JSON values "
                f"(numbers, strings, lists, dicts), e.g. tensor.item() for scalars"
            ) from error
        # orbax's NumpyHandler deep-copies host arrays before save returns (deepcopy_host_arrays=True),
        # so an async save is safe even though these arrays share memory with the caller's CPU tensors.
        arrays, leaves = _encode(state)
        args = self._ocp.args
        items: dict[str, Any] = {
            "d9dfn": args.JsonSave({"format": FORMAT, "version": FORMAT_VERSION, "num_ranks": 1}),
            "metadata": args.JsonSave(metadata),
            _manifest_item(0): args.JsonSave({"rank": 0, "leaves": leaves}),
        }
        if arrays:
            items[_rank_item(0)] = args.PyTreeSave(arrays)
        # Purge only with no save in flight: orbax's finalize thread moves old steps into the trash.
        self._manager.wait_until_finished()
        self._wrote = True
        self._purge_deleted()
        saved = self._manager.save(step, args=args.Composite(**items))
        assert saved, f"orbax declined to save step {step}"
        if not self.async_save:
            self._purge_deleted()

    def wait(self) -> None:
        """Block until an async save has been committed (no-op for synchronous saves)."""
        self._manager.wait_until_finished()
        self._purge_deleted()

    def close(self) -> None:
        """Wait for pending saves and release orbax's resources."""
        self._manager.close()
        self._purge_deleted()

    def _purge_deleted(self) -> None:
        """Remove the steps that retention moved into the trash (a kill midway leaves them for next time)."""
        if self._wrote:
            shutil.rmtree(self.directory / _TRASH, ignore_errors=True)

    def restore(
        self, step: int | None = None, like: PyTree = None, *, strict: bool = True, fallback: bool = False
    ) -> tuple[PyTree, dict[str, Any]]:
        """Read ``step`` (default: the newest) back as ``(state, metadata)``.

        With a template ``like``, the state has ``like``'s structure, and every tensor must have its
        template's dtype and shape; it lands on the template's device (CPU for a ``meta`` template).
        Without one, the state is the flat ``{key: leaf}`` dict as stored.

        Args:
            step: which step; ``None`` for the newest.
            like: a tree of the same structure as the saved state, or ``None``.
            strict: refuse saved leaves that ``like`` has no place for (``False``: ignore them, e.g. to
                read only ``{"params": ...}`` out of a training state).
            fallback: with ``step=None``, skip corrupted steps (logging a warning) and return the newest
                readable one; the caller learns which from the metadata it saved.

        Raises:
            FileNotFoundError: no checkpoint at all, or no ``step``.
            CheckpointCorruptedError: the step's files are missing, truncated or altered.
            ValueError: ``like`` does not match the saved leaves (key paths, dtypes, shapes, kinds).
        """
        self._manager.wait_until_finished()  # a step being saved asynchronously is read once committed
        self._manager.reload()  # see steps written or deleted by other stores since this one opened.
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"CheckpointStore.restore: no checkpoint in {self.directory}; check the directory (or run name), "
                f"or start from scratch"
            )
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"CheckpointStore.restore: no step {step} in {self.directory} (saved steps: {steps}); pass one of "
                f"them, or None for the newest"
            )
        candidates = [step] if step is not None else (steps[::-1] if fallback else [steps[-1]])
        for i, candidate in enumerate(candidates):
            try:
                flat, metadata = self._read(candidate, steps)
            except CheckpointCorruptedError as error:
                if i + 1 == len(candidates):
                    raise
                _LOG.warning("%s; falling back to step %d", error, candidates[i + 1])
                continue
            return _match(flat, like, strict=strict, step=candidate), metadata
        raise AssertionError("unreachable: the loop returns or raises")

    def _read(self, step: int, steps: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The flat ``{key: tensor | value}`` dict and metadata of ``step``, checked against its manifest."""
        step_dir = self.step_directory(step)

        def corrupted(problem: str) -> CheckpointCorruptedError:
            return CheckpointCorruptedError(
                f"CheckpointStore.restore: step {step} in {step_dir} is corrupted: {problem}; restore another step "
                f"(saved steps: {steps}) with restore(step=...) or fallback=True, or delete {step_dir}"
            )

        args = self._ocp.args
        try:
            head = self._manager.restore(
                step,
                args=args.Composite(
                    d9dfn=args.JsonRestore(), metadata=args.JsonRestore(), **{_manifest_item(0): args.JsonRestore()}
                ),
            )
            header, metadata, manifest = head["d9dfn"], head["metadata"], head[_manifest_item(0)]
        except Exception as error:  # orbax/tensorstore/json raise many types; all mean "unreadable" here.
            raise corrupted(_brief(error)) from error
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise corrupted(f"{step_dir / 'd9dfn'} does not describe a {FORMAT} (got {header!r})")
        if header.get("version") != FORMAT_VERSION or header.get("num_ranks") != 1:
            raise NotImplementedError(
                f"CheckpointStore.restore: step {step} in {step_dir} has format version {header.get('version')} "
                f"written by {header.get('num_ranks')} processes; this d9dfn reads version {FORMAT_VERSION} from one "
                f"process; restore it with the d9dfn version (and process count) that wrote it"
            )
        leaves: dict[str, dict[str, Any]] = manifest["leaves"]
        stored = [key for key, leaf in leaves.items() if leaf["kind"] == "array" and leaf["stored"]]
        arrays: dict[str, np.ndarray] = {}
        if stored:
            rank_dir = step_dir / _rank_item(0)
            try:
                arrays = self._manager.restore(step, args=args.Composite(**{_rank_item(0): args.PyTreeRestore()}))[
                    _rank_item(0)
                ]
            except Exception as error:  # as above
                raise corrupted(f"cannot read {rank_dir} ({_brief(error)})") from error
            if sorted(arrays) != sorted(stored):
                raise corrupted(f"{rank_dir} holds keys {sorted(arrays)} but its manifest lists {sorted(stored)}")
        flat: dict[str, Any] = {}
        for key, leaf in leaves.items():
            if leaf["kind"] == "value":
                flat[key] = leaf["value"]
            elif not leaf["stored"]:
                flat[key] = torch.empty(leaf["shape"], dtype=getattr(torch, leaf["dtype"]))
            else:
                array, dtype = arrays[key], getattr(torch, leaf["dtype"])
                if array.dtype != _numpy_dtype(dtype) or list(array.shape) != leaf["shape"]:
                    raise corrupted(
                        f"leaf {key!r} reads back as {array.dtype} {list(array.shape)}, not as the "
                        f"{leaf['dtype']} {leaf['shape']} its manifest lists"
                    )
                if _crc32(arrays[key]) != leaf["crc32"]:
                    raise corrupted(f"leaf {key!r} in {step_dir / _rank_item(0)} fails its checksum (crc32)")
                flat[key] = _numpy_to_tensor(array, leaf["dtype"])
        return flat, metadata


def _brief(error: Exception) -> str:
    """An exception as one line short enough to read (tensorstore appends its whole JSON spec)."""
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + " ..."


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(dtype={_dtype_name(value.dtype)}, shape={tuple(value.shape)})"
    return f"{type(value).__name__}({value!r})"


def _match(flat: dict[str, Any], like: PyTree, *, strict: bool, step: int) -> PyTree:
    """Put the saved leaves into ``like``'s structure, checking kinds, dtypes and shapes."""
    if like is None:
        return flat
    paths, templates, treespec = tree_flatten_with_path(like)
    keys = [_key(path) for path in paths]
    missing = [path for path, key in zip(paths, keys, strict=True) if key not in flat]
    unexpected = sorted(set(flat) - set(keys)) if strict else []
    if missing or unexpected:
        raise ValueError(
            f"CheckpointStore.restore: step {step} does not fit the template: the template has "
            f"{[format_path(p) for p in missing[:5]]}{' ...' if len(missing) > 5 else ''} that the checkpoint lacks, "
            f"and the checkpoint has {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} that the template lacks; "
            f"pass like= a tree of the saved structure (saved keys: {list(flat)[:8]}"
            f"{' ...' if len(flat) > 8 else ''}), or strict=False to ignore extra saved leaves"
        )
    restored = []
    for path, key, template in zip(paths, keys, templates, strict=True):
        saved = flat[key]
        if isinstance(template, torch.Tensor):
            fits = isinstance(saved, torch.Tensor) and saved.dtype == template.dtype and saved.shape == template.shape
            device = torch.device("cpu") if template.is_meta else template.device
        else:
            fits = type(saved) is type(template) and isinstance(template, _VALUE_TYPES)
        if not fits:
            raise ValueError(
                f"CheckpointStore.restore: leaf {format_path(path)} of step {step} is {_describe(saved)} but the "
                f"template has {_describe(template)}; make the template leaf match the saved one (convert after "
                f"restoring), or restore a step saved with this structure"
            )
        restored.append(saved.to(device) if isinstance(saved, torch.Tensor) else saved)
    return tree_unflatten(treespec, restored)
