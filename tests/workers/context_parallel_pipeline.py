"""Context parallelism across pipeline stages, for `tests/launched/test_context_parallel.py` (4 ranks): pipeline 2 x
context parallel 2, the example GPT and a transformers Llama under GPipe and 1F1B (and a 4-layer Llama under the
four multi-stage schedules), each against one process on the same global batches; and the pipeline split context
parallelism refuses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch

from lightning_dpar import FullyShardStrategy
from lightning_dpar.pipeline.values import tensor_specs
from tests.workers.cases import Case
from tests.workers.common import BATCH, trainer_for, world_size
from tests.workers.context_parallel import (
    SEQ,
    GPTModule,
    HFModule,
    Tokens,
    expect_error,
    gpt_data,
    parity,
    reference_val_loss,
)


def pipeline_cp(schedule: str, **options: Any) -> FullyShardStrategy:
    return FullyShardStrategy(pipeline_parallel_size=2, context_parallel_size=2, pipeline_schedule=schedule, **options)


def pipelined_parity(strategy: FullyShardStrategy, make: Callable[[], L.LightningModule], data: Any) -> dict | None:
    """`parity` (one data-parallel rank: the four ranks are 2 stages x 2 context-parallel ranks), and from every rank
    its attention calls and the shapes its stages sent on (the boundary, recorded per batch shape)."""
    result = parity(strategy, make, 1, data)
    applied = strategy.applied
    sent = [
        tuple(spec.shape)
        for table in applied.pipeline._shape_tables.values()
        for value in table[2].values()
        for spec in tensor_specs(value)
    ]
    ranks: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(ranks, (applied.context_parallel.attention.calls, sent))
    if result is None:
        return None
    return {**result, "attention_calls": [calls for calls, _ in ranks], "sent_shapes": [shapes for _, shapes in ranks]}


def validation_after_fit() -> dict | None:
    """The example GPT fitted under PP 2 x CP 2, then `validate`: the forward-only pass through the stages splits the
    sequence too (every rank's attention calls grow), and the logged `val_loss` is one process's."""
    from torch.utils.data import DataLoader

    strategy = pipeline_cp("1F1B")
    trainer = trainer_for(strategy)
    module = GPTModule()
    trainer.fit(module, DataLoader(gpt_data(), batch_size=BATCH))
    attention = strategy.applied.context_parallel.attention
    before = attention.calls
    val_data = Tokens(SEQ + 1, n=8, seed=11)
    (metrics,) = trainer.validate(module, DataLoader(val_data, batch_size=BATCH), verbose=False)
    calls: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(calls, attention.calls - before)
    if trainer.global_rank != 0:
        return None
    return {"val_loss": metrics["val_loss"], "want": reference_val_loss(val_data), "attention_calls": calls}


def group_context_parallel_pipeline() -> Iterator[Case]:
    if world_size() != 4:
        return
    for schedule in ("GPipe", "1F1B"):
        name = schedule.lower()
        yield Case(f"gpt_pp2_cp2_{name}", lambda s=schedule: pipelined_parity(pipeline_cp(s), GPTModule, gpt_data()))
        yield Case(f"llama_pp2_cp2_{name}", lambda s=schedule: pipelined_parity(pipeline_cp(s), HFModule, Tokens(SEQ)))
    yield Case(
        "llama_pp2_cp2_1f1b_checkpointed",
        lambda: pipelined_parity(pipeline_cp("1F1B", activation_checkpointing=True), HFModule, Tokens(SEQ)),
    )
    deep = lambda: HFModule(num_hidden_layers=4)  # noqa: E731  (4 stages of one block)
    for schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"):
        yield Case(
            f"llama4_pp2_cp2_{schedule.lower()}",
            lambda s=schedule: pipelined_parity(pipeline_cp(s, pipeline_stages_per_rank=2), deep, Tokens(SEQ)),
        )
    yield Case("validation_after_fit_pp2_cp2", validation_after_fit)
    yield Case(
        "error_pipeline_with_the_per_rank_loss",
        lambda: expect_error(lambda: pipeline_cp("GPipe", context_parallel_loss="per_rank"), HFModule, Tokens(SEQ)),
    )
    inside = dict(shard_modules=["CausalSelfAttention", "MLP"], pipeline_split=["model.blocks.0.mlp"])
    yield Case(
        "error_pipeline_split_inside_a_block",
        lambda: expect_error(lambda: pipeline_cp("GPipe", **inside), GPTModule, gpt_data()),
    )


GROUPS = {"context_parallel_pipeline": group_context_parallel_pipeline}
