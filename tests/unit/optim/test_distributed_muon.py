"""Distributed Muon (`lightning_dpar.optim.distributed_muon`) in process: which optimizers it takes, and, installed,
the same step as `torch.optim.Muon` for matrices that are whole on the rank (plain, or a DTensor on a one-rank mesh).
Matrices sharded over 2 and 4 gloo ranks, bit for bit against DDP, are in `tests/launched/test_optimizers.py`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_dpar.optim.distributed_muon import install, supports


class MyMuon(torch.optim.Muon):
    """A subclass may change the update: not taken."""


def test_only_muon_itself_is_supported():
    params = [nn.Parameter(torch.ones(2, 2))]
    assert supports(torch.optim.Muon(params))
    assert not supports(MyMuon(params)) and not supports(torch.optim.SGD(params, lr=0.1))


def test_installed_it_steps_whole_matrices_as_muon_does(gloo_world):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    starts = [torch.randn(4, 3), torch.randn(5, 2)]
    grads = [[torch.randn(4, 3), torch.randn(5, 2)] for _ in range(2)]
    plain = [nn.Parameter(s.clone()) for s in starts]
    ours = [nn.Parameter(starts[0].clone()), nn.Parameter(distribute_tensor(starts[1].clone(), mesh, [Shard(0)]))]
    reference = torch.optim.Muon(plain, lr=0.05, weight_decay=0.1)
    optimizer = torch.optim.Muon(ours, lr=0.05, weight_decay=0.1)
    install(optimizer)
    for step_grads in grads:
        for p, q, g in zip(plain, ours, step_grads):
            p.grad = g.clone()
            q.grad = g.clone() if not hasattr(q, "device_mesh") else distribute_tensor(g.clone(), mesh, [Shard(0)])
        reference.step()
        optimizer.step()
    assert torch.equal(ours[0].detach(), plain[0].detach())
    assert torch.equal(ours[1].full_tensor().detach(), plain[1].detach())
    assert not torch.equal(plain[0].detach(), starts[0])  # it moved
    momentum = optimizer.state[ours[1]]["momentum_buffer"]
    assert torch.equal(momentum.full_tensor(), reference.state[plain[1]]["momentum_buffer"])
