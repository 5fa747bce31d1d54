"""`python -m lightning_dpar plan --auto`: the ranked table from the command line, in this process (each candidate
mesh planned by the dry run on a fake world), what it says when nothing fits, and a bad profile."""

from __future__ import annotations

import pytest

from lightning_dpar.__main__ import main
from lightning_dpar.layout_search.cli import main as search_main

pytestmark = pytest.mark.usefixtures("no_pytest_argv")

SMALL_GPT = ["--trainer.devices", "4", "--model.n_layer", "4", "--model.n_embd", "64", "--model.n_head", "4"]


@pytest.mark.slow  # ~25 s: a dry run per layout; the full suite runs it, the fast lane stays under 2 min
def test_plan_auto_prints_the_ranked_table_choice_and_rejections(capsys):
    assert main(["plan", "--auto", "--top", "100", *SMALL_GPT]) == 0
    out = capsys.readouterr().out
    assert "Chosen layout for 4 ranks (profile cpu-gloo)" in out
    assert out.count("runner-up") == 2
    for column in ("mesh", "pipeline", "AC", "params", "grads", "optim", "activ*", "buffers", "peak/rank"):
        assert column in out
    for column in ("compute", "exposed comm", "bubble", "samples/s"):
        assert column in out
    assert "pp4 Interleaved1F1B: 8 stages need at least as many layers; the model has 4" in out
    assert "fsdp1 tp4" in out and "1F1B m4" in out


@pytest.mark.slow  # ~25 s: a dry run per layout; the full suite runs it
def test_heads_not_divisible_by_the_tp_size_are_rejected_with_the_planners_message(capsys):
    assert main(["plan", "--auto", "--top", "3", *SMALL_GPT[:-1], "2"]) == 0
    out = capsys.readouterr().out
    rejected = out[out.index("Rejected") :]
    assert "tp4" in rejected and "2" in rejected  # 2 heads over 4 tensor-parallel ranks
    assert "fsdp1 tp4" not in out[: out.index("Rejected")]


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_when_nothing_fits_it_says_what_would(capsys):
    assert main(["plan", "--auto", "--device-memory", "0.004", *SMALL_GPT]) == 1
    out = capsys.readouterr().out
    assert "No layout of 4 ranks fits" in out
    assert "does not fit by" in out
    assert "Nothing fits. with" in out and "GiB per device it would fit" in out


def test_an_unknown_profile_is_refused_naming_the_presets(capsys):
    assert main(["plan", "--auto", "--profile", "tpu", *SMALL_GPT]) == 1
    assert "`profile='tpu'` is not a known hardware profile" in capsys.readouterr().err


def test_plan_auto_with_a_global_batch_prices_each_layout_at_its_share(capsys):
    # 2 layers, not SMALL_GPT's 4: what is checked is each layout's share of the batch, not the depth
    two_layers = [*SMALL_GPT[:2], "--model.n_layer", "2", *SMALL_GPT[4:]]
    assert main(["plan", "--auto", "--global-batch-size", "6", "--top", "100", *two_layers]) == 0
    out = capsys.readouterr().out
    assert "a global batch of 6 sequences, split over the data-parallel ranks, of 128 tokens each" in out
    assert "(4 data-parallel ranks): a global batch of 6 does not split evenly over 4 data-parallel ranks" in out
    assert "samples/s" in out


def test_plan_auto_refuses_both_batch_sizes(capsys):
    """`layout_search.cli.main` itself, which `plan --auto` hands the rest of its arguments to."""
    assert search_main(["--batch-size", "2", "--global-batch-size", "8", *SMALL_GPT]) == 1
    assert "`--batch-size` and `--global-batch-size` both fix the batch" in capsys.readouterr().err


def test_plan_auto_refuses_float8_on_a_profile_without_float8_matmuls(capsys):
    assert main(["plan", "--auto", "--float8", "tensorwise", *SMALL_GPT]) == 1
    err = capsys.readouterr().err
    assert "`float8='tensorwise'` on profile 'cpu-gloo', whose device has no float8 matmuls" in err
    assert "Drop `float8=`" in err


def test_plan_auto_prices_float8_and_allows_loss_parallel(capsys):
    """`--float8` prices every layout with the recipe (the converted matmuls at the profile's float8 rate);
    `--loss-parallel` gives it to the TP layouts, which the example GPT's plan (its head not column-parallel and
    gathered) cannot run: they are rejected with the planner's fix. The layouts the recipe cannot train on (the
    tensorwise recipe under TP, context parallelism) are rejected with the float8 step's own reason."""
    small = ["--trainer.devices", "2", "--model.n_layer", "2", "--seq-len", "16", "--batch-size", "2", *SMALL_GPT[4:]]
    args = ["plan", "--auto", "--profile", "h100-node", "--float8", "rowwise", "--loss-parallel", *small]
    assert main(args) == 0
    out = capsys.readouterr().out
    # 2 blocks of q, k, v, proj (64 x 64) and fc, proj (64 x 256): 98,304 weights; not the head (64 x 256)
    assert "float8 (rowwise): 98,304 weights' matmuls" in out and "at 790 TFLOP/s, the rest at 400" in out
    assert "Loss parallel: on every layout with tensor parallelism" in out
    assert "float8 rowwise" in out[out.index("Chosen layout") :].splitlines()[0]
    rejected = out[out.index("Rejected") :]
    assert "fsdp1 tp2: `FSDPTensorParallelStrategy(loss_parallel=True)` needs the output layer" in rejected
    assert "colwise_gather_output" in rejected
    # tensorwise under TP is refused by the float8 step: the TP layouts are out before the planner sees them
    assert main([*args[:5], "tensorwise", *args[6:]]) == 0
    out = capsys.readouterr().out
    rejected = out[out.index("Rejected") :]
    assert "pp1 tp2: float8 with `tensor_parallel_size=2`: the tensorwise recipe's scales" in rejected
    assert "cp2: float8 with `context_parallel_size=2` is not supported" in rejected
