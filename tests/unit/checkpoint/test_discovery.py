"""The "last" rule of `lightning_dpar.checkpoint.discovery`, in-process: `resolve_last` picks the newest complete
checkpoint, skipping dangling links, interrupted saves and every kind of damage, and says what it skipped. The
checkpoints under real faults (SIGKILLs, a frozen rank, full and read-only disks) are in
`tests/launched/test_checkpoint_faults.py` (workers in `tests/workers/checkpoint_faults.py`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dpar.checkpoint.discovery import resolve_last
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.storage import Location


def _sharded_checkpoint(path: Path, mtime: float) -> None:
    """A real (one-process) DCP directory with `meta.pt`, completed at `mtime`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        dcp.save({"state_dict": {"w": torch.zeros(2)}}, checkpoint_id=str(path), no_dist=True)
    torch.save({}, path / "meta.pt")
    os.utime(path / "meta.pt", (mtime, mtime))


def test_resolve_last_picks_newest_complete_and_skips_dangling_link(tmp_path):
    _sharded_checkpoint(tmp_path / "step=3.ckpt", 1000)
    _sharded_checkpoint(tmp_path / "step=4.ckpt", 2000)
    _sharded_checkpoint(tmp_path / "step=5.ckpt", 3000)
    next((tmp_path / "step=5.ckpt").glob("*.distcp")).unlink()  # a shard went missing: not complete
    os.symlink("step=6.ckpt", tmp_path / "last.ckpt")  # its save never completed
    (tmp_path / ".dpar-partial-0123456789-abcd1234").mkdir()
    path, reason = resolve_last([Location.parse(tmp_path)])
    assert path == str(tmp_path / "step=4.ckpt")
    assert "last.ckpt" in reason and "step=5.ckpt" in reason and ".dpar-partial-" in reason


def test_resolve_last_follows_a_valid_link_and_prefers_newest(tmp_path):
    _sharded_checkpoint(tmp_path / "step=3.ckpt", 3000)
    _sharded_checkpoint(tmp_path / "step=2.ckpt", 1000)
    os.symlink("step=3.ckpt", tmp_path / "last.ckpt")
    path, _ = resolve_last([Location.parse(tmp_path)])
    # The link and its target are equally new: the `last` name wins, as in Lightning's own resolution (which also
    # keeps `ModelCheckpoint` from deleting the checkpoint a run resumed from when that is not `last`).
    assert path == str(tmp_path / "last.ckpt")


def test_resolve_last_without_checkpoints_leaves_it_to_lightning(tmp_path):
    assert resolve_last([Location.parse(tmp_path / "missing")])[0] is None
    assert resolve_last([Location.parse(tmp_path)])[0] is None


def test_resolve_last_with_only_interrupted_saves_raises(tmp_path):
    os.symlink("step=6.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(CheckpointLoadError, match="no complete checkpoint"):
        resolve_last([Location.parse(tmp_path)])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("meta_truncated", "meta.pt' cannot be read"),
        ("index_truncated", ".metadata' cannot be read as a dcp index"),
        ("shard_truncated", "is truncated"),
        ("shard_missing", "is missing"),
        ("meta_missing", "lacks 'meta.pt'"),
    ],
)
def test_resolve_last_skips_every_kind_of_damage_naming_it_and_why(tmp_path, damage, why):
    """Whatever is damaged in the newest checkpoint (a truncated `meta.pt` used to be picked, and its load failed),
    "last" resolves to the newest intact one, and the line saying so names the skipped one and the damage."""
    _sharded_checkpoint(tmp_path / "step=1.ckpt", 1000)
    _sharded_checkpoint(tmp_path / "step=2.ckpt", 2000)
    newest = tmp_path / "step=2.ckpt"
    shard = next(newest.glob("*.distcp"))
    if damage == "meta_truncated":
        data = (newest / "meta.pt").read_bytes()
        (newest / "meta.pt").write_bytes(data[: len(data) // 2])
        os.utime(newest / "meta.pt", (2000, 2000))
    elif damage == "index_truncated":
        (newest / ".metadata").write_bytes((newest / ".metadata").read_bytes()[:20])
    elif damage == "shard_truncated":
        shard.write_bytes(shard.read_bytes()[:3])
    elif damage == "shard_missing":
        shard.unlink()
    else:
        (newest / "meta.pt").unlink()
    path, reason = resolve_last([Location.parse(tmp_path)])
    assert path == str(tmp_path / "step=1.ckpt")
    assert f"skipped {str(newest)!r}: " in reason and why in reason.lower(), reason


def test_resolve_last_skips_a_damaged_full_format_file(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(4)}}, tmp_path / "step=1.ckpt")
    os.utime(tmp_path / "step=1.ckpt", (1000, 1000))
    torch.save({"state_dict": {"w": torch.zeros(4)}}, tmp_path / "step=2.ckpt")
    data = (tmp_path / "step=2.ckpt").read_bytes()
    (tmp_path / "step=2.ckpt").write_bytes(data[: len(data) - 40])
    path, reason = resolve_last([Location.parse(tmp_path)])
    assert path == str(tmp_path / "step=1.ckpt")
    assert "step=2.ckpt" in reason and "truncated or corrupted" in reason, reason
