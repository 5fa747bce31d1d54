"""The averaged copy of Lightning's weight-averaging callbacks laid out like the model
(`lightning_dpar.conformance.weight_averaging`), in-process: like a sharded model (a fake 2-rank world), and without
what another pipeline stage holds. The callbacks under every strategy through real Trainers are the conformance matrix's
callback rows (cases in `tests/workers/conformance_callbacks.py`, the matrix in
`tests/launched/test_conformance_callbacks.py`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_dpar.conformance.weight_averaging import lay_out_like


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight
        self.norm = nn.BatchNorm1d(4)


def test_averaged_copy_is_laid_out_like_a_sharded_model(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    fake_world(2)
    torch.manual_seed(0)
    model = Tied()
    average = copy.deepcopy(model)  # what the callbacks take in `setup`, before the strategy parallelises
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    lay_out_like(average, model, "EMAWeightAveraging")
    for (name, ours), (_, theirs) in zip(average.named_parameters(), model.named_parameters()):
        assert isinstance(ours, DTensor), name
        assert (ours.device_mesh, ours.placements, ours.shape) == (theirs.device_mesh, theirs.placements, theirs.shape)
        assert torch.equal(ours.to_local(), theirs.to_local()) and ours is not theirs and not ours.requires_grad
    assert average.second.weight is average.first.weight  # still tied
    assert [n for n, _ in average.named_buffers()] == [n for n, _ in model.named_buffers()]
    averaged = dict(average.named_parameters())
    lay_out_like(average, model, "EMAWeightAveraging")  # a second `setup`: the averages are kept
    assert all(p is averaged[n] for n, p in average.named_parameters())


def test_averaged_copy_drops_what_another_pipeline_stage_holds():
    model = Tied()
    average = copy.deepcopy(model)
    model.norm = nn.Identity()  # held by another stage: the stage has no such parameters
    lay_out_like(average, model, "StochasticWeightAveraging")
    assert [n for n, _ in average.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in average.named_buffers()] == []
