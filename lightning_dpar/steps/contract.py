"""The contract every step of the parallelisation keeps: a `Step` is its slice of the plan (`Step.plan`), how that
slice is applied (`Step.apply`), and, if it has them, what it does around each training step (`around_step`,
`around_backward`, `step_output`) or, for a step that takes the training step over (the pipeline's schedule runs
forward, loss and backward itself), the runner of each step (`Step.runner`). Each feature's folder exports its `Step`
as `STEP` from its `step.py`;
`lightning_dpar.parallel.parallelize.STEPS` lists them in order and walks them.

This module sits low in the layers (just above `parallel_dims`) so that every feature folder can import it; it
imports nothing from the plan or any feature. What a step reads of the strategy's options, of the model's facts and
of the plan, it declares itself (a `typing.Protocol` in its folder, which the real `PlanOptions`, `ModelFacts` and
`ModulePlan` satisfy). What one step hands a later one goes through `Applying.results`, keyed by the step's name,
read through typed accessors in the producing feature's folder (`pipeline.step.pipelined`, ...)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes

__all__ = [
    "Applying",
    "BackwardContext",
    "MixedPrecision",
    "Planning",
    "Running",
    "Step",
    "StepContext",
    "StepOutput",
    "StepRunner",
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
#: A unit's mixed-precision policy, given whether it is a top-level unit (the strategy's precision plugin's).
MixedPrecision = Callable[[bool], MixedPrecisionPolicy]


@dataclass
class Planning:
    """What the walk over the steps carries while it makes the plan: its inputs (the model, the mesh sizes, the
    strategy's frozen `PlanOptions`, the model's facts found once before any step plans) and the slices made so far
    (`ModulePlan` fields by name), which later steps may read (context parallelism reads the pipeline split).

    `options` and `facts` are typed by what reads them: each step declares the fields it reads."""

    module: nn.Module
    dims: ParallelDims
    options: Any
    facts: Any
    slices: dict[str, Any] = field(default_factory=dict)


@dataclass
class Applying:
    """What the walk over the steps carries while it applies the plan: its inputs (the meshes, whether meta tensors
    are materialised, the `compile` options, the mixed-precision policy) and what each step applied so far returned
    (`results`, by step name: the pipeline stages, the context-parallel hooks, the modules whose gradient sync the
    strategy controls), which later steps read through the producing step's accessor."""

    meshes: ParallelMeshes
    materialize: bool = True
    compile_options: Mapping[str, Any] | None = None
    mixed_precision: MixedPrecision = field(default=lambda top_level: MixedPrecisionPolicy())
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Running:
    """What a step that takes the training step over is given, once the plan is applied, to build its runner: the
    parallelised model, the strategy's frozen `PlanOptions`, its meshes and device, its precision plugin (whose
    context each step runs in) and its checkpoint manager. Typed by what the step reads of them, as `Planning`."""

    module: nn.Module
    options: Any
    meshes: ParallelMeshes
    device: torch.device
    precision: Any
    checkpoints: Any


class StepRunner(Protocol):
    """Lightning's step hooks as a step that takes them over runs them (the pipeline's schedule): the strategy's
    `training_step`, `backward`, evaluation steps and training-loader check call these instead of Lightning's."""

    def training_step(self, args: tuple[Any, ...], accumulate: int) -> Tensor:
        """The whole training step (forward, loss, backward) over `args` (the batch first); the loss on every rank."""
        ...

    def backward(self, strategy: Any, closure_loss: Tensor) -> Tensor:
        """Lightning's backward, between the strategy's hooks around it, of a step `training_step` already ran."""
        ...

    def eval_step(self, step_name: str, args: tuple[Any, ...]) -> Any:
        """`validation_step`, `test_step` or `predict_step` over `args`."""
        ...

    def check_batches(self, dataloader: object) -> None:
        """Refuse a training loader whose batches this runner cannot run, before training."""
        ...


@dataclass(frozen=True)
class Step:
    """One step of the parallelisation: its `name`; its slice of the plan (`plan(planning)`: the `ModulePlan`
    fields it owns, refusing what it cannot apply before any collective); how it applies that slice
    (`apply(root, plan, applying)`: reading its slice, its meshes and earlier steps' results; what it returns is its
    result, `applying.results[name]`); and, if it has one, given its result: what it does around each training or
    evaluation step's forward (`around_step(result)`: its `StepContext`, or `None` where this run needs none, so a
    step costs nothing per step where it does nothing), around each training step's backward
    (`around_backward(result)`: its `BackwardContext`, or `None`), and what it makes of each training step's output
    (`step_output(result)`: its `StepOutput`, or `None`); or, for a step that takes the training step over, its
    runner (`runner(result, running)`: a `StepRunner`, or `None` where this run does not need one; at most one step
    of a run has one)."""

    name: str
    plan: Callable[[Planning], Mapping[str, Any]]
    apply: Callable[[nn.Module, Any, Applying], Any]
    around_step: Callable[[Any], StepContext | None] | None = None
    around_backward: Callable[[Any], BackwardContext | None] | None = None
    step_output: Callable[[Any], StepOutput | None] | None = None
    runner: Callable[[Any, Running], StepRunner | None] | None = None
