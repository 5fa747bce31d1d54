"""Adapter-only checkpoints through real Trainers: a LoRA fine-tune of a tiny Llama (`peft`) interrupted, saved with
`checkpoint_weights="trainable"` and resumed from `pretrained=` ends with the weights of an uninterrupted run;
resuming without the base, or with another base, is refused on every rank with what to pass.

The base directories are written by the pytest side (`tests/launched/test_adapter_checkpoints.py`) next to the results
file; the checkpoints and trained weights written here are what its in-process export tests read.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from tests.workers.cases import Case, one_case
from tests.workers.common import full_params, trainer_for, world_size

BATCH = 2
SEQ = 8
STEPS = 6  # the uninterrupted run; the interrupted one stops after INTERRUPT
INTERRUPT = 3
LR = 1e-2  # large enough that the adapters move visibly in a few steps
#: A hand TP plan for the peft-wrapped Llama: the base layers as usual, LoRA's `lora_B` split like its base's output
#: (`lora_A` replicated), exact for a colwise base.
PEFT_TP_PLAN = {
    "model.base_model.model.model.layers.*.self_attn.[qv]_proj.base_layer": "colwise",
    "model.base_model.model.model.layers.*.self_attn.[qv]_proj.lora_B.default": "colwise",
    "model.base_model.model.model.layers.*.self_attn.k_proj": "colwise",
    "model.base_model.model.model.layers.*.self_attn.o_proj": "rowwise",
}


def workdir() -> Path:
    return Path(sys.argv[2]).resolve().parent


def base_dir(name: str = "base") -> str:
    return str(workdir() / name)


class TokenData(Dataset):
    def __init__(self, vocab: int = 64, n: int = 32, seed: int = 7) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class LoraLM(L.LightningModule):
    """`get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, q/v))`, the base built from the config (random
    weights; `pretrained=` fills them), the adapters seeded with `seed`."""

    def __init__(self, path: str, seed: int = 123, tp_plan: dict | None = None) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = get_peft_model(base, config)
        if tp_plan is not None:
            self.tp_plan = tp_plan

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


def strategy(layout: str, pretrained: str | None = None, **kwargs) -> L.pytorch.strategies.Strategy:
    if layout == "2d":
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, pretrained=pretrained, **kwargs)
    return FullyShardStrategy(pretrained=pretrained, **kwargs)


def fit(layout: str, steps: int, ckpt_path: str | None = None, seed: int = 123, **kwargs) -> L.Trainer:
    path = base_dir()
    module = LoraLM(path, seed=seed, tp_plan=PEFT_TP_PLAN if layout == "2d" else None)
    trainer = trainer_for(strategy(layout, path, **kwargs), max_steps=steps)
    trainer.fit(module, DataLoader(TokenData(), batch_size=BATCH, shuffle=True), ckpt_path=ckpt_path)
    return trainer


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def resume_case(layout: str, checkpoint_format: str, async_save: bool) -> dict | None:
    """Uninterrupted run against one interrupted after `INTERRUPT` steps, saved adapter-only, and resumed from a
    module whose adapters start from other random values (only the checkpoint makes them equal)."""
    name = f"adapter_{layout}_{checkpoint_format}{'_async' if async_save else ''}_{world_size()}"
    options = dict(checkpoint_format=checkpoint_format, async_save=async_save, checkpoint_weights="trainable")
    whole = fit(layout, STEPS, **options)
    want = full_params(whole)
    interrupted = fit(layout, INTERRUPT, **options)
    ckpt = str(workdir() / f"{name}.ckpt")
    interrupted.save_checkpoint(ckpt)
    interrupted.strategy.wait_for_checkpoint()
    at_interrupt = full_params(interrupted)
    resumed = fit(layout, STEPS, ckpt_path=ckpt, seed=999, **options)
    got = full_params(resumed)
    if dist.get_rank() != 0:
        return None
    trainable = sorted(k for k, p in resumed.lightning_module.named_parameters() if p.requires_grad)
    torch.save(at_interrupt, workdir() / f"{name}.trained.pt")  # the values the checkpoint holds, for the exports
    return {
        "ckpt": ckpt,
        "max_abs_diff": max_diff(got, want),
        "adapters_moved": max((want[k] - at_interrupt[k]).abs().max().item() for k in trainable),
        "trainable": len(trainable),
        "global_step": resumed.global_step,
        "stored_keys": sorted(stored_keys(ckpt)),
    }


def stored_keys(ckpt: str) -> set[str]:
    """The model keys a checkpoint of either format holds."""
    from lightning_dpar.checkpoint.contents import inspect_checkpoint
    from lightning_dpar.checkpoint.storage import Location

    location = Location.parse(ckpt)
    if location.is_dir():
        info = inspect_checkpoint(location)
        return info.keys_under(info.model_key)
    return set(torch.load(ckpt, weights_only=True, mmap=True)["state_dict"])


def refusal_case() -> dict | None:
    """An adapter-only checkpoint resumed with no `pretrained=`, and with another base: refused on every rank."""
    ckpt = str(workdir() / "refusal.ckpt")
    fit("fsdp", 1, checkpoint_weights="trainable").save_checkpoint(ckpt)
    messages = {}
    for label, pretrained in (("no_base", None), ("other_base", base_dir("other_base"))):
        trainer = trainer_for(FullyShardStrategy(pretrained=pretrained), max_steps=2)
        try:
            trainer.fit(LoraLM(base_dir()), DataLoader(TokenData(), batch_size=BATCH), ckpt_path=ckpt)
            message = None
        except CheckpointLoadError as error:
            message = str(error)
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, message)
        messages[label] = gathered
    # The same run saving everything: the checkpoint that the export tests compare with.
    full = str(workdir() / "all_weights.ckpt")
    trainer = fit("fsdp", 2)
    trainer.save_checkpoint(full)
    got = full_params(trainer)
    if dist.get_rank() != 0:
        return None
    torch.save(got, workdir() / "all_weights.trained.pt")
    return {"messages": messages, "full_ckpt": full, "full_stored": len(stored_keys(full))}


def group_resume() -> Iterator[Case]:
    if world_size() == 4:
        yield Case("adapter_2d_sharded_4", lambda: resume_case("2d", "sharded", async_save=False))
        return
    yield Case("adapter_fsdp_sharded_async_2", lambda: resume_case("fsdp", "sharded", async_save=True))
    yield Case("adapter_fsdp_full_2", lambda: resume_case("fsdp", "full", async_save=False))


GROUPS = {
    "adapter_resume": group_resume,
    "adapter_refusal": one_case("adapter_refusal", refusal_case),
}
