"""The parallelisation as data: `STEPS`, the ordered list of steps, one per feature, and the two walks over it:
`plan_modules`, which asks each step for its slice of the plan (made once from the model, the mesh sizes and the
strategy's frozen `PlanOptions`), and `apply_plan`, which applies each slice. Training, the `plan` dry run and the
layout search all go through both.

The order is torchtitan's: pipeline split -> float8 (torchao's `Float8Linear` swapped in before any module is
sharded) -> tensor parallel -> loss parallel (the output layer's logits kept
sharded; torchtitan folds it into its output layer's style) -> expert parallel -> context parallel -> activation
checkpointing -> compile -> data parallel (`fully_shard` or `replicate`) -> materialise. The context-parallel hooks
come before activation checkpointing, which gets their `context_fn`: a recomputed block's attention must be
context-parallel again.

A `Step` binds what its feature's folder exports: its slice of the plan (`plan`), how it is applied (`apply`), and,
if it has them, what it does around each step's forward (`around_step`) and backward (`around_backward`) and to its
output (`step_output`). A feature's own code stays in its folder (`pipeline/step.py`, `float8/step.py`,
`experts/`, `context_parallel/step.py`, `loss_parallel/step.py`, `parallel/data_parallel.py`); a new feature is one
more folder and one more `Step` at its place in `STEPS` (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_dpar._private_api import waited
from lightning_dpar.activation_checkpointing import step as activation_checkpointing_step
from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingPlan
from lightning_dpar.conformance.batchnorm import check_no_batch_norm_in_pipeline
from lightning_dpar.context_parallel import step as context_parallel_step
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.context_parallel.step import ContextParallelPlan
from lightning_dpar.experts.parallel import apply_expert_parallel
from lightning_dpar.experts.plan import plan_experts
from lightning_dpar.float8 import step as float8_step
from lightning_dpar.loss_parallel import step as loss_parallel_step
from lightning_dpar.parallel.data_parallel import MixedPrecision, apply_data_parallel, outermost_fsdp_modules
from lightning_dpar.parallel.materialize import materialize_meta_tensors
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes
from lightning_dpar.pipeline import step as pipeline_step
from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.plan import ModulePlan, local_plan
from lightning_dpar.plan.compile import compile_units
from lightning_dpar.plan.initialisers import check_initialisable
from lightning_dpar.plan.planner import (
    PlanOptions,
    check_adoptable,
    data_parallel_settings,
    expert_selectors,
    plan_tensor_parallel,
    shard_units,
)
from lightning_dpar.plan.selectors import resolve_activation_checkpointing, select_modules
from lightning_dpar.plan.structure import (
    check_not_wrapped_by_other_parallelism,
    data_parallel_roots,
    has_fully_shard,
    is_parallelized,
    repeated_blocks,
)
from lightning_dpar.plan.ties import TiedGroup, check_each_in_one_unit, check_tied_layouts, retie, tied_parameters

__all__ = [
    "STEPS",
    "AppliedPlan",
    "Applying",
    "BackwardContext",
    "ModelFacts",
    "Planning",
    "Step",
    "StepContext",
    "StepOutput",
    "apply_compile",
    "apply_plan",
    "apply_tensor_parallel",
    "model_facts",
    "plan_modules",
    "wait_before_compiled_units",
]

#: What a step does around each training or evaluation step's forward, given whether it trains and the step's
#: arguments: a context manager.
StepContext = Callable[[bool, Sequence[Any]], AbstractContextManager[None]]
#: What a step makes of each training step's output before Lightning reads it (the loss's backward, logging): a
#: function of the output (loss parallel's loss, a DTensor replicated on every rank, handed on as its local tensor).
StepOutput = Callable[[Any], Any]
#: What a step does around each training step's backward: a context manager (loss parallel's `loss_parallel()`,
#: which torch needs around the backward of the loss it computed as well as around its forward).
BackwardContext = Callable[[], AbstractContextManager[None]]


@dataclass(frozen=True)
class ModelFacts:
    """What planning finds on the model once, before any step makes its slice, because several steps read it.

    `adopted`: the user parallelised the model in `configure_model` (no tensor, expert or pipeline parallelism and
    no activation checkpointing are added; `adopted_sharded`: it applied `fully_shard` itself, so the data-parallel
    wrapper adds no units). `blocks`: its repeated blocks; `shard_units`: the FSDP units (none for a wrapper that
    does not shard); `tied`: parameters reachable under several names (`lightning_dpar.plan.ties`); `experts`: the
    experts modules expert parallelism splits (tensor parallelism leaves them out); `checkpointing`: the modules
    recomputed in backward and how (context parallelism checks none cuts a block); `roots`: the data-parallel wrapper's
    top-level units (none under pipelining: each stage is its own root)."""

    adopted: bool
    adopted_sharded: bool
    blocks: list[str]
    shard_units: list[str]
    tied: list[TiedGroup]
    experts: list[str]
    checkpointing: ActivationCheckpointingPlan
    roots: list[str]


def model_facts(module: nn.Module, dims: ParallelDims, options: PlanOptions) -> ModelFacts:
    """`module`'s `ModelFacts` on a world of `dims`, refusing what cannot compose (classic DDP / FSDP1 wrappers, a
    model parallelised already by a strategy that does not adopt it) before any step plans."""
    check_not_wrapped_by_other_parallelism(module, options.strategy)
    blocks = repeated_blocks(module)
    units = shard_units(module, options, blocks)
    if is_parallelized(module):
        check_adoptable(module, dims, options)
        sharded = has_fully_shard(module)  # the wrapper adds no units of its own, so needs no top-level units
        roots = [] if sharded else data_parallel_roots(module)
        return ModelFacts(True, sharded, blocks, units, [], [], ActivationCheckpointingPlan(), roots)
    tied = tied_parameters(module)
    experts = plan_experts(module, dims.expert, dims.shard, expert_selectors(module, options))
    checkpointing = activation_checkpointing_step.plan_activation_checkpointing(
        module,
        options.activation_checkpointing,
        lambda spec: resolve_activation_checkpointing(module, spec, units, blocks),
        options.strategy,
    )
    roots = [] if dims.pipeline > 1 else data_parallel_roots(module)  # refuses containers holding parameters
    return ModelFacts(False, False, blocks, units, tied, list(experts), checkpointing, roots)


@dataclass
class Planning:
    """What the walk over `STEPS` carries while it makes the plan: its inputs (the model, the mesh sizes, the frozen
    options, the model's facts) and the slices made so far (`ModulePlan` fields by name), which later steps may
    read (context parallelism reads the pipeline split)."""

    module: nn.Module
    dims: ParallelDims
    options: PlanOptions
    facts: ModelFacts
    slices: dict[str, Any] = field(default_factory=dict)


@dataclass
class Applying:
    """What the walk over `STEPS` carries while it applies the plan: its inputs (the meshes, whether meta tensors
    are materialised, the `compile` options, the mixed-precision policy) and what earlier steps produced (the
    pipeline stages, the context-parallel hooks, the modules whose gradient sync the strategy controls)."""

    meshes: ParallelMeshes
    materialize: bool = True
    compile_options: Mapping[str, Any] | None = None
    mixed_precision: MixedPrecision = field(default=lambda top_level: MixedPrecisionPolicy())
    pipeline: PipelinedModel | None = None
    context_parallel: ContextParallel | None = None
    grad_sync_modules: list[nn.Module] = field(default_factory=list)
    loss_parallel: str | None = None


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
    backward_contexts: tuple[BackwardContext, ...] = ()
    output_steps: tuple[StepOutput, ...] = ()

    def step_output(self, output: Any) -> Any:
        """Each training step's output as the steps of this run that have a `StepOutput` (`output_steps`, in the
        order of `STEPS`) hand it on to Lightning."""
        for step in self.output_steps:
            output = step(output)
        return output

    def around_step(self, training: bool, args: Sequence[Any] = ()) -> AbstractContextManager[None]:
        """What the steps of this run that have one (`step_contexts`, in the order of `STEPS`) do around each
        training or evaluation step's forward (`args`: the step's arguments, the batch first)."""
        if len(self.step_contexts) == 1:
            return self.step_contexts[0](training, args)
        return _each_entered([partial(context, training, args) for context in self.step_contexts])

    def around_backward(self) -> AbstractContextManager[None]:
        """What the steps of this run that have one (`backward_contexts`, in the order of `STEPS`) do around each
        training step's backward (nothing to enter, and no cost per step, where none has one)."""
        if not self.backward_contexts:
            return nullcontext()
        if len(self.backward_contexts) == 1:
            return self.backward_contexts[0]()
        return _each_entered(self.backward_contexts)


@contextmanager
def _each_entered(contexts: Sequence[Callable[[], AbstractContextManager[None]]]) -> Generator[None, None, None]:
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        yield


@dataclass(frozen=True)
class Step:
    """One step of the parallelisation: its `name`; its slice of the plan (`plan(planning)`: the `ModulePlan`
    fields it owns, refusing what it cannot apply before any collective); how it applies that slice (`apply`:
    reading its meshes and earlier steps' results from `Applying`, recording its own there); and, if it has one,
    what it does around each training or evaluation step's forward (`around_step(applying)`, once applied: its
    `StepContext`, or `None` where this run needs none, so a step costs nothing per step where it does nothing) and
    around each training step's backward (`around_backward(applying)`: its `BackwardContext`, or `None`), and what
    it makes of each training step's output (`step_output(applying)`: its `StepOutput`, or `None`)."""

    name: str
    plan: Callable[[Planning], Mapping[str, Any]]
    apply: Callable[[nn.Module, ModulePlan, Applying], None]
    around_step: Callable[[Applying], StepContext | None] | None = None
    around_backward: Callable[[Applying], BackwardContext | None] | None = None
    step_output: Callable[[Applying], StepOutput | None] | None = None


def _plan_pipeline_split(planning: Planning) -> Mapping[str, Any]:
    module, dims, facts = planning.module, planning.dims, planning.facts
    if dims.pipeline > 1:
        check_no_batch_norm_in_pipeline(module, dims.pipeline)
    split = pipeline_step.plan_pipeline_split(
        module, dims, planning.options.pipeline, facts.shard_units or facts.blocks
    )
    return {"pipeline": split}


def _pipeline_split(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    device = applying.meshes.device if applying.materialize else torch.device("meta")
    applying.pipeline = pipeline_step.apply_pipeline_split(root, plan.pipeline, plan.pipeline_rank, device)


def _plan_float8(planning: Planning) -> Mapping[str, Any]:
    """The Linear modules converted to float8 (none without `float8=`), every refusal before any collective."""
    facts = planning.facts
    part = float8_step.plan_float8(
        planning.module,
        planning.dims,
        planning.options.float8,
        planning.options.strategy,
        adopted=facts.adopted,
        experts=facts.experts,
    )
    return {"float8": part.modules, "float8_config": part.config}


def _float8(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """torchao's `Float8Linear` swapped in for the planned modules, before tensor parallelism shards them."""
    float8_step.apply_float8(root, float8_step.Float8Plan(plan.float8, plan.float8_config), applying.meshes.device)


def _plan_tensor_parallel(planning: Planning) -> Mapping[str, Any]:
    module, facts = planning.module, planning.facts
    if facts.adopted:  # `check_adoptable` refused a `tp_plan`: the model's own layout stays
        return {"tensor_parallel": {}}
    styles = plan_tensor_parallel(module, planning.dims, planning.options, facts.experts)
    check_tied_layouts(module, facts.tied, styles)
    return {"tensor_parallel": styles}


def _tensor_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """The planned styles, the output layer's vocabulary-sharded under loss parallel (the next step's slice)."""
    if plan.tensor_parallel:
        styles = loss_parallel_step.sharded_output_styles(plan.tensor_parallel, plan.loss_parallel)
        apply_tensor_parallel(root, applying.meshes.tensor_parallel, styles, plan.tied)


def _plan_loss_parallel(planning: Planning) -> Mapping[str, Any]:
    """The output layer whose logits stay sharded, found in the tensor-parallel step's resolved styles."""
    options, styles = planning.options, planning.slices["tensor_parallel"]
    output = loss_parallel_step.plan_loss_parallel(
        planning.module, planning.dims, options.loss_parallel, styles, options.strategy
    )
    return {"loss_parallel": output}


def _loss_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """Its style was applied with tensor parallelism's (one `parallelize_module` call, ties kept); what remains is
    the context around each step, recorded here for `around_step` and `around_backward`."""
    applying.loss_parallel = plan.loss_parallel


def _loss_parallel_around_step(applying: Applying) -> StepContext | None:
    output = applying.loss_parallel
    return None if output is None else partial(loss_parallel_step.around_step, output)


def _loss_parallel_around_backward(applying: Applying) -> BackwardContext | None:
    output = applying.loss_parallel
    return None if output is None else partial(loss_parallel_step.around_step, output)


def _loss_parallel_step_output(applying: Applying) -> StepOutput | None:
    return None if applying.loss_parallel is None else loss_parallel_step.plain_loss


def _plan_expert_parallel(planning: Planning) -> Mapping[str, Any]:
    return {"experts": list(planning.facts.experts)}  # found with the facts: tensor parallelism leaves them out


def _expert_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if plan.experts:
        assert applying.meshes.expert is not None, "an expert-parallel plan needs the expert mesh"
        apply_expert_parallel(root, applying.meshes.expert, plan.experts)


def _plan_context_parallel(planning: Planning) -> Mapping[str, Any]:
    facts = planning.facts
    split = planning.slices["pipeline"]
    part = context_parallel_step.plan_context_parallel(
        planning.module,
        planning.dims,
        planning.options.context_parallel_loss,
        planning.options.strategy,
        facts.checkpointing.modules,
        split.stages if split is not None else None,
    )
    return {"context_parallel": part.blocks, "context_parallel_loss": part.loss_module}


def _context_parallel(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    stages = pipeline_step.rank_stages(plan.pipeline, plan.pipeline_rank)  # the other stages' blocks are remote
    part = ContextParallelPlan(plan.context_parallel, plan.context_parallel_loss)
    applying.context_parallel = context_parallel_step.apply_context_parallel(root, part, applying.meshes, stages)


def _context_parallel_around_step(applying: Applying) -> StepContext | None:
    runtime = applying.context_parallel
    return None if runtime is None else partial(context_parallel_step.around_step, runtime)


def _plan_activation_checkpointing(planning: Planning) -> Mapping[str, Any]:
    part = planning.facts.checkpointing  # found with the facts: context parallelism checks it cuts no block
    return {"activation_checkpointing": list(part.modules), "activation_checkpointing_policy": part.policy}


def _activation_checkpointing(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    context = applying.context_parallel
    part = activation_checkpointing_step.ActivationCheckpointingPlan(
        plan.activation_checkpointing, plan.activation_checkpointing_policy
    )
    activation_checkpointing_step.apply_activation_checkpointing(
        root, part, context.checkpoint_contexts if context is not None else None
    )


def _plan_compile(planning: Planning) -> Mapping[str, Any]:
    facts = planning.facts
    return {"compile_units": compile_units(planning.module, facts.shard_units, facts.blocks, facts.roots or None)}


def _compile(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if applying.compile_options is not None:
        apply_compile(root, plan.compile_units, applying.compile_options)
        if applying.meshes.dims.tensor_parallel > 1:
            wait_before_compiled_units(root, plan.compile_units)


def _plan_data_parallel(planning: Planning) -> Mapping[str, Any]:
    """The wrapper's units and settings; under DDP (no tensor parallelism) each tied parameter must sit inside one
    of its units, and the modules left unsynchronised (`ignored_modules`) are resolved."""
    module, dims, options, facts = planning.module, planning.dims, planning.options, planning.facts
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


def _plan_materialize(planning: Planning) -> Mapping[str, Any]:
    """A meta-device model is refused here if a module's parameters could not be initialised shard by shard (an
    adopted model was built by the user's own `configure_model`)."""
    if not planning.facts.adopted:
        check_initialisable(planning.module)
    return {}


def _materialize(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    """Each rank allocates and initialises only its own shards (see `lightning_dpar.parallel.materialize`); the dry
    run leaves meta tensors on the meta device."""
    if applying.materialize:
        materialize_meta_tensors(root, applying.meshes.device, plan.tied)


#: The steps, in the order they apply (torchtitan's: a model is split into stages first, its Linear layers are
#: converted to float8, each stage's modules are tensor- and expert-parallelised, then wrapped for recomputation and
#: compiled, and the data-parallel wrapper goes around all of it; shards are allocated last, once every layout is
#: known). A new step goes at its place here.
STEPS: tuple[Step, ...] = (
    Step("pipeline split", _plan_pipeline_split, _pipeline_split),
    Step("float8", _plan_float8, _float8),
    Step("tensor parallel", _plan_tensor_parallel, _tensor_parallel),
    Step(
        "loss parallel",
        _plan_loss_parallel,
        _loss_parallel,
        _loss_parallel_around_step,
        _loss_parallel_around_backward,
        _loss_parallel_step_output,
    ),
    Step("expert parallel", _plan_expert_parallel, _expert_parallel),
    Step("context parallel", _plan_context_parallel, _context_parallel, _context_parallel_around_step),
    Step("activation checkpointing", _plan_activation_checkpointing, _activation_checkpointing),
    Step("compile", _plan_compile, _compile),
    Step("data parallel", _plan_data_parallel, _data_parallel),
    Step("materialise", _plan_materialize, _materialize),
)


def plan_modules(module: nn.Module, dims: ParallelDims, options: PlanOptions, rank: int = 0) -> ModulePlan:
    """What will be applied to which submodule of `module` on a world of `dims`, as seen by global rank `rank` (it
    matters only with pipeline parallelism, where each rank holds other stages): the model's facts, then each of
    `STEPS`' slices in order; with pipelining, restricted to `rank`'s stages (`local_plan`).

    Pure (no process group): a plan that does not fit the model (a pattern matching nothing, a tensor-parallel size
    that does not divide a sharded dimension or head count, a split leaving a stage empty) fails the same way on
    every rank and in the `plan` dry run.
    """
    facts = model_facts(module, dims, options)
    planning = Planning(module, dims, options, facts)
    for step in STEPS:
        planning.slices.update(step.plan(planning))
    whole = ModulePlan(tied=facts.tied, adopted=facts.adopted, **planning.slices)
    if whole.pipeline is None:
        return whole
    return local_plan(whole, whole.pipeline, pipeline_rank=rank // (dims.world_size // dims.pipeline))


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
    backward = [step.around_backward(applying) for step in STEPS if step.around_backward is not None]
    outputs = [step.step_output(applying) for step in STEPS if step.step_output is not None]
    return AppliedPlan(
        plan,
        root,
        applying.grad_sync_modules,
        fsdp_modules,
        applying.pipeline,
        applying.context_parallel,
        tuple(context for context in contexts if context is not None),
        tuple(context for context in backward if context is not None),
        tuple(output for output in outputs if output is not None),
    )


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
