"""The search's pure logic with a stand-in probe (memory from the mesh sizes alone): candidates and their
refusals, ranking, determinism, what does not fit, and what would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dpar.layout_search.candidates import Layout, enumerate_layouts
from lightning_dpar.layout_search.cost import MeshMemory, RankMemory
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import GIB, PRESETS
from lightning_dpar.layout_search.search import search, what_would_fit

FACTS = ModelFacts(params=100_000_000, layers=8, hidden=1024, vocab=32000, seq_len=512, batch_size=8, heads=16)
PARAM_BYTES = 16  # fp32 parameters, gradients and two AdamW states per element


def sharded_probe(layout: Layout) -> MeshMemory:
    """Memory split evenly over every rank that shards a parameter; heads must divide by the TP size."""
    d = layout.dims
    if FACTS.heads % d.tensor_parallel:
        raise ValueError(f"heads {FACTS.heads} not divisible by tensor_parallel_size={d.tensor_parallel}")
    per_rank = FACTS.params // (d.shard * d.tensor_parallel * d.pipeline)
    rank = RankMemory(4 * per_rank, 4 * per_rank, 8 * per_rank)  # activations: the formula
    return MeshMemory((rank,), 2 * FACTS.params // FACTS.layers // d.tensor_parallel)


def test_candidates_cover_every_mesh_and_refuse_with_reasons():
    layouts, rejected = enumerate_layouts(4, 4, 1, layers=4, batch_size=6)
    meshes = {(c.dims.pipeline, c.dims.replicate, c.dims.shard, c.dims.tensor_parallel) for c in layouts}
    assert (1, 1, 4, 1) in meshes and (1, 1, 1, 4) in meshes and (1, 2, 2, 1) in meshes and (2, 1, 2, 1) in meshes
    assert {c.activation_checkpointing for c in layouts} == {False, "selective", True}
    # 6 sequences per rank do not split into 4 microbatches; 8 stages need 8 layers.
    reasons = {r.what: r.reason for r in rejected}
    assert "does not divide into 4 microbatches" in reasons["pp2 1F1B m4"]
    assert "at least as many layers" in reasons["pp4 Interleaved1F1B"]
    assert all(c.microbatches and 6 % c.microbatches == 0 for c in layouts)


def test_expert_parallel_sizes_only_for_moe_models():
    dense, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=8)
    moe, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=8, moe=True)
    assert {c.dims.expert for c in dense} == {1}
    assert {c.dims.expert for c in moe} == {1, 2, 4}


def test_tensor_parallel_stays_within_a_node():
    layouts, rejected = enumerate_layouts(16, 8, 2, layers=8, batch_size=8)
    assert max(c.dims.tensor_parallel for c in layouts) == 8
    assert any(r.what == "tp16" and "spans nodes" in r.reason for r in rejected)
    # Across nodes, HSDP's shard groups are whole nodes.
    assert all((c.dims.shard * c.dims.tensor_parallel) % 8 == 0 for c in layouts if c.dims.replicate > 1)


def test_ranked_by_time_per_sample_among_layouts_that_fit():
    result = search(FACTS, 8, 1, PRESETS["h100-node"], sharded_probe)
    times = [e.seconds_per_sample for e in result.ranked]
    assert times == sorted(times) and len(times) > 10
    assert all(e.memory.total <= result.profile.device_memory for e in result.ranked)
    assert not result.too_big
    # The planner's refusal (16 heads over TP 8 divide; none refused here) and arithmetic refusals are kept.
    assert all(r.reason for r in result.rejected)


def test_the_planners_errors_reject_the_mesh_with_its_message():
    facts = replace(FACTS, heads=6)

    def probe(layout):
        if facts.heads % layout.dims.tensor_parallel:
            raise ValueError(f"heads 6 not divisible by tensor_parallel_size={layout.dims.tensor_parallel}")
        return sharded_probe(layout)

    result = search(facts, 4, 1, PRESETS["cpu-gloo"], probe)
    assert any("tensor_parallel_size=4" in r.reason for r in result.rejected)
    assert all(e.layout.dims.tensor_parallel != 4 for e in result.ranked + result.too_big)


def test_same_model_and_world_give_the_same_choice():
    first = search(FACTS, 8, 1, PRESETS["h100-node"], sharded_probe)
    second = search(FACTS, 8, 1, PRESETS["h100-node"], sharded_probe)
    assert [e.layout for e in first.ranked] == [e.layout for e in second.ranked]
    assert first.best is not None and first.best.layout == second.best.layout


def test_too_little_memory_rejects_by_how_much_and_says_what_would_fit():
    small = PRESETS["cpu-gloo"].with_memory(1 * GIB)
    result = search(FACTS, 2, 1, small, sharded_probe)
    assert result.best is None and result.too_big
    assert all(result.over_by(e) > 0 for e in result.too_big)
    suggestion = what_would_fit(result, lambda world, nodes: sharded_probe)
    assert suggestion.memory_needed == min(e.memory.total for e in result.too_big)
    assert suggestion.devices_needed is not None and suggestion.devices_needed > 2
    assert suggestion.devices_layout is not None
    assert suggestion.devices_layout.memory.total <= small.device_memory
    assert "GiB per device" in suggestion.describe()


def test_a_budget_below_the_runtime_memory_tries_no_other_world():
    tiny = PRESETS["cpu-gloo"].with_memory(PRESETS["cpu-gloo"].runtime_memory // 2)
    result = search(FACTS, 2, 1, tiny, sharded_probe)

    def no_other_world(world, nodes):
        raise AssertionError(f"a world of {world} was tried")

    suggestion = what_would_fit(result, no_other_world)
    assert suggestion.devices_needed is None and suggestion.memory_needed is not None
    assert "no device count fits 16.00 MiB per device: the profile's runtime memory alone" in suggestion.describe()
    assert "32.00 MiB" in suggestion.describe()


def test_selective_checkpointing_is_chosen_where_it_fits_and_full_checkpointing_is_not_needed():
    """Without checkpointing nothing fits; selective checkpointing fits and recomputes a tenth of what full does
    (the traced share), so it beats full checkpointing on every mesh where both fit."""
    memory = PRESETS["h100-node"].device_memory

    def probe(layout: Layout) -> MeshMemory:
        rank = replace(
            sharded_probe(layout).ranks[0], activations=2 * memory, activations_checkpointed=0, activations_selective=0
        )
        return MeshMemory((rank,), sharded_probe(layout).gathered_unit, selective_share=0.1)

    result = search(FACTS, 4, 1, PRESETS["h100-node"], probe)
    assert result.best is not None and result.best.layout.activation_checkpointing == "selective"
    assert all(e.layout.activation_checkpointing for e in result.ranked)


def test_activation_checkpointing_can_be_fixed():
    result = search(FACTS, 4, 1, PRESETS["h100-node"], sharded_probe, activation_checkpointing=True)
    assert {e.layout.activation_checkpointing for e in result.ranked} == {True}


def test_bad_world_is_refused():
    with pytest.raises(ValueError, match="multiple of the number of nodes"):
        search(FACTS, 6, 4, PRESETS["h100-node"], sharded_probe)
