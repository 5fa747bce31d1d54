"""The layout search rendered (`lightning_dpar.layout_search.report`), on estimates set by hand: the choice and why
each runner-up loses, the ranked table, what does not fit and by how much, and what was rejected. The search that
fills these in is tested in `test_search.py` and through `plan --auto` in `test_cli.py`."""

from __future__ import annotations

from dataclasses import replace

from lightning_dpar.layout_search.candidates import Layout, Rejected
from lightning_dpar.layout_search.cost import Estimate, MemorySplit, TimeSplit
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import PRESETS
from lightning_dpar.layout_search.report import render_choice, render_search, why
from lightning_dpar.layout_search.search import SearchResult
from lightning_dpar.parallel_dims import ParallelDims

GIB = 2**30
PROFILE = replace(PRESETS["cpu-gloo"], device_memory=8 * GIB)
FACTS = ModelFacts(params=1_000_000, layers=4, hidden=64, vocab=256, seq_len=128, batch_size=2)
MEMORY = MemorySplit(parameters=GIB, gradients=GIB, optimizer=2 * GIB, activations=GIB, buffers=0)


def estimate(tp: int, compute: float, exposed: float, bubble: float = 0.0, samples: int = 8, **memory) -> Estimate:
    layout = Layout(ParallelDims(4, replicate=1, shard=4 // tp, tensor_parallel=tp))
    return Estimate(layout, replace(MEMORY, **memory), TimeSplit(compute, exposed, bubble, exposed), samples)


FAST = estimate(1, compute=0.100, exposed=0.020)  # 0.12 s for 8 samples
SLOW_COMM = estimate(2, compute=0.100, exposed=0.080)  # 0.18 s: 50% slower, 7.5 ms more communication per sample
BIG_BATCH = estimate(4, compute=0.200, exposed=0.020, samples=16)  # 0.22 s for 16 samples: 13.75 ms per sample


def test_why_names_the_largest_difference_per_sample():
    assert why(FAST, SLOW_COMM) == "50% slower per sample, mostly exposed communication (+7.500 ms per sample)"
    # 15 ms per sample against 13.75 ms; compute costs 12.5 ms per sample either way, communication 2.5 against 1.25
    assert why(BIG_BATCH, FAST) == "9% slower per sample, mostly exposed communication (+1.250 ms per sample)"


def result(ranked, too_big=(), rejected=()) -> SearchResult:
    return SearchResult(4, 1, PROFILE, FACTS, list(ranked), list(too_big), list(rejected))


def test_the_choice_and_its_two_runners_up():
    text = render_choice(result([FAST, SLOW_COMM, BIG_BATCH, BIG_BATCH]))
    lines = text.splitlines()
    assert lines[0] == (
        "Chosen layout for 4 ranks (profile cpu-gloo): fsdp4 tp1, AC off: step 120.0 ms, 66.7 samples/s,"
        " peak 5.00 GiB per rank of 8.00 GiB"
    )
    assert lines[1] == f"  runner-up 2: fsdp2 tp2, AC off: {why(FAST, SLOW_COMM)}"
    assert lines[2].startswith("  runner-up 3: fsdp1 tp4, AC off: ") and len(lines) == 3
    assert render_choice(result([])) == "No layout of 4 ranks fits 8.00 GiB per device."


def test_the_whole_search_with_what_does_not_fit_and_what_was_rejected():
    big = estimate(2, compute=0.1, exposed=0.0, activations=6 * GIB)  # 10 GiB on 8
    untraced = replace(SLOW_COMM, memory=replace(SLOW_COMM.memory, activations_traced=False))
    rejected = Rejected("fsdp1 tp4", "4 heads ... do not divide")
    text = render_search(result([FAST, untraced], [big], [rejected]), top=1)
    assert text.startswith(
        "Layout search: 1,000,000 parameters (1,000,000 active per token), 4 layers, width 64; 2 sequences of 128"
        " tokens per data-parallel rank\nWorld: 4 ranks on 1 node(s); profile cpu-gloo:"
    )
    assert "Layouts that fit, fastest per sample first (2):" in text
    row = next(line for line in text.splitlines() if line.startswith("  1  "))
    assert row.split() == [
        *("1", "fsdp4", "tp1", "-", "off"),
        *("1.00", "GiB", "1.00", "GiB", "2.00", "GiB", "1.00", "GiB", "0", "B", "0", "B", "5.00", "GiB"),
        *("100.0", "ms", "20.0", "ms", "0.0", "ms", "0.0", "ms", "120.0", "ms", "66.7"),
    ]
    assert "  ... 1 more (--top to show them)" in text
    assert "a formula (lightning_dpar.estimates.activation_formula) for 1 of 2 layouts" in text
    assert "  fsdp2 tp2, AC off: does not fit by 2.00 GiB (peak 10.00 GiB)" in text
    assert text.endswith("Rejected (1):\n  fsdp1 tp4: 4 heads ... do not divide\n")
