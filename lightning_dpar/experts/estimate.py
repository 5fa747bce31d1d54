"""The `plan` dry run's expert-parallel section (`lightning_dpar.estimates.dry_run` calls it): which experts a rank
holds in each experts module, and how its parameter memory splits between experts and the rest."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_dpar.experts.parallel import local_expert_range
from lightning_dpar.helpers import format_bytes, group_modules, is_under, local_numel
from lightning_dpar.parallel_dims import EXPERT, ParallelDims
from lightning_dpar.plan import ModulePlan
from lightning_dpar.plan.selectors import fqn_matches

__all__ = ["describe_experts"]


def describe_experts(
    module: nn.Module, plan: ModulePlan, dims: ParallelDims, expert_mesh: DeviceMesh | None, rank: int
) -> list[str]:
    """Which experts this rank holds in each experts module, and its parameter memory split into expert and other
    parameters (what expert parallelism divides, and what it leaves to FSDP alone)."""
    if not plan.experts or expert_mesh is None:
        return []
    coordinate = expert_mesh.get_coordinate()
    assert coordinate is not None
    expert_rank = coordinate[list(expert_mesh.mesh_dim_names or ()).index(EXPERT)]
    lines = []
    for fqn, _, count in group_modules({fqn: [] for fqn in plan.experts}):
        # The group's first member, not index 0: DeepSeek-V3's first layers are dense, its experts start at layer 3.
        first = next(name for name in plan.experts if fqn_matches(fqn, name))
        experts = module.get_submodule(first).num_experts
        held = local_expert_range(experts, expert_rank, dims.expert)
        others = ", ".join(
            f"{r}: {local_expert_range(experts, r, dims.expert)[0]}-{local_expert_range(experts, r, dims.expert)[-1]}"
            for r in range(dims.expert)
        )
        times = f" x{count}" if count > 1 else ""
        lines.append(
            f"  {fqn}{times}: {experts} experts; rank {rank} (expert={expert_rank}) holds experts {held[0]}-{held[-1]}"
            f" (by expert rank: {others}), FSDP-sharded over expert_shard {dims.expert_shard}"
        )
    expert_bytes = other_bytes = 0
    for name, param in module.named_parameters():
        size = local_numel(param) * param.element_size()
        if is_under(name, plan.experts):
            expert_bytes += size
        else:
            other_bytes += size
    lines.append(
        f"  parameters on rank {rank}: experts {format_bytes(expert_bytes)}, other {format_bytes(other_bytes)}"
    )
    return lines
