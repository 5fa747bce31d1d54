"""Selective activation checkpointing (`activation_checkpointing="selective"`) cases for
`tests/launched/test_activation_checkpointing.py`: the example GPT and a transformers Llama trained through real
Trainers on 2 and 4 gloo ranks under DDP (`ReplicateStrategy`), FSDP, TP 2, TP 2 x FSDP 2, context parallelism
(alone and with TP) and pipeline parallelism (with FSDP and with TP), each against one process on the same global
batches; one step's activation memory measured without, with selective and with full checkpointing, beside the
activation estimate of each; and the refusal of a setting that is not one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from lightning_dpar.examples.gpt import GPT
from tests.workers.cases import Case
from tests.workers.common import world_size
from tests.workers.context_parallel import (
    GPTModule,
    HFModule,
    Tokens,
    expect_error,
    gpt_data,
    measure_and_estimate,
    parity,
)

SELECTIVE = "selective"


def gpt(strategy: Callable[[], Any], dp: int) -> Callable[[], dict | None]:
    return lambda: parity(strategy(), GPTModule, dp, gpt_data())


def llama(strategy: Callable[[], Any], dp: int, ignored: bool = False) -> Callable[[], dict | None]:
    from tests.workers.context_parallel import SEQ

    return lambda: parity(strategy(), HFModule, dp, Tokens(SEQ, ignored=ignored))


def tp(size: int, **options: Any) -> Callable[[], Any]:
    return lambda: FSDPTensorParallelStrategy(tensor_parallel_size=size, activation_checkpointing=SELECTIVE, **options)


def fsdp(**options: Any) -> Callable[[], Any]:
    return lambda: FullyShardStrategy(activation_checkpointing=SELECTIVE, **options)


def group_activation_checkpointing() -> Iterator[Case]:
    world = world_size()
    yield Case(f"gpt_selective_fsdp{world}", gpt(fsdp(), world))
    yield Case(f"llama_selective_fsdp{world}", llama(fsdp(), world))
    yield Case(f"gpt_selective_cp{world}", gpt(fsdp(context_parallel_size=world), 1))
    yield Case(f"llama_selective_cp{world}_ignore_index", llama(fsdp(context_parallel_size=world), 1, ignored=True))
    yield Case(f"gpt_selective_pp2_fsdp{world // 2}", gpt(fsdp(pipeline_parallel_size=2), world // 2))
    if world == 2:
        replicate = lambda: ReplicateStrategy(activation_checkpointing=SELECTIVE)  # noqa: E731
        yield Case("gpt_selective_replicate2", gpt(replicate, 2))
        yield Case("gpt_selective_tp2", gpt(tp(2), 1))
        yield Case("llama_selective_tp2", llama(tp(2, tp_plan="auto"), 1))
    if world == 4:
        yield Case("gpt_selective_tp2_fsdp2", gpt(tp(2), 2))
        yield Case("llama_selective_tp2_fsdp2", llama(tp(2, tp_plan="auto"), 2))
        yield Case("llama_selective_tp2_cp2", llama(tp(2, tp_plan="auto", context_parallel_size=2), 1))
        yield Case("gpt_selective_pp2_tp2", gpt(tp(2, pipeline_parallel_size=2), 1))
    yield Case(
        "error_not_a_setting",
        lambda: expect_error(lambda: FullyShardStrategy(activation_checkpointing="everything"), GPTModule, gpt_data()),
    )


def activation_memory(checkpointing: Any, tensor_parallel: int = 1) -> dict | None:
    """One step's activation memory on each rank (`StorageMeter`, which follows tensor storages as the estimate
    does) for the example GPT on 2 x 256 tokens per data-parallel rank, under `checkpointing`, and the activation
    estimate (the `plan` dry run's) of the same layout and batch, under each setting."""
    from lightning_dpar.activation_checkpointing.step import CHECKPOINTING_SETTINGS

    def make() -> GPT:
        torch.manual_seed(0)
        return GPT(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=64)

    data = Tokens(257, n=16)
    if tensor_parallel > 1:
        strategy: Any = FSDPTensorParallelStrategy(
            tensor_parallel_size=tensor_parallel, activation_checkpointing=checkpointing
        )
    else:
        strategy = FullyShardStrategy(activation_checkpointing=checkpointing)
    result = measure_and_estimate(strategy, make, data)
    if result is None:
        return None
    measured, estimate = result
    estimated = {}
    for setting in CHECKPOINTING_SETTINGS:
        footprint = estimate.rank(0).per_microbatch(setting)
        estimated[str(setting)] = {"retained": footprint.retained, "peak": footprint.peak}
    assert estimate.flops is not None
    return {
        "retained": [r for r, _ in measured],
        "peak": [p for _, p in measured],
        "estimated": estimated,
        "plan": str(estimate.checkpointing),
        "recomputed_fraction": {str(s): estimate.flops.recomputed_fraction(s) for s in CHECKPOINTING_SETTINGS},
    }


def group_activation_checkpointing_memory() -> Iterator[Case]:
    for setting in (False, SELECTIVE, True):
        yield Case(f"memory_gpt_{setting}", lambda s=setting: activation_memory(s))
        if world_size() == 2:
            yield Case(f"memory_gpt_tp2_{setting}", lambda s=setting: activation_memory(s, tensor_parallel=2))


GROUPS = {
    "activation_checkpointing": group_activation_checkpointing,
    "activation_checkpointing_memory": group_activation_checkpointing_memory,
}
