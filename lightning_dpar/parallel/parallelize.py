"""The parallelisation as data: `STEPS`, the ordered list of steps, and the two walks over it: `plan_modules`, which
asks each step for its slice of the plan (made once from the model, the mesh sizes, the strategy's frozen
`PlanOptions` and the model's facts, `lightning_dpar.parallel.facts`), and `apply_plan`, which applies each slice.
Training, the `plan` dry run and the layout search all go through both.

The order is torchtitan's: pipeline split -> float8 (torchao's `Float8Linear` swapped in before any module is
sharded) -> tensor parallel -> loss parallel (the output layer's logits kept sharded; torchtitan folds it into its
output layer's style) -> expert parallel -> context parallel -> activation checkpointing -> compile -> data parallel
(`fully_shard` or `replicate`) -> materialise. The context-parallel hooks come before activation checkpointing,
which gets their `context_fn`: a recomputed block's attention must be context-parallel again.

Every step keeps the contract of `lightning_dpar.steps.contract.Step`: its slice of the plan, how it is applied, and
what it does around each step. A feature's step is exported by its own folder (`STEP` in `pipeline/step.py`,
`float8/step.py`, `loss_parallel/step.py`, `experts/step.py`, `context_parallel/step.py`,
`activation_checkpointing/step.py`), next to its plan and apply code; of the steps that belong to no feature, the
data-parallel step is `parallel/data_parallel.py`'s, next to its wrappers, and tensor parallel, compile and
materialise are bound here, to the plan's and this folder's code. A new feature is one more folder and one more
`Step` at its place in `STEPS` (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightning_dpar._private_api import waited
from lightning_dpar.activation_checkpointing import step as activation_checkpointing_step
from lightning_dpar.context_parallel import step as context_parallel_step
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.experts import step as experts_step
from lightning_dpar.float8 import step as float8_step
from lightning_dpar.loss_parallel import step as loss_parallel_step
from lightning_dpar.parallel import data_parallel
from lightning_dpar.parallel.facts import model_facts
from lightning_dpar.parallel.materialize import materialize_meta_tensors
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes
from lightning_dpar.pipeline import step as pipeline_step
from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.plan import ModulePlan, local_plan
from lightning_dpar.plan.compile import compile_units
from lightning_dpar.plan.initialisers import check_initialisable
from lightning_dpar.plan.planner import PlanOptions, plan_tensor_parallel
from lightning_dpar.plan.ties import TiedGroup, check_tied_layouts, retie
from lightning_dpar.steps.contract import (
    Applying,
    BackwardContext,
    MixedPrecision,
    Planning,
    Running,
    Step,
    StepContext,
    StepOutput,
    StepRunner,
)

__all__ = [
    "STEPS",
    "AppliedPlan",
    "apply_compile",
    "apply_plan",
    "apply_tensor_parallel",
    "plan_modules",
    "wait_before_compiled_units",
]


@dataclass(frozen=True)
class AppliedPlan:
    """What applying `plan` to `module` produced: the modules whose gradient sync the strategy controls (`no_sync`),
    every FSDP unit (resharded between steps), each step's result (`results`, by step name: with pipeline
    parallelism this rank's stages, `pipeline`; with context parallelism the hooks that split each sequence,
    `context_parallel`), and what the steps do around each training step (`around_step`, `around_backward`,
    `step_output`)."""

    plan: ModulePlan
    module: nn.Module
    grad_sync_modules: list[nn.Module]
    fsdp_modules: list[FSDPModule]
    results: Mapping[str, Any] = field(default_factory=dict)

    step_contexts: tuple[StepContext, ...] = ()
    backward_contexts: tuple[BackwardContext, ...] = ()
    output_steps: tuple[StepOutput, ...] = ()

    @property
    def pipeline(self) -> PipelinedModel | None:
        """This rank's pipeline stages (the pipeline split step's result); `None` without pipelining."""
        return pipeline_step.pipelined(self.results)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The context-parallel hooks (the context-parallel step's result); `None` without context parallelism."""
        return context_parallel_step.runtime_of(self.results)

    def step_runner(self, running: Running) -> StepRunner | None:
        """The runner of the step that takes this run's training step over (the pipeline's schedule); `None` where
        Lightning's own step hooks run. Built once, after the plan is applied."""
        runners = [step.runner(self.results[step.name], running) for step in STEPS if step.runner is not None]
        taking_over = [runner for runner in runners if runner is not None]
        assert len(taking_over) <= 1, "at most one step of a run takes the training step over"
        return taking_over[0] if taking_over else None

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
        return _each_entered([partial(around, training, args) for around in self.step_contexts])

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
        for enter in contexts:
            stack.enter_context(enter())
        yield


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


def _plan_compile(planning: Planning) -> Mapping[str, Any]:
    facts = planning.facts
    return {"compile_units": compile_units(planning.module, facts.shard_units, facts.blocks, facts.roots or None)}


def _compile(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if applying.compile_options is not None:
        apply_compile(root, plan.compile_units, applying.compile_options)
        if applying.meshes.dims.tensor_parallel > 1:
            wait_before_compiled_units(root, plan.compile_units)


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
    pipeline_step.STEP,
    float8_step.STEP,
    Step("tensor parallel", _plan_tensor_parallel, _tensor_parallel),
    loss_parallel_step.STEP,
    experts_step.STEP,
    context_parallel_step.STEP,
    activation_checkpointing_step.STEP,
    Step("compile", _plan_compile, _compile),
    data_parallel.STEP,
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
    results = applying.results
    for step in STEPS:
        results[step.name] = step.apply(root, plan, applying)
    fsdp_modules = [module for module in root.modules() if isinstance(module, FSDPModule)]
    contexts = [step.around_step(results[step.name]) for step in STEPS if step.around_step is not None]
    backward = [step.around_backward(results[step.name]) for step in STEPS if step.around_backward is not None]
    outputs = [step.step_output(results[step.name]) for step in STEPS if step.step_output is not None]
    return AppliedPlan(
        plan,
        root,
        results[data_parallel.STEP.name],
        fsdp_modules,
        results,
        tuple(around for around in contexts if around is not None),
        tuple(around for around in backward if around is not None),
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
