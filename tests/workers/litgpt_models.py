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


#: The MLP plan for a bare `GPT` (Fabric sets up the model itself, not a LightningModule around it).
FABRIC_MLP_TP_PLAN = {k.removeprefix("net."): v for k, v in MLP_TP_PLAN.items()}
MICRO, ACCUMULATE, FABRIC_STEPS, MAX_NORM = 2, 2, 3, 0.5


def _pretrain_batches(dp: int) -> list[torch.Tensor]:
    """One global batch per optimizer step: `dp` ranks x `ACCUMULATE` micro-batches of `MICRO` sequences."""
    ids, size = TokenIds().ids, dp * ACCUMULATE * MICRO
    return [ids[s * size : (s + 1) * size] for s in range(FABRIC_STEPS)]


def _pretrain_reference(dp: int) -> dict[str, torch.Tensor]:
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    torch.manual_seed(SEED)  # built normally on CPU, with the seed the sharded run materialised with
    model = GPT(config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for batch in _pretrain_batches(dp):
        chunked_cross_entropy(model(batch[:, :-1]), batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fabric_pretrain_case(strategy, dp: int, save_to: str | None = None) -> dict | None:
    """A Fabric loop shaped like LitGPT's pretraining script (`litgpt/pretrain.py`): the model built on the meta
    device under `fabric.init_module(empty_init=True)`, `fabric.setup` then `fabric.setup_optimizers`, a `state`
    dict with `iter_num` and `step_count`, `no_backward_sync` while accumulating, the loss divided by the
    accumulation, `clip_gradients` before each step, `fabric.save(path, state)`; against one process."""
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    fabric = L.Fabric(accelerator="cpu", devices=world_size(), strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(config())
    torch.manual_seed(SEED)  # the shards are materialised from this stream, as a CPU build would be
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    sampler = fabric.strategy.distributed_sampler_kwargs
    rank, replicas = sampler["rank"], sampler["num_replicas"]
    micro_batches = [
        micro
        for batch in _pretrain_batches(dp)
        for micro in batch.chunk(replicas)[rank].chunk(ACCUMULATE)  # this rank's part, in micro-batches
    ]
    for input_ids in micro_batches:
        state["iter_num"] += 1
        is_accumulating = state["iter_num"] % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids[:, :-1])
            loss = chunked_cross_entropy(logits, input_ids[:, 1:])
            fabric.backward(loss / ACCUMULATE)
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
    if save_to is not None:
        fabric.save(save_to, state)
    got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    got = {k: v.detach().cpu() for k, v in got.items()}
    if fabric.global_rank != 0:
        return None
    want = _pretrain_reference(dp)
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want), "steps": state["step_count"]}


def _refused_attention_plan() -> list[str | None]:
    import torch.distributed as dist
    from litgpt.model import GPT

    from lightning_dpar.fabric import FSDPTensorParallelStrategy as FabricFSDPTensorParallelStrategy

    message = None
    try:
        plan = {**FABRIC_MLP_TP_PLAN, "transformer.h.*.attn.qkv": "colwise", "transformer.h.*.attn.proj": "rowwise"}
        fabric = L.Fabric(
            accelerator="cpu",
            devices=world_size(),
            strategy=FabricFSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=plan),
        )
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = GPT(config())
        fabric.setup(model)
    except ValueError as error:
        message = str(error)
    messages: list[str | None] = [None] * world_size()
    dist.all_gather_object(messages, message)
    return messages


def group_litgpt_fabric() -> Iterator[Case]:
    from lightning_dpar.fabric import FSDPTensorParallelStrategy as FabricFSDPTensorParallelStrategy

    world = world_size()
    yield Case("litgpt_fabric_fsdp", lambda: fabric_pretrain_case("dpar_fsdp", world))
    yield Case(
        "litgpt_fabric_2d",
        lambda: fabric_pretrain_case(
            FabricFSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=FABRIC_MLP_TP_PLAN), world // 2
        ),
    )
    yield Case("litgpt_fabric_refuses_fused_qkv_split", _refused_attention_plan)


GROUPS = {"litgpt": group_litgpt, "litgpt_fabric": group_litgpt_fabric}
