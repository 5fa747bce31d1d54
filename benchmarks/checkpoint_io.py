"""Time training is blocked per checkpoint save (sync vs async) and peak memory per rank while saving and loading.

    torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint_io.py OUT_DIR [--blocks 16] [--width 1024]
    torchrun --standalone --nproc-per-node=2 benchmarks/checkpoint_io.py OUT_DIR --load OUT_DIR/sync/LAST.ckpt

Trains a stack of `blocks` Linear(width, width) layers with Adam under `dpar_fsdp`, saving every 2 steps through
`ModelCheckpoint`; prints, per mode, the median blocked seconds per save (`blocked_s`: the strategy's writer, from
the state dicts to the return; `save_checkpoint_s`: all of `trainer.save_checkpoint` as training waits for it,
Lightning gathering the state dicts included), the end-to-end write time, and each rank's peak RSS growth above
its steady training state during save and load (Linux `VmHWM`, reset through `/proc/self/clear_refs`). `--load`
measures a load in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpar import FullyShardStrategy


def rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Body(torch.nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Stack(L.LightningModule):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.body = Body(blocks, width)

    def training_step(self, batch, batch_idx):
        x = self.body(batch[0])
        time.sleep(0.2)  # stands in for a real step's compute, during which a background save can proceed
        return F.mse_loss(x, torch.zeros_like(x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class PeakDuringSave(Callback):
    """Resets the peak before every save and records how far RSS rose above the pre-save level."""

    def __init__(self) -> None:
        self.growth: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % 2 == 1:  # the next batch end saves
            self.before = rss_mib("VmRSS")
            reset_peak()
        elif hasattr(self, "before"):
            self.growth.append(rss_mib("VmHWM") - self.before)


def timed_calls(obj: object, name: str) -> list[float]:
    """Seconds of every call of `obj.name` from now on (the list fills as it is called)."""
    original, seconds = getattr(obj, name), []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return seconds


def run(mode: str, out: str, blocks: int, width: int) -> dict:
    data = TensorDataset(torch.randn(64, width))
    strategy = FullyShardStrategy(async_save=mode == "async")
    callback = ModelCheckpoint(dirpath=os.path.join(out, mode), every_n_train_steps=2, save_top_k=-1)
    peak = PeakDuringSave()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peak, callback],
    )
    save_calls = timed_calls(trainer, "save_checkpoint")
    start = time.perf_counter()
    trainer.fit(Stack(blocks, width), DataLoader(data, batch_size=4))
    fit_s = time.perf_counter() - start
    timings = strategy.checkpoints.writer.timings
    params = sum(p.numel() for p in Stack(blocks, width).parameters())
    return {
        "mode": mode,
        "rank": dist.get_rank(),
        "model_mib": params * 4 / 2**20,
        "model_and_adam_mib": params * 12 / 2**20,
        "saves": len(timings),
        "blocked_s_median": statistics.median(t.blocked_s for t in timings),
        "save_checkpoint_s_median": statistics.median(save_calls),
        "write_s_median": statistics.median(t.total_s for t in timings if t.total_s is not None),
        "fit_s": fit_s,
        "save_peak_growth_mib": max(peak.growth) if peak.growth else None,
        "last_checkpoint": callback.last_model_path or callback.best_model_path,
    }


def measure_load(path: str, blocks: int, width: int) -> dict:
    """In fresh processes: peak RSS growth per rank from the set-up model and optimizer to the end of the load."""
    data = TensorDataset(torch.randn(64, width))
    strategy = FullyShardStrategy()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=10,  # the checkpoint's step: restores, trains nothing
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    original_load = strategy.load_checkpoint
    growth = {}

    def measured_load(checkpoint_path, weights_only=None):
        before = rss_mib("VmRSS")
        reset_peak()
        result = original_load(checkpoint_path, weights_only)
        growth["mib"] = rss_mib("VmHWM") - before
        return result

    strategy.load_checkpoint = measured_load
    trainer.fit(Stack(blocks, width), DataLoader(data, batch_size=4), ckpt_path=path)
    return {"mode": "load", "rank": dist.get_rank(), "load_peak_growth_mib": growth["mib"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--load", help="measure loading this checkpoint instead (run in fresh processes)")
    args = parser.parse_args()
    if args.load:
        rows = [measure_load(args.load, args.blocks, args.width)]
    else:
        rows = [run(mode, args.out, args.blocks, args.width) for mode in ("sync", "async")]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        for rank_rows in gathered:
            for row in rank_rows:
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
