"""One checkpoint through other strategies and world sizes, on 1, 2 and 4 gloo ranks (workers in
`tests/workers/checkpoint_reshard.py`).

The resharding chain: 2D on 4 ranks (a) -> FSDP on 2 (b) -> replicate on 2 (c) -> FSDP on 1 (d) -> 2D on 2 (e),
each stage resuming what the previous one saved. One fixture per launch, named after its chain stage(s), depends on
the fixtures whose checkpoints it loads and passes their directories on (`inputs_env`); each launch saves under a
directory of its own. The same launches carry the data position (saved on 4 data-parallel ranks with stage a,
loaded on 2 with stages b and c) and the consolidation of stage a's checkpoint in one process (with stage d).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import LaunchResults, run_workers
from tests.workers.checkpoint_common import inputs_env


@dataclass(frozen=True)
class Launch:
    """A launch's results, and the directory its cases saved under (case `name` in `directory / name`)."""

    results: LaunchResults
    directory: Path

    def saved_by(self, case: str) -> Path:
        return self.directory / case


@pytest.fixture(scope="module")
def chain_a(tmp_path_factory) -> Launch:
    """Stage a (2D on 4 ranks, 4 steps) and the data position saved after 3 steps on 4 data-parallel ranks."""
    directory = tmp_path_factory.mktemp("chain_a")
    return Launch(run_workers(4, "reshard_chain_a,reshard_position_save", directory), directory)


@pytest.fixture(scope="module")
def chain_bc(chain_a, tmp_path_factory) -> Launch:
    """Stage b (FSDP on 2) resumes stage a; stage c (replicate on 2) resumes b; the data position loads on 2."""
    directory = tmp_path_factory.mktemp("chain_bc")
    inputs = inputs_env(
        chain_a=chain_a.saved_by("chain_a"),
        chain_b=directory / "chain_b",
        position_save=chain_a.saved_by("position_save"),
    )
    groups = "reshard_chain_b,reshard_chain_c,reshard_position_load"
    return Launch(run_workers(2, groups, directory, extra_env=inputs), directory)


@pytest.fixture(scope="module")
def chain_d(chain_a, chain_bc, tmp_path_factory) -> Launch:
    """Stage d (FSDP on 1) resumes stage c; stage a's checkpoint is consolidated in this one process."""
    directory = tmp_path_factory.mktemp("chain_d")
    inputs = inputs_env(chain_c=chain_bc.saved_by("chain_c"), chain_a=chain_a.saved_by("chain_a"))
    return Launch(run_workers(1, "reshard_chain_d,reshard_export", directory, extra_env=inputs), directory)


@pytest.fixture(scope="module")
def chain_e(chain_d, tmp_path_factory) -> Launch:
    """Stage e (2D on 2) resumes stage d."""
    directory = tmp_path_factory.mktemp("chain_e")
    inputs = inputs_env(chain_d=chain_d.saved_by("chain_d"))
    return Launch(run_workers(2, "reshard_chain_e", directory, extra_env=inputs), directory)


# ---------------------------------------------------------------------- resharding
#: The fixture whose launch runs each stage.
STAGE_LAUNCH = {"b": "chain_bc", "c": "chain_bc", "d": "chain_d", "e": "chain_e"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGE_LAUNCH))
def test_resharding_chain_keeps_model_and_optimizer_exact(request, chain_a, stage):
    """2d on 4 -> fsdp on 2 -> replicate on 2 -> fsdp on 1 -> 2d on 2: full params and Adam state bit-identical."""
    result = request.getfixturevalue(STAGE_LAUNCH[stage]).results[f"chain_{stage}"]
    assert result["max_diff_to_previous"] == 0.0
    assert result["keys"] > 40  # model params + exp_avg, exp_avg_sq, step per param + param-group values
    assert result["global_step"] == 4
    assert result["lr"] == chain_a.results["chain_a"]["lr"]  # scheduler state came along


@pytest.mark.slow
def test_data_position_maps_to_a_new_data_parallel_size(chain_a, chain_bc):
    """3 steps on 4 data-parallel ranks, then the rest of the epoch on 2: every sample exactly once."""
    before, after = chain_a.results["position_save"]["seen"], chain_bc.results["position_load"]["seen"]
    assert len(before) == 3 * 4 * 4
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(128))
    assert chain_bc.results["position_load"]["global_step"] == 3 + (128 - 48) // (2 * 4)


# ---------------------------------------------------------------------- consolidating stage a in one process
@pytest.mark.slow
def test_consolidate_2d_checkpoint_to_lightning_ckpt(chain_d):
    """The 4-rank TP+FSDP checkpoint, consolidated in one process."""
    export = chain_d.results["export_ckpt"]
    assert export["code"] == 0
    assert export["ckpt_model_diff"] == 0.0
    assert export["ckpt_optimizer_diff"] == 0.0
    assert export["ckpt_param_ids"] == list(range(12))


@pytest.mark.slow
def test_consolidate_2d_checkpoint_to_safetensors(chain_d):
    export = chain_d.results["export_safetensors"]
    assert export["code"] == 0
    assert export["safetensors_files"] >= 2 and export["safetensors_index"]
    assert export["safetensors_diff"] == 0.0


@pytest.mark.slow
def test_consolidate_refuses_a_truncated_checkpoint(chain_d):
    assert chain_d.results["export_truncated"] == 1


@pytest.mark.slow
def test_consolidated_ckpt_resumes_on_a_plain_single_device_trainer(chain_d):
    export = chain_d.results["export_plain_resume"]
    assert export["code"] == 0
    assert export["plain_resume_first_step"] == 4
    assert export["plain_resume_final_step"] == 6


@pytest.mark.slow
def test_load_from_checkpoint_helper_reads_a_sharded_directory(chain_d):
    assert chain_d.results["export_helper"] == 0.0
