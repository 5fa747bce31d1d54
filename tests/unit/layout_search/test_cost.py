"""The cost model's pure logic: profiles as data, the activation formula, and each term of one layout's estimate,
checked against numbers worked out by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_dpar.estimates.activation_formula import activation_bytes
from lightning_dpar.layout_search.candidates import Layout
from lightning_dpar.layout_search.cost import MeshMemory, RankMemory, estimate
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import (
    PRESETS,
    HardwareProfile,
    Link,
    get_profile,
    load_profile,
    save_profile,
)
from lightning_dpar.parallel_dims import ParallelDims

#: A profile with round numbers: 1 TFLOP/s, 1 GB/s within a node, no latency, nothing hidden.
FLAT = HardwareProfile("flat", 4, 10**12, 1e12, Link(0.0, 1e9), Link(0.0, 1e8))
FACTS = ModelFacts(params=1_000_000, layers=4, hidden=64, vocab=100, seq_len=10, batch_size=8)
MESH = MeshMemory((RankMemory(parameters=1000, gradients=1000, optimizer=2000),), gathered_unit=100)  # untraced


def dims(world=4, tp=1, pp=1, replicate=1, ep=1):
    return ParallelDims.resolve(
        world, world, tp, replicate_size=replicate, pipeline_parallel_size=pp, expert_parallel_size=ep
    )


def test_profiles_round_trip_through_json(tmp_path):
    path = tmp_path / "p.json"
    measured = HardwareProfile(
        "m", 4, 1, 2.0, Link(1e-5, 1e9), Link(1e-4, 1e8), collectives={"all_reduce": {"2": Link(3e-5, 5e8)}}
    )
    save_profile(measured, path)
    assert load_profile(path) == measured
    assert json.loads(path.read_text())["name"] == "m"
    assert get_profile(str(path)) == measured
    assert get_profile("h100-node") is PRESETS["h100-node"]


def test_a_measured_collective_overrides_the_link_within_a_node_only():
    measured = HardwareProfile(
        "m", 8, 1, 1.0, Link(0, 1e9), Link(0, 1e8), collectives={"all_reduce": {"2": Link(0, 5e8), "4": Link(0, 2e8)}}
    )
    assert measured.collective_link("all_reduce", 2, False).bandwidth == 5e8
    assert measured.collective_link("all_reduce", 8, False).bandwidth == 2e8  # nearest smaller measured size
    assert measured.collective_link("all_reduce", 4, True).bandwidth == 1e8  # across nodes: the link
    assert measured.collective_link("all_gather", 4, False).bandwidth == 1e9


@pytest.mark.parametrize("spec", ["nope", "missing.json", 3])
def test_an_unknown_profile_names_the_presets(spec):
    with pytest.raises(ValueError, match="cpu-gloo"):
        get_profile(spec)


def test_activation_formula():
    one = dict(layers=4, hidden=8, heads=2, vocab=10, seq_len=5, microbatch_size=2, element_size=4)
    s_b_h_e = 5 * 2 * 8 * 4
    logits = 3 * 5 * 2 * 10 * 4
    assert activation_bytes(**one) == 4 * s_b_h_e * 17 + s_b_h_e + logits
    assert activation_bytes(**one, tensor_parallel=2) == 4 * s_b_h_e * 11 + s_b_h_e + logits
    # Checkpointing keeps each layer's input, plus one layer recomputed whole.
    assert activation_bytes(**one, checkpointing=True) == 4 * s_b_h_e + s_b_h_e * 17 + s_b_h_e + logits
    # Pipeline stage 0 of 2 under 1F1B with 4 microbatches: 2 in flight, 2 layers each.
    piped = activation_bytes(**one, pipeline=2, microbatches=4, schedule="1F1B")
    assert piped == 2 * (2 * s_b_h_e * 17 + s_b_h_e) + logits
    gpipe = activation_bytes(**one, pipeline=2, microbatches=4, schedule="GPipe")
    assert gpipe == 4 * (2 * s_b_h_e * 17 + s_b_h_e) + 4 * logits
    # Interleaved1F1B, 2 ranks x 2 stages, 4 microbatches: rank 0 keeps 3 + 2 microbatches of 1 layer in flight.
    interleaved = activation_bytes(**one, pipeline=2, microbatches=4, schedule="Interleaved1F1B", stages_per_rank=2)
    assert interleaved == 5 * s_b_h_e * 17 + 3 * s_b_h_e + logits
    scores = activation_bytes(**one, flash_attention=False) - activation_bytes(**one)
    assert scores == 4 * 5 * 2 * 5 * 5 * 2 * 4 // 2


def test_compute_is_6n_per_token_over_throughput_and_split_by_tp_and_pp():
    flops = 6 * (1_000_000) + 12 * 4 * 64 * 10
    data_parallel = estimate(Layout(dims()), FACTS, MESH, FLAT)
    assert data_parallel.time.compute == pytest.approx(flops * 80 / 1e12)
    assert data_parallel.samples_per_step == 32
    tensor_parallel = estimate(Layout(dims(tp=2)), FACTS, MESH, FLAT)
    assert tensor_parallel.time.compute == pytest.approx(flops * 80 / 2e12)
    assert tensor_parallel.samples_per_step == 16
    checkpointed = estimate(Layout(dims(), activation_checkpointing=True), FACTS, MESH, FLAT)
    assert checkpointed.time.compute == pytest.approx(flops * 80 * 8 / 6 / 1e12)


def test_selective_checkpointing_recomputes_its_traced_share_of_what_full_recomputes():
    """6 + 2 x the share the dry run's trace measured (`MeshMemory.selective_share`); not traced, priced as full (an
    upper bound), with its activations counted as without checkpointing (an upper bound too)."""
    flops = 6 * (1_000_000) + 12 * 4 * 64 * 10
    traced = replace(MESH, selective_share=0.25)
    selective = estimate(Layout(dims(), activation_checkpointing="selective"), FACTS, traced, FLAT)
    assert selective.time.compute == pytest.approx(flops * 80 * (6 + 2 * 0.25) / 6 / 1e12)
    untraced = estimate(Layout(dims(), activation_checkpointing="selective"), FACTS, MESH, FLAT)
    assert untraced.time.compute == pytest.approx(flops * 80 * 8 / 6 / 1e12)
    assert untraced.memory.activations == estimate(Layout(dims()), FACTS, MESH, FLAT).memory.activations


def test_moe_compute_counts_the_active_experts_only():
    moe = ModelFacts(
        params=1_000_000,
        layers=4,
        hidden=64,
        vocab=100,
        seq_len=10,
        batch_size=8,
        expert_params=800_000,
        experts=8,
        experts_per_token=2,
        moe_layers=4,
    )
    assert moe.active_params == 200_000 + 200_000
    dense = ModelFacts(params=400_000, layers=4, hidden=64, vocab=100, seq_len=10, batch_size=8)
    assert moe.flops_per_token() == dense.flops_per_token()


def test_fsdp_communication_is_the_ring_volume_over_the_link():
    # 4 shards, fp32: per unit (4 layers + 1) 200,000 params = 800 kB; all-gather x2 and reduce-scatter x1 per
    # unit, each moving 3/4 of the unit.
    got = estimate(Layout(dims()), FACTS, MESH, FLAT)
    assert got.time.communication == pytest.approx(5 * 3 * 800_000 * 0.75 / 1e9)
    assert got.time.exposed_communication == pytest.approx(got.time.communication)  # nothing hidden
    hidden = estimate(
        Layout(dims()), FACTS, MESH, HardwareProfile("h", 4, 10**12, 1e12, Link(0, 1e9), Link(0, 1e8), fsdp_overlap=1.0)
    )
    assert hidden.time.exposed_communication == pytest.approx(max(0.0, got.time.communication - got.time.compute))


def test_tensor_parallel_all_reduces_per_layer_and_pipeline_bubble():
    activation = 8 * 10 * 64 * 4  # one microbatch (the whole batch), fp32
    tp = estimate(Layout(dims(tp=4)), FACTS, MESH, FLAT)  # no FSDP (shard 1)
    assert tp.time.communication == pytest.approx(4 * 4 * 2 * activation * 0.75 / 1e9)
    piped = estimate(Layout(dims(pp=4), schedule="1F1B", microbatches=4), FACTS, MESH, FLAT)
    assert piped.time.bubble == pytest.approx(piped.time.compute * (3 / 7) / (4 / 7))
    interleaved = estimate(
        Layout(dims(pp=2, world=2), schedule="Interleaved1F1B", microbatches=2, stages_per_rank=2), FACTS, MESH, FLAT
    )
    assert interleaved.time.bubble == pytest.approx(interleaved.time.compute * (1 / 5) / (4 / 5))


def test_memory_split_adds_the_dry_run_numbers_activations_and_buffers():
    got = estimate(Layout(dims()), FACTS, MESH, FLAT).memory
    assert (got.parameters, got.gradients, got.optimizer) == (1000, 2 * 500, 2000)
    assert got.buffers == 2 * 100 + 100
    assert got.activations == activation_bytes(
        layers=4, hidden=64, heads=0, vocab=100, seq_len=10, microbatch_size=8, element_size=4
    )
    assert got.total == 1000 + 1000 + 2000 + got.activations + 300
    assert not got.activations_traced


def test_a_rank_without_a_traced_selective_figure_has_no_selective_peak():
    """Not traced under selective checkpointing: `None`, so the formula stands in (not the full figure)."""
    rank = RankMemory(1000, 1000, 2000, activations=9000, activations_checkpointed=1500)
    assert [rank.activation_peak(c) for c in (False, True, "selective")] == [9000, 1500, None]
    assert replace(rank, activations_selective=2000).activation_peak("selective") == 2000


def test_traced_activations_are_taken_per_checkpointing_setting_on_the_rank_with_the_highest_peak():
    # Stage 0 holds the embeddings and most activations; the last stage the head's parameters.
    first = RankMemory(1000, 1000, 2000, activations=9000, activations_checkpointed=1500)
    last = RankMemory(3000, 3000, 6000, activations=500, activations_checkpointed=400)
    mesh = MeshMemory((first, last), gathered_unit=0)
    layout = Layout(dims(pp=2, world=2), schedule="1F1B", microbatches=2)
    without = estimate(layout, FACTS, mesh, FLAT).memory
    assert (without.parameters, without.activations, without.activations_traced) == (1000, 9000, True)
    with_ = estimate(replace(layout, activation_checkpointing=True), FACTS, mesh, FLAT).memory
    assert (with_.parameters, with_.activations) == (3000, 400)
    first, last = replace(first, activations_selective=8500), replace(last, activations_selective=450)
    selective = estimate(
        replace(layout, activation_checkpointing="selective"), FACTS, MeshMemory((first, last), 0), FLAT
    ).memory
    assert (selective.parameters, selective.activations) == (1000, 8500)


def test_groups_spanning_nodes_use_the_slower_link():
    two_nodes = ParallelDims.resolve(8, 4, 1, num_nodes=2)
    across = estimate(Layout(two_nodes), FACTS, MESH, FLAT)
    within = estimate(
        Layout(ParallelDims.resolve(8, 8, 1)),
        FACTS,
        MESH,
        HardwareProfile("f8", 8, 10**12, 1e12, Link(0, 1e9), Link(0, 1e8)),
    )
    assert across.time.communication == pytest.approx(10 * within.time.communication)


def test_the_profiles_runtime_memory_and_step_overhead_are_added_once():
    plain = estimate(Layout(dims()), FACTS, MESH, FLAT)
    busy = estimate(Layout(dims()), FACTS, MESH, replace(FLAT, runtime_memory=123, step_overhead=0.5))
    assert busy.memory.total == plain.memory.total + 123 and busy.memory.runtime == 123
    assert busy.time.total == pytest.approx(plain.time.total + 0.5)
    assert busy.time.compute == plain.time.compute


def test_float8_matmul_rates_where_the_device_has_them():
    """NVIDIA's dense peaks at the presets' 40% sustained: float8 twice bf16 on H100, H200 and B200; none on an
    A100 or a CPU, where float8 is refused naming the fix."""
    from lightning_dpar.layout_search.profiles import check_float8

    for name in ("h100-node", "h200-node", "b200-node"):
        profile = PRESETS[name]
        assert profile.float8_matmul_flops == pytest.approx(2 * profile.matmul_flops, rel=0.02), name
        check_float8("tensorwise", profile)
    assert PRESETS["h100-node"].float8_matmul_flops == pytest.approx(0.4 * 1979e12, rel=0.01)
    assert PRESETS["b200-node"].float8_matmul_flops == pytest.approx(0.4 * 4500e12, rel=0.01)
    for name in ("a100-node", "cpu-gloo"):
        assert PRESETS[name].float8_matmul_flops is None
        with pytest.raises(ValueError, match=rf"profile '{name}', whose device has no float8 matmuls.*Drop `float8=`"):
            check_float8("rowwise", PRESETS[name])
    check_float8(None, PRESETS["cpu-gloo"])


def test_a_profile_written_before_float8_loads_without_float8_matmuls(tmp_path):
    path = tmp_path / "old.json"
    data = PRESETS["h100-node"].to_json()
    del data["float8_matmul_flops"]
    path.write_text(json.dumps(data))
    assert load_profile(path).float8_matmul_flops is None
    save_profile(PRESETS["h100-node"], path)
    assert load_profile(path) == PRESETS["h100-node"]


def test_float8_runs_the_converted_matmuls_at_the_float8_rate_and_the_rest_at_the_bf16_rate():
    """Of 6 x 1,000,000 + attention FLOPs per token, the 6 x 600,000 of the converted `nn.Linear` weights run at
    2 TFLOP/s, the rest at 1 (full checkpointing recomputes both alike); nothing else changes."""
    fast = replace(FLAT, float8_matmul_flops=2e12)
    facts = replace(FACTS, float8_params=600_000)
    flops = 6 * 1_000_000 + 12 * 4 * 64 * 10
    converted = 6 * 600_000
    for ac, factor in ((False, 1.0), (True, 8 / 6)):
        bf16 = estimate(Layout(dims(tp=2), activation_checkpointing=ac), facts, MESH, fast)
        float8 = estimate(Layout(dims(tp=2), activation_checkpointing=ac, float8="tensorwise"), facts, MESH, fast)
        tokens = 80 / 2  # per tensor-parallel rank
        assert bf16.time.compute == pytest.approx(flops * factor * tokens / 1e12)
        want = (flops - converted) * factor * tokens / 1e12 + converted * factor * tokens / 2e12
        assert float8.time.compute == pytest.approx(want)
        assert float8.memory == bf16.memory
        assert float8.time.communication == bf16.time.communication
    assert facts.float8_flops_per_token("selective", 0.5) == converted * (1 + 2 / 6 * 0.5)
    with pytest.raises(ValueError, match="no float8 matmuls"):
        estimate(Layout(dims(), float8="tensorwise"), facts, MESH, FLAT)


def test_float8_layouts_say_so_and_pass_the_recipe_to_the_strategy():
    layout = Layout(dims(tp=2), float8="rowwise")
    assert layout.strategy_kwargs()["float8"] == "rowwise"
    assert layout.describe().endswith("float8 rowwise")
    assert "float8" not in Layout(dims(tp=2)).strategy_kwargs()
