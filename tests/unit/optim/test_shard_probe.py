"""The shard probe of `lightning_dpar.optim.shard_probe` in-process, on a real gloo group of one rank: the tensors it
builds for each parameter layout, its verdict where nothing is split, and the path through DTensor. Its verdicts
on 2 and 4 ranks (a LARS written with `p.norm()` accepted, one reading `to_local()` refused) are in
`tests/launched/test_optimizers.py`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_dpar.optim import shard_probe
from tests.workers.optimizers import LARSLike, LocalLARS


class Mesh:
    """The sizes of a mesh, which is all `_shape` reads."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, dim: int) -> int:
        return self.sizes[dim]


@pytest.mark.parametrize(
    ("sizes", "placements", "ndim", "shape"),
    [
        ((2,), (Shard(0),), 2, [6, 5]),  # FSDP: rows, 3 per shard
        ((2,), (Shard(1),), 2, [5, 6]),  # row-wise TP: columns
        ((2, 2), (Shard(0), Shard(0)), 2, [12, 5]),  # FSDP over column-wise TP: both split the rows
        ((2, 2), (Shard(0), Shard(1)), 2, [6, 6]),
        ((2, 2), (Replicate(), Shard(0)), 1, [6]),  # HSDP, a bias
        ((4,), (Shard(2),), 3, [5, 5, 12]),
    ],
)
def test_each_layout_gets_a_small_tensor_its_split_dims_divide_evenly(sizes, placements, ndim, shape):
    assert shard_probe._shape(Mesh(*sizes), (placements, ndim)) == shape


def test_nothing_split_nothing_to_probe_and_no_process_group_nothing_to_share():
    optimizer = LocalLARS([torch.nn.Parameter(torch.randn(4, 3))])
    assert shard_probe._split_layouts(optimizer) == {}
    assert shard_probe.agreed(shard_probe.probe_on_shards)(optimizer) == (True, "")


def test_the_probe_steps_dtensors_of_the_parameters_placements(gloo_world):
    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    optimizer = LARSLike([param], lr=0.5)
    assert shard_probe._split_layouts(optimizer) == {}  # a mesh of one rank splits nothing
    for cls in (LARSLike, LocalLARS):  # on one rank the shard is the whole: both end where the whole does
        difference, size = shard_probe._compare(cls([param]), {"lr": 0.5, "trust": 0.02}, mesh, [((Shard(0),), 2)])
        assert difference == 0.0 and size > 0
