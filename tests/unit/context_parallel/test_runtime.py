"""The hooks on the blocks (`lightning_dpar.context_parallel.runtime`), one rank simulated in process: what a block
receives (its part of every argument spanning the sequence, tuples and namedtuples included), what the model gets
back (the whole sequence), and that nothing is split outside `active()`."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar.context_parallel.runtime import ContextParallel


class Rotary(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.shape[1], rotary.cos.shape[1], rotary.sin.shape[1], positions.shape[0]))
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return x + y.transpose(1, 2).reshape(x.shape)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotary = Rotary(torch.ones(1, x.shape[1], 4), torch.zeros(1, x.shape[1], 4))
        positions = torch.arange(x.shape[1])
        for layer in self.layers:
            x = layer(x, rotary, positions)
        return x


def test_each_block_gets_its_part_of_every_sequence_argument_and_the_model_gets_the_whole_back():
    model = Model()
    runtime = ContextParallel.simulate(model, 2)
    x = torch.randn(3, 16, 8, requires_grad=True)
    with runtime.active():
        out = model(x)
    assert out.shape == (3, 16, 8)
    assert all(seen == [(8, 8, 8, 8)] for seen in (layer.seen for layer in model.layers))
    assert runtime.attention.calls == 2 and not runtime.attention.active
    out.sum().backward()  # the simulated exchange has a backward too
    assert x.grad is not None and x.grad.shape == x.shape


def test_nothing_is_split_outside_active_and_the_hooks_come_off():
    model = Model()
    runtime = ContextParallel.simulate(model, 2)
    model(torch.randn(1, 16, 8))
    assert model.layers[0].seen == [(16, 16, 16, 16)]
    runtime.remove()
    with runtime.active():
        model(torch.randn(1, 16, 8))
    assert model.layers[0].seen[-1] == (16, 16, 16, 16)
