"""The healing payload: local shards out, and back into another rank's model and optimizer, `DTensor` state put
back on the receiving parameter's mesh, so the next step of the healed rank equals the peer's."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_dpar.fault_tolerance.healing import (
    apply_model_state,
    apply_optimizer_state,
    model_state,
    optimizer_state,
    payload_bytes,
)


def _trained(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(7)
    optimizer.zero_grad()
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()


def test_a_healed_rank_steps_exactly_as_its_peer(gloo_world):
    peer, peer_optimizer = _trained(seed=0, steps=3)
    healed, healed_optimizer = _trained(seed=1, steps=0)  # other weights, no optimizer state yet
    payload = {"model": model_state(peer), "optimizer": optimizer_state(peer_optimizer)}
    assert not any(isinstance(t, DTensor) for t in payload["model"].values())  # plain local shards travel
    apply_model_state(healed, payload["model"])
    apply_optimizer_state(healed_optimizer, payload["optimizer"])
    assert isinstance(next(iter(healed_optimizer.state.values()))["exp_avg"], DTensor)
    _step(peer, peer_optimizer)
    _step(healed, healed_optimizer)
    for (name, a), (_, b) in zip(peer.named_parameters(), healed.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    # weights 4*6+6+6*3+3 = 51 floats; Adam's two moments per parameter and a step count per parameter tensor
    assert payload_bytes(payload) == 51 * 4 + 2 * 51 * 4 + 4 * 4


def test_a_model_of_another_shape_is_refused(gloo_world):
    peer, _ = _trained(seed=0, steps=0)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    try:
        apply_model_state(other, model_state(peer))
    except RuntimeError as error:
        assert "has shape (3, 6), this rank's (2, 6)" in str(error)
    else:
        raise AssertionError("a shard of another shape was copied")
