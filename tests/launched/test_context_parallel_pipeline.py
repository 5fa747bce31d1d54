"""Context parallelism across pipeline stages through real Trainers on 4 gloo ranks (cases in
`tests/workers/context_parallel_pipeline.py`, in the same 4-rank launch as `test_context_parallel.py`): 2 pipeline
stages x CP 2, each ending with the parameters of one process on the same global batches, every rank logging the
whole-sequence loss; and the split context parallelism refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.launched.test_context_parallel import _check_parity

SHARED_LAUNCH = {4: "context_parallel_pipeline"}


@pytest.fixture(scope="module")
def cp4(shared_launch):
    return shared_launch(4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "gpt_pp2_cp2_gpipe",
        "gpt_pp2_cp2_1f1b",
        "llama_pp2_cp2_gpipe",
        "llama_pp2_cp2_1f1b",
        "llama_pp2_cp2_1f1b_checkpointed",
        "llama4_pp2_cp2_interleaved1f1b",
        "llama4_pp2_cp2_loopedbfs",
        "llama4_pp2_cp2_interleavedzerobubble",
        "llama4_pp2_cp2_zbvzerobubble",
    ],
)
def test_context_parallelism_composes_with_pipeline_parallelism(cp4, case):
    """2 pipeline stages x CP 2 (`tests/workers/context_parallel_pipeline.py`): every stage's blocks run on this
    rank's part of the sequence (the second stage's from the part it receives, its rotary positions cut as at the
    first block), the last stage gathers it for the loss. Parity with one process and the loss on every rank; every
    rank's stages attended (one block each: the shape-recording pass and 2 microbatches x 3 steps; 4 x 3 for the
    multi-stage schedules' microbatches of one, each rank's two stages; once more per step's microbatches where
    the blocks are recomputed); and a boundary carries this rank's part, half the sequence."""
    result = cp4[case]
    _check_parity(result, 4)
    assert result["dims"].endswith("pipeline 2 x replicate 1 x shard 2 (data_shard 1 x context 2) x tensor_parallel 1")
    calls = {"checkpointed": 1 + 2 * 3 * 2, "llama4": 2 * (1 + 4 * 3)}
    expected = next((n for key, n in calls.items() if key in case), 1 + 2 * 3)
    assert result["attention_calls"] == [expected] * 4
    sent = [shape for shapes in result["sent_shapes"] for shape in shapes]
    assert sent and all(shape[1] == 16 // 2 for shape in sent)  # SEQ tokens split in 2: what crosses a boundary


@pytest.mark.slow
def test_a_pipeline_split_inside_a_block_is_refused(cp4):
    """FSDP units finer than the blocks let a pipeline split cut a block in two; CP splits at whole blocks."""
    messages = cp4["error_pipeline_split_inside_a_block"]
    assert all(m is not None and "puts parts of block 'model.blocks.0' on stages [0, 1]" in m for m in messages)
    assert len(set(messages)) == 1


@pytest.mark.slow
def test_validation_through_the_stages_splits_the_sequence_and_logs_the_global_loss(cp4):
    """After fitting under PP 2 x CP 2, `validate` (2 batches, forward only through the stages) attends on every rank
    and logs one process's loss."""
    result = cp4["validation_after_fit_pp2_cp2"]
    assert result["val_loss"] == pytest.approx(result["want"], abs=1e-5)
    assert result["attention_calls"] == [2] * 4


@pytest.mark.slow
def test_the_per_rank_loss_with_pipelining_is_refused(cp4):
    messages = cp4["error_pipeline_with_the_per_rank_loss"]
    expected = "context_parallel_loss='per_rank')` is not supported yet"
    assert all(m is not None and expected in m for m in messages) and len(set(messages)) == 1
