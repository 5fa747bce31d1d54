"""Cases for `tests/launched/test_checkpoint_formats.py`: the full format, fsspec URLs (`file://` on 2 ranks,
`memory://` in one process), the memory `consolidate` needs, and checkpoints written by Lightning's own strategies
resumed under dpar. Every case saves under its own directory (`checkpoint_common.case_dir`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader

from lightning_dpar import FullyShardStrategy, ReplicateStrategy
from tests.workers.cases import Case, one_case
from tests.workers.checkpoint_common import (
    ResumeModule,
    case_dir,
    flat_tensors,
    full_optimizer,
    max_diff,
    train_loader,
    val_loader,
)
from tests.workers.common import full_params, trainer_for, world_size


# ---------------------------------------------------------------------- full format, fsspec
def full_format_case() -> dict:
    """`checkpoint_format="full"`: one file that torch.load / load_from_checkpoint read and dpar resumes from."""
    file = case_dir("full_format") / "full.ckpt"
    trainer = trainer_for(FullyShardStrategy(checkpoint_format="full"), max_steps=4)
    trainer.fit(ResumeModule(), train_loader())
    reference = full_params(trainer)
    trainer.save_checkpoint(file)
    resumed = ResumeModule()
    trainer2 = trainer_for(ReplicateStrategy(), max_steps=4)
    trainer2.fit(resumed, train_loader(), ckpt_path=str(file))
    resumed_params = full_params(trainer2)
    if trainer.global_rank != 0:
        return None
    plain = torch.load(file, weights_only=True)
    from_file = ResumeModule.load_from_checkpoint(file)
    return {
        "is_file": file.is_file(),
        "plain_load_diff": max_diff(plain["state_dict"], reference),
        "optimizer_keys": sorted(plain["optimizer_states"][0]["state"])[:3],
        "load_from_checkpoint_diff": max_diff(from_file.state_dict(), reference),
        "dpar_resume_diff": max_diff(resumed_params, reference),
    }


def file_url_case() -> float:
    """Sharded through a `file://` URL: the fsspec code path on a filesystem every rank shares."""
    trainer = trainer_for(ReplicateStrategy(), max_steps=4)
    trainer.fit(ResumeModule(), train_loader())
    reference = full_params(trainer)
    url = f"file://{case_dir('file_url') / 'url.ckpt'}"
    trainer.save_checkpoint(url)
    evaluator = trainer_for(FullyShardStrategy())
    evaluator.validate(ResumeModule(), val_loader(), ckpt_path=url, verbose=False)
    loaded = full_params(evaluator)  # a collective: on every rank
    return max_diff(loaded, reference) if trainer.global_rank == 0 else None


def memory_fs_case() -> dict:
    """A `memory://` fsspec filesystem (one process: memory:// is per process) through ModelCheckpoint."""
    import fsspec

    module = ResumeModule()
    callback = ModelCheckpoint(dirpath="memory://mc", filename="{step}", every_n_train_steps=2, save_top_k=1)
    trainer = trainer_for(FullyShardStrategy(), max_steps=6, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    reference = full_params(trainer)
    evaluator = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy())
    trainer2.validate(evaluator, val_loader(), ckpt_path="memory://mc/step=6.ckpt", verbose=False)
    fs = fsspec.filesystem("memory")
    return {
        "listing": sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/mc", detail=False)),
        "files": sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/mc/step=6.ckpt", detail=False)),
        "load_diff": max_diff(full_params(trainer2), reference),
    }


# ---------------------------------------------------------------------- memory of consolidate
class WideModule(L.LightningModule):
    """128 MiB of weights in 32 tensors of 4 MiB: big enough that holding the model would show in RSS."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(32)))

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


_MEASURE_PEAK = """
import sys
from lightning_dpar.checkpoint.consolidate import main
def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) / 1024
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
assert main(sys.argv[1:]) == 0
print(status("VmHWM") - before)
"""


def export_memory_case() -> dict:
    """Peak RSS growth of `consolidate` in a fresh process: safetensors streams; the .ckpt holds the model."""
    root = case_dir("export_memory")
    trainer = trainer_for(FullyShardStrategy(), max_steps=1)
    trainer.fit(WideModule(), DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 1024)), batch_size=4))
    trainer.save_checkpoint(root / "wide.ckpt")
    growth = {}
    for fmt, extra in (("safetensors", ["--max-shard-size", "8MB"]), ("lightning", [])):
        argv = [str(root / "wide.ckpt"), str(root / f"out_{fmt}"), "--format", fmt, *extra]
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE_PEAK, *argv], capture_output=True, text=True, env=os.environ.copy()
        )
        growth[fmt] = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else proc.stderr[-2000:]
    return {"model_mib": 128.0, "peak_growth_mib": growth}


# ---------------------------------------------------------------------- migration from Lightning's strategies
def _migrate(name: str, trainer: L.Trainer, save: Callable[[L.Trainer, Path], None]) -> dict:
    """Resume under dpar_fsdp from a checkpoint `save(trainer, path)` wrote; compare model and optimizer exactly."""
    path = case_dir(f"migrate_{name}") / f"{name}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    save(trainer, path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = {k.removeprefix("_forward_module."): v for k, v in full_params(trainer).items()}
    optimizer = trainer.optimizers[0]
    reference_optim = flat_tensors("optim", get_optimizer_state_dict(trainer.model, optimizer, options=options))
    resumed = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy(), max_steps=6)
    trainer2.fit(resumed, train_loader(), ckpt_path=str(path))
    # The state right after loading: a Trainer that trains nothing (max_steps already reached).
    loaded = ResumeModule()
    trainer3 = trainer_for(FullyShardStrategy(), max_steps=4)
    trainer3.fit(loaded, train_loader(), ckpt_path=str(path))
    params = full_params(trainer3)
    optim = flat_tensors("optim", full_optimizer(trainer3))
    if trainer.global_rank != 0:
        return None
    return {
        "layout": sorted(os.listdir(path)),
        "first_step": min(s for s, _ in resumed.losses),
        "model_diff": max_diff(params, reference),
        "optimizer_diff": max_diff(optim, reference_optim),
    }


class ModelParallelModule(ResumeModule):
    """Written for Lightning's `ModelParallelStrategy`: applies FSDP2 itself in `configure_model`."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        for layer in self.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def migrate_model_parallel_case() -> dict:
    """A checkpoint Lightning's `ModelParallelStrategy` wrote, for real."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = trainer_for(ModelParallelStrategy(data_parallel_size=world_size(), tensor_parallel_size=1), max_steps=4)
    trainer.fit(ModelParallelModule(), train_loader())
    return _migrate("model_parallel", trainer, lambda t, path: t.save_checkpoint(path))


def migrate_fsdp_strategy_sharded_case() -> dict:
    """Lightning's `FSDPStrategy` (FSDP1) needs a GPU in torch>=2.11, so its sharded layout (model under `model`) is
    written by `FSDPStrategy.save_checkpoint` itself on FSDP2 shards."""
    from lightning.pytorch.strategies import FSDPStrategy

    trainer = trainer_for(FullyShardStrategy(), max_steps=4)
    trainer.fit(ResumeModule(), train_loader())

    def save_like_fsdp_strategy(t: L.Trainer, path: Path) -> None:
        checkpoint = t._checkpoint_connector.dump_checkpoint()
        t.strategy._state_dict_type = "sharded"
        FSDPStrategy.save_checkpoint(t.strategy, checkpoint, path)
        t.strategy.barrier()

    return _migrate("fsdp_strategy_sharded", trainer, save_like_fsdp_strategy)


def group_two_ranks() -> Iterator[Case]:
    yield Case("full_format", full_format_case)
    yield Case("file_url", file_url_case)
    yield Case("migrate_model_parallel", migrate_model_parallel_case)
    yield Case("migrate_fsdp_strategy_sharded", migrate_fsdp_strategy_sharded_case)


GROUPS = {
    "formats_two_ranks": group_two_ranks,
    "formats_memory_fs": one_case("memory_fs", memory_fs_case),
    "formats_export_memory": one_case("export_memory", export_memory_case),
}
