"""Applying a parallelism plan: the ordered list of steps (`STEPS`), one per feature, and `apply_plan`, which walks
it. In torchtitan's order: pipeline split -> tensor parallel -> expert parallel -> context parallel -> activation
checkpointing -> compile -> data parallel (`fully_shard` or `replicate`) -> materialise. Training and the `plan` dry
run both go through `apply_plan`. The context-parallel hooks come before activation checkpointing, which gets their
`context_fn`: a recomputed block's attention must be context-parallel again.

Each `Step` reads its slice of the `ModulePlan` (made once by `lightning_dpar.plan.plan_modules`), applies it with
the meshes it needs, and may say what it does around each training or evaluation step (`AppliedPlan.around_step`).
A feature's own code stays in its folder (`pipeline/`, `experts/`, `context_parallel/`); its step here only hands it
its slice. A new feature is one more folder and one more `Step` at its place in `STEPS` (docs/architecture.md).

Wrappers are applied to the LightningModule's children: Lightning calls `training_step` directly (not `forward`), so
forward hooks on the LightningModule would never fire. A child that is only a container (`nn.ModuleList`,
`nn.ModuleDict`: no `forward` of its own) is never wrapped either; its items are. Parameters registered on the
LightningModule itself get a `fully_shard` unit on it whose forward methods are the step methods
(`shard_direct_parameters`); under DDP the strategy all-reduces their gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
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
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_dpar._private_api import ddp_replicate, waited
from lightning_dpar.activation_checkpointing import step as activation_checkpointing_step
from lightning_dpar.context_parallel import step as context_parallel_step
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.context_parallel.step import ContextParallelPlan
from lightning_dpar.experts.parallel import apply_expert_parallel
from lightning_dpar.parallel.fsdp_units import fully_shard_unit
from lightning_dpar.parallel.materialize import materialize_meta_tensors
from lightning_dpar.parallel_dims import ParallelMeshes
from lightning_dpar.pipeline.stage import PipelinedModel, split_into_stages
from lightning_dpar.plan import ModulePlan
from lightning_dpar.plan.structure import direct_parameters
from lightning_dpar.plan.ties import SharedOwners, TiedGroup, retie

__all__ = [
    "STEPS",
    "AppliedPlan",
    "Applying",
    "MixedPrecision",
    "Step",
    "StepContext",
    "apply_compile",
    "apply_ddp_replicate",
    "apply_expert_parallel",
    "apply_fully_shard",
    "apply_plan",
    "apply_tensor_parallel",
    "ignored_parameters",
    "materialize_meta_tensors",
    "outermost_fsdp_modules",
    "wait_before_compiled_units",
]

#: A unit's mixed-precision policy, given whether it is a top-level unit (the strategy's precision plugin's).
MixedPrecision = Callable[[bool], MixedPrecisionPolicy]

#: What a step does around each training or evaluation step's forward, given whether it trains and the step's
#: arguments: a context manager.
StepContext = Callable[[bool, Sequence[Any]], AbstractContextManager[None]]


@dataclass
class Applying:
    """What the walk over `STEPS` carries from step to step: its inputs (the meshes, whether meta tensors are
    materialised, the `compile` options, the mixed-precision policy) and what earlier steps produced (the pipeline
    stages, the context-parallel hooks, the modules whose gradient sync the strategy controls)."""

    meshes: ParallelMeshes
    materialize: bool = True
    compile_options: Mapping[str, Any] | None = None
    mixed_precision: MixedPrecision = field(default=lambda top_level: MixedPrecisionPolicy())
    pipeline: PipelinedModel | None = None
    context_parallel: ContextParallel | None = None
    grad_sync_modules: list[nn.Module] = field(default_factory=list)


@dataclass(frozen=True)
class AppliedPlan:
    """What applying `plan` to `module` produced: the modules whose gradient sync the strategy controls (`no_sync`),
    every FSDP unit (resharded between steps), with pipeline parallelism this rank's stages, and with context
    parallelism the hooks that split each sequence (active around each step's forward, `around_step`)."""

    plan: ModulePlan
    module: nn.Module
    grad_sync_modules: list[nn.Module]
    fsdp_modules: list[FSDPModule]
    pipeline: PipelinedModel | None = None
    context_parallel: ContextParallel | None = None

    step_contexts: tuple[StepContext, ...] = ()

    def around_step(self, training: bool, args: Sequence[Any] = ()) -> AbstractContextManager[None]:
        """What the steps of this run that have one (`step_contexts`, in the order of `STEPS`) do around each
        training or evaluation step's forward (`args`: the step's arguments, the batch first)."""
        if len(self.step_contexts) == 1:
            return self.step_contexts[0](training, args)
        return _each_entered(self.step_contexts, training, args)


@contextmanager
def _each_entered(contexts: Sequence[StepContext], training: bool, args: Sequence[Any]) -> Generator[None, None, None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context(training, args))
        yield


@dataclass(frozen=True)
class Step:
    """One step of the parallelisation: its `name`, how it applies its slice of the plan to the model (`apply`:
    reading its meshes and earlier steps' results from `Applying`, recording its own there), and, if it has one,
    what it does around each training or evaluation step (`around_step(applying)`, once applied: its
    `StepContext`, or `None` where this run needs none, so a step costs nothing per step where it does nothing)."""

    name: str
    apply: Callable[[nn.Module, ModulePlan, Applying], None]
    around_step: Callable[[Applying], StepContext | None] | None = None


def _pipeline_split(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """This rank's pipeline stages; the other stages' units are dropped first, so no rank ever allocates them."""
    if plan.pipeline is not None:
        device = applying.meshes.device if applying.materialize else torch.device("meta")
        applying.pipeline = split_into_stages(root, plan.pipeline, plan.pipeline_rank, device)


def _tensor_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if plan.tensor_parallel:
        apply_tensor_parallel(root, applying.meshes.tensor_parallel, plan.tensor_parallel, plan.tied)


def _expert_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if plan.experts:
        assert applying.meshes.expert is not None, "an expert-parallel plan needs the expert mesh"
        apply_expert_parallel(root, applying.meshes.expert, plan.experts)


def _context_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    stages = None
    if plan.pipeline is not None:  # this rank's stages: the other stages' blocks are remote units
        split = plan.pipeline
        stages = [split.stages[stage] for stage in split.stages_of_rank(plan.pipeline_rank)]
    part = ContextParallelPlan(plan.context_parallel, plan.context_parallel_loss)
    applying.context_parallel = context_parallel_step.apply_context_parallel(root, part, applying.meshes, stages)


def _context_parallel_around_step(applying: Applying) -> StepContext | None:
    runtime = applying.context_parallel
    return None if runtime is None else partial(context_parallel_step.around_step, runtime)


def _activation_checkpointing(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    context = applying.context_parallel
    part = activation_checkpointing_step.ActivationCheckpointingPlan(
        plan.activation_checkpointing, plan.activation_checkpointing_policy
    )
    activation_checkpointing_step.apply_activation_checkpointing(
        root, part, context.checkpoint_contexts if context is not None else None
    )


def _compile(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if applying.compile_options is not None:
        apply_compile(root, plan.compile_units, applying.compile_options)
        if applying.meshes.dims.tensor_parallel > 1:
            wait_before_compiled_units(root, plan.compile_units)


def _data_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """The wrapper `plan.data_parallel` names, with its settings. A model whose `configure_model` applied
    `fully_shard` itself is adopted as it is: its outermost units are the ones whose gradient sync the strategy
    controls."""
    if plan.adopted_sharded:
        applying.grad_sync_modules = outermost_fsdp_modules(root)
    else:
        meshes, pipelined = applying.meshes, applying.pipeline
        applying.grad_sync_modules = apply_data_parallel(root, plan, meshes, applying.mixed_precision, pipelined)
    if applying.pipeline is not None:
        applying.pipeline.install_unit_hooks()


def _materialize(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """Each rank allocates and initialises only its own shards (see `lightning_dpar.parallel.materialize`); the dry
    run leaves meta tensors on the meta device."""
    if applying.materialize:
        materialize_meta_tensors(root, applying.meshes.device, plan.tied)


#: The steps, in the order they apply (torchtitan's: a model is split into stages first, each stage's modules are
#: tensor- and expert-parallelised, then wrapped for recomputation and compiled, and the data-parallel wrapper goes
#: around all of it; shards are allocated last, once every layout is known). A new step goes at its place here.
STEPS: tuple[Step, ...] = (
    Step("pipeline split", _pipeline_split),
    Step("tensor parallel", _tensor_parallel),
    Step("expert parallel", _expert_parallel),
    Step("context parallel", _context_parallel, _context_parallel_around_step),
    Step("activation checkpointing", _activation_checkpointing),
    Step("compile", _compile),
    Step("data parallel", _data_parallel),
    Step("materialise", _materialize),
)


def apply_plan(
    root: nn.Module,
    plan: ModulePlan,
    meshes: ParallelMeshes,
    *,
    mixed_precision: MixedPrecision | None = None,
    compile_options: Mapping[str, Any] | None = None,
    materialize: bool = True,
) -> AppliedPlan:
    """Apply `plan` to `root` on `meshes`: each of `STEPS` in order, each reading its slice of the plan and its mesh.

    `mixed_precision` gives each FSDP unit's policy (default: FSDP's, no casting); `compile_options=None` compiles
    nothing; `materialize=False` leaves meta-device tensors on the meta device (the `plan` dry run), otherwise each
    rank allocates and initialises only its own shards on `meshes.device`.
    """
    applying = Applying(meshes, materialize, compile_options)
    if mixed_precision is not None:
        applying.mixed_precision = mixed_precision
    for step in STEPS:
        step.apply(root, plan, applying)
    fsdp_modules = [module for module in root.modules() if isinstance(module, FSDPModule)]
    contexts = [step.around_step(applying) for step in STEPS if step.around_step is not None]
    return AppliedPlan(
        plan,
        root,
        applying.grad_sync_modules,
        fsdp_modules,
        applying.pipeline,
        applying.context_parallel,
        tuple(context for context in contexts if context is not None),
    )


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


def apply_tensor_parallel(
    root: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], tied: Sequence[TiedGroup] = ()
) -> None:
    """Shard the planned modules over the tensor-parallel mesh (plan already resolved to concrete names).

    `parallelize_module` gives each module a new parameter of its own, which would untie `tied` names (an embedding
    and the head sharing its weight); they are tied again, one DTensor serving both (the plan checked their layouts
    agree, `lightning_dpar.plan.ties.check_tied_layouts`)."""
    if plan and tp_mesh.size() > 1:
        parallelize_module(root, tp_mesh, dict(plan))
        retie(root, tied)


def apply_compile(root: nn.Module, fqns: Sequence[str], options: Mapping[str, Any]) -> None:
    """Compile each listed block in place (`nn.Module.compile`): names and state-dict keys stay unchanged."""
    for fqn in fqns:
        root.get_submodule(fqn).compile(**options)


def wait_before_compiled_units(root: nn.Module, compiled: Sequence[str]) -> None:
    """Make each module that runs eagerly (outside every compiled unit, enclosing none) return plain tensors.

    torch's column- and row-wise styles end with an asynchronous collective (the all-gather or all-reduce of the
    module's output) and hand on its result as an `AsyncCollectiveTensor`. Where that is the input of a compiled unit
    (a transformers model's row-wise token embedding feeding the first decoder layer), torch 2.13 compiles the unit as
    if its input needed no gradient, so the embedding never gets one: measured on a tiny Llama under TP 2, its
    gradient was exactly zero and the run ended 0.19 away from one process. A forward hook waits for the collective
    there instead, keeping the autograd history (`_private_api.waited`; no copy). Every eager module gets it, not only
    the plan's tensor-parallel ones: a model parallelised in its own `configure_model` (adopted, with no plan of
    ours) may end any module with such a collective; on a plain output the hook is one type check. Inside a compiled
    unit the styles' hooks are traced with the unit and need nothing; a module enclosing compiled units returns what
    they computed."""
    if "" in compiled:
        return
    inside = tuple(f"{fqn}." for fqn in compiled)
    for fqn, module in root.named_modules():
        encloses = fqn == "" or any(unit.startswith(f"{fqn}.") for unit in compiled)
        if fqn in compiled or fqn.startswith(inside) or encloses:
            continue
        module.register_forward_hook(lambda module, args, output: waited(output))


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
    return {p for fqn in patterns for p in root.get_submodule(fqn).parameters()}
