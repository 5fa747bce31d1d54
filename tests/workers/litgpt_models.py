"""A LitGPT `GPT` (grouped-query attention, RMSNorm, LLaMA MLP, rotary cos/sin buffers computed in `__init__`)
through real Trainers: built normally, and built on the meta device and materialised shard by shard, which must equal
building it normally on CPU with the same seed. LitGPT fuses q, k and v into one `qkv` weight that its attention
splits by the global head counts, so only the MLP is tensor-parallel here."""

from __future__ import annotations

import os
from collections.abc import Iterator

import lightning as L
import torch
import torch.nn.functional as F

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for, world_size
from tests.workers.hf_models import SEED, VOCAB, TokenIds, global_batches

MLP_TP_PLAN = {"net.transformer.h.*.mlp.fc_[12]": "colwise", "net.transformer.h.*.mlp.proj": "rowwise"}


def config():
    from litgpt.config import Config

    return Config(
        block_size=8,
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        intermediate_size=64,
        mlp_class_name="LLaMAMLP",
        norm_class_name="RMSNorm",
        bias=False,
        parallel_residual=False,
        rotary_percentage=1.0,
    )


class LitGPTModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from litgpt.model import GPT

        self.net = GPT(config())

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _reference(data, dp: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)  # built normally on CPU, with the seed the sharded run materialised with
    module = LitGPTModule()
    optimizer = module.configure_optimizers()
    for batch in global_batches(data, dp, seed):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity_case(strategy, dp: int, empty_init: bool) -> dict | None:
    """Train under `strategy`; on rank 0, the largest difference to single-process training of a normal CPU build."""
    data = TokenIds()
    trainer = trainer_for(strategy)
    try:
        if empty_init:
            with trainer.init_module(empty_init=True):
                module = LitGPTModule()
            L.seed_everything(SEED)
        else:
            torch.manual_seed(SEED)
            module = LitGPTModule()
            L.seed_everything(SEED)  # the same shuffling as the meta-init cases
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    finally:
        os.environ.pop("PL_GLOBAL_SEED", None)  # other cases shuffle with Lightning's default seed 0
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = _reference(data, dp, SEED)
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}


def group_litgpt() -> Iterator[Case]:
    world = world_size()
    yield Case("litgpt_replicate", lambda: parity_case(ReplicateStrategy(), world, empty_init=False))
    yield Case("litgpt_meta_init_fsdp", lambda: parity_case(FullyShardStrategy(), world, empty_init=True))
    yield Case(
        "litgpt_meta_init_2d_mlp_tp",
        lambda: parity_case(
            FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=MLP_TP_PLAN), world // 2, empty_init=True
        ),
    )


GROUPS = {"litgpt": group_litgpt}
