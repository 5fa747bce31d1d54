"""Mixture-of-experts weights on 2 and 4 gloo ranks (workers in `tests/workers/moe_weights.py`): every on-disk layout
of a tiny Qwen3-MoE and Mixtral (`tests/support/moe.py`) loads into `dpar_fsdp`'s shards exactly; each rank reads of
the per-expert tensors only the experts and rows it holds, under FSDP, expert parallelism, both, and a row split; an
incomplete directory is refused on every rank; `consolidate --format hf` of a sharded checkpoint is what
`save_pretrained` writes and `from_pretrained` loads. The same on one rank, in process:
`tests/unit/hf_weights/test_moe_weights.py`."""

from __future__ import annotations

import pytest

from tests.conftest import run_workers
from tests.support import moe

transformers = pytest.importorskip("transformers")

GATE_UP = "model.layers.0.mlp.experts.{}.{}_proj.weight[{}]"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_weights")
    moe.write_layouts(root)
    state = moe.per_expert_tensors("qwen3_moe", moe.source("qwen3_moe").state_dict())
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    moe.write_files(state, root / "qwen3_moe_incomplete", 1, moe.config("qwen3_moe").to_json_string())
    return root


@pytest.fixture(scope="module")
def results2(workdir):
    return run_workers(2, "moe_load,moe_slices,moe_errors,moe_export", workdir)


@pytest.fixture(scope="module")
def results4(workdir):
    return run_workers(4, "moe_slices_4", workdir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", moe.LAYOUTS)
@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("expert_parallel", ["", "_ep"])
def test_every_layout_loads_into_fsdp_shards_exactly(results2, kind, layout, expert_parallel):
    """FSDP 2 (each rank holds half of each expert tensor's experts), and expert parallel 2 (each rank holds half of
    the experts, `(_StridedShard, Shard)` over `expert_shard` x `expert`)."""
    result = results2[f"moe_load_{kind}_{layout}{expert_parallel}"]
    assert result["random_init_diff"] > 0.01  # the model started from other values
    assert result["loaded_max_abs_diff"] == 0.0
    assert result["local_gate_up_shape"] == [2, 32, 32]  # each rank holds 2 of the 4 experts


def expected(experts, parts=("gate", "up"), rows="0:16, 0:32"):
    return sorted(GATE_UP.format(e, part, rows) for e in experts for part in parts)


@pytest.mark.slow
def test_fsdp_ranks_read_only_their_own_experts(results2):
    result = results2["moe_slices_fsdp"]
    assert result["placements"] == ["Shard(dim=0)"]
    assert result["loaded_max_abs_diff"] == 0.0
    gate_up = [[s for s in rank if "down" not in s] for rank in result["slices_by_rank"]]
    assert gate_up == [expected([0, 1]), expected([2, 3])]


@pytest.mark.slow
def test_expert_parallel_ranks_read_only_their_own_experts(results2):
    result = results2["moe_slices_expert"]
    assert result["loaded_max_abs_diff"] == 0.0
    down = [[s for s in rank if "down_proj" in s] for rank in result["slices_by_rank"]]
    assert down == [
        [f"model.layers.0.mlp.experts.{e}.down_proj.weight[0:32, 0:16]" for e in (0, 1)],
        [f"model.layers.0.mlp.experts.{e}.down_proj.weight[0:32, 0:16]" for e in (2, 3)],
    ]


@pytest.mark.slow
def test_a_row_split_reads_gate_on_one_rank_and_up_on_the_other(results2):
    """`gate_up_proj` split on dim 1: rank 0 holds every expert's gate rows, rank 1 its up rows; each reads only
    those tensors (and of `down_proj`, only its half of the rows)."""
    result = results2["moe_slices_rows"]
    assert result["placements"] == ["Shard(dim=1)"]
    assert result["loaded_max_abs_diff"] == 0.0
    rank0, rank1 = ([s for s in rank if "down" not in s] for rank in result["slices_by_rank"])
    assert rank0 == expected(range(4), parts=("gate",)) and rank1 == expected(range(4), parts=("up",))
    down = [[s for s in rank if "down" in s] for rank in result["slices_by_rank"]]
    rows = ("0:16", "16:32")
    assert down == [[f"model.layers.0.mlp.experts.{e}.down_proj.weight[{r}, 0:16]" for e in range(4)] for r in rows]


@pytest.mark.slow
def test_expert_parallel_with_fsdp_on_top_reads_one_expert_per_rank(results4):
    """Mesh (dp 2, expert 2): expert rank p holds experts 2p, 2p+1, FSDP gives dp rank d the d-th of them, so rank
    (d, p) reads expert 2p + d alone; the placements are the `_StridedShard` + `Shard` the issue describes."""
    result = results4["moe_slices_expert_fsdp"]
    assert "_StridedShard" in result["placements"][0] and result["placements"][1] == "Shard(dim=0)"
    assert result["loaded_max_abs_diff"] == 0.0
    gate_up = [[s for s in rank if "down" not in s] for rank in result["slices_by_rank"]]
    # global rank = 2 d + p
    assert gate_up == [expected([0]), expected([2]), expected([1]), expected([3])]


@pytest.mark.slow
def test_an_incomplete_directory_is_refused_on_every_rank_naming_the_key(results2):
    for messages in results2["moe_errors"]:
        assert len(messages) == 1
        assert "the checkpoint lacks 'model.layers.1.mlp.experts.2.up_proj.weight'" in messages[0]
        assert "'model.model.layers.1.mlp.experts.gate_up_proj' (4, 32, 32) is 4 experts'" in messages[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", moe.KINDS)
def test_hf_export_of_a_sharded_checkpoint_loads_with_from_pretrained_exactly(results2, kind):
    result = results2[f"moe_export_{kind}"]
    assert result["code"] == 0 and result["files"] > 1
    assert result["same_keys_as_save_pretrained"]
    assert result["missing"] == [] and result["unexpected"] == [] and result["mismatched"] == []
    assert result["max_abs_diff"] == 0.0
    assert result["trained_from_source"] > 0  # the export holds the trained weights
