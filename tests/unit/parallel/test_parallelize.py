"""Per-step work the strategies must not add over a hand-written FSDP2 loop (see docs/benchmarks.md, "Where the step
time goes"). In-process, one-rank gloo group: FSDP2's resharding decisions do not depend on the world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_dpar.parallel import parallelize
from lightning_dpar.plan.structure import data_parallel_roots


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Module(nn.Module):
    """LightningModule-shaped: one top-level child (the FSDP root) holding blocks and a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Net()


def _wrap(module: nn.Module, reshard_after_forward: bool | int) -> None:
    mesh = init_device_mesh("cpu", (1,))
    units = ["model.blocks.0", "model.blocks.1"]
    policy = lambda root: MixedPrecisionPolicy()  # noqa: E731
    parallelize.apply_fully_shard(module, mesh, units, policy, data_parallel_roots(module), reshard_after_forward)


def test_root_keeps_its_parameters_from_forward_to_backward(one_rank_group):
    """`reshard_after_forward=True` reshards the blocks, not the root: its parameters are needed again at once in
    backward, so resharding them would cost one more all-gather every step (as the plain loop does not)."""
    module = _Module()
    _wrap(module, reshard_after_forward=True)
    loss = module.model(torch.randn(3, 4)).sum()
    assert isinstance(module.model.blocks[0].weight, DTensor)  # a block: resharded after its forward
    assert not isinstance(module.model.head.weight, DTensor)  # the root's own head: still unsharded
    loss.backward()
    assert isinstance(module.model.head.weight, DTensor)  # resharded after backward, as always


def test_explicit_false_still_applies_to_every_unit(one_rank_group):
    module = _Module()
    _wrap(module, reshard_after_forward=False)
    module.model(torch.randn(3, 4)).sum()
    assert not isinstance(module.model.blocks[0].weight, DTensor)
    assert not isinstance(module.model.head.weight, DTensor)
