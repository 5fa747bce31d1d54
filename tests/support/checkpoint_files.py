"""Small real checkpoints written in one process (no Trainer, no process group) for the tests of unusable and
hostile checkpoints: a sharded one as lightning_dpar writes it, a full-format file, and copies to damage (also the
damaged copies the launched bad-input cases load)."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import lightning as L
import torch
import torch.distributed.checkpoint as dcp
from torch import nn


class Tiny(L.LightningModule):
    def __init__(self, width: int = 4, config: object | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(width, 3)
        self.register_buffer("counts", torch.arange(3, dtype=torch.int64))


def write_sharded(path: Path, width: int = 4) -> Path:
    """A sharded checkpoint as lightning_dpar writes it, in one process: model + Adam state (tensors and bytes
    leaves) under DCP, Lightning's and our metadata (with data-file checksums) in `meta.pt`."""
    module = Tiny(width)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    module.layer(torch.randn(2, width)).sum().backward()
    optimizer.step()
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer_state = {
        "state": {names[id(p)]: s for p, s in optimizer.state.items()},
        "param_groups": [{**g, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups],
    }
    dcp.save({"state_dict": module.state_dict(), "optimizer_0": optimizer_state}, checkpoint_id=path, no_dist=True)
    files = {}
    for file in sorted(path.glob("*.distcp")):
        data = file.read_bytes()
        files[file.name] = (len(data), zlib.crc32(data))
    meta = {
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": L.__version__,
        "hyper_parameters": {"width": width},
        "dpar": {"format_version": 1, "files": files},
    }
    torch.save(meta, path / "meta.pt")
    return path


def write_full(path: Path) -> Path:
    module = Tiny()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"width": 4}, "dpar": {}}, path)
    return path


def copy_of(pristine: Path, tmp_path: Path, name: str = "victim.ckpt") -> Path:
    target = tmp_path / "run" / name
    shutil.copytree(pristine, target)
    return target


def write_damaged_copies(good: Path, root: Path) -> None:
    """Damaged and foreign copies of the sharded checkpoint `good` (2 ranks) under `root`: `truncated.ckpt` (rank 1's
    shard cut short), `corrupted.ckpt` (a flipped byte in rank 0's shard), and what a future lightning_dpar would
    write: `newer_sharded.ckpt` and `newer_full.ckpt` (format version 99)."""
    for name in ("truncated.ckpt", "corrupted.ckpt", "newer_sharded.ckpt"):
        shutil.copytree(good, root / name, dirs_exist_ok=True)
    shard = root / "truncated.ckpt" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    shard = root / "corrupted.ckpt" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Written by a future lightning_dpar: a sharded directory and a full-format file.
    meta = torch.load(root / "newer_sharded.ckpt" / "meta.pt", weights_only=False)
    meta["dpar"]["format_version"] = 99
    torch.save(meta, root / "newer_sharded.ckpt" / "meta.pt")
    torch.save({"state_dict": {}, "dpar": {"format_version": 99}}, root / "newer_full.ckpt")
