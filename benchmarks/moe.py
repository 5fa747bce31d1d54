"""The example GPT's MoE variant under FSDP alone and under expert parallelism: step time, tokens/s, and the bytes
each layout moves.

    torchrun --standalone --nproc-per-node=4 benchmarks/moe.py OUT_DIR [--steps 12]

Model: `GPT(n_experts=8, experts_per_token=2, n_embd=128, n_layer=2, block_size=128)`, batch 8 sequences per rank,
fp32, AdamW. Layouts: `dpar_fsdp` (every rank all-gathers every expert), expert parallel 2 (x FSDP 2 over the rest)
and expert parallel 4. Per step:

- step time: rank 0's median wall time of a training step after 2 warm-up steps, and global tokens/s;
- all-to-all bytes: the token rows all ranks together passed to `all_to_all_single` (measured by wrapping it: both
  exchanges, forward and backward, every MoE layer), against the minimum, every (token, choice) pair's row once each
  way: `tokens x top_k x hidden x bytes x 2 ways x 2 (forward, backward) x layers`;
- expert all-gather bytes: what FSDP's all-gathers of the expert parameters bring to one rank per step (each expert
  tensor's gathered size less its local shard, from the placements, times 2 gathers: forward, and again for
  backward since units reshard after forward).

Prints a Markdown table and writes it to OUT_DIR/moe_<preset>.md. `--preset gpu` (when a GPU is lent): CUDA and
NCCL, bf16-mixed, and the experts as grouped matmuls (`experts_grouped_mm=True`, `torch._grouped_mm`) instead of
the CPU preset's loop over the chosen experts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_dpar import FullyShardStrategy
from lightning_dpar.examples.gpt import GPT

SEQ, BATCH, EMBD, EXPERTS, TOP_K = 128, 8, 128, 8, 2
LAYOUTS = {"fsdp": 1, "ep2_fsdp2": 2, "ep4": 4}


class AllToAllBytes:
    """Bytes of token rows (floating point; not the split counts or expert ids) this rank passes to
    `all_to_all_single`, counted by wrapping it for the benchmark's duration."""

    def __init__(self) -> None:
        self.sent = 0
        self._original = dist.all_to_all_single

    def __enter__(self) -> AllToAllBytes:
        original = self._original

        def counted(output, input, *args, **kwargs):
            if input.is_floating_point():
                self.sent += input.numel() * input.element_size()
            return original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._original


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self._start)


def expert_gather_bytes(module: torch.nn.Module) -> int:
    """What one all-gather of every expert parameter brings to this rank: gathered size less the local shard (FSDP
    gathers over every sharded dim but the `expert` one)."""
    total = 0
    for name, param in module.named_parameters():
        if ".experts." not in name or not isinstance(param, DTensor):
            continue
        names = param.device_mesh.mesh_dim_names or ()
        gathered = param.numel()
        if "expert" in names:
            gathered //= param.device_mesh.size(names.index("expert"))
        total += (gathered - param.to_local().numel()) * param.element_size()
    return total


#: accelerator, precision and grouped matmuls per preset.
PRESETS = {"cpu": ("cpu", "32-true", False), "gpu": ("cuda", "bf16-mixed", True)}


def run(layout: str, steps: int, preset: str) -> dict[str, float]:
    expert = LAYOUTS[layout]
    world = int(os.environ["WORLD_SIZE"])
    accelerator, precision, grouped = PRESETS[preset]
    torch.manual_seed(0)
    module = GPT(
        block_size=SEQ,
        n_layer=2,
        n_head=4,
        n_embd=EMBD,
        n_experts=EXPERTS,
        experts_per_token=TOP_K,
        experts_grouped_mm=grouped,
    )
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator=accelerator,
        precision=precision,
        devices=world,
        strategy=FullyShardStrategy(expert_parallel_size=expert),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    with AllToAllBytes() as moved:
        trainer.fit(module, DataLoader(Tokens(BATCH * world * steps), batch_size=BATCH))
    sent = torch.tensor([moved.sent], dtype=torch.float64)
    dist.all_reduce(sent)
    step = statistics.median(timer.times[2:])
    tokens = BATCH * SEQ * world  # per step
    layers = len(module.model.blocks)
    element = 2 if precision.startswith("bf16") else 4  # the rows travel in the compute dtype
    minimum = tokens * TOP_K * EMBD * element * 2 * 2 * layers
    gathers_per_step = 2  # forward, and again for backward (reshard_after_forward)
    return {
        "step_s": step,
        "tokens_per_s": tokens / step,
        "all_to_all_mb": sent.item() / steps / 1e6,
        "all_to_all_min_mb": minimum / 1e6 if expert > 1 else 0.0,
        "expert_gather_mb": expert_gather_bytes(module) * gathers_per_step / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    args = parser.parse_args()
    rows = {layout: run(layout, args.steps, args.preset) for layout in LAYOUTS}
    if int(os.environ.get("RANK", 0)) != 0:
        return
    lines = [
        f"MoE example GPT (8 experts, top-2, width {EMBD}, 2 layers), {os.environ['WORLD_SIZE']} ranks, batch"
        f" {BATCH} x {SEQ} tokens per rank, preset {args.preset} ({PRESETS[args.preset][1]}); per step:",
        "",
        "| layout | step time | tokens/s | all-to-all, all ranks | its minimum | expert all-gather per rank |",
        "|---|---|---|---|---|---|",
    ]
    for layout, r in rows.items():
        lines.append(
            f"| {layout} | {r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} | {r['all_to_all_mb']:.2f} MB"
            f" | {r['all_to_all_min_mb']:.2f} MB | {r['expert_gather_mb']:.2f} MB |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"moe_{args.preset}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
