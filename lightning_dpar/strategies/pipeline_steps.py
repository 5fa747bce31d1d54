"""Lightning's step hooks routed through the pipeline schedule: with pipeline parallelism a strategy's
`training_step` runs one schedule step over the batch's microbatches (forward and backward), `backward` adds the
gradients that step kept aside between the hooks around backward, and the evaluation steps run forward-only
schedules. Each runs in the precision plugin's context for that step. The schedule itself is driven by
`lightning_dpar.pipeline.runtime`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_dpar.optim.precision import DparPrecision
from lightning_dpar.pipeline.runtime import PipelineRuntime

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = ["PipelineSteps"]


class PipelineSteps:
    """The step hooks of a strategy whose model is split into pipeline stages (`runtime`)."""

    def __init__(self, runtime: PipelineRuntime) -> None:
        self.runtime = runtime

    def training_step(self, precision: DparPrecision, args: tuple[Any, ...], accumulate: int) -> Tensor:
        """One schedule step over the batch's microbatches, forward and backward; the loss on every rank."""
        batch, *step_args = args
        with precision.train_step_context():
            return self.runtime.train_step(batch, tuple(step_args), accumulate)

    def backward(self, strategy: Strategy, closure_loss: Tensor) -> Tensor:
        """The schedule already ran every microbatch's backward inside `training_step`; its gradients are added
        here, between the hooks around backward, as Lightning's backward would."""
        module = strategy.lightning_module
        assert module is not None
        strategy.pre_backward(closure_loss)
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        self.runtime.add_step_gradients()
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def eval_step(self, precision: DparPrecision, step_name: str, args: tuple[Any, ...]) -> Any:
        """`validation_step`, `test_step` or `predict_step` through a forward-only schedule."""
        contexts = {
            "validation_step": precision.val_step_context,
            "test_step": precision.test_step_context,
            "predict_step": precision.predict_step_context,
        }
        with contexts[step_name]():
            return self.runtime.eval_step(step_name, args[0], tuple(args[1:]))

    def check_batches(self, dataloader: object) -> None:
        """Refuse a training loader whose batches cannot be split into the schedule's microbatches, before training."""
        self.runtime.check_batches(dataloader)
