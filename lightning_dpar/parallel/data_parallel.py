"""The data-parallel step (`STEP`: its slice of the plan, the wrapper's units and settings, and how it is applied,
wrapping each pipeline stage where there are stages) and its wrappers: FSDP2's `fully_shard` (over the FSDP mesh,
over each pipeline stage, or over replicas of size-1 shard groups when tensor-parallel parameters rule DDP out) and
composable DDP's `replicate`, each on the top-level units the plan names (`ModulePlan.data_parallel_roots`), with the
settings the plan carries (`ModulePlan.data_parallel`). `reshard` frees unsharded parameters between steps.

Wrappers go on the LightningModule's children: Lightning calls `training_step` directly (not `forward`), so forward
hooks on the LightningModule would never fire. A child that is only a container (`nn.ModuleList`, `nn.ModuleDict`:
no `forward` of its own) is never wrapped either; its items are. Parameters registered on the LightningModule itself
get a `fully_shard` unit on it whose forward methods are the step methods (`shard_direct_parameters`); under DDP the
strategy all-reduces their gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from lightning_dpar._private_api import ddp_replicate
from lightning_dpar.parallel.facts import ModelFacts
from lightning_dpar.parallel.fsdp_units import fully_shard_unit
from lightning_dpar.parallel_dims import ParallelMeshes
from lightning_dpar.pipeline import step as pipeline_step
from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.plan import ModulePlan
from lightning_dpar.plan.planner import PlanOptions, data_parallel_settings
from lightning_dpar.plan.selectors import select_modules
from lightning_dpar.plan.structure import direct_parameters
from lightning_dpar.plan.ties import SharedOwners, TiedGroup, check_each_in_one_unit
from lightning_dpar.steps.contract import Applying, MixedPrecision, Planning, Step

__all__ = [
    "STEP",
    "STEP_METHODS",
    "apply_data_parallel",
    "apply_ddp_replicate",
    "apply_fully_shard",
    "ignored_parameters",
    "outermost_fsdp_modules",
    "reshard",
    "shard_direct_parameters",
]


def apply_data_parallel(
    root: nn.Module,
    plan: ModulePlan,
    meshes: ParallelMeshes,
    mixed_precision: MixedPrecision,
    pipelined: PipelinedModel | None = None,
) -> list[nn.Module]:
    """The data-parallel wrapper `plan.data_parallel` names, on its mesh; returns the modules whose gradient sync
    `no_sync` controls. `pipelined`: this rank's pipeline stages, whose roots are the FSDP roots."""
    settings = plan.data_parallel
    if settings.reduce_dtype is None:
        policy = mixed_precision
    else:

        def policy(top_level: bool) -> MixedPrecisionPolicy:
            return replace(mixed_precision(top_level), reduce_dtype=settings.reduce_dtype)

    if settings.wrapper == "replicate":
        return apply_ddp_replicate(
            root,
            meshes.data_parallel.get_group(),
            plan.data_parallel_roots,
            plan.ignored,
            settings.ddp_kwargs,
            settings.comm_hook,
            meshes.device,
        )
    if settings.wrapper == "fully_shard_replicas":
        return apply_fully_shard(
            root,
            meshes.replicate_shard,
            units=[],
            mp_policy=policy,
            top_level_units=plan.data_parallel_roots,
            reshard_after_forward=False,
            ignored_params=ignored_parameters(root, plan.ignored),
        )
    return apply_fully_shard(  # type: ignore[return-value]
        root,
        meshes.fsdp,
        plan.shard_units,
        policy,
        top_level_units=plan.data_parallel_roots,
        reshard_after_forward=settings.reshard_after_forward,
        cpu_offload=settings.cpu_offload,
        stage_roots=list(pipelined.stages.values()) if pipelined is not None else [],
        final_unit=plan.pipeline.stages[-1][-1] if plan.pipeline is not None else None,
        tied=plan.tied,
        expert_units=plan.experts,
        expert_mesh=meshes.expert_fsdp,
    )


def outermost_fsdp_modules(root: nn.Module) -> list[nn.Module]:
    """The FSDP units of `root` that no other unit encloses."""
    outermost: list[nn.Module] = []
    for module in root.modules():
        if isinstance(module, FSDPModule) and not any(module in set(o.modules()) for o in outermost):
            outermost.append(module)
    return outermost


def reshard(modules: Sequence[FSDPModule]) -> None:
    """Free the unsharded parameters of FSDP `modules`, registering their shards again (a no-op for those sharded).

    An FSDP root (or a unit with `reshard_after_forward=False`) keeps its parameters unsharded after forward
    (backward follows at once in training) until its post-backward hook reshards them, which never runs after an
    evaluation step, nor for a unit whose parameters are all frozen. Between steps, `parameters()` must yield the
    shards: callbacks pair them with averaged shards (weight averaging) or add them to the optimizer (finetuning),
    and an unsharded parameter would be a whole plain tensor that the next all-gather overwrites."""
    for module in modules:
        module.reshard()


def apply_fully_shard(
    root: nn.Module,
    mesh: DeviceMesh,
    units: Sequence[str],
    mp_policy: Callable[[bool], MixedPrecisionPolicy],
    top_level_units: Sequence[str],
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
    stage_roots: Sequence[nn.Module] = (),
    final_unit: str | None = None,
    tied: Sequence[TiedGroup] = (),
    expert_units: Sequence[str] = (),
    expert_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """`fully_shard` each unit (innermost first), then each top-level unit (`ModulePlan.data_parallel_roots`);
    returns the top-level units.

    `mp_policy(is_top_level)` gives each unit's mixed-precision policy. With pipeline parallelism the units are the
    stages' units, each stage's root module (`stage_roots`) is the FSDP root over them instead, and `final_unit` is
    the unit computing the model's output. A `tied` parameter used in several units goes to the innermost unit
    enclosing them all (the LightningModule's own unit if need be), as FSDP2 requires: each parameter has one unit.
    The `expert_units` (experts modules split by expert parallelism) are units of their own on `expert_mesh`, the
    ranks holding the same experts, sharded first so the blocks around them leave their parameters alone.
    """
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for fqn in expert_units:
        assert expert_mesh is not None, "expert units are sharded over the expert FSDP mesh"
        fully_shard_unit(
            root.get_submodule(fqn),
            mesh=expert_mesh,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy(False),
        )
    if stage_roots:
        return _fully_shard_stages(
            root, mesh, units, mp_policy, reshard_after_forward, cpu_offload, stage_roots, final_unit
        )
    top_level_names = list(top_level_units)
    # The top-level units are FSDP roots. `reshard_after_forward=True` on a root frees its parameters after forward
    # only to all-gather them again at once for backward (the loss is the last thing forward computes); torch's
    # default (`None`) keeps a root's parameters unsharded instead and reshards every other unit, which is what
    # `True` means for the blocks. Explicit `False` or an int still apply to the roots as given.
    root_reshard = None if reshard_after_forward is True else reshard_after_forward
    owners = SharedOwners(root, tied, [*units, *top_level_names, ""], ignored_params or set())

    def shard(fqn: str, top_level: bool) -> None:
        fully_shard_unit(
            root.get_submodule(fqn),
            mesh=mesh,
            offload_policy=offload,
            reshard_after_forward=root_reshard if top_level else reshard_after_forward,
            mp_policy=mp_policy(top_level),
            **owners.ignored_kwargs(fqn),
        )

    top_level_set = set(top_level_names)
    # A unit holding a parameter shared by several units below it goes first, while it can still reach the
    # parameter (`fully_shard` does not look inside units already applied); the units below leave it alone.
    for fqn in owners.hoisting_units():
        if fqn == "":
            shard_direct_parameters(root, mp_policy(True), {"mesh": mesh, "offload_policy": offload}, owners)
        else:
            shard(fqn, top_level=fqn in top_level_set)
    # Deepest first (a stable sort by depth): nested `fully_shard` must wrap descendants before their ancestors.
    for fqn in sorted(units, key=_depth, reverse=True):
        if not isinstance(root.get_submodule(fqn), FSDPModule):
            shard(fqn, top_level=False)
    top_level = []
    for name in top_level_names:
        child = root.get_submodule(name)
        if not isinstance(child, FSDPModule):
            shard(name, top_level=True)
        top_level.append(child)
    if isinstance(root, FSDPModule):
        return [root]
    if direct_parameters(root):
        return [shard_direct_parameters(root, mp_policy(True), {"mesh": mesh, "offload_policy": offload}, owners)]
    return top_level  # type: ignore[return-value]


def _fully_shard_stages(
    root: nn.Module,
    mesh: DeviceMesh,
    units: Sequence[str],
    mp_policy: Callable[[bool], MixedPrecisionPolicy],
    reshard_after_forward: bool | int,
    cpu_offload: bool,
    stage_roots: Sequence[nn.Module],
    final_unit: str | None,
) -> list[FSDPModule]:
    """`fully_shard` each unit of this rank's pipeline stages, then each stage's root module over them.

    The model's final unit (the head) returns fp32 under bf16-mixed, as the top-level unit does unpipelined, so
    the loss is computed in fp32. Each stage root holds no parameters of its own; it is the FSDP root torch's
    pipeline schedules drive (gradients are reduced once per step, after the last microbatch's backward). Batch
    inputs are not cast by it: units cast their own.
    """
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for fqn in sorted(units, key=_depth, reverse=True):
        if isinstance(root.get_submodule(fqn), FSDPModule):  # an experts unit, sharded already
            continue
        fully_shard_unit(
            root.get_submodule(fqn),
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy(fqn == final_unit),
            offload_policy=offload,
        )
    for stage_root in stage_roots:
        policy = replace(mp_policy(False), cast_forward_inputs=False)
        fully_shard_unit(stage_root, mesh=mesh, mp_policy=policy, reshard_after_forward=False, offload_policy=offload)
    return list(stage_roots)  # type: ignore[arg-type]


#: The LightningModule methods Lightning calls instead of `forward`.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def shard_direct_parameters(
    root: nn.Module, policy: MixedPrecisionPolicy, common: Mapping[str, Any], owners: SharedOwners
) -> FSDPModule:
    """Shard the parameters registered on the LightningModule itself, and those shared by several top-level units,
    with a `fully_shard` unit on it.

    Lightning calls the step methods, not `forward`, so they are registered as FSDP forward methods: the unit's
    parameters are gathered for each step and their gradients reduce-scattered after its backward. The unit is the
    root of all others and keeps its parameters gathered from forward to backward (FSDP's rule for the root); batch
    inputs are not cast (`cast_forward_inputs=False`), the children cast their own.
    """
    fully_shard(
        root,
        mp_policy=replace(policy, cast_forward_inputs=False),
        reshard_after_forward=False,
        **common,
        **owners.ignored_kwargs(""),
    )
    for name in STEP_METHODS:
        if callable(getattr(root, name, None)):
            register_fsdp_forward_method(root, name)
    return root  # type: ignore[return-value]


def _depth(fqn: str) -> int:
    return fqn.count(".")


def apply_ddp_replicate(
    root: nn.Module,
    process_group: dist.ProcessGroup,
    roots: Sequence[str],
    ignored_modules: Sequence[str],
    ddp_kwargs: Mapping[str, Any],
    comm_hook: Callable[..., Any] | None,
    device: torch.device,
) -> list[nn.Module]:
    """Composable DDP on each top-level unit (`roots`: `ModulePlan.data_parallel_roots`); gradients of
    `ignored_modules` (FQNs) are not synchronised. A unit whose parameters are all frozen is left out (DDP refuses
    it); the strategy averages the gradients of parameters frozen here once they require them (a finetuning callback
    unfreezing a backbone)."""
    ignored = {root.get_submodule(fqn) for fqn in ignored_modules}
    replicated = []
    for name in roots:
        child = root.get_submodule(name)
        if child in ignored or not any(p.requires_grad for p in child.parameters()):
            continue
        child_ignored = [m for m in child.modules() if m in ignored]
        ddp_replicate(
            child,
            ignored_modules=child_ignored,
            process_group=process_group,
            device_id=device,
            **ddp_kwargs,
        )
        if comm_hook is not None:
            child.register_comm_hook(process_group, comm_hook)
        replicated.append(child)
    return replicated


def ignored_parameters(root: nn.Module, patterns: Sequence[str]) -> set[nn.Parameter]:
    """The parameters of the modules named by `patterns` (`ModulePlan.ignored`), whose gradients are not
    synchronised."""
    return {p for fqn in patterns for p in root.get_submodule(fqn).parameters()}


def _plan(planning: Planning) -> Mapping[str, Any]:
    """The wrapper's units and settings; under DDP (no tensor parallelism) each tied parameter must sit inside one
    of its units, and the modules left unsynchronised (`ignored_modules`) are resolved."""
    module, dims = planning.module, planning.dims
    options: PlanOptions = planning.options
    facts: ModelFacts = planning.facts
    ignored: list[str] = []
    if not facts.adopted:
        if dims.pipeline == 1 and options.ddp_units and dims.tensor_parallel == 1:  # with TP: FSDP replicas
            check_each_in_one_unit(facts.tied, facts.roots, options.strategy)
        if options.ignored_modules:
            ignored = list(select_modules(module, options.ignored_modules, "ignored_modules"))
    return {
        "shard_units": facts.shard_units,
        "data_parallel_roots": facts.roots,
        "ignored": ignored,
        "adopted_sharded": facts.adopted_sharded,
        "data_parallel": data_parallel_settings(dims, options),
    }


def _apply(root: nn.Module, plan: ModulePlan, applying: Applying) -> list[nn.Module]:
    """The wrapper `plan.data_parallel` names, with its settings; its result is the modules whose gradient sync the
    strategy controls. A model whose `configure_model` applied `fully_shard` itself is adopted as it is: its
    outermost units are those modules."""
    stages = pipeline_step.pipelined(applying.results)
    if plan.adopted_sharded:
        grad_sync_modules = outermost_fsdp_modules(root)
    else:
        grad_sync_modules = apply_data_parallel(root, plan, applying.meshes, applying.mixed_precision, stages)
    if stages is not None:
        stages.install_unit_hooks()
    return grad_sync_modules


#: The data-parallel step: after compile, before materialise; its result is the modules whose gradient sync the
#: strategy controls (`AppliedPlan.grad_sync_modules`).
STEP = Step("data parallel", _plan, _apply)
