"""A LightningModule split into this rank's pipeline stages, run through the user's own step methods.

Every stage runs the LightningModule's unchanged `training_step` (or `validation_step`, ...) on its microbatch:

- the units of other stages are replaced by `RemoteUnit`s, which hold no parameters, so the stage's state dict has
  exactly the unsplit model's keys for its own parameters;
- the remote unit just before the stage returns the activation received from the previous stage;
- other remote units return zeros of the shapes their stage recorded, so code between units that only looks at
  shapes (causal masks, position ids, rotary embeddings: modules without parameters run on every stage) behaves as in
  the unsplit model;
- on every stage but the last, the step ends right after the stage's last unit (`StageStop`, raised by a hook on
  that unit) and that unit's output is what is sent on. The last stage runs the step to its end: the loss.

Values flow between stages only through the boundary unit's output; a model whose later units read a tensor computed
by an earlier stage's unit (other than through that output) cannot be split there (see `docs/pipeline.md`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.pipeline.values import ValueSpec, describe, fabricate, rebuild, tensors

__all__ = ["PipelinedModel", "RemoteUnit", "StageModule", "StageStop", "split_into_stages"]


class StageStop(BaseException):
    """Ends a step method after the stage's last unit. A `BaseException`, so a user's `except Exception` around the
    forward does not swallow it."""

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage finished")
        self.output = output


@dataclass
class _Run:
    stage: int
    received: Any
    boundary_unit: str | None
    stop_unit: str | None
    called: set[str] = field(default_factory=set)


class RemoteUnit(nn.Module):
    """Stands in for a unit that runs on another stage (or on another of this rank's stages)."""

    def __init__(self, fqn: str, stage: int, model: PipelinedModel) -> None:
        super().__init__()
        self.fqn, self.stage = fqn, stage
        object.__setattr__(self, "_pipelined_model", model)  # not a submodule: it is not part of the state dict

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._pipelined_model.remote_output(self.fqn, self.stage)

    def extra_repr(self) -> str:
        return f"{self.fqn!r} on pipeline stage {self.stage}"


class StageModule(nn.Module):
    """The module torch's `PipelineStage` runs for one stage: it holds the stage's units (so `parameters()` and the
    FSDP root over them are exactly the stage's) and runs the step method with the other stages' units remote."""

    def __init__(self, stage: int, units: Sequence[nn.Module], model: PipelinedModel) -> None:
        super().__init__()
        self.stage = stage
        self.units = nn.ModuleList(units)
        object.__setattr__(self, "_pipelined_model", model)

    def forward(self, *received: torch.Tensor, batch: Any, step_args: tuple[Any, ...] = ()) -> Any:
        return self._pipelined_model.run_stage(self.stage, received, batch, step_args)


def _parent_and_name(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent, _, name = fqn.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


class PipelinedModel:
    """This rank's view of a LightningModule split into pipeline stages (see the module docstring)."""

    def __init__(self, root: nn.Module, split: PipelineSplit, pipeline_rank: int, device: torch.device) -> None:
        self.root, self.split, self.pipeline_rank, self.device = root, split, pipeline_rank, device
        self.local_stages = split.stages_of_rank(pipeline_rank)
        #: Per input shape: every unit's output spec (recorded by the unit's own stage, for the zeros of remote
        #: units), and what each stage receives and sends. `select_shapes` picks the current one.
        self._shape_tables: dict[Any, tuple[dict[str, ValueSpec], dict[int, ValueSpec], dict[int, ValueSpec]]] = {}
        self.unit_outputs: dict[str, ValueSpec] = {}
        self.input_specs: dict[int, ValueSpec] = {}
        self.output_specs: dict[int, ValueSpec] = {}
        #: The step method each stage runs (`use_step`, before a schedule or forward pass).
        self._step: Callable[..., Any] | None = None
        self._run: _Run | None = None
        self.stages: dict[int, StageModule] = {}
        self._remote_twins: dict[str, RemoteUnit] = {}
        self._local_units: dict[str, nn.Module] = {}

    # ------------------------------------------------------------------ building
    def replace_remote_units(self) -> None:
        """Swap every unit of another rank's stages for a `RemoteUnit` and build this rank's `StageModule`s."""
        for stage, units in enumerate(self.split.stages):
            for fqn in units:
                remote = RemoteUnit(fqn, stage, self)
                parent, name = _parent_and_name(self.root, fqn)
                if stage in self.local_stages:
                    self._local_units[fqn] = parent.get_submodule(name)
                    self._remote_twins[fqn] = remote
                else:
                    setattr(parent, name, remote)  # the real unit (and its memory) is dropped here
        for stage in self.local_stages:
            self.stages[stage] = StageModule(stage, [self._local_units[f] for f in self.split.stages[stage]], self)

    def install_unit_hooks(self) -> None:
        """Hooks that record each local unit's output spec and end a stage after its last unit. Installed after the
        data-parallel wrapper, so they run after its own forward hooks (FSDP's post-forward must see the output)."""
        for fqn, unit in self._local_units.items():
            unit.register_forward_hook(self._after_unit_hook(fqn))

    def _after_unit_hook(self, fqn: str) -> Callable[..., None]:
        @torch.compiler.disable  # runs eagerly: it raises, and reads this object's state
        def after_unit(module: nn.Module, args: Any, output: Any) -> None:
            run = self._run
            if run is None:
                return
            self._count_call(run, fqn)
            if fqn not in self.unit_outputs:
                self.unit_outputs[fqn] = describe(output, f"Pipeline unit {fqn!r}")
            if fqn == run.stop_unit:
                raise StageStop(output)

        return after_unit

    @property
    def remote_units(self) -> list[str]:
        """The units other pipeline ranks hold (their parameters are not in this rank's state dict)."""
        return [fqn for stage, units in enumerate(self.split.stages) if stage not in self.local_stages for fqn in units]

    # ------------------------------------------------------------------ running
    def use_step(self, step: Callable[..., Any]) -> None:
        """Run `step` (the LightningModule's `training_step`, `validation_step`, ...) on every stage from now on."""
        self._step = step

    def adopt_received_specs(self, stage: int, received: ValueSpec, unit_outputs: dict[str, ValueSpec]) -> None:
        """Take what the previous stage sent with its boundary output in a forward-only pass: the spec of what
        `stage` receives, and the output specs of the units run so far (for the zeros of remote units)."""
        self.input_specs[stage] = received
        self.unit_outputs.update(unit_outputs)

    def select_shapes(self, key: Any) -> bool:
        """Use the recorded specs for inputs of shape `key`; returns whether they are new (still to be recorded)."""
        is_new = key not in self._shape_tables
        if is_new:
            self._shape_tables[key] = ({}, {}, {})
        self.unit_outputs, self.input_specs, self.output_specs = self._shape_tables[key]
        return is_new

    @property
    def num_stages(self) -> int:
        return self.split.num_stages

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages - 1

    def run_stage(
        self, stage: int, received: Sequence[torch.Tensor], batch: Any, step_args: tuple[Any, ...] = ()
    ) -> Any:
        """Run the step method on `batch` (and `step_args`, e.g. `batch_idx`) as stage `stage`: the step's own output
        on the last stage, otherwise the tensors of the stage's boundary output."""
        assert self._step is not None, "the runtime sets the step method (`use_step`) before running stages"
        value = rebuild(self.input_specs[stage], iter(received)) if stage > 0 else None
        run = _Run(
            stage=stage,
            received=value,
            boundary_unit=self.split.stages[stage - 1][-1] if stage > 0 else None,
            stop_unit=None if self.is_last(stage) else self.split.stages[stage][-1],
        )
        with self._only_units_of(stage):
            self._run = run
            try:
                output = self._step(batch, *step_args)
            except StageStop as stop:
                if stage not in self.output_specs:
                    self.output_specs[stage] = describe(stop.output, f"Pipeline unit {run.stop_unit!r}")
                return tuple(tensors(stop.output))
            finally:
                self._run = None
        if run.stop_unit is not None:
            raise RuntimeError(
                f"The step ended on pipeline stage {stage} without running {run.stop_unit!r}, the stage's last unit."
                " Stages are cut in the order the units are registered; if the forward calls them in another order,"
                " give it with `pipeline_call_order`."
            )
        return output

    def remote_output(self, fqn: str, stage: int) -> Any:
        """What a remote unit returns: the received activation at the boundary, zeros of the right shape before it."""
        run = self._run
        if run is None:
            raise RuntimeError(
                f"{fqn!r} runs on pipeline stage {stage}, another stage than this rank's; under pipeline parallelism"
                " call the model only inside the step methods the Trainer runs."
            )
        self._count_call(run, fqn)
        if fqn == run.boundary_unit:
            return run.received
        if stage > run.stage:
            raise RuntimeError(
                f"Pipeline stage {run.stage} called {fqn!r} of the later stage {stage} before finishing its own units"
                f" (last: {run.stop_unit!r}). The forward must call units in registration order."
            )
        spec = self.unit_outputs.get(fqn)
        if spec is None:
            raise RuntimeError(
                f"Pipeline stage {run.stage} called {fqn!r} (stage {stage}), which its own stage never called before"
                " finishing. Stages are cut in the order the units are registered, and the model calls them in"
                f" another order ({fqn!r} runs later than it is registered, e.g. a head registered before the"
                " blocks), or skips it. Give the order with `pipeline_call_order` (LitGPT: ['transformer',"
                " 'lm_head']), or register the modules in the order the forward calls them."
            )
        return fabricate(spec, self.device)

    @staticmethod
    def _count_call(run: _Run, fqn: str) -> None:
        """A unit runs once per step: a second call (a reused layer, `generate()` in a step) would see the stage's
        received activation or stop the stage again, silently computing something else than the unsplit model."""
        if fqn in run.called:
            raise RuntimeError(
                f"Pipeline unit {fqn!r} was called twice in one step on stage {run.stage}. Under pipeline parallelism"
                " each unit runs once per step (the stages are cut between units): do not reuse a layer, and do not"
                " generate token by token inside a step."
            )
        run.called.add(fqn)

    @contextmanager
    def _only_units_of(self, stage: int) -> Iterator[None]:
        """While `stage` runs, this rank's units of its other stages act as remote units."""
        swapped = [fqn for other in self.local_stages if other != stage for fqn in self.split.stages[other]]
        for fqn in swapped:
            parent, name = _parent_and_name(self.root, fqn)
            setattr(parent, name, self._remote_twins[fqn])
        try:
            yield
        finally:
            for fqn in swapped:
                parent, name = _parent_and_name(self.root, fqn)
                setattr(parent, name, self._local_units[fqn])


def split_into_stages(
    root: nn.Module, split: PipelineSplit, pipeline_rank: int, device: torch.device
) -> PipelinedModel:
    """Keep this rank's stages of `root` in place (same names) and replace every other unit by a `RemoteUnit`."""
    model = PipelinedModel(root, split, pipeline_rank, device)
    model.replace_remote_units()
    return model
