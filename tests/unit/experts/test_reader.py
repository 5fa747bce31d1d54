"""`FusedExpertsReader` (`lightning_dpar.experts.reader`): DCP loads a fused expert parameter from per-expert tensors
in safetensors files, as if the checkpoint held it, and the other tensors as `HuggingFaceStorageReader` does. One
process here; each rank reading only its block of a sharded load is in `tests/launched/test_moe.py`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dpar.experts.keys import ExpertMerge, group_experts
from lightning_dpar.experts.reader import FusedExpertsReader
from tests.support.moe import write_files

safe_open = pytest.importorskip("safetensors").safe_open

MERGE = ExpertMerge(("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"), "mlp.experts.gate_up_proj")


def test_a_fused_parameter_is_read_from_its_per_expert_tensors_and_the_rest_as_stored(tmp_path):
    torch.manual_seed(0)
    tensors = {f"layer.mlp.experts.{e}.{p}_proj.weight": torch.randn(3, 4) for e in range(2) for p in ("gate", "up")}
    tensors["layer.norm.weight"] = torch.randn(4)
    write_files(tensors, tmp_path, files=2, config_json="{}")
    shapes, fused, conflicts = group_experts({k: tuple(v.shape) for k, v in tensors.items()}, [MERGE])
    assert conflicts == [] and shapes["layer.mlp.experts.gate_up_proj"] == (2, 6, 4)
    files = {}
    for index in (1, 2):
        name = tmp_path / f"model-{index:05d}-of-00002.safetensors"
        with safe_open(str(name), framework="pt") as handle:
            files |= {key: str(name) for key in handle.keys()}
    reader = FusedExpertsReader(str(tmp_path), fused, {key: key for key in tensors}, files)
    targets = {"layer.mlp.experts.gate_up_proj": torch.zeros(2, 6, 4), "layer.norm.weight": torch.zeros(4)}
    dcp.load(targets, storage_reader=reader, no_dist=True)
    expected = torch.stack(
        [torch.cat([tensors[f"layer.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in range(2)]
    )
    assert torch.equal(targets["layer.mlp.experts.gate_up_proj"], expected)
    assert torch.equal(targets["layer.norm.weight"], tensors["layer.norm.weight"])
    assert sorted(reader.slices_read) == sorted(
        f"layer.mlp.experts.{e}.{p}_proj.weight[0:3, 0:4]" for e in range(2) for p in ("gate", "up")
    )
