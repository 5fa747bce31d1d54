"""The update probe (`lightning_dpar.optim.update_probe`) on real torch optimizers and on two written here whose
kind is known by construction: an elementwise update, one normalised per tensor, one normalised over every
parameter."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_dpar.optim.update_probe import UpdateKind, fresh_instance, group_hyperparameters, probe_update_kind


class NormalisedSGD(Optimizer):
    """Steps each parameter by its gradient over a norm: the tensor's own (`scope='tensor'`) or that of every
    gradient it holds (`scope='model'`)."""

    def __init__(self, params, lr: float = 0.1, scope: str = "tensor") -> None:
        super().__init__(params, {"lr": lr, "scope": scope})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"]]
            total = torch.sqrt(sum((g * g).sum() for g in grads))
            for p, g in zip(group["params"], grads):
                p -= group["lr"] * g / (g.norm() if group["scope"] == "tensor" else total)


class Broken(Optimizer):
    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        raise RuntimeError("needs a GPU")


def _params():
    return [nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.ones(2))]


def test_elementwise_optimizers_are_found_so():
    for optimizer in (torch.optim.SGD(_params(), lr=0.1, momentum=0.9), torch.optim.AdamW(_params(), lr=1e-3)):
        found = probe_update_kind(optimizer)
        assert (found.kind, found.source) == (UpdateKind.ELEMENTWISE, "probe"), found


def test_a_per_tensor_update_and_a_whole_model_one_are_told_apart():
    per_tensor = probe_update_kind(NormalisedSGD(_params()))
    assert per_tensor.kind is UpdateKind.PER_TENSOR
    assert "a copy stepped on a 6x5 matrix cut into rows moved the pieces up to" in per_tensor.reason
    whole_model = probe_update_kind(NormalisedSGD(_params(), scope="model"))
    assert whole_model.kind is UpdateKind.WHOLE_MODEL
    assert whole_model.reason.endswith("and two tensors stepped together unlike apart")
    assert probe_update_kind(torch.optim.Muon([nn.Parameter(torch.ones(3, 2))])).kind is UpdateKind.PER_TENSOR


def test_an_optimizer_the_probe_cannot_step_is_not_assumed_elementwise():
    found = probe_update_kind(Broken(_params()))
    assert found.kind is UpdateKind.WHOLE_MODEL
    assert "could not step a copy of Broken on a small float64 CPU matrix (RuntimeError: needs a GPU)" in found.reason


def test_the_probe_leaves_the_optimizer_and_the_global_generator_as_they_were():
    params = _params()
    optimizer = torch.optim.Adam(params, lr=0.1)
    state = torch.get_rng_state()
    probe_update_kind(optimizer)
    assert torch.equal(torch.get_rng_state(), state)
    assert optimizer.state == {} and all(torch.equal(p, torch.ones_like(p)) for p in params)


def test_distinct_hyperparameters_and_fresh_instances_of_them():
    a, b, c = (nn.Parameter(torch.ones(1)) for _ in range(3))
    optimizer = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}, {"params": [c]}], lr=0.1)
    hypers = group_hyperparameters(optimizer)
    assert [h["lr"] for h in hypers] == [0.1, 0.5]  # the first and third groups share theirs
    fresh = fresh_instance(optimizer, hypers[1], [nn.Parameter(torch.zeros(2))])
    assert type(fresh) is torch.optim.SGD and fresh.param_groups[0]["lr"] == 0.5 and fresh.state == {}
    tensor_lr = torch.optim.Adam([a], lr=torch.tensor(0.01))
    copy = fresh_instance(tensor_lr, group_hyperparameters(tensor_lr)[0], [b])
    assert copy.param_groups[0]["lr"] is not tensor_lr.param_groups[0]["lr"]  # a step may change it in place
