"""Loss parallel through real Trainers on 2 and 4 gloo ranks (cases in `tests/workers/loss_parallel.py`): parity
with one process under TP 2 and TP 2 x FSDP 2 with an uneven vocabulary (65 over TP 2) and `ignore_index` labels,
for a user's `F.cross_entropy` in `training_step` and for a transformers Llama's own loss; the logits' bytes per rank
halved under TP 2, measured as the activation estimate follows storages and estimated alike; and each refusal,
raised alike on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

ATOL = 1e-5
SHARED_LAUNCH = {2: "loss_parallel,loss_parallel_memory", 4: "loss_parallel"}


@pytest.fixture(scope="module")
def lp2(shared_launch):
    return shared_launch(2)


@pytest.fixture(scope="module")
def lp4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case"),
    [("lp2", "gpt_tp2"), ("lp2", "llama_tp2"), ("lp4", "gpt_tp2_fsdp2"), ("lp4", "llama_tp2_fsdp2")],
)
def test_loss_parallel_matches_one_process(world, case, request):
    """Vocabulary-sharded logits (33 and 32 of 65 classes per rank) and torch's `loss_parallel()` cross-entropy
    around forward and backward, with -100 labels: the parameters after 3 steps and every rank's loss equal one
    process's on the same global batches."""
    result = request.getfixturevalue(world)[case]
    assert result["max_abs_diff"] < ATOL
    assert result["loss_diff"] < ATOL
    assert result["steps"] == [3] * (2 if world == "lp2" else 4)


@pytest.mark.slow
def test_validation_under_loss_parallel_logs_one_processs_loss(lp2):
    """`validate` after `fit`: the validation forward runs inside `loss_parallel()` too, and its loss (a DTensor,
    logged with `sync_dist=True`: the strategy reduces its whole value) equals one process's on the trained model."""
    result = lp2["loss_parallel_validation_after_fit"]
    assert abs(result["val_loss"] - result["want"]) < ATOL


@pytest.mark.slow
def test_dpar_auto_chooses_and_trains_tensor_parallelism_with_loss_parallel(lp2):
    """`dpar_auto(loss_parallel=True)` on a GPT whose logits decide the memory (vocabulary 16,384), at 60 MiB per
    rank: the search gives TP 2 loss parallel, which then fits and beats the pipeline that fits without it; the
    strategy is built with it (its plan keeps the head's logits sharded) and trains at parity with one process."""
    result = lp2["loss_parallel_auto_layout"]
    assert result["chosen"].startswith("fsdp1 tp2") and "loss parallel" in result["chosen"], result["chosen"]
    assert result["loss_parallel"] == "model.head"
    assert result["max_abs_diff"] < ATOL
    assert result["loss_diff"] < ATOL
    assert result["steps"] == [3, 3]


@pytest.mark.slow
def test_loss_parallel_halves_the_logits_bytes_per_rank_as_estimated(lp2):
    """One real step under TP 2 (a vocabulary of 4,096 on 2 x 256 tokens: 8 MiB of fp32 logits): what the forward
    keeps for backward falls by exactly half the logits (the log-probabilities the loss keeps are this rank's
    vocabulary shard), on each rank, and so does the step's peak; the activation estimate (the `plan` dry run's) is
    the measured figure, retained and peak, to the loss's bytes with and without (under loss parallel it traces
    torch's vocabulary-parallel backward, which hands the loss's gradient through the log-softmax's)."""
    without, with_ = lp2["memory_loss_parallel_False"], lp2["memory_loss_parallel_True"]
    shard = without["logits_bytes_whole"] // 2
    for before, after in zip(without["retained"], with_["retained"]):
        assert before - after == shard
    assert with_["peak"][0] < without["peak"][0] - 2 * shard
    for run in (without, with_):
        assert abs(run["estimated"]["retained"] - run["retained"][0]) <= 64, run
        assert abs(run["estimated"]["peak"] - run["peak"][0]) <= 64, run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "case", "expected"),
    [
        ("lp2", "error_without_tp", ["loss_parallel=True", "`tensor_parallel_size=1`", "tensor_parallel_size=2"]),
        ("lp2", "error_head_not_in_plan", ["'model.head' has no tensor-parallel style", "colwise_gather_output"]),
        ("lp2", "error_head_rowwise", ["'model.head' is RowwiseParallel", "colwise_gather_output"]),
        ("lp4", "error_pipeline", ["`pipeline_parallel_size=2` is not supported", "loss_parallel=False"]),
        ("lp2", "error_label_smoothing", ["LossParallelError", "label_smoothing", "loss_parallel=False"]),
        ("lp2", "error_argmax", ["LossParallelError", "full_tensor()", "'model.head'"]),
    ],
)
def test_loss_parallel_refusals(world, case, expected, request):
    """Each refusal raised alike on every rank (none hangs), naming the value, what is valid and the fix: before
    training for a setting that cannot work, at the first use for a use of the sharded logits torch does not
    support (label smoothing, an argmax)."""
    messages = request.getfixturevalue(world)[case]
    assert len(set(messages)) == 1 and messages[0] is not None
    for part in expected:
        assert part in messages[0], (part, messages[0])
