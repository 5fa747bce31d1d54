"""Checkpoint formats and paths through real Trainers (workers in `tests/workers/checkpoint_formats.py`): the full
format, fsspec URLs, the memory `consolidate` needs, and checkpoints of Lightning's own strategies resumed under
dpar. Two independent launches: 2 ranks, and 1 (`memory://` is per process; the memory measurement is rank 0's)."""

from __future__ import annotations

import pytest

from tests.conftest import LaunchResults

SHARED_LAUNCH = {2: "formats_two_ranks", 1: "formats_memory_fs,formats_export_memory"}


@pytest.fixture(scope="module")
def two_ranks(shared_launch) -> LaunchResults:
    return shared_launch(2)


@pytest.fixture(scope="module")
def one_rank(shared_launch) -> LaunchResults:
    return shared_launch(1)


@pytest.mark.slow
def test_full_format_is_one_file_every_reader_accepts(two_ranks):
    result = two_ranks["full_format"]
    assert result["is_file"]
    assert result["plain_load_diff"] == 0.0  # torch.load(weights_only=True)
    assert result["load_from_checkpoint_diff"] == 0.0  # LightningModule.load_from_checkpoint
    assert result["dpar_resume_diff"] == 0.0  # fit(ckpt_path=file) under another dpar strategy
    assert result["optimizer_keys"] == [0, 1, 2]  # keyed by position like a plain optimizer


@pytest.mark.slow
def test_fsspec_file_url_on_two_ranks(two_ranks):
    assert two_ranks["file_url"] == 0.0  # saved under replicate, loaded under fsdp


@pytest.mark.slow
def test_fsspec_memory_url_through_model_checkpoint(one_rank):
    memory = one_rank["memory_fs"]  # save_top_k=1 removed older dirs
    assert memory["listing"] == ["step=6.ckpt"]
    assert memory["files"] == [".metadata", "__0_0.distcp", "meta.pt"]
    assert memory["load_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("source", ["model_parallel", "fsdp_strategy_sharded"])
def test_resume_from_lightning_strategies_checkpoints(two_ranks, source):
    result = two_ranks[f"migrate_{source}"]
    assert result["layout"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert result["model_diff"] == 0.0
    assert result["optimizer_diff"] == 0.0
    assert result["first_step"] == 4


@pytest.mark.slow
def test_safetensors_export_streams(one_rank):
    """Peak RSS growth of `consolidate` on a 128 MiB model of 4 MiB tensors, each in a fresh process: the
    safetensors export holds a few tensors at a time; the single .ckpt holds the whole model."""
    memory = one_rank["export_memory"]
    growth = memory["peak_growth_mib"]
    assert isinstance(growth["safetensors"], float), growth["safetensors"]
    assert growth["safetensors"] < memory["model_mib"] / 3
    assert growth["lightning"] > memory["model_mib"] * 0.9  # the contrast: the measurement sees a whole model
