"""Checkpoint checks that agree (issue 22 item 3): every kind of damage to a step x {train, infer, export}.

One tiny eager run saves steps 1 and 2 once per module; each case copies it, damages step 2 and runs the
command in-process through ``d9dfn.cli.main``. Every command checks the whole step against its file list
(``d9dfn/checkpoint/_integrity.py``), so all three refuse alike: exit 2, one line naming the damaged file and
the command's own option that reads another step. The table in ``docs/design/checkpoints.md`` is ``KINDS``.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _jobs import TINY, job_argv

from d9dfn.checkpoint import CheckpointStore
from d9dfn.cli import main

STEPS = ("trainer.total_steps=2", "trainer.checkpointing.period_steps=1")
"""Two saved steps: step 2 is damaged, step 1 is the newest intact one."""

COMMANDS = ("train", "infer", "export")


def _flip(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _biggest(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _one_less(metadata: dict) -> None:
    metadata["log_lines"] -= 1  # still valid JSON, still a count: only a checksum can tell


def _other_moment_checksum(manifest: dict) -> None:
    # The leaf crc32 of an optimizer moment no longer matches its (intact) bytes: what a resume reads and
    # checks, and what reading the weights alone never sees.
    manifest["leaves"]["opt_state/2/norm.weight"]["crc32"] ^= 1


def _flip_leaf(step_dir: Path, raw: bytes) -> None:
    """Flip one byte inside a leaf's stored bytes, in every data file that holds them (OCDBT keeps two copies)."""
    hits = 0
    for file in (step_dir / "rank_00000").rglob("*"):
        if file.is_file() and (at := file.read_bytes().find(raw)) >= 0:
            _flip(file, at + len(raw) // 2)
            hits += 1
    assert hits, "the leaf's bytes are in no data file"


def _drop_listed(step_dir: Path, prefix: str, *, own_crc32: bool) -> None:
    """Drop the entries under ``prefix`` from the step's file list; ``own_crc32``: recompute the list's own crc32
    (as an editor who knew the format would), else leave it (a plain edit); without it, as a list of an older step."""
    file_list = step_dir / "d9dfn" / "files.json"
    listed = json.loads(file_list.read_text())
    listed["files"] = {name: entry for name, entry in listed["files"].items() if not name.startswith(prefix)}
    if own_crc32:
        entries = json.dumps(listed["files"], sort_keys=True, separators=(",", ":")).encode()
        listed["crc32"] = zlib.crc32(entries)
    file_list.write_text(json.dumps(listed))


def _unlisted_edit(step_dir: Path, *, own_crc32: bool) -> None:
    """Issue 44 point 4: an entry dropped from the list, then the file it listed edited (``log_lines``)."""
    _drop_listed(step_dir, "metadata/metadata", own_crc32=own_crc32)
    _edit_json(step_dir / "metadata" / "metadata", _one_less)


def _drop_item(step_dir: Path, item: str) -> None:
    """An item's folder deleted with its entries, the list's crc32 recomputed: only the step's own metadata (orbax's
    item list, the header's rank count) says it is gone."""
    shutil.rmtree(step_dir / item)
    _drop_listed(step_dir, f"{item}/", own_crc32=True)


def _drop_item_everywhere(step_dir: Path, item: str) -> None:
    """As :func:`_drop_item`, and out of orbax's item list too (its entry in the list rewritten to match): only the
    header's rank count still names it."""
    orbax = step_dir / "_CHECKPOINT_METADATA"
    _edit_json(orbax, lambda metadata: metadata["item_handlers"].pop(item))
    file_list = step_dir / "d9dfn" / "files.json"
    listed = json.loads(file_list.read_text())
    listed["files"]["_CHECKPOINT_METADATA"] = [orbax.stat().st_size, zlib.crc32(orbax.read_bytes())]
    file_list.write_text(json.dumps(listed))
    _drop_item(step_dir, item)


_LISTED = "listed in d9dfn/files.json"
KINDS: dict[str, tuple[Callable[[Path, dict[str, bytes]], None], str]] = {
    "truncated-array-file": (
        lambda s, raw: _truncate(_biggest(s / "rank_00000")),
        rf"file rank_00000/\S+ has \d+ bytes, not the \d+ {_LISTED}",
    ),
    "byte-flipped-array-file": (
        lambda s, raw: _flip(_biggest(s / "rank_00000")),
        rf"file rank_00000/\S+ fails its checksum \(crc32 {_LISTED}\)",
    ),
    "byte-flipped-weight": (
        lambda s, raw: _flip_leaf(s, raw["params"]),
        rf"file rank_00000/\S+ fails its checksum \(crc32 {_LISTED}\)",
    ),
    "byte-flipped-optimizer-state": (
        lambda s, raw: _flip_leaf(s, raw["opt_state"]),
        rf"file rank_00000/\S+ fails its checksum \(crc32 {_LISTED}\)",
    ),
    "checksum-failure-in-optimizer-state": (
        lambda s, raw: _edit_json(s / "manifest_00000" / "metadata", _other_moment_checksum),
        rf"file manifest_00000/metadata fails its checksum \(crc32 {_LISTED}\)",
    ),
    "deleted-array-metadata": (
        lambda s, raw: (s / "rank_00000" / "_METADATA").unlink(),
        rf"file rank_00000/_METADATA is missing \({_LISTED}\)",
    ),
    "truncated-leaf-manifest": (
        lambda s, raw: _truncate(s / "manifest_00000" / "metadata"),
        rf"file manifest_00000/metadata has \d+ bytes, not the \d+ {_LISTED}",
    ),
    "deleted-caller-metadata": (
        lambda s, raw: (s / "metadata" / "metadata").unlink(),
        rf"file metadata/metadata is missing \({_LISTED}\)",
    ),
    "altered-header": (
        lambda s, raw: (s / "d9dfn" / "metadata").write_text('{"format": "something else"}'),
        rf"file d9dfn/metadata has 28 bytes, not the \d+ {_LISTED}",
    ),
    "deleted-checkpoint-metadata": (
        lambda s, raw: (s / "_CHECKPOINT_METADATA").unlink(),
        rf"file _CHECKPOINT_METADATA is missing \({_LISTED}\)",
    ),
    "emptied-ocdbt-manifest": (
        lambda s, raw: (s / "rank_00000" / "manifest.ocdbt").write_bytes(b""),
        rf"file rank_00000/manifest.ocdbt has 0 bytes, not the \d+ {_LISTED}",
    ),
    "byte-flipped-ocdbt-manifest": (
        lambda s, raw: _flip(s / "rank_00000" / "manifest.ocdbt"),
        rf"file rank_00000/manifest.ocdbt fails its checksum \(crc32 {_LISTED}\)",
    ),
    "emptied-process-ocdbt-manifest": (
        lambda s, raw: (s / "rank_00000" / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b""),
        rf"file rank_00000/ocdbt.process_0/manifest.ocdbt has 0 bytes, not the \d+ {_LISTED}",
    ),
    "byte-flipped-process-ocdbt-manifest": (
        lambda s, raw: _flip(s / "rank_00000" / "ocdbt.process_0" / "manifest.ocdbt"),
        rf"file rank_00000/ocdbt.process_0/manifest.ocdbt fails its checksum \(crc32 {_LISTED}\)",
    ),
    "edited-log-lines": (
        lambda s, raw: _edit_json(s / "metadata" / "metadata", _one_less),
        rf"file metadata/metadata fails its checksum \(crc32 {_LISTED}\)",
    ),
    "deleted-step-item": (
        lambda s, raw: shutil.rmtree(s / "manifest_00000"),
        r"folder manifest_00000/ is missing \(its 2 files are listed in d9dfn/files.json\)",
    ),
    "deleted-process-data": (
        lambda s, raw: shutil.rmtree(s / "rank_00000" / "ocdbt.process_0"),
        r"folder rank_00000/ocdbt.process_0/ is missing \(its \d+ files are listed in d9dfn/files.json\)",
    ),
    "deleted-file-list": (
        lambda s, raw: (s / "d9dfn" / "files.json").unlink(),
        r"its file list d9dfn/files.json is missing",
    ),
    "dropped-entry-then-edited": (
        lambda s, raw: _unlisted_edit(s, own_crc32=False),
        r"its file list d9dfn/files.json fails its own checksum \(crc32 of its entries\): it was edited",
    ),
    "dropped-entry-and-crc32-then-edited": (
        lambda s, raw: _unlisted_edit(s, own_crc32=True),
        r"file metadata/metadata is not listed in d9dfn/files.json: added after the step was saved, or its entry "
        r"was dropped from the list",
    ),
    "added-file": (
        lambda s, raw: (s / "rank_00000" / "notes.txt").write_text("mine"),
        r"file rank_00000/notes.txt is not listed in d9dfn/files.json: .*",
    ),
    "dropped-item-of-orbax": (
        lambda s, raw: _drop_item(s, "rank_00000"),
        r"its file list d9dfn/files.json names no file of item\(s\) \['rank_00000'\], which orbax's "
        r"_CHECKPOINT_METADATA names",
    ),
    "dropped-item-of-the-header": (
        lambda s, raw: _drop_item_everywhere(s, "manifest_00000"),
        r"its file list d9dfn/files.json names no file of item\(s\) \['manifest_00000'\], which the header \(1 "
        r"rank\(s\)\) names",
    ),
}
"""Each kind of damage to a step directory (``raw``: the stored bytes of one weight and one optimizer moment),
and the problem every command reports."""

FIXES = {
    "train": "resume from the newest intact step with `d9dfn train --resume-from newest-intact`, or a saved step "
    "with `--resume-from STEP` (saved steps: [1, 2]); the later steps are then set aside",
    "infer": "evaluate the newest intact step with `d9dfn infer --step newest-intact`, or a saved step with "
    "`--step STEP` (saved steps: [1, 2])",
    "export": "export the newest intact step with `d9dfn export --step newest-intact`, or a saved step with "
    "`--step STEP` (saved steps: [1, 2])",
}
"""The way out each command names: its own options, never a Python call."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A tiny run with steps 1 and 2, and the raw bytes of a weight and of an optimizer moment of step 2."""
    root = tmp_path_factory.mktemp("trained")
    assert main(job_argv("train", root, *STEPS, base=TINY)) == 0
    checkpoints = root / "stdlib-lm" / "checkpoints"
    with CheckpointStore(checkpoints, create=False) as store:
        state, _ = store.restore(2)
    arrays = {key: leaf.numpy().tobytes() for key, leaf in state.items() if isinstance(leaf, torch.Tensor)}
    data = b"".join(p.read_bytes() for p in (checkpoints / "2" / "rank_00000").rglob("*") if p.is_file())

    def stored_raw(prefix: str) -> bytes:
        # A leaf stored as raw bytes (the small ones are) that are no other leaf's.
        for key, raw in arrays.items():
            unique = sum(raw in other for other in arrays.values()) == 1
            if key.startswith(prefix) and len(raw) >= 32 and raw in data and unique:
                return raw
        raise AssertionError(f"no leaf under {prefix} is stored as raw bytes")

    return root, {"params": stored_raw("params/"), "opt_state": stored_raw("opt_state/")}


def _argv(command: str, root: Path, *extra: str) -> list[str]:
    if command == "export":
        return ["export", str(root / "stdlib-lm"), str(root / "export"), *extra]
    return [*job_argv(command, root, *STEPS, base=TINY), *extra]


def _copy(trained: tuple[Path, dict[str, bytes]], to: Path, *kinds: str, steps: tuple[int, ...] = (2,)) -> Path:
    root, raw = trained
    shutil.copytree(root, to, dirs_exist_ok=True)
    for kind in kinds:
        for step in steps:
            KINDS[kind][0](to / "stdlib-lm" / "checkpoints" / str(step), raw)
    return to


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_command_refuses_a_damaged_step_alike(trained, tmp_path: Path, capsys, kind: str, command: str) -> None:
    root = _copy(trained, tmp_path, kind)
    assert main(_argv(command, root)) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback, no warning
    step_dir = root / "stdlib-lm" / "checkpoints" / "2"
    prefix = f"d9dfn: error: checkpoint step 2 in {step_dir} is corrupted: "
    assert re.fullmatch(re.escape(prefix) + KINDS[kind][1] + re.escape(f"; {FIXES[command]}"), lines[0]), lines[0]
    assert not (root / "export").exists()  # nothing written from a damaged step


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_reads_an_intact_step(trained, tmp_path: Path, capsys, command: str) -> None:
    root = _copy(trained, tmp_path)
    assert main(_argv(command, root)) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err.lower()
    if command == "export":
        assert (root / "export" / "model.safetensors").is_file()
    else:
        assert "checkpoint step 2)" in captured.out


def test_newest_intact_and_a_named_step_go_on_past_the_damage(trained, tmp_path: Path, capsys, caplog) -> None:
    root = _copy(trained, tmp_path, "byte-flipped-optimizer-state")
    assert main(_argv("infer", root, "--step", "newest-intact")) == 0
    assert "checkpoint step 1)" in capsys.readouterr().out
    warning = r"step 2 in \S+ is corrupted: file rank_00000/\S+ fails its checksum.*; falling back to step 1"
    assert re.search(warning, caplog.text)
    assert main(_argv("export", root, "--step", "1")) == 0
    assert (root / "export" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(_argv("train", root, "--resume-from", "newest-intact")) == 0
    out = capsys.readouterr().out
    assert "from step 1 (resume_from='newest-intact')" in out
    assert "set aside the later step(s) [2]" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_no_intact_step_left_says_so(trained, tmp_path: Path, capsys, command: str) -> None:
    root = _copy(trained, tmp_path, "edited-log-lines", steps=(1, 2))
    option = "--resume-from" if command == "train" else "--step"
    assert main(_argv(command, root, option, "newest-intact")) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(
        f"d9dfn: error: checkpoint step 1 in {root / 'stdlib-lm' / 'checkpoints' / '1'} is corrupted"
    )
    fix = "start over under another run name (--set trainer.run.name=NAME)" if command == "train" else "train again"
    assert line.endswith(f"; no saved step is intact (saved steps: [1, 2]); {fix}")
