"""The Mixture-of-Experts layer of the example GPT (`GPT(n_experts=8)`): a top-k router and an experts module that
follows the package's experts contract (`lightning_dpar.experts.plan`), so `expert_parallel_size` splits it.

The router runs on each rank's own tokens and hands its choices to the experts module, as transformers 5's MoE
models do; the experts keep their weights stacked along dim 0, one slice per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar._private_api import grouped_mm

__all__ = ["Experts", "MoE", "Router"]


class Router(nn.Module):
    """Top-k routing: a linear score per expert, softmax, the `top_k` best, their weights renormalised to sum 1."""

    def __init__(self, n_embd: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"`experts_per_token={top_k}` must be between 1 and `n_experts={num_experts}`.")
        self.top_k = top_k
        self.score = nn.Linear(n_embd, num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = F.softmax(self.score(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        return chosen, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


class Experts(nn.Module):
    """`num_experts` GELU MLPs with their weights stacked: `fc` `[E, 4 * n_embd, n_embd]`, `proj` `[E, n_embd,
    4 * n_embd]`. `forward(hidden_states, top_k_index, top_k_weights)` runs each chosen expert on its tokens only:
    in a loop over the chosen experts, or with `grouped=True` as one grouped matmul per projection over the
    (token, choice) rows sorted by expert (`torch._grouped_mm`, where torch has it: the GPU preset)."""

    def __init__(self, n_embd: int, num_experts: int, grouped: bool = False) -> None:
        super().__init__()
        if grouped and grouped_mm() is None:
            raise ValueError("`experts_grouped_mm=True` needs `torch._grouped_mm`, which this torch lacks.")
        self.num_experts = num_experts
        self.grouped = grouped
        self.fc = nn.Parameter(torch.empty(num_experts, 4 * n_embd, n_embd))
        self.proj = nn.Parameter(torch.empty(num_experts, n_embd, 4 * n_embd))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc, std=0.02)
        nn.init.normal_(self.proj, std=0.02)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.grouped:
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():  # only the experts some token chose
            token, choice = torch.where(top_k_index == expert)
            y = F.gelu(hidden_states[token] @ self.fc[expert].T) @ self.proj[expert].T
            out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out

    def _grouped_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        matmul = grouped_mm()
        assert matmul is not None
        tokens, top_k = top_k_index.shape
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        rows = hidden_states[order // top_k]
        ends = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts).cumsum(0).to(torch.int32)
        y = matmul(F.gelu(matmul(rows, self.fc.transpose(1, 2), offs=ends)), self.proj.transpose(1, 2), offs=ends)
        per_choice = y[torch.argsort(order)].view(tokens, top_k, hidden_states.shape[-1])
        return (per_choice * top_k_weights.unsqueeze(-1)).sum(dim=1)


class MoE(nn.Module):
    """The MoE feed-forward of a block: `router` chooses, `experts` compute, on `[batch, time, n_embd]` inputs."""

    def __init__(self, n_embd: int, num_experts: int, top_k: int, grouped: bool = False) -> None:
        super().__init__()
        self.router = Router(n_embd, num_experts, top_k)
        self.experts = Experts(n_embd, num_experts, grouped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights = self.router(tokens)
        return self.experts(tokens, chosen, weights).view_as(x)
