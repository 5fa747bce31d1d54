"""`dpar_auto` through real Trainers: the layout it chooses (with no budget, with a memory budget just below its
first choice's peak, and with one below every layout that neither pipelines nor tensor-parallelises) trains to the
same parameters as the same layout chosen by hand with `FSDPTensorParallelStrategy`, and as single-process training
on the same global batches."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from lightning_dpar import AutoParallelStrategy, FSDPTensorParallelStrategy
from lightning_dpar.examples.gpt import GPT
from lightning_dpar.layout_search.isolated import search_anywhere
from lightning_dpar.layout_search.profiles import GIB, PRESETS
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for, world_size
from tests.workers.hf_models import SEQ, VOCAB, TokenIds, global_batches


class TinyGPT(GPT):
    """The example GPT, 4 layers of width 32; SGD, so that the comparison measures gradients."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _train(strategy) -> tuple[dict[str, torch.Tensor], object]:
    trainer = trainer_for(strategy)
    trainer.fit(TinyGPT(), DataLoader(TokenIds(), batch_size=BATCH))
    return full_params(trainer), trainer


def _reference(dp: int, steps: int) -> dict[str, torch.Tensor]:
    module = TinyGPT()
    optimizer = module.configure_optimizers()
    for batch in global_batches(TokenIds(), dp, 0, steps):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity_case(device_memory: float | None) -> dict | None:
    """`dpar_auto` (with `device_memory` GiB, or the profile's), then the chosen layout by hand; on rank 0 each one's
    largest difference to single-process training and to each other."""
    auto = AutoParallelStrategy(device_memory=device_memory)
    got, trainer = _train(auto)
    layout = auto.chosen
    assert layout is not None and auto.search_result is not None
    hand, _ = _train(FSDPTensorParallelStrategy(**layout.strategy_kwargs()))
    if trainer.global_rank != 0:
        return None
    want = _reference(layout.dims.data_parallel, trainer.global_step)
    assert set(got) == set(want) == set(hand), sorted(set(got) ^ set(want))
    return {
        "chosen": layout.describe(),
        "runners_up": [e.layout.describe() for e in auto.search_result.ranked[1:3]],
        "peak": auto.search_result.best.memory.total,
        "device_memory": auto.search_result.profile.device_memory,
        "steps": trainer.global_step,
        "auto_vs_hand": max((got[k] - hand[k]).abs().max().item() for k in want),
        "auto_vs_single": max((got[k] - want[k]).abs().max().item() for k in want),
    }


def _budget_below_first_choice() -> float:
    """GiB just below the unconstrained choice's predicted peak: the search must choose a leaner layout."""
    result = search_anywhere(TinyGPT(), world_size(), 1, PRESETS["cpu-gloo"], BATCH)
    assert result.best is not None
    return (result.best.memory.total - 1) / GIB


def _budget_below_data_parallel_layouts() -> float:
    """GiB just below every layout without pipeline or tensor parallelism: the search must split the model."""
    result = search_anywhere(TinyGPT(), world_size(), 1, PRESETS["cpu-gloo"], BATCH)
    plain = [e.memory.total for e in result.ranked if e.layout.dims.pipeline == e.layout.dims.tensor_parallel == 1]
    return (min(plain) - 1) / GIB


def group_auto_layout() -> Iterator[Case]:
    yield Case("auto_gpt", lambda: parity_case(None))
    yield Case("auto_gpt_budget", lambda: parity_case(_budget_below_first_choice()))
    yield Case("auto_gpt_split", lambda: parity_case(_budget_below_data_parallel_layouts()))


GROUPS = {"auto_layout": group_auto_layout}
