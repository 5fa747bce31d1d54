"""`BatchRule`, the per-rank batch of each data-parallel size, and the search pricing each layout at its own: a fixed
per-rank batch, a global batch split over the data-parallel ranks, and what a loader was read to yield."""

from __future__ import annotations

import pytest

from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.candidates import enumerate_layouts
from lightning_dpar.layout_search.profiles import PRESETS
from lightning_dpar.layout_search.search import search
from tests.unit.layout_search.test_search import FACTS, sharded_probe


def test_a_global_batch_is_split_over_the_data_parallel_ranks_where_it_splits_evenly():
    rule = BatchRule(global_batch=12)
    assert rule.sizes(8) == {
        1: 12,
        2: 6,
        4: 3,
        8: "a global batch of 12 does not split evenly over 8 data-parallel ranks",
    }


def test_a_loader_read_at_each_size_is_a_fixed_batch_a_global_batch_or_a_table():
    assert BatchRule.observe({1: 4, 2: 4}, "dl") == BatchRule(per_rank=4, source="dl")
    sized = BatchRule.observe({1: 8, 2: 4, 4: 2}, "dl")
    assert sized.global_batch == 8 and [sized.at(d) for d in (1, 2, 4, 8)] == [8, 4, 2, 1]
    odd = BatchRule.observe({1: 5, 2: 3}, "dl")  # neither: only where it was read
    assert odd.global_batch is None and (odd.at(1), odd.at(2)) == (5, 3)
    assert odd.at(4) == "dl was not read at 4 data-parallel ranks"


def test_a_global_batch_must_agree_with_what_the_loader_yields():
    rule = BatchRule(global_batch=8, observed=((1, 4), (2, 4), (4, 4)), source="the training DataLoader")
    assert rule.at(2) == 4
    assert rule.at(1) == "the training DataLoader yields 4 per rank, not 8 / 1 = 8"


@pytest.mark.parametrize(("per_rank", "global_batch"), [(0, None), (None, -1), (2, 4), (True, None)])
def test_invalid_rules_are_refused(per_rank, global_batch):
    with pytest.raises(ValueError):
        BatchRule(per_rank=per_rank, global_batch=global_batch)


def test_candidates_refuse_the_data_parallel_sizes_without_a_batch_and_split_each_sizes_own():
    layouts, rejected = enumerate_layouts(4, 4, 1, layers=4, batch_size=BatchRule(global_batch=6))
    assert {c.dims.data_parallel for c in layouts} == {1, 2}
    assert any("(4 data-parallel ranks)" in r.what and "does not split evenly" in r.reason for r in rejected)
    # pp2 leaves 2 data-parallel ranks of 3 sequences: 4 microbatches do not divide them, 2 do not either.
    reasons = {r.what: r.reason for r in rejected}
    assert reasons["pp2 1F1B m2"] == "the per-rank batch size 3 does not divide into 2 microbatches"
    # pp4 leaves 1 data-parallel rank of 6: 4 microbatches do not divide 6 either, but 8 stages need 8 layers first.
    assert all(6 // c.dims.data_parallel % c.microbatches == 0 for c in layouts)


def test_the_search_prices_each_layout_at_its_own_per_rank_batch():
    fixed = search(FACTS, 8, 1, PRESETS["h100-node"], sharded_probe)
    split = search(FACTS, 8, 1, PRESETS["h100-node"], sharded_probe, batch=BatchRule(global_batch=16))
    assert {e.samples_per_step for e in split.ranked + split.too_big} == {16}
    assert len({e.samples_per_step for e in fixed.ranked + fixed.too_big}) > 1  # 8 per rank: the global batch varies
    assert split.batch == BatchRule(global_batch=16)

    # The same layout of 4 data-parallel ranks trains 16 / 4 = 4 per rank: its activations are priced at 4, not 8.
    def of(result):
        return {e.layout: e for e in result.ranked + result.too_big}

    layout = next(x for x in of(split) if x.dims.data_parallel == 4 and x.schedule is None)
    assert of(split)[layout].memory.activations < of(fixed)[layout].memory.activations
    assert of(split)[layout].time.compute == pytest.approx(of(fixed)[layout].time.compute / 2)
