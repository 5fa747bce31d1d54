"""Where `AutoParallelStrategy` reads the batch (`strategies.auto_batch`): a `DataLoader`, a data module's attribute,
a `train_dataloader()` hook read at each data-parallel size; the strategy's own sizes; and the refusals, each naming
the bad value, what is valid and what to set."""

from __future__ import annotations

import lightning as L
import pytest
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.data_batch import (
    check_loader,
    check_no_size_fits,
    read_batch_sizes,
    resolve_batch_rule,
)


def no_hook(source, data_parallel):
    raise AssertionError("a DataLoader or a batch_size attribute is read without calling the hook")


class Sized(L.LightningModule):
    """`train_dataloader()` sized as a global batch of 8 over the replicas it is told."""

    def train_dataloader(self, replicas: int = 1):
        return DataLoader(range(64), batch_size=8 // replicas)


def sized_hook(source, data_parallel):
    return source.train_dataloader(data_parallel)


def test_a_dataloader_yields_its_batch_size_at_every_size():
    assert read_batch_sizes(DataLoader(range(8), batch_size=4), 4, no_hook) == (
        {1: 4, 2: 4, 4: 4},
        "the training DataLoader (batch_size=4)",
    )


def test_a_dataloader_with_a_batch_sampler_cannot_be_read():
    loader = DataLoader(range(8), batch_sampler=BatchSampler(SequentialSampler(range(8)), 4, False))
    sizes, why = read_batch_sizes(loader, 2, no_hook)
    assert sizes is None and "batch_sampler" in why


def test_a_data_module_batch_size_attribute_is_read_without_calling_its_hook():
    data = L.LightningDataModule()
    data.batch_size = 6
    assert read_batch_sizes(data, 2, no_hook) == ({1: 6, 2: 6}, "the data module's batch_size (6)")


def test_a_train_dataloader_hook_is_read_at_every_data_parallel_size():
    sizes, name = read_batch_sizes(Sized(), 4, sized_hook)
    assert sizes == {1: 8, 2: 4, 4: 2} and name == "Sized.train_dataloader()"
    assert BatchRule.observe(sizes, name).global_batch == 8


def test_a_hook_that_raises_is_refused_naming_the_error_and_what_to_set():
    def broken(source, data_parallel):
        raise AttributeError("'Sized' object has no attribute 'data'")

    read = read_batch_sizes(Sized(), 2, broken)
    assert read[0] is None
    with pytest.raises(ValueError, match=r"Sized.train_dataloader\(\).*raised AttributeError.*`global_batch_size="):
        resolve_batch_rule(None, None, read)
    # Told the global batch, the strategy trusts it (and checks the loader Lightning builds, `check_loader`).
    assert resolve_batch_rule(None, 8, read) == BatchRule(global_batch=8, source=read[1])


def test_a_module_without_the_hook_is_refused():
    sizes, why = read_batch_sizes(L.LightningModule(), 2, no_hook)
    assert sizes is None
    assert why == "LightningModule.train_dataloader() is not defined, and `fit` was given no training data"


def test_the_strategys_batch_size_wins_and_global_batch_size_is_checked_against_the_data():
    read = read_batch_sizes(DataLoader(range(8), batch_size=4), 4, no_hook)
    assert resolve_batch_rule(3, None, read) == BatchRule(per_rank=3)
    rule = resolve_batch_rule(None, 8, read)
    assert rule.sizes(4) == {
        1: "the training DataLoader (batch_size=4) yields 4 per rank, not 8 / 1 = 8",
        2: 4,
        4: "the training DataLoader (batch_size=4) yields 4 per rank, not 8 / 4 = 2",
    }


def test_a_global_batch_no_data_parallel_size_can_train_is_refused_naming_the_valid_ones():
    rule = resolve_batch_rule(None, 6, read_batch_sizes(DataLoader(range(8), batch_size=4), 4, no_hook))
    with pytest.raises(ValueError) as caught:
        check_no_size_fits(rule, 4)
    message = str(caught.value)
    assert message.startswith("`global_batch_size=6` cannot be trained on 4 ranks")
    assert "a multiple of 4" in message
    assert "`global_batch_size=4`, `global_batch_size=8`, `global_batch_size=16`" in message
    check_no_size_fits(resolve_batch_rule(None, 8, read_batch_sizes(Sized(), 4, sized_hook)), 4)  # agrees everywhere


def test_the_loader_lightning_builds_must_yield_the_batch_the_layout_was_chosen_for():
    rule = BatchRule(global_batch=8)
    check_loader(DataLoader(range(8), batch_size=4), 4, 2, rule)
    with pytest.raises(ValueError, match=r"yields batches of 8 per rank, but the layout was chosen for 4 at 2 data"):
        check_loader(DataLoader(range(8), batch_size=8), 4, 2, rule)
