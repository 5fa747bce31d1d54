"""Checkpoint size and save time of adapter-only checkpoints (`checkpoint_weights="trainable"`) against full ones.

    torchrun --standalone --nproc-per-node=2 benchmarks/adapter_checkpoints.py OUT_DIR [--saves 5]

Two LoRA fine-tunes under `dpar_fsdp`, each from a base in a `pretrained=` directory written first:

- `example`: the bundled GPT (`lightning_dpar.examples.GPT`, its defaults) with `peft` LoRA r=4 on `attn.q`/`attn.v`;
- `llama`: a Llama of 21 M parameters (hidden 512, 4 layers, vocabulary 8192, untied head) with LoRA r=4 on
  `q_proj`/`v_proj`, a base 640x the adapter.

For each, both formats (`sharded`, `full`) and both `checkpoint_weights`, after two training steps: the checkpoint's
bytes on disk and the median wall time of `trainer.save_checkpoint` over `--saves` saves (the first adapter-only save
also reads the base directory's headers and fingerprint once: shown apart). Prints a Markdown table (rank 0) and
writes it to OUT_DIR/adapter_checkpoints.md.
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
from torch.utils.data import DataLoader, Dataset

from lightning_dpar import FullyShardStrategy
from tests.support.hf_configs import decoder_settings

SEQ = 32
LLAMA = decoder_settings(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


class Tokens(Dataset):
    def __init__(self, vocab: int, n: int = 64) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))


class LlamaLoRA(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = lora(LlamaForCausalLM(LlamaConfig(**LLAMA)), ["q_proj", "v_proj"])

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def example_lora() -> L.LightningModule:
    from lightning_dpar.examples import GPT

    module = GPT()
    module.model = lora(module.model, ["q", "v"])
    module.tp_plan = {}
    return module


def write_base(kind: str, path: Path) -> None:
    """The base the fine-tune starts from, as `pretrained=` reads it (rank 0 writes, the others wait)."""
    if dist.get_rank() == 0 and not path.exists():
        torch.manual_seed(0)
        tmp = path.with_name(path.name + ".tmp")
        if kind == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(tmp)
        else:
            from safetensors.torch import save_file

            from lightning_dpar.examples import GPT

            tmp.mkdir(parents=True)
            save_file(GPT().model.state_dict(), tmp / "model.safetensors")
        tmp.rename(path)
    dist.barrier()


def size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(kind: str, out: Path, checkpoint_format: str, weights: str, saves: int) -> dict:
    base = out / f"{kind}_base"
    torch.manual_seed(1)
    module = LlamaLoRA() if kind == "llama" else example_lora()
    data = Tokens(LLAMA["vocab_size"] if kind == "llama" else 256)
    strategy = FullyShardStrategy(
        pretrained=str(base),
        checkpoint_format=checkpoint_format,
        checkpoint_weights=weights,
        process_group_backend="gloo",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=2))
    times = []
    path = out / f"{kind}_{checkpoint_format}_{weights}.ckpt"
    for _ in range(saves):
        dist.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        dist.barrier()
        times.append(time.perf_counter() - start)
    params = dict(module.named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    return {
        "model": kind,
        "format": checkpoint_format,
        "weights": weights,
        "bytes": size_on_disk(path),
        "first_s": times[0],
        "median_s": statistics.median(times[1:] or times),
        "trainable": trainable,
        "frozen": frozen,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model (frozen / trainable params) | format | checkpoint_weights | size | save, median | first save |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} ({row['frozen'] / 1e6:.2f} M / {row['trainable'] / 1e3:.1f} K) | {row['format']} |"
            f" {row['weights']} | {row['bytes'] / 1e6:.3f} MB | {row['median_s'] * 1e3:.0f} ms |"
            f" {row['first_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in ("example", "llama"):
        write_base(kind, out / f"{kind}_base")
        for checkpoint_format in ("sharded", "full"):
            for weights in ("all", "trainable"):
                rows.append(measure(kind, out, checkpoint_format, weights, args.saves))
    if dist.get_rank() == 0:
        text = table(rows)
        print(text)
        (out / "adapter_checkpoints.md").write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
