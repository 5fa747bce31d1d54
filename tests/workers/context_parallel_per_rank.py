"""Context-parallel cases with the loss on each rank's own tokens (`context_parallel_loss="per_rank"`): the
`context_parallel_loss` group of `tests/launched/test_context_parallel.py`, registered by `context_parallel`.
transformers causal LMs trained through real Trainers against one process on the same global batches (CP alone,
with `ignore_index` tokens spread unevenly, CP x FSDP, CP x TP, with activation checkpointing), the activation
memory it saves, and its refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from tests.workers.cases import Case
from tests.workers.common import BATCH, trainer_for, world_size
from tests.workers.context_parallel import (
    SEQ,
    GPTModule,
    HFModule,
    Tokens,
    activation_memory,
    expect_error,
    gpt_data,
    parity,
)
from tests.workers.context_parallel import reference as one_process

PER_RANK = {"context_parallel_loss": "per_rank"}


def per_rank_case(
    cp: int, config_class: str = "LlamaConfig", tp: int = 1, checkpointing: bool = False, ignored: bool = False
) -> Callable[[], Any]:
    dp = world_size() // (cp * tp)

    def run():
        options = {"context_parallel_size": cp, "activation_checkpointing": checkpointing, **PER_RANK}
        if tp > 1:
            strategy = FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan="auto", **options)
        else:
            strategy = FullyShardStrategy(**options)
        return parity(strategy, lambda: HFModule(config_class), dp, Tokens(SEQ, ignored=ignored))

    return run


class Validated(HFModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)


def validation_after_fit() -> dict | None:
    """A Llama fitted with the per-rank loss over every rank, then `validate`: the validation forward computes its
    loss per rank too (all-reduced without a gradient), and `val_loss` equals one process's on the trained model."""
    trainer = trainer_for(FullyShardStrategy(context_parallel_size=world_size(), **PER_RANK))
    module = Validated()
    trainer.fit(module, DataLoader(Tokens(SEQ), batch_size=BATCH))
    val_data = Tokens(SEQ, n=8, seed=11, ignored=True)
    trainer.strategy.applied.context_parallel.attention.counter.reset()  # what validation alone sends
    (metrics,) = trainer.validate(module, DataLoader(val_data, batch_size=BATCH), verbose=False)
    sent = trainer.strategy.applied.context_parallel.attention.counter.forward_bytes
    if trainer.global_rank != 0:
        return None
    reference = HFModule()
    reference.load_state_dict(one_process(HFModule, Tokens(SEQ), 1)[0])
    with torch.no_grad():
        batches = [default_collate([val_data[i] for i in range(start, start + BATCH)]) for start in (0, BATCH)]
        want = sum(float(reference.loss(batch)) for batch in batches) / 2
    return {"val_loss": metrics["val_loss"], "want": want, "kv_bytes_sent_rank0": sent}


class OwnLossFromLogits(HFModule):
    """Computes its loss from the logits itself, calling the model without `labels`."""

    def loss(self, batch: Any) -> torch.Tensor:
        logits = self.net(input_ids=batch).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


class ReadsLogits(HFModule):
    """Uses the model's loss, and reads the logits too (for a metric, say)."""

    def loss(self, batch: Any) -> torch.Tensor:
        outputs = self.net(input_ids=batch, labels=batch)
        self.log("accuracy", (outputs.logits.argmax(-1) == batch).float().mean())
        return outputs.loss


def group_context_parallel_loss() -> Iterator[Case]:
    world = world_size()
    for family in ("LlamaConfig", "Qwen3Config"):
        name = f"{family[:-6].lower()}_cp{world}_per_rank"
        yield Case(name, per_rank_case(world, family))
        yield Case(f"{name}_ignore_index", per_rank_case(world, family, ignored=True))
    yield Case(f"llama_cp{world}_per_rank_checkpointed", per_rank_case(world, checkpointing=True))
    if world == 4:
        yield Case("llama_cp2_fsdp2_per_rank", per_rank_case(2))
        yield Case("llama_cp2_tp2_per_rank", per_rank_case(2, tp=2))
    yield Case("per_rank_validation_after_fit", validation_after_fit)
    for cp in sorted({2, world}):
        yield Case(f"memory_llama_cp{cp}_per_rank", lambda c=cp: activation_memory("llama", c, loss="per_rank"))

    def case(name: str, make: Callable[[], Any], data: Callable[[], Any]) -> Case:
        strategy = lambda: FullyShardStrategy(context_parallel_size=world, **PER_RANK)  # noqa: E731
        return Case(f"error_{name}", lambda: expect_error(strategy, make, data()))

    yield case("per_rank_not_a_causal_lm", GPTModule, gpt_data)
    yield case("per_rank_without_labels", OwnLossFromLogits, lambda: Tokens(SEQ))
    yield case("per_rank_logits_read", ReadsLogits, lambda: Tokens(SEQ))
