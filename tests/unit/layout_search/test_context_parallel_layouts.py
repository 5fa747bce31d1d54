"""Context parallelism in the layout search: which CP sizes are candidates, what the cost model charges for them, and
that the search picks CP when only splitting the sequence makes the activations fit (a stand-in probe whose
activations divide by the CP size, as the dry run's traced estimate does for the blocks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dpar.layout_search.candidates import Layout, enumerate_layouts
from lightning_dpar.layout_search.cost import MeshMemory, RankMemory, estimate
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import GIB, PRESETS
from lightning_dpar.layout_search.search import search
from lightning_dpar.parallel_dims import ParallelDims

FACTS = ModelFacts(params=1_000_000_000, layers=16, hidden=2048, vocab=32000, seq_len=65536, batch_size=1, heads=16)


def test_context_parallel_sizes_are_candidates_only_with_a_sequence_length_they_split():
    without, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=2)
    assert {c.dims.context for c in without} == {1}
    layouts, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=2, seq_len=16)
    assert {c.dims.context for c in layouts} == {1, 2, 4}
    cp = [c for c in layouts if c.dims.context > 1]
    assert {(c.dims.pipeline, c.dims.context) for c in cp} == {(1, 2), (1, 4), (2, 2)}  # CP within each stage
    assert {c.activation_checkpointing for c in cp} == {False, "selective", True}  # recomputed context-parallel too
    assert {c.dims.tensor_parallel * c.dims.context for c in cp} <= {2, 4}
    assert cp[0].strategy_kwargs()["context_parallel_size"] == cp[0].dims.context
    assert "cp" in cp[0].mesh()
    # 12 tokens (or 13, a model that cuts one off) split into 2 x 2 chunks, not 2 x 4.
    layouts, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=2, seq_len=12)
    assert {c.dims.context for c in layouts} == {1, 2}


def test_a_global_batch_is_split_over_the_data_parallel_ranks_left_by_context_parallelism():
    from lightning_dpar.layout_search.batch import BatchRule

    layouts, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=BatchRule(global_batch=4), seq_len=16)
    for layout in (c for c in layouts if c.dims.context > 1):
        d = layout.dims
        assert d.data_parallel == 4 // (d.pipeline * d.tensor_parallel * d.context)


def _mesh(layout: Layout, activations: int) -> MeshMemory:
    per_rank = activations // layout.dims.context
    rank = RankMemory(GIB, GIB, 2 * GIB, per_rank, per_rank, per_rank)
    return MeshMemory((rank,), GIB // 8)


def test_the_cost_model_charges_the_exchange_and_divides_the_compute():
    dims = {cp: ParallelDims.resolve(8, 8, context_parallel_size=cp) for cp in (1, 2)}
    profile = PRESETS["h100-node"]
    plain, split = (estimate(Layout(dims[cp]), FACTS, _mesh(Layout(dims[cp]), 8 * GIB), profile) for cp in (1, 2))
    assert split.time.compute == plain.time.compute / 2
    assert split.time.communication > plain.time.communication  # the key/value exchange on top of FSDP's
    assert split.seconds_per_sample > plain.seconds_per_sample  # CP never pays for speed alone
    assert split.memory.activations == plain.memory.activations // 2


def test_under_pipelining_the_boundary_carries_the_part_and_each_rank_exchanges_for_its_stages():
    """PP 2 x CP 2 against PP 2 alone and CP 2 alone (8 ranks, the same microbatches): the stage boundary's sends
    halve, and each pipeline rank's key/value exchange covers half the layers."""
    profile = PRESETS["h100-node"]

    def priced(pp: int, cp: int):
        dims = ParallelDims.resolve(8, 8, pipeline_parallel_size=pp, context_parallel_size=cp)
        layout = Layout(dims, False, "1F1B" if pp > 1 else None, 2)
        return estimate(layout, FACTS, _mesh(layout, 8 * GIB), profile)

    pipelined, both, split = priced(2, 1), priced(2, 2), priced(1, 2)
    assert both.time.compute == pipelined.time.compute / 2
    exchange = split.time.communication - priced(1, 1).time.communication  # CP alone: all 16 layers
    stage_exchange = both.time.communication - pipelined.time.communication  # 8 layers, but PP's sends halve
    assert 0 < stage_exchange < exchange
    assert both.memory.activations == pipelined.memory.activations // 2


def test_the_search_chooses_context_parallelism_when_only_it_fits():
    """Activations of 400 GiB per sequence, a model whose heads no TP size divides: nothing fits an 80 GiB device
    but CP 8 (50 GiB per rank), even with activation checkpointing (priced here as no saving at all)."""

    def probe(layout: Layout) -> MeshMemory:
        if layout.dims.tensor_parallel > 1:
            raise ValueError("7 heads do not divide by the tensor-parallel size")
        return _mesh(layout, 400 * GIB)

    result = search(replace(FACTS, seq_len=131072), 8, 1, PRESETS["h100-node"], probe)
    ranked = [(e.layout.mesh(), e.layout.activation_checkpointing) for e in result.ranked]
    # recomputing costs time: ranked after; selective (untraced here: priced as full) before full on ties
    assert ranked == [("fsdp8 tp1 cp8", False), ("fsdp8 tp1 cp8", "selective"), ("fsdp8 tp1 cp8", True)]
    assert result.too_big and all(e.layout.dims.context < 8 for e in result.too_big)


@pytest.mark.slow  # two searches with the dry-run probe (tens of seconds): full suite only
def test_dpar_auto_trains_context_parallelism_when_the_search_chooses_it():
    """The example GPT at 2048 tokens on 4 ranks without activation checkpointing (which would fit this narrow model
    in less), with a memory budget between what the best
    context-parallel layout and the best other layout need (both from the real dry-run probe): `dpar_auto` chooses
    CP and sets it where `FSDPTensorParallelStrategy` reads it."""
    import torch

    from lightning_dpar import AutoParallelStrategy
    from lightning_dpar.examples import GPT
    from lightning_dpar.layout_search.probe import search_model

    def gpt() -> GPT:
        with torch.device("meta"):
            return GPT(n_layer=2, n_head=4, n_embd=64, block_size=2048)

    everything = search_model(gpt(), 4, 1, PRESETS["cpu-gloo"], 1, seq_len=2048, activation_checkpointing=False)
    least = {
        split: min(e.memory.total for e in everything.ranked if (e.layout.dims.context > 1) == split)
        for split in (True, False)
    }
    assert least[True] < least[False]
    budget = (least[True] + least[False]) / 2 / GIB
    strategy = AutoParallelStrategy(batch_size=1, seq_len=2048, device_memory=budget, activation_checkpointing=False)
    strategy.connect(gpt())
    dims = strategy.resolve_dims(4, 4, 1)
    assert dims.context > 1 and strategy._context_parallel_size == dims.context


@pytest.mark.slow  # a whole search (14 traces, 5 s); the per-rank loss's trace: context_parallel/test_loss
def test_the_search_prices_context_parallel_layouts_with_the_per_rank_loss_when_set():
    """A Llama whose logits dominate (vocab 4096, hidden 64) at 1024 tokens: with `context_parallel_loss="per_rank"`
    among the strategy arguments (what `plan --auto` reads off the configured strategy, and what `dpar_auto` passes
    on), every CP layout is estimated with the head and the loss on the rank's own tokens, and needs less than the
    same layout with the head on the whole sequence; the layouts without CP are unchanged."""
    pytest.importorskip("transformers")
    import lightning as L
    import torch
    import transformers

    from lightning_dpar import AutoParallelStrategy
    from lightning_dpar.layout_search.probe import search_model
    from tests.support.hf_configs import decoder_config

    class Causal(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = decoder_config("LlamaConfig", vocab_size=4096, max_position_embeddings=1024)
            self.net = transformers.LlamaForCausalLM(config)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(input_ids=batch, labels=batch).loss

    with torch.device("meta"):
        model = Causal()
    memory = {}
    for loss in ("whole", "per_rank"):
        kwargs = {"context_parallel_loss": loss}
        result = search_model(model, 2, 1, PRESETS["cpu-gloo"], 1, 1024, strategy_kwargs=kwargs)
        memory[loss] = {e.layout.describe(): e.memory.total for e in result.ranked}
    assert memory["whole"].keys() == memory["per_rank"].keys()
    for layout, whole in memory["whole"].items():
        if "cp2" in layout:
            assert memory["per_rank"][layout] < whole, layout
        else:
            assert memory["per_rank"][layout] == whole, layout
    strategy = AutoParallelStrategy(seq_len=1024, context_parallel_loss="per_rank")
    assert strategy.search_settings["strategy_kwargs"] == {"context_parallel_loss": "per_rank"}
