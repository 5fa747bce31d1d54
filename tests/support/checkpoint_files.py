"""Small real checkpoints written in one process (no Trainer, no process group) for the tests of unusable and
hostile checkpoints: a sharded one as lightning_dpar writes it, a full-format file, and copies to damage."""

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
