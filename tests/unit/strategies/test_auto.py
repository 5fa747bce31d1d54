"""`AutoParallelStrategy` chooses in `resolve_dims` (before any process group): the search's best layout, set where
`FSDPTensorParallelStrategy` reads it; and its refusals, each naming the value and what would be valid."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_dpar
from lightning_dpar import AutoParallelStrategy
from lightning_dpar.examples import GPT
from lightning_dpar.layout.probe import search_model
from lightning_dpar.layout.profiles import PRESETS


def gpt() -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=4, n_head=4, n_embd=64, block_size=32)


def connected(strategy: AutoParallelStrategy, module: L.LightningModule) -> AutoParallelStrategy:
    strategy.connect(module)
    return strategy


def test_registered_as_dpar_auto():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["dpar_auto"]["strategy"] is lightning_dpar.AutoParallelStrategy


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_chooses_the_searchs_best_layout_and_trains_it_as_the_2d_strategy_would():
    strategy = connected(AutoParallelStrategy(batch_size=8), gpt())
    dims = strategy.resolve_dims(4, 4, 1)
    best = search_model(gpt(), 4, 1, PRESETS["cpu-gloo"], 8).best
    assert best is not None and strategy.chosen == best.layout
    assert dims == best.layout.dims
    assert strategy.plan_options.activation_checkpointing == best.layout.activation_checkpointing
    if dims.pipeline > 1:
        assert strategy.pipeline_config.schedule.name == best.layout.schedule
        assert strategy.pipeline_config.microbatches == best.layout.microbatches
    # Deterministic: another strategy on the same model and world makes the same choice.
    again = connected(AutoParallelStrategy(batch_size=8), gpt())
    assert again.resolve_dims(4, 4, 1) == dims and again.chosen == strategy.chosen


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_fixed_activation_checkpointing_is_kept():
    strategy = connected(AutoParallelStrategy(batch_size=8, activation_checkpointing=True), gpt())
    strategy.resolve_dims(2, 2, 1)
    assert strategy.chosen is not None and strategy.chosen.activation_checkpointing


def test_the_sizes_it_chooses_cannot_be_given():
    with pytest.raises(ValueError, match=r"chooses \['tensor_parallel_size'\] itself"):
        AutoParallelStrategy(tensor_parallel_size=2)


def test_an_unknown_profile_fails_when_built():
    with pytest.raises(ValueError, match=r"`profile='a100'` is not a known hardware profile.*cpu-gloo"):
        AutoParallelStrategy(profile="a100")


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_a_memory_budget_below_the_models_minimum_says_what_would_fit():
    strategy = connected(AutoParallelStrategy(batch_size=8, device_memory=0.001), gpt())
    with pytest.raises(ValueError, match=r"No layout of 2 ranks fits 0.00 GiB per device.*GiB per device it would fit"):
        strategy.resolve_dims(2, 2, 1)


def test_without_a_batch_size_or_trainer_it_asks_for_one():
    strategy = connected(AutoParallelStrategy(), gpt())
    with pytest.raises(ValueError, match="Pass `batch_size="):
        strategy.resolve_dims(2, 2, 1)
