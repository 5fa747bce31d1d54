"""The experts' dense stand-in for the activation trace (`lightning_dpar.experts.tracing_stand_in`): every
(token, choice) row through expert 0's matmuls, gated where the next weight reads half the output, weighted by the
router and summed per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar.experts.tracing_stand_in import replace_experts_for_tracing


class Experts(nn.Module):
    """transformers' layout: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]."""

    def __init__(self, experts: int = 3, hidden: int = 4, inner: int = 5) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise AssertionError("the stand-in replaces this")


class Ungated(Experts):
    """Two stacked weights where the second reads all of the first's output: an activation, no gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 6, 4))
        self.down_proj = nn.Parameter(torch.randn(3, 4, 6))


def test_each_experts_module_is_replaced_and_runs_expert_0_on_every_choice():
    torch.manual_seed(0)
    model = nn.Module()
    model.moe, model.dense = Experts(), nn.Linear(4, 4)
    assert replace_experts_for_tracing(model) == ["moe"]
    x = torch.randn(2, 4)
    index, weights = torch.tensor([[2, 1], [0, 2]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    out = model.moe(x, index, weights)
    gate_up, down = model.moe.gate_up_proj[0], model.moe.down_proj[0]
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    per_row = (F.silu(gate) * up) @ down.T  # each token's one row, the same for both of its choices
    torch.testing.assert_close(out, per_row * weights.sum(dim=1, keepdim=True))


def test_without_a_gate_the_activation_runs_between_the_matmuls():
    torch.manual_seed(0)
    model = nn.Sequential(Ungated())
    assert replace_experts_for_tracing(model) == ["0"]
    experts = model[0]
    x, weights = torch.randn(3, 4), torch.full((3, 1), 2.0)
    out = experts(x, torch.zeros(3, 1, dtype=torch.long), weights)
    expected = F.silu(x @ experts.gate_up_proj[0].T) @ experts.down_proj[0].T * 2
    torch.testing.assert_close(out, expected)
