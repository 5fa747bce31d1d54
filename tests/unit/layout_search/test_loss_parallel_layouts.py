"""Loss parallel in the layout search (`dpar_auto(loss_parallel=True)`, `plan --auto --loss-parallel`): which
candidates get it, that their logits are priced as the `plan` dry run estimates them (sharded over the vocabulary),
and that on a model whose logits dominate the search picks a tensor-parallel layout that fits only with loss parallel
when it is allowed, and not otherwise."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar.estimates.activation_formula import activation_bytes
from lightning_dpar.examples.gpt import GPT, TP_PLAN
from lightning_dpar.layout_search.candidates import Layout, enumerate_layouts
from lightning_dpar.layout_search.cost import MeshMemory, RankMemory, estimate
from lightning_dpar.layout_search.model_facts import ModelFacts, facts_of
from lightning_dpar.layout_search.probe import dry_run_probe, search_model, token_batch
from lightning_dpar.layout_search.profiles import PRESETS, HardwareProfile, Link
from lightning_dpar.layout_search.report import render_search
from lightning_dpar.layout_search.search import search
from lightning_dpar.parallel_dims import ParallelDims

MIB = 2**20
#: The example GPT's plan with its head column-parallel and gathered: what loss parallel keeps sharded.
HEAD_PLAN = {**TP_PLAN, "model.head": "colwise_gather_output"}
#: 4 x 128 tokens per rank over a vocabulary of 8,192: 16 MiB of fp32 logits, against 4.4 MiB of parameters.
VOCAB, SEQ, BATCH = 8192, 128, 4


def big_vocab_gpt(vocab: int = VOCAB, seq: int = SEQ) -> GPT:
    with torch.device("meta"):
        model = GPT(vocab_size=vocab, block_size=seq, n_layer=2, n_head=4, n_embd=64)
    model.tp_plan = dict(HEAD_PLAN)
    return model


def test_loss_parallel_goes_to_the_tensor_parallel_layouts_without_pipeline_or_context_parallelism():
    plain, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=4, seq_len=16)
    assert not any(layout.loss_parallel for layout in plain)  # off unless the user allows it
    layouts, _ = enumerate_layouts(4, 4, 1, layers=4, batch_size=4, seq_len=16, loss_parallel=True)
    assert len(layouts) == len(plain)  # not a choice: the same layouts, some with it
    for layout in layouts:
        d = layout.dims
        assert layout.loss_parallel == (d.tensor_parallel > 1 and d.pipeline == 1 and d.context == 1), layout
    sharded = next(layout for layout in layouts if layout.loss_parallel)
    assert sharded.strategy_kwargs()["loss_parallel"] is True
    assert "loss parallel" in sharded.describe()
    assert "loss_parallel" not in next(layout for layout in layouts if not layout.loss_parallel).strategy_kwargs()
    assert sharded.probe_key != Layout(sharded.dims).probe_key  # planned and traced apart from the gathered one


def test_the_formula_counts_each_ranks_vocabulary_shard_of_the_logits():
    """Untraced (a step that cannot run on fake tensors), the formula divides its logits term by the TP size."""
    one = dict(layers=4, hidden=8, heads=2, vocab=1000, seq_len=5, microbatch_size=2, element_size=4)
    logits = 3 * 5 * 2 * 1000 * 4
    gathered = activation_bytes(**one, tensor_parallel=4)
    assert gathered - activation_bytes(**one, tensor_parallel=4, loss_parallel=True) == logits - logits // 4
    facts = ModelFacts(params=10**6, layers=4, hidden=8, vocab=1000, seq_len=5, batch_size=2, heads=2)
    mesh = MeshMemory((RankMemory(1000, 1000, 2000),), gathered_unit=100)
    tp = ParallelDims.resolve(4, 4, 4)
    without = estimate(Layout(tp), facts, mesh, PRESETS["cpu-gloo"])
    with_ = estimate(Layout(tp, loss_parallel=True), facts, mesh, PRESETS["cpu-gloo"])
    assert without.memory.activations - with_.memory.activations == logits - logits // 4


def test_the_gathered_logits_all_gather_and_loss_parallels_three_all_reduces():
    """TP's communication adds the output layer's: without loss parallel its logits (2 x 5 tokens x 1,000 classes,
    fp32) all-gathered once per microbatch, each rank receiving 3/4 of them over TP 4; with it, three all-reduces
    of one fp32 per token (2 x 3/4 of 40 bytes each)."""
    facts = ModelFacts(params=10**6, layers=4, hidden=8, vocab=1000, seq_len=5, batch_size=2, heads=2)
    plain = MeshMemory((RankMemory(1000, 1000, 2000),), gathered_unit=0)
    gathered = MeshMemory((RankMemory(1000, 1000, 2000),), gathered_unit=0, gathered_output=1000)
    flat = HardwareProfile("flat", 4, 10**12, 1e12, Link(0.0, 1e9), Link(0.0, 1e9))
    tp = ParallelDims.resolve(4, 4, 4)
    base = estimate(Layout(tp), facts, plain, flat).time.communication
    whole = estimate(Layout(tp), facts, gathered, flat).time.communication
    sharded = estimate(Layout(tp, loss_parallel=True), facts, gathered, flat).time.communication
    assert whole - base == pytest.approx(2 * 5 * 1000 * 4 * 0.75 / 1e9)
    assert sharded - base == pytest.approx(3 * 2 * 2 * 5 * 4 * 0.75 / 1e9)


def test_a_loss_parallel_layouts_activations_are_the_dry_runs_estimate_with_sharded_logits():
    """Reused, not duplicated: the probe plans the layout with `loss_parallel=True`, so its activations are what
    `plan --batch-size --seq-len` reports for `FSDPTensorParallelStrategy(loss_parallel=True)`; the gathered
    layout's peak exceeds it by at least the two whole logits the backward holds at once."""
    from lightning_dpar import FSDPTensorParallelStrategy
    from lightning_dpar.estimates import plan
    from lightning_dpar.optim.precision import DparPrecision

    dims = ParallelDims.resolve(2, 2, 2)
    vocab, seq = 1024, 32

    def gpt() -> GPT:
        return big_vocab_gpt(vocab, seq)

    batch = token_batch(BATCH, seq)
    probe = dry_run_probe(gpt, 2, 1, batch=batch)
    sharded, gathered = probe(Layout(dims, loss_parallel=True)), probe(Layout(dims))
    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2, loss_parallel=True)
    strategy.precision_plugin = DparPrecision("32-true")
    reported = plan(strategy, gpt(), 2, batch=batch).activations
    assert reported.loss_parallel == "model.head"
    assert sharded.ranks[0].activations == reported.peak(0, checkpointing=False)
    assert sharded.ranks[0].activations_selective == reported.peak(0, checkpointing="selective")
    assert gathered.ranks[0].activations - sharded.ranks[0].activations >= BATCH * seq * vocab * 4
    assert gathered.gathered_output == sharded.gathered_output == vocab  # the head's output, whole in its plan


@pytest.fixture(scope="module")
def searches():
    """The big-vocabulary GPT on 2 ranks at 80 MiB per rank, without and with loss parallel allowed."""
    profile = PRESETS["cpu-gloo"].with_memory(80 * MIB)
    return {
        allowed: search_model(big_vocab_gpt(), 2, 1, profile, BATCH, SEQ, loss_parallel=allowed)
        for allowed in (False, True)
    }


@pytest.mark.slow  # two whole searches (10 s); the fast lane keeps the probe's LP pricing (the test above)
def test_the_search_picks_tensor_parallelism_that_fits_only_with_loss_parallel_when_allowed(searches):
    """Whole logits (16 MiB, three times over in backward) put every layout but pipelining over 80 MiB; TP 2 with
    loss parallel keeps half of them on each rank and fits, and is faster than the pipeline's bubble."""
    without, allowed = searches[False], searches[True]
    assert without.best is not None and without.best.layout.dims.pipeline == 2
    assert not any(e.layout.dims.tensor_parallel > 1 for e in without.ranked)
    tp2 = [e for e in without.too_big if e.layout.dims.tensor_parallel == 2]
    assert tp2 and all(not e.layout.loss_parallel for e in tp2)
    best = allowed.best
    assert best is not None and best.layout.dims.tensor_parallel == 2 and best.layout.loss_parallel
    assert best.layout.strategy_kwargs() == {
        "tensor_parallel_size": 2,
        "replicate_size": 1,
        "activation_checkpointing": best.layout.activation_checkpointing,
        "loss_parallel": True,
    }
    assert best.seconds_per_sample < without.best.seconds_per_sample
    gathered = next(e for e in tp2 if e.layout.activation_checkpointing == best.layout.activation_checkpointing)
    assert gathered.time.communication > best.time.communication  # the whole logits' all-gather, which it saves
    # backward holds the whole log-probabilities and two whole gradients at once, against one shard of each
    saved = gathered.memory.activations - best.memory.activations
    assert saved == pytest.approx(2 * BATCH * SEQ * VOCAB * 4, rel=1e-3)
    # Layouts that cannot run it run without it, priced as before.
    assert [e.layout for e in allowed.ranked if e.layout.dims.pipeline > 1] == [
        e.layout for e in without.ranked if e.layout.dims.pipeline > 1
    ]


@pytest.mark.slow  # two whole searches (10 s); the fast lane keeps the probe's LP pricing (the test above)
def test_the_table_shows_which_layouts_run_loss_parallel(searches):
    text = render_search(searches[True])
    assert "Loss parallel: on every layout with tensor parallelism" in text
    header = next(line for line in text.splitlines() if "peak/rank" in line)
    assert " LP " in header
    assert "loss parallel" in text.split("Chosen layout", 1)[1].splitlines()[0]
    assert " LP " not in render_search(searches[False])


def test_an_output_layer_loss_parallel_cannot_shard_rejects_the_tensor_parallel_layouts_saying_why():
    """The user allowed loss parallel, but the `tp_plan` leaves the head out: the TP layouts are rejected with the
    planner's message and its fix, not silently trained without it (the dry run's plans alone, no trace)."""

    def head_not_in_plan() -> GPT:
        model = big_vocab_gpt()
        model.tp_plan = dict(TP_PLAN)
        return model

    facts = facts_of(head_not_in_plan(), SEQ, BATCH)
    probe = dry_run_probe(head_not_in_plan, 2, 1)
    result = search(facts, 2, 1, PRESETS["cpu-gloo"], probe, activation_checkpointing=False, loss_parallel=True)
    reasons = [r.reason for r in result.rejected if r.what == "fsdp1 tp2"]
    assert reasons and "colwise_gather_output" in reasons[0] and "'model.head'" in reasons[0]
    assert not any(e.layout.dims.tensor_parallel > 1 for e in result.ranked + result.too_big)
    assert result.ranked  # the layouts without TP run, without loss parallel
