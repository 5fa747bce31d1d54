"""The `plan` dry run's activation memory (`--batch-size`, `--seq-len`): the report's figures are
`lightning_dpar.estimates.activations`' estimate of the same plan, added on top of the peak, per pipeline stage with its
microbatches in flight, in this one process."""

from __future__ import annotations

import pytest
import torch

import lightning_dpar
from lightning_dpar.estimates import main, plan
from lightning_dpar.helpers import format_bytes
from tests.conftest import ROOT

EXAMPLE_2D = str(ROOT / "examples" / "configs" / "2d.yaml")

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


def _small_gpt():
    from lightning_dpar.examples.gpt import GPT

    with torch.device("meta"):
        return GPT(block_size=64, n_layer=2, n_head=4, n_embd=64)


def test_activations_are_the_pure_estimates_and_go_on_top_of_the_peak():
    """The report's figures are `estimate_activations` of the same plan on the unparallelised model; the peak adds
    the plan's choice (here with activation checkpointing) to the persistent memory and the gathered unit."""
    from lightning_dpar.estimates.activations import estimate_activations

    strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, activation_checkpointing=True)
    report = plan(strategy, _small_gpt(), world_size=4, batch=(4, 65), batch_source="given here")
    dims = strategy.resolve_dims(4, 4, 1)
    model = _small_gpt()
    assert report.activations == estimate_activations(model, strategy.module_plan(model, dims, 0), dims, (4, 65))
    estimate = report.activations
    assert estimate.checkpointing and estimate.tensor_parallel == 2
    assert estimate.checkpointed == ("model.blocks.0", "model.blocks.1")
    with_ac, without = estimate.rank(0).per_microbatch(True), estimate.rank(0).per_microbatch(False)
    assert with_ac.retained < without.retained and with_ac.peak < without.peak
    rendered = report.render()
    peak = report.memory.total + report.largest_unit[1] + with_ac.peak
    assert f"  peak        {format_bytes(peak)}" in rendered
    assert "Activations on each rank, per microbatch: token ids (4, 65) int64 (given here)" in rendered
    row = f"  full activation checkpointing       {format_bytes(with_ac.retained)}"
    assert any(line.startswith(row) and line.endswith("<- the plan") for line in rendered.splitlines())
    assert "not included: communication buffers, allocator overhead" in rendered


def test_selective_checkpointing_is_the_plans_row_between_none_and_full_with_its_recomputed_flops():
    """`activation_checkpointing="selective"`: the dry run's activation table marks the selective row as the plan's,
    its figures between the two others, and each row gives the share of the step's matmul and attention FLOPs its
    backward recomputes."""
    strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, activation_checkpointing="selective")
    report = plan(strategy, _small_gpt(), world_size=4, batch=(4, 65), batch_source="given here")
    estimate = report.activations
    assert estimate.checkpointing == "selective"
    rank = estimate.rank(0)
    none, selective, full = (rank.per_microbatch(setting) for setting in (False, "selective", True))
    assert full.retained < selective.retained < none.retained
    peak = report.memory.total + report.largest_unit[1] + selective.peak
    assert f"  peak        {format_bytes(peak)}" in report.render()
    flops = estimate.flops
    assert flops.recomputed(False) == 0 < flops.recomputed("selective") < flops.recomputed(True)
    rows = {line.split("  ")[1]: line for line in report.render().splitlines() if "activation checkpointing  " in line}
    assert rows["selective activation checkpointing"].endswith("<- the plan")
    assert f"{flops.recomputed_fraction('selective'):.0%}" in rows["selective activation checkpointing"]
    assert f"{flops.recomputed_fraction(True):.0%}" in rows["full activation checkpointing"]


def test_traces_are_reused_across_tensor_parallel_sizes_and_give_the_same_estimate():
    """A trace depends on the TP styles, not the TP size: one shared cache serves TP 2 and TP 4 with what tracing
    each afresh gives; another microbatch is traced anew."""
    from lightning_dpar.estimates.activations import estimate_activations

    traces = {}
    for tp in (2, 4):
        strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=tp)
        dims = strategy.resolve_dims(4, 4, 1)
        model = _small_gpt()
        plan_ = strategy.module_plan(model, dims, 0)
        assert estimate_activations(model, plan_, dims, (4, 65), traces=traces) == estimate_activations(
            model, plan_, dims, (4, 65)
        )
        assert len(traces) == 3  # without, with selective and with full checkpointing, traced for TP 2 only
    estimate_activations(model, plan_, dims, (2, 65), traces=traces)
    assert len(traces) == 6


def test_pipeline_stages_hold_their_microbatches_in_flight(capsys):
    assert main(["--trainer.strategy=dpar_3d", "--batch-size", "4", "--seq-len", "33"]) == 0
    out = capsys.readouterr().out
    assert "per microbatch: token ids (2, 33) int64 (from --batch-size and --seq-len)" in out  # 2 microbatches
    assert "1F1B over 2 microbatches keeps up to 2 in flight on this rank" in out
    assert "total/rank  activations/rank" in out
    strategy = lightning_dpar.FSDPTensorParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)
    estimate = plan(strategy, _small_gpt(), world_size=4, batch=(4, 33)).activations
    first, last = estimate.rank(0), estimate.rank(1)
    assert (first.in_flight, last.in_flight) == ((2,), (1,))  # 1F1B: p - r on rank r
    footprint = first.per_microbatch(False)
    boundary = 2 * 32 * 64 * 4  # one microbatch's hidden states, float32, whole on each TP rank
    assert (first.stages[0].received, first.stages[0].sent) == (0, boundary)
    assert (last.stages[0].received, last.stages[0].sent) == (boundary, 0)
    # Rank 0: 2 in flight, and a buffer for each microbatch's gradient from stage 1.
    assert estimate.peak(0) == 2 * footprint.retained + footprint.peak - footprint.retained + 2 * boundary
    # Rank 1: 1 in flight, and a buffer for each microbatch's activation from stage 0.
    own = last.stages[0].without_checkpointing
    assert estimate.peak(1) == own.retained + 2 * boundary + own.peak - own.retained


def test_without_a_batch_shape_activations_are_not_estimated(capsys):
    assert main(["--config", EXAMPLE_2D]) == 0
    out = capsys.readouterr().out
    assert (
        "  activations not estimated: give the batch shape with --batch-size and --seq-len (the datamodule's"
        " batches: --batch-size 8 --seq-len 129)"
    ) in out
    assert "not included: activations, communication buffers, allocator overhead" in out


def test_a_batch_the_microbatches_do_not_divide_is_said_so(capsys):
    assert main(["--trainer.strategy=dpar_3d", "--batch-size", "3", "--seq-len", "33"]) == 0
    assert (
        "activations could not be estimated (ValueError: a batch of 3 does not split into"
        " `pipeline_microbatches=2` equal microbatches)"
    ) in capsys.readouterr().out


def test_half_a_batch_shape_is_refused(capsys):
    assert main(["--config", EXAMPLE_2D, "--batch-size", "4"]) == 1
    assert "give both --batch-size and --seq-len, as positive integers (got (4, None))" in capsys.readouterr().err


def test_the_report_keeps_exporting_the_names_that_moved_out_of_it():
    """The pipeline section is the pipeline folder's (`lightning_dpar.pipeline.report`) and the grouping of repeated
    modules `lightning_dpar.helpers`', yet `lightning_dpar.estimates.report` still exports them, as before."""
    from lightning_dpar import helpers
    from lightning_dpar.estimates.report import PipelineReport, StageRow
    from lightning_dpar.helpers import group_modules
    from lightning_dpar.pipeline import report as pipeline_report

    assert (PipelineReport, StageRow) == (pipeline_report.PipelineReport, pipeline_report.StageRow)
    assert group_modules is helpers.group_modules
