"""CheckpointStore on several gloo ranks: sharded saves, resharding restores (2 -> 1, 2, 4, 2x2, replicated).

The ranks start from a forkserver, not by forking the pytest worker: tensorstore (under orbax) aborts a forked
child that uses it once the parent has used it, and test_checkpoint.py runs in the same worker first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from _ranks import _init, _run_ranks
from hypothesis import given
from hypothesis import strategies as st

from d9dfn._pytree import tree_flatten_with_path, tree_map, tree_unflatten
from d9dfn.checkpoint import CheckpointCorruptedError, CheckpointStore
from d9dfn.checkpoint._layout import Piece, Region, SavedArray, check_cover, copy_overlap

TESTS = Path(__file__).resolve().parent


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0, subnormals) of ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=generator).view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


class AdamLike(NamedTuple):
    mu: dict[str, torch.Tensor]
    nu: dict[str, torch.Tensor]
    count: torch.Tensor


def full_state(seed: int) -> dict[str, Any]:
    """A training-state-like tree of whole tensors; every rank builds the same one."""
    params = {
        "w": random_bits((5, 3), torch.float32, seed),  # 5 rows: 3 + 2 on two ranks, 2 + 2 + 1 + 0 on four
        "emb": random_bits((2, 4), torch.bfloat16, seed + 1),  # 2 rows on four ranks: two empty shards
        "norm": random_bits((6,), torch.bfloat16, seed + 2),
        "head.bias": random_bits((3,), torch.float32, seed + 3),
    }
    moments = {
        name: random_bits(tuple(p.shape), torch.float32, seed + 10 + i) for i, (name, p) in enumerate(params.items())
    }
    return {
        "params": params,
        "opt_state": (AdamLike(mu=moments, nu=tree_map(torch.square, moments), count=torch.tensor(seed)), None),
        "step": torch.tensor(seed, dtype=torch.int64),
        "key": torch.tensor(seed * 7919, dtype=torch.int64),
        "lr": 0.1 * seed,
    }


def distribute(state: dict[str, Any], mesh: Any, placements: Any, replicated: tuple[str, ...] = ()) -> dict[str, Any]:
    """``state`` with every params / opt_state tensor of dim >= 1 as a DTensor (``replicated`` names: Replicate)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    paths, leaves, spec = tree_flatten_with_path(state)
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and path[0] in ("params", "opt_state"):
            leaf_placements = [Replicate()] * mesh.ndim if path[-1] in replicated else placements
            # src_data_rank=None: every rank slices its own copy of the (identical) full tensor, no scatter.
            leaf = distribute_tensor(leaf, mesh, leaf_placements, src_data_rank=None)
        out.append(leaf)
    return tree_unflatten(spec, out)


def assert_restored(restored: Any, template: Any, full: Any) -> None:
    """Each leaf has the template's kind and layout, this rank's shard of ``full``, and ``full`` as a whole."""
    from torch.distributed.tensor import DTensor

    got_paths, got, _ = tree_flatten_with_path(restored)
    _, templates, _ = tree_flatten_with_path(template)
    _, wants, _ = tree_flatten_with_path(full)
    assert len(got) == len(templates) == len(wants)
    for path, leaf, like, want in zip(got_paths, got, templates, wants, strict=True):
        assert type(leaf) is type(like), path
        if isinstance(like, DTensor):
            assert (leaf.device_mesh, leaf.placements, leaf.shape) == (like.device_mesh, like.placements, like.shape)
            assert bits(leaf.to_local()) == bits(like.to_local()), path  # this rank's shard, bit for bit
            assert bits(leaf.full_tensor()) == bits(want), path
        elif isinstance(like, torch.Tensor):
            assert (leaf.dtype, leaf.shape, bits(leaf)) == (want.dtype, want.shape, bits(want)), path
        else:
            assert leaf == want, path


def _save_worker(rank: int, world_size: int, init_file: str, directory: str) -> None:
    """Two ranks save steps 1-3 (keep=2) of an FSDP-like state, then read them back on the same mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    dist = _init(rank, world_size, init_file)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        store = CheckpointStore(directory, keep=2)
        # One rank's bad leaf fails the save on every rank, with that rank's message, and commits nothing.
        bad = distribute(full_state(1), mesh, [Shard(0)], replicated=("norm",))
        if rank == 1:
            bad["extra"] = object()
        with pytest.raises(
            TypeError, match=r"leaf \['extra'\] is a object" + ("" if rank == 1 else r".*raised on rank 1")
        ):
            store.save(1, bad, {"step": 1})
        assert store.all_steps() == []
        for step in (1, 2, 3):
            store.save(step, distribute(full_state(step), mesh, [Shard(0)], replicated=("norm",)), {"step": step})
        assert store.all_steps() == [2, 3]  # retention, on every rank
        like = distribute(full_state(0), mesh, [Shard(0)], replicated=("norm",))
        restored, metadata = store.restore(None, like=like)
        assert metadata == {"step": 3}
        assert_restored(restored, distribute(full_state(3), mesh, [Shard(0)], replicated=("norm",)), full_state(3))
        with pytest.raises(FileNotFoundError, match=r"no step 1 .*saved steps: \[2, 3\]"):
            store.restore(1, like=like)
        # A template that does not fit on one rank fails the restore on all of them.
        wrong = dict(like, lr=0) if rank == 0 else like
        with pytest.raises(
            ValueError, match=r"leaf \['lr'\] of step 3 is float\(0.3" + ("" if rank == 0 else ".*rank 0")
        ):
            store.restore(3, like=wrong)
        store.close()
        # Async: rank 0 commits in the background; the others return once their items are staged.
        with CheckpointStore(Path(directory).parent / "async", async_save=True) as fast:
            fast.save(7, distribute(full_state(7), mesh, [Shard(0)]), {"step": 7})
            fast.wait()
            assert_restored(
                fast.restore(7, like=like)[0], distribute(full_state(7), mesh, [Shard(0)], ("norm",)), full_state(7)
            )
    finally:
        dist.destroy_process_group()


def _restore_worker(rank: int, world_size: int, init_file: str, directory: str, single: str) -> None:
    """Four ranks read the two-rank steps as 4-way shards, 2x2 hybrid shards and replicas; then corruption."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    dist = _init(rank, world_size, init_file)
    try:
        flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        layouts = [
            (flat, [Shard(0)]),
            (hybrid, [Replicate(), Shard(0)]),
            (flat, [Replicate()]),
            (hybrid, [Shard(0), Shard(0)]),
        ]
        store = CheckpointStore(directory, create=False)
        for mesh, placements in layouts:
            restored, metadata = store.restore(3, like=distribute(full_state(0), mesh, placements))
            assert metadata == {"step": 3}
            assert_restored(restored, distribute(full_state(3), mesh, placements), full_state(3))
        # A single-process checkpoint restores sharded too.
        restored, _ = CheckpointStore(single, create=False).restore(
            None, like=distribute(full_state(0), hybrid, [Replicate(), Shard(0)])
        )
        assert_restored(restored, distribute(full_state(5), hybrid, [Replicate(), Shard(0)]), full_state(5))
        # A byte of rank_00001's biggest array file flips. Rank 1 checks that item's files against the step's
        # file list (rank 0 the JSON items): every rank reports the corruption, and all fall back alike.
        dist.barrier()
        if rank == 0:
            item = Path(directory) / "3" / "rank_00001"
            biggest = max((p for p in item.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
            data = bytearray(biggest.read_bytes())
            data[len(data) // 2] ^= 0xFF
            biggest.write_bytes(bytes(data))
        dist.barrier()
        like = distribute(full_state(0), flat, [Shard(0)])
        with pytest.raises(
            CheckpointCorruptedError,
            match=r"step 3 .* is corrupted: file rank_00001/\S+ fails its checksum \(crc32 listed in d9dfn/files",
        ) as info:
            store.restore(None, like=like)
        assert info.value.steps == [2, 3]  # on every rank, with the way out
        assert "CheckpointStore.restore(step=...)" in str(info.value)
        restored, metadata = store.restore(None, like=like, fallback=True)
        assert metadata == {"step": 2}
        assert_restored(restored, distribute(full_state(2), flat, [Shard(0)]), full_state(2))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_checkpoint_store_sharded_save_on_two_ranks_restores_on_one_two_and_four(tmp_path: Path) -> None:
    directory, single = tmp_path / "ckpt", tmp_path / "single"
    _run_ranks(_save_worker, 2, tmp_path, str(directory), clean=True)
    # One committed step per save, nothing left in staging, and each replicated leaf written once (rank 0).
    assert sorted(p.name for p in directory.iterdir()) == ["2", "3"]
    names = {p.name for p in (directory / "3").iterdir()}
    assert {"d9dfn", "metadata", "manifest_00000", "manifest_00001", "rank_00000", "rank_00001"} <= names
    assert json.loads((directory / "3" / "d9dfn" / "metadata").read_text())["num_ranks"] == 2
    manifests = [json.loads((directory / "3" / f"manifest_{r:05d}" / "metadata").read_text())["leaves"] for r in (0, 1)]
    assert ("params/norm" in manifests[0], "params/norm" in manifests[1]) == (True, False)
    assert ("step" in manifests[0], "step" in manifests[1]) == (True, False)
    assert (manifests[0]["params/w"]["offsets"], manifests[1]["params/w"]["offsets"]) == ([0, 0], [3, 0])
    assert (manifests[0]["params/w"]["shape"], manifests[1]["params/w"]["shape"]) == ([3, 3], [2, 3])
    # On one process with no process group at all: whole plain tensors.
    restored, metadata = CheckpointStore(directory, create=False).restore(3, like=full_state(0))
    assert metadata == {"step": 3}
    assert_restored(restored, full_state(3), full_state(3))
    flat, _ = CheckpointStore(directory, create=False).restore(3)
    assert bits(flat["opt_state/0/1/emb"]) == bits(full_state(3)["opt_state"][0].nu["emb"])
    with CheckpointStore(single) as store:
        store.save(5, full_state(5), {"step": 5})
    _run_ranks(_restore_worker, 4, tmp_path, str(directory), str(single), clean=True)


def _vanishing_rank_worker(rank: int, world_size: int, init_file: str, directory: str, report: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    dist = _init(rank, world_size, init_file, timeout_s=5.0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    state = distribute(full_state(1), mesh, [Shard(0)])
    store = CheckpointStore(directory)
    if rank == 1:
        os._exit(0)  # dies silently before the save: only the collectives can notice
    start = time.monotonic()
    try:
        store.save(1, state, {"step": 1})
    except Exception as error:  # the point: it raises instead of waiting forever
        Path(report).write_text(f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {error}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.ranks
def test_checkpoint_store_save_fails_when_a_rank_is_gone(tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    _run_ranks(_vanishing_rank_worker, 2, tmp_path, str(tmp_path / "ckpt"), str(report), clean=True)
    text = report.read_text()
    seconds = float(text.split(" after ")[1].split(" s:")[0])
    assert seconds < 10, text  # the 5 s process-group timeout at most, never a hang
    assert CheckpointStore(tmp_path / "ckpt").all_steps() == []


# ------------------------------------------------------------------------------------------------ the pure resharding


def _chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``size`` rows into ``parts``: (start, rows), trailing parts possibly empty."""
    step = -(-size // parts) if size else 0
    return [(min(i * step, size), max(0, min(step, size - i * step))) for i in range(parts)]


@given(
    rows=st.integers(0, 9),
    cols=st.integers(1, 3),
    saved_parts=st.integers(1, 4),
    read_parts=st.integers(1, 5),
    dim=st.integers(0, 1),
)
def test_checkpoint_resharding_equals_slicing_the_full_tensor(rows, cols, saved_parts, read_parts, dim) -> None:
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    size = full.shape[dim]

    def box(start: int, length: int) -> Region:
        offsets, shape = [0, 0], list(full.shape)
        offsets[dim], shape[dim] = start, length
        return Region(tuple(offsets), tuple(shape))

    pieces = [
        Piece(r, box(s, n), n * full.shape[1 - dim] > 0, 0) for r, (s, n) in enumerate(_chunks(size, saved_parts))
    ]
    saved = SavedArray("float32", tuple(full.shape), tuple(pieces))
    for start, length in _chunks(size, read_parts):
        region = box(start, length)
        check_cover(saved, region)
        out = torch.full(region.shape, float("nan"))
        for piece in pieces:
            data = full[tuple(slice(o, o + n) for o, n in zip(piece.region.offsets, piece.region.shape, strict=True))]
            copy_overlap(out, region, piece.region, data)
        assert torch.equal(out, full.narrow(dim, start, length))
    if pieces[0].stored:  # without the first piece there is a gap; with it twice, an overlap
        with pytest.raises(ValueError, match="do not cover"):
            check_cover(saved._replace(pieces=saved.pieces[1:]), box(0, size))
        with pytest.raises(ValueError, match="overlap"):
            check_cover(saved._replace(pieces=(pieces[0], *pieces)), box(0, size))
