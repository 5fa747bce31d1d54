"""Cases for `tests/launched/test_activations.py`: the activation estimate against a real run under tensor parallelism
on 2 ranks (`FSDPTensorParallelStrategy(tensor_parallel_size=2)`), for the example GPT (its own `tp_plan`) and a tiny
transformers Llama (`tp_plan="auto"`: the model's own plan, embedding and head included), without and with
activation checkpointing. Measured with `StorageMeter`: under tensor parallelism gloo's threads free the collectives'
tensors, which the CPU allocator's profiler record does not see."""

from __future__ import annotations

from collections.abc import Iterator

from lightning_dpar import FSDPTensorParallelStrategy
from tests.support.activation_cases import estimate_and_measure
from tests.support.activation_meter import StorageMeter
from tests.workers.cases import Case
from tests.workers.common import world_size


def tensor_parallel_case(model: str, checkpointing: bool) -> dict:
    tp_plan = "auto" if model == "llama" else None  # the GPT carries its own `tp_plan`
    strategy = FSDPTensorParallelStrategy(
        tensor_parallel_size=2, tp_plan=tp_plan, activation_checkpointing=checkpointing
    )
    return estimate_and_measure(model, strategy, StorageMeter(), devices=world_size())


def group_activations() -> Iterator[Case]:
    for model in ("gpt", "llama"):
        for checkpointing in (False, True):
            name = f"tp2_{model}_{'ac' if checkpointing else 'no_ac'}"
            yield Case(name, lambda m=model, c=checkpointing: tensor_parallel_case(m, c))


GROUPS = {"activations": group_activations}
