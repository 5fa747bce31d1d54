"""Expert parallelism at run time: each experts module's experts split between the `expert` ranks of the mesh, and
each token sent to the ranks holding its chosen experts and back.

`apply_expert_parallel` makes each planned experts module's parameters DTensors sharded along the expert dim (dim 0)
over the `expert` mesh dim, so every rank holds `num_experts / expert_parallel_size` experts and checkpoints keep the
unsplit model's keys and shapes (DCP reshards them between expert-parallel sizes). Its `forward` becomes
`ExpertDispatch`:

1. each (token, choice) pair goes to the rank holding its expert, by one all-to-all with uneven splits (dropless:
   every pair is computed, however unbalanced the routing);
2. the module's own `forward` runs there on the rows it received, with its local experts and local expert ids;
3. the results come back by the reverse all-to-all, and each token's results are summed with its routing weights.

Autograd differentiates both all-to-alls (`AllToAll`), so gradients reach every token's rank, the router included.
The result equals running every expert locally, up to the order of floating-point sums.

Gradient averaging. An expert's gradient on its rank sums the contributions of every token the `expert` ranks sent
it; FSDP then averages over the ranks that hold the same experts (`expert_shard`, and `replicate` under HSDP), which
are only `data_parallel / expert_parallel_size` ranks. The local experts' gradients are therefore scaled by
`1 / expert_parallel_size` (`ScaleGradient`), so every gradient is the average over the same global batch, neither
divided twice nor left summed. (FSDP's own `set_gradient_divide_factor` would do the same on NCCL, but needs a
reduce op gloo lacks.)

Under `compile`, the dispatch and the local experts run eagerly (`torch.compiler.disable`): the split sizes are
read back to the host and the rows per expert change every step, which would make the compiler recompile each step;
the rest of each block compiles.

A rank whose experts receive no token still runs the module on zero rows and keeps its output attached to the
experts' parameters and to the received rows (a zero-sized term), so each collective runs in backward on every rank,
every expert gets a (zero) gradient, and FSDP reduces the same tensors on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_dpar._private_api import swapped_parameters

__all__ = ["AllToAll", "ExpertDispatch", "ScaleGradient", "apply_expert_parallel", "local_expert_range"]


class AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 with uneven splits, differentiable: backward is the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits = (receive, send, group)
        received = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), receive, send, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        receive, send, group = ctx.splits
        return AllToAll.apply(grad, send, receive, group), None, None, None


class ScaleGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def local_expert_range(num_experts: int, expert_rank: int, expert_parallel_size: int) -> range:
    """The global ids of the experts that expert rank `expert_rank` holds: a contiguous block, as `Shard(0)` lays
    them out."""
    per_rank = num_experts // expert_parallel_size
    return range(expert_rank * per_rank, (expert_rank + 1) * per_rank)


class ExpertDispatch:
    """The `forward` of an expert-parallel experts module: tokens to their experts' ranks, the module's own `forward`
    on the local experts, and the results back, weighted (see the module docstring)."""

    def __init__(self, module: nn.Module, expert_mesh: DeviceMesh) -> None:
        self._module = module
        self._local_forward = module.forward
        self._group = expert_mesh.get_group()
        self._size = expert_mesh.size()
        self.num_experts: int = module.num_experts  # type: ignore[assignment]
        self.local_experts = self.num_experts // self._size

    @torch.compiler.disable
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        (tokens, hidden), top_k = hidden_states.shape, top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # pairs grouped by expert, hence by destination rank
        sorted_experts = experts[order]
        rows = hidden_states[order // top_k]
        send_counts = torch.bincount(sorted_experts // self.local_experts, minlength=self._size)
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts, group=self._group)
        send, receive = send_counts.tolist(), receive_counts.tolist()
        received = AllToAll.apply(rows, receive, send, self._group)
        local_ids = sorted_experts.new_empty(sum(receive))
        dist.all_to_all_single(local_ids, sorted_experts % self.local_experts, receive, send, group=self._group)
        computed = self._run_local_experts(received, local_ids)
        returned = AllToAll.apply(computed, send, receive, self._group)
        per_choice = returned[torch.argsort(order)].view(tokens, top_k, hidden)
        combined = (per_choice * top_k_weights.unsqueeze(-1).to(per_choice.dtype)).sum(dim=1)
        return combined.to(hidden_states.dtype)

    def _run_local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The module's own forward on the received rows, each with weight 1 (weights are applied at home), with
        its local experts' plain tensors registered in place of the DTensors."""
        module = self._module
        local = {
            name: ScaleGradient.apply(param.to_local() if isinstance(param, DTensor) else param, 1.0 / self._size)
            for name, param in module.named_parameters(recurse=False)
        }
        module.num_experts = self.local_experts
        try:
            with swapped_parameters(module, local):
                weights = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
                computed = self._local_forward(rows, local_ids.unsqueeze(-1), weights)
        finally:
            module.num_experts = self.num_experts
        # Zero-sized terms keep the output attached to every local parameter and to the received rows even when no
        # row arrived, so both all-to-alls run in backward on every rank and every expert gets a gradient.
        attached = rows[:, :0].sum() + sum(tensor[:0].sum() for tensor in local.values())
        return computed + attached


def apply_expert_parallel(root: nn.Module, expert_mesh: DeviceMesh, fqns: Sequence[str]) -> None:
    """Split each experts module in `fqns` between the ranks of the 1-D `expert_mesh` and route its tokens by
    all-to-all. Before FSDP, which then shards each expert slice over the ranks that hold the same experts."""
    if expert_mesh.size() == 1:
        return
    for fqn in fqns:
        module = root.get_submodule(fqn)
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), expert_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.forward = ExpertDispatch(module, expert_mesh)
