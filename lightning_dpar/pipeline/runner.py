"""The pipeline split step's runner (a `StepRunner`, built by `lightning_dpar.pipeline.step.pipeline_runner`):
with pipeline parallelism the schedule takes Lightning's step hooks over. A strategy's `training_step` runs one
schedule step over the batch's microbatches (forward and backward), `backward` adds the gradients that step kept
aside, between the hooks around backward, and the evaluation steps run forward-only schedules, each in the precision
plugin's context for that step. The schedule itself is driven by `lightning_dpar.pipeline.runtime`."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dpar.pipeline.runtime import PipelineRuntime

__all__ = ["CheckpointsRead", "PipelineSteps", "PrecisionRead"]


@runtime_checkable
class PrecisionRead(Protocol):
    """What the runner uses of the strategy's precision plugin (`DparPrecision`): the context of each kind of step,
    and gradient norms summed over the stages."""

    def train_step_context(self) -> AbstractContextManager[Any]: ...

    def val_step_context(self) -> AbstractContextManager[Any]: ...

    def test_step_context(self) -> AbstractContextManager[Any]: ...

    def predict_step_context(self) -> AbstractContextManager[Any]: ...

    def reduce_norms_across(self, group: dist.ProcessGroup, device: torch.device) -> None: ...


@runtime_checkable
class CheckpointsRead(Protocol):
    """What it tells the checkpoint manager (`CheckpointManager`): the units other stages hold."""

    def hold_pipeline_stages(self, keys_held_elsewhere: Any, pipeline_group: dist.ProcessGroup) -> None: ...


class PipelineSteps:
    """The step hooks of a strategy whose model is split into pipeline stages (`runtime`), each run in `precision`'s
    context for that step."""

    def __init__(self, runtime: PipelineRuntime, precision: PrecisionRead) -> None:
        self.runtime = runtime
        self.precision = precision

    def training_step(self, args: tuple[Any, ...], accumulate: int) -> Tensor:
        """One schedule step over the batch's microbatches, forward and backward; the loss on every rank."""
        batch, *step_args = args
        with self.precision.train_step_context():
            return self.runtime.train_step(batch, tuple(step_args), accumulate)

    def backward(self, strategy: Any, closure_loss: Tensor) -> Tensor:
        """The schedule already ran every microbatch's backward inside `training_step`; its gradients are added
        here, between the hooks around backward, as Lightning's backward would (`strategy`: Lightning's
        `Strategy`, whose hooks and precision plugin run around it)."""
        module = strategy.lightning_module
        assert module is not None
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        self.runtime.add_step_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def eval_step(self, step_name: str, args: tuple[Any, ...]) -> Any:
        """`validation_step`, `test_step` or `predict_step` through a forward-only schedule."""
        contexts = {
            "validation_step": self.precision.val_step_context,
            "test_step": self.precision.test_step_context,
            "predict_step": self.precision.predict_step_context,
        }
        with contexts[step_name]():
            return self.runtime.eval_step(step_name, args[0], tuple(args[1:]))

    def check_batches(self, dataloader: object) -> None:
        """Refuse a training loader whose batches cannot be split into the schedule's microbatches, before training."""
        self.runtime.check_batches(dataloader)
