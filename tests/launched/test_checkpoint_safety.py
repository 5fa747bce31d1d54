"""Loading a checkpoint runs no code from it, and every unusable checkpoint fails naming the file and what to do:
the 2-rank Trainer cases (`fit(ckpt_path=...)`, memory-mapped full-format loads), workers in
`tests/workers/checkpoint_safety.py`. The in-process tests (hostile payloads against every reader, the index
allowlist, a user's own type allowed) are in `tests/unit/checkpoint/test_safety.py`.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.unit.checkpoint.test_safety import ADMITTED

# ---------------------------------------------------------------------- through real Trainers on 2 ranks
SHARED_LAUNCH = {2: "safety_fit,safety_mmap"}


@pytest.fixture(scope="module")
def trainer_results(shared_launch):
    return shared_launch(2)


FIT_CASES = {
    "index_dotted": (".metadata", "refers to torch.distributed.checkpoint.filesystem.os.system"),
    "index_function": (".metadata", "refers to torch.distributed.checkpoint.format_utils.torch_save_to_dcp"),
    "meta_pt": ("meta.pt", "refers to posix.system"),
    "distcp_leaf": ("", "refers to posix.system"),  # the file holding the item: `data_file`
    "full_file": ("", "refers to builtins.eval"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FIT_CASES))
def test_fit_ckpt_path_runs_no_code_and_names_the_file(trainer_results, case):
    file_name, refers_to = FIT_CASES[case]
    result = trainer_results[f"safety_{case}"]
    assert result["payload_works"], "the payload must work for the test to mean anything"
    file = os.path.join(result["path"], file_name or result.get("data_file", ""))
    for message, ran_after in zip(result["errors"], result["ran"]):  # per rank
        assert not ran_after
        assert re.match(r"(Checkpoint|Unsafe)\w*Error: ", message), message  # a CheckpointLoadError
        assert repr(file.rstrip("/")) in message, message
        assert refers_to in message and "Nothing from it was run" in message


@pytest.mark.slow
def test_index_of_fsdp_shards_and_adam_state_refers_only_to_the_allowlist(trainer_results):
    """The index a 2-rank `dpar_fsdp` Trainer wrote (DTensor shards, Adam state, LR scheduler leaves)."""
    named = {tuple(pair) for pair in trainer_results["safety_index_globals"]}
    assert named <= ADMITTED
    assert ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata") in named  # sharded tensors were seen


@pytest.mark.slow
def test_fit_ckpt_path_with_a_hostile_distcp_tensor_runs_no_code(trainer_results):
    """DCP reads tensor items itself (`weights_only`): nothing runs, and the refusal names the file. Until the load
    path wraps its `dcp.load` in `translate_dcp_errors`, it arrives as DCP's `CheckpointException`."""
    result = trainer_results["safety_distcp_tensor"]
    assert result["payload_works"]
    file = os.path.join(result["path"], result["data_file"])
    for message, ran_after in zip(result["errors"], result["ran"]):
        assert not ran_after
        assert f"In {file!r}: a tensor item refers to posix.system" in message, message


@pytest.mark.slow
def test_translate_dcp_errors_on_a_collective_read(trainer_results):
    """Around a 2-rank `dcp.load`: every rank gets one `UnsafeCheckpointError` naming the checkpoint, the failing
    rank(s) and the file, instead of DCP's `CheckpointException` (a BaseException)."""
    result = trainer_results["safety_translated"]
    file = os.path.join(result["path"], result["data_file"])
    for message, ran_after in zip(result["errors"], result["ran"]):
        assert not ran_after
        assert re.match(
            rf"UnsafeCheckpointError: Checkpoint load of {re.escape(repr(result['path']))} failed on ranks? ", message
        )
        assert f"In {file!r}: a tensor item refers to posix.system" in message, message


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("truncated_meta", ["meta.pt' cannot be read (", "If it was copied here, copy it again"]),
        ("missing_shard", ["__1_0.distcp' is missing", "Copy '__1_0.distcp' again from the machine that wrote it"]),
    ],
)
def test_fit_ckpt_path_on_a_damaged_checkpoint_names_the_previous_one(trainer_results, case, expected):
    result = trainer_results[f"safety_{case}"]
    for message in result["errors"]:
        assert re.match(r"(Checkpoint|Corrupt)\w*Error: ", message), message  # a CheckpointLoadError
        for fragment in expected:
            assert fragment in message, message
        assert f"resume from the previous checkpoint: {result['previous']!r}" in message


@pytest.mark.slow
def test_full_format_load_is_memory_mapped(trainer_results):
    """Per-rank peak RSS growth with a 64 MiB full-format file on 2 ranks (freed heap returned to the OS before each
    measurement). Reading it (`read_full`, which every rank does) maps the file instead of copying it: RSS does not
    grow, where the same file read without mmap grows it by the file's size (the contrast shows the measurement sees
    a whole file; the read before mmap grew it by 2x). In the whole `validate(ckpt_path=...)` load every rank grows by
    the half it keeps: each copies its shards out of the mapped file and gives the mapped pages back (rank 0 used to
    grow by the whole file, as the source of torch's scatter)."""
    result = trainer_results["safety_mmap"]
    file_mib = result["file_mib"]
    assert file_mib >= 64
    for read, unmapped in zip(result["read_growth_mib"], result["unmapped_growth_mib"]):
        assert unmapped > 0.9 * file_mib
        assert read < 0.05 * file_mib
    assert all(growth < 0.6 * file_mib for growth in result["load_growth_mib"]), result
    assert result["max_diff"] == 0.0


@pytest.mark.slow
def test_full_format_resume_with_optimizer_state_stays_under_the_file_size(trainer_results):
    """`fit(ckpt_path=...)` from a 192 MiB full-format file (64 MiB of weights, Adam's two states) on 2 ranks: each
    rank's peak RSS grows by less than 1.2x the file (measured 0.95x: its shards, the optimizer's initial states and
    one tensor of the mapped file at a time). It used to grow by 1.9x on rank 0: the whole mapped file, and a copy of
    it for the scatter."""
    result = trainer_results["safety_mmap_resume"]
    assert result["file_mib"] >= 190
    assert all(growth < 1.2 * result["file_mib"] for growth in result["load_growth_mib"]), result
    assert result["max_diff"] == 0.0
