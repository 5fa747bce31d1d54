"""Mixture-of-Experts layers traced for the activation estimate as their dense equivalent under balanced routing.

An experts module picks its rows by the router's choices (`unique`, `nonzero`, `where`), whose output sizes depend on
values a fake tensor does not have, so it cannot run in `lightning_dpar.estimates.activation_trace`'s fake step. What it
keeps for backward is, per (token, choice) row, what one expert's MLP keeps; under dropless routing every rank's experts
together see `tokens x top_k` rows on average (with expert parallelism too: the rows a rank sends equal, on average, the
rows it receives). So the trace runs, in its place, the same chain of matmuls on `tokens x top_k` rows with expert 0's
weights: each stacked weight `[experts, out, in]` in registration order is a linear map, and where the next one reads
half of this one's output the output is gated (`act(gate) * up`, transformers' `gate_up_proj`). The activation
function's own saved tensors are those of a SiLU/GELU-sized elementwise op.

An estimate for balanced routing: a router that sends more rows to one rank's experts makes that rank keep more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar.experts.plan import find_experts

__all__ = ["replace_experts_for_tracing"]


def replace_experts_for_tracing(root: nn.Module) -> list[str]:
    """Give every experts module in `root` (a fake copy being traced) its dense stand-in forward; returns their
    names."""
    found = find_experts(root)
    for fqn in found:
        module = root.get_submodule(fqn)
        module.forward = _dense_equivalent(module)
    return found


def _dense_equivalent(module: nn.Module) -> Callable[..., torch.Tensor]:
    weights = [p for p in module.parameters(recurse=False) if p.ndim == 3]

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        x = hidden_states.repeat_interleave(top_k, dim=0)
        for index, weight in enumerate(weights):
            x = F.linear(x, weight[0])
            following = weights[index + 1] if index + 1 < len(weights) else None
            if following is not None and following.shape[-1] * 2 == x.shape[-1]:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            elif following is not None:
                x = F.silu(x)
        per_choice = x.view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(x.dtype)
        return per_choice.sum(dim=1).to(hidden_states.dtype)

    return forward
