"""peft LoRA through real Trainers: a tiny Llama wrapped by `peft.get_peft_model`, trained under every layout
(FSDP, DDP-style replicate, 2D with `tp_plan="auto"` and with a plan written for the base model's names, pipeline,
3D), and compared with single-process LoRA training of the same model on the same global batches: the trainable
(adapter) weights, the frozen base, and the loss of every step. Each case also records, per rank, what the frozen
parameters hold after training (no gradient, no optimizer state) and what the `PerformanceMonitor` measured."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
import torch.distributed as dist

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, PerformanceMonitor, ReplicateStrategy
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for, world_size
from tests.workers.hf_models import TokenIds, global_batches, llama_config

#: The projections LoRA adapts: the issue's two, or every Linear of the decoder layers (row-wise ones included).
QV = ["q_proj", "v_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: A plan written for the base model's names (relative to the LightningModule before `get_peft_model`).
BASE_NAMES_PLAN = {
    "net.model.layers.*.self_attn.q_proj": "colwise",
    "net.model.layers.*.self_attn.k_proj": "colwise",
    "net.model.layers.*.self_attn.v_proj": "colwise",
    "net.model.layers.*.self_attn.o_proj": "rowwise",
    "net.model.layers.*.mlp.gate_proj": "colwise",
    "net.model.layers.*.mlp.up_proj": "colwise",
    "net.model.layers.*.mlp.down_proj": "rowwise",
}


class LoraLlama(L.LightningModule):
    """`get_peft_model(LlamaForCausalLM(tiny), LoraConfig(r=4, ...))`, built the same way on every rank and in the
    reference. `init_lora_weights=False` gives lora_B random values (peft's default zeros would leave lora_A's
    gradient zero in the first step), so every adapter weight moves from the first step on."""

    def __init__(self, targets: list[str] = QV, tied: bool = False) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        self.net = get_peft_model(LlamaForCausalLM(llama_config(tied=tied)), config)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        # All parameters, as plain peft scripts pass them: the optimizer makes state only for those with gradients.
        # SGD with momentum: the parameters move by lr x gradient (see tests/workers/hf_models.py), and it has a state.
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def reference(module: LoraLlama, dp: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process LoRA training on the global batches the `dp` data-parallel ranks see together."""
    optimizer = module.configure_optimizers()
    losses = []
    for batch in global_batches(TokenIds(), dp, seed=0):
        optimizer.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, losses


def _max_diff(got: dict, want: dict, names) -> float:
    return max(((got[k] - want[k]).abs().max().item() for k in names), default=0.0)


def parity_case(strategy, dp: int, targets: list[str] = QV, tied: bool = False) -> dict | None:
    """Train under `strategy`; on rank 0, the largest differences to single-process LoRA training, and what every
    rank holds for the frozen parameters."""
    monitor = PerformanceMonitor(summary=False)
    trainer = trainer_for(strategy, callbacks=[monitor])
    module = LoraLlama(targets, tied)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    trainer.fit(module, torch.utils.data.DataLoader(TokenIds(), batch_size=BATCH))
    # Every rank: frozen parameters hold no gradient and no optimizer state; trainable ones hold both.
    optimizer = trainer.optimizers[0]
    held = {
        "frozen_with_grad": sorted(
            n for n, p in module.named_parameters() if not p.requires_grad and p.grad is not None
        ),
        "frozen_with_state": sum(1 for p in optimizer.state if not p.requires_grad),
        "trainable_with_state": sum(1 for p in optimizer.state if p.requires_grad),
        "trainable_local": sum(1 for p in module.parameters() if p.requires_grad),
    }
    pipelined = strategy.dims.pipeline > 1
    losses = [] if pipelined else module.losses
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, (held, losses))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want, want_losses = reference(LoraLlama(targets, tied), dp)
    frozen = set(want) - trainable
    result = {
        "trainable_names": len(trainable),
        "trainable_max_abs_diff": _max_diff(got, want, trainable),
        "frozen_max_abs_diff": _max_diff(got, want, frozen),
        "trainable_moved": _max_diff(LoraLlama(targets, tied).state_dict(), want, trainable),
        "held_per_rank": [h for h, _ in gathered],
        "monitor_held": [
            {"trainable": h.trainable, "frozen": h.frozen, "gradients": h.gradients, "optimizer": h.optimizer}
            for h in monitor.held_state_per_rank
        ],
    }
    if not pipelined:
        # Each rank's loss is the mean over its batch's tokens (equal counts): the global loss is their mean over
        # the data-parallel groups, i.e. over all ranks (the ranks of one tensor-parallel group agree).
        per_step = [sum(rank_losses[s] for _, rank_losses in gathered) / len(gathered) for s in range(len(want_losses))]
        result["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(per_step, want_losses))
    if tied:
        result["still_tied"] = module.net.base_model.model.lm_head.weight is (
            module.net.base_model.model.model.embed_tokens.weight
        )
    return result


def group_peft() -> Iterator[Case]:
    world = world_size()
    try:
        import peft  # noqa: F401
    except ImportError:
        return  # tests/launched/test_peft.py skips without peft
    yield Case("lora_fsdp", lambda: parity_case(FullyShardStrategy(), world))
    yield Case("lora_replicate", lambda: parity_case(ReplicateStrategy(), world))
    yield Case(
        "lora_2d_auto_qv",
        lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), world // 2),
    )
    yield Case(
        "lora_2d_auto_all_linear",
        lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), world // 2, ALL_LINEAR),
    )
    yield Case(
        "lora_2d_base_names_plan",
        lambda: parity_case(
            FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=BASE_NAMES_PLAN), world // 2, ALL_LINEAR
        ),
    )
    yield Case(
        "lora_pipeline",
        lambda: parity_case(FullyShardStrategy(pipeline_parallel_size=2), world // 2, ALL_LINEAR),
    )
    yield Case(
        "lora_tied_2d_auto",
        lambda: parity_case(
            FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), world // 2, ALL_LINEAR, tied=True
        ),
    )
    if world == 4:
        yield Case(
            "lora_3d_auto",
            lambda: parity_case(
                FSDPTensorParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan="auto"),
                1,
                ALL_LINEAR,
            ),
        )


GROUPS = {"peft": group_peft}
