"""Lightning's step hooks, as one mixin of `DparStrategy`: the training, validation, test and predict steps (with DDP's
buffer broadcast around each forward, and the last step's gradients released before it), backward, the optimizer step
(FSDP units resharded after it), the switch that skips gradient sync during accumulation, and building the optimizers.
Where a step of the parallelisation takes the training step over (the pipeline's schedule: `Step.runner`), the steps
and backward go through its runner instead of Lightning's own."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar.agreement import first_problem
from lightning_dpar.conformance.buffers import BufferSync
from lightning_dpar.conformance.callback_checks import optimizer_problem
from lightning_dpar.experts.router_loss import GlobalRouterLoss
from lightning_dpar.helpers import attached_trainer, key_value_cache_configs, without_key_value_cache
from lightning_dpar.optim.nonfinite import SKIPPED_METRIC, NonFiniteGuard, parameter_names
from lightning_dpar.parallel import data_parallel, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dpar.steps.contract import StepRunner

__all__ = ["StepHooks"]


class StepHooks(ParallelStrategy):
    """The step hooks of `DparStrategy`, which sets the state they read (in `setup`)."""

    #: The runner of the step that takes the training step over (the pipeline's schedule), or None.
    _runner: StepRunner | None
    #: DDP's buffer broadcast (`lightning_dpar.conformance.buffers`).
    _buffer_sync: BufferSync | None
    #: The load-balancing loss of transformers MoE models over the global batch (`lightning_dpar.experts.router_loss`).
    _router_loss: GlobalRouterLoss | None
    #: What applying the plan produced: every FSDP unit (resharded between steps, `optimizer_step`) and the modules
    #: whose gradient all-reduce / reduce-scatter `block_backward_sync` switches off.
    applied: parallelize.AppliedPlan | None
    _backward_sync_blocked: bool
    #: The non-finite step guard (`lightning_dpar.optim.nonfinite`); None with `on_nonfinite="off"`.
    nonfinite: NonFiniteGuard | None

    @property
    def _fsdp_units(self) -> list[FSDPModule]:
        return self.applied.fsdp_modules if self.applied is not None else []

    @property
    def _grad_sync_modules(self) -> list[nn.Module]:
        return self.applied.grad_sync_modules if self.applied is not None else []

    #: The configs of transformers models that build a key/value cache in every forward (`use_cache`).
    _cache_configs: tuple[Any, ...] = ()
    #: Whether each accumulation window's first forward starts with the last step's gradients released
    #: (`_release_last_gradients`); decided on the first training step after each `setup`.
    _releases_gradients: bool | None = None

    def _prepare_step_forward(self, module: nn.Module) -> None:
        """What runs around each step's forward (`_step_forward`), made once the model is parallelised: DDP's buffer
        broadcast, and the global-batch router loss of a transformers MoE model."""
        self._buffer_sync = BufferSync(module, self.data_parallel_group)
        router_loss = GlobalRouterLoss(module, self.data_parallel_group)
        self._router_loss = router_loss if router_loss.applies else None
        self._releases_gradients = None
        self._cache_configs = key_value_cache_configs(module)

    def _release_last_gradients(self) -> None:
        """Free the last optimizer step's gradients before the forward of an accumulation window's first batch.

        Lightning's automatic optimisation zeroes gradients between `training_step` and `backward`, so the previous
        step's gradients (a whole fp32 copy of the trainable shards) stay alive through the forward, on top of its
        activations: the peak of a step is higher than a hand-written loop's (`zero_grad` after `step`) by up to
        the gradients' size. Lightning's own zeroing, moments later, calls the same `optimizer.zero_grad()` on
        the same window, so releasing them before the forward changes no value; it is done only where nothing can
        tell the difference: automatic optimisation, and neither `optimizer_zero_grad` nor `on_before_zero_grad`
        overridden by the LightningModule or a callback (a hook of those names would see the gradients gone).
        Hooks between the step and the next batch's forward (`on_train_batch_end`, checkpoints, validation,
        `on_train_batch_start`) still see them."""
        module = self.lightning_module
        trainer = attached_trainer(module)
        if trainer is None or module is None:
            return
        if self._releases_gradients is None:
            self._releases_gradients = _zeroing_is_lightnings_own(module, trainer.callbacks)
        if self._releases_gradients and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0:
            for optimizer in self.optimizers:
                optimizer.zero_grad()

    @contextmanager
    def _step_forward(self, training: bool, args: Sequence[Any] = ()) -> Generator[None, None, None]:
        """Around each step's forward, as DDP's wrapper does: rank 0's buffers are broadcast to the data-parallel peers
        first if a training forward ran since the last broadcast (`lightning_dpar.conformance.buffers`); a transformers
        MoE model's load-balancing loss covers the global batch (`lightning_dpar.experts.router_loss`); a training
        forward of a transformers model builds no key/value cache (`without_key_value_cache`); and what the
        parallelisation's steps do around each step (`AppliedPlan.around_step`: with context parallelism, each
        sequence split across the context-parallel ranks)."""
        if self._buffer_sync is not None:
            self._buffer_sync.before_forward()
        steps = self.applied if self.applied is not None and self.applied.step_contexts else None
        with (
            steps.around_step(training, args) if steps is not None else nullcontext(),
            self._router_loss.active() if self._router_loss is not None else nullcontext(),
            without_key_value_cache(self._cache_configs) if training and self._cache_configs else nullcontext(),
        ):
            yield
        if self._buffer_sync is not None:
            module = self.lightning_module
            # Under manual optimisation Lightning's DDP switches its gradient sync off around the step's forward
            # (`_DDPForwardRedirection`), so that forward does not mark buffers for the next broadcast either.
            manual = module is not None and not module.automatic_optimization
            synced = training and torch.is_grad_enabled() and not self._backward_sync_blocked and not manual
            self._buffer_sync.after_forward(synced)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The output as the parallelisation's steps hand it on (`AppliedPlan.step_output`: with loss parallel, the
        loss as a plain tensor). Where a step takes the training step over, its runner's (with pipeline parallelism:
        one schedule step over the batch's microbatches, forward and backward); returns the loss on every rank."""
        self._release_last_gradients()
        with self._step_forward(training=True, args=args):
            if self._runner is None:
                output = super().training_step(*args, **kwargs)
                steps = self.applied
                return steps.step_output(output) if steps is not None and steps.output_steps else output
            trainer = attached_trainer(self.lightning_module)
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
            return self._runner.training_step(args, accumulate)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The step, checked for NaN and Inf first (`lightning_dpar.optim.nonfinite`), then every FSDP unit's
        parameters sharded again: a root, or a unit no backward went through (all its parameters frozen), keeps them
        unsharded, and callbacks between steps must see the shards (`data_parallel.reshard`)."""
        step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        output = step(closure) if self.nonfinite is None else self._checked_step(step, closure, optimizer)
        data_parallel.reshard(self._fsdp_units)
        return output

    def _checked_step(self, step: Callable[[Callable[[], Any]], Any], closure: Callable[[], Any], opt: Any) -> Any:
        """`step(closure)` through the non-finite guard: its verdict comes from gradient-norm clipping when that runs
        (Lightning's own `configure_gradient_clipping`, by norm), else right after the closure; under `"skip"` the
        count of skipped steps is logged."""
        guard, module = self.nonfinite, self.lightning_module
        assert guard is not None and module is not None
        trainer = attached_trainer(module)
        clip = trainer.gradient_clip_val if trainer is not None else None
        deferred = (
            trainer is not None
            and module.automatic_optimization
            and clip is not None
            and float(clip) > 0
            and trainer.gradient_clip_algorithm in (None, "norm")
            and not is_overridden("configure_gradient_clipping", module)
        )
        output = guard.optimizer_step(
            step,
            closure,
            parameters=lambda: list(self.precision_plugin.main_params(opt)),
            names=lambda: parameter_names([module]),
            global_step=trainer.global_step if trainer is not None else -1,
            device=self.root_device,
            deferred=deferred,
        )
        if guard.mode == "skip" and trainer is not None:
            module.log(SKIPPED_METRIC, float(guard.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """What the parallelisation's steps do around backward (`AppliedPlan.around_backward`: with loss parallel,
        torch's `loss_parallel()`, which the backward of a vocabulary-parallel loss needs). Where a step's runner ran
        the training step (the pipeline's schedule ran every microbatch's backward inside `training_step`), the
        runner's, between the hooks around backward."""
        if self.nonfinite is not None:
            self.nonfinite.note_loss(closure_loss)
        if self._runner is None:
            steps = self.applied if self.applied is not None and self.applied.backward_contexts else None
            with steps.around_backward() if steps is not None else nullcontext():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self._runner.backward(self, closure_loss)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._runner is None:
                output = super().validation_step(*args, **kwargs)
                data_parallel.reshard(self._fsdp_units)  # see `optimizer_step`
                return output
            return self._runner.eval_step("validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._runner is None:
                return super().test_step(*args, **kwargs)
            return self._runner.eval_step("test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._runner is None:
                return super().predict_step(*args, **kwargs)
            return self._runner.eval_step("predict_step", args)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient all-reduce / reduce-scatter on non-final micro-batches of gradient accumulation."""
        for module in self._grad_sync_modules:
            module.set_requires_gradient_sync(False)
        self._backward_sync_blocked = True
        try:
            yield
        finally:
            self._backward_sync_blocked = False
            for module in self._grad_sync_modules:
                module.set_requires_gradient_sync(True)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's `configure_optimizers`; where a step's runner runs the training step (the pipeline's stages),
        an error on some ranks is raised on every rank (each stage builds its optimizer over its own parameters, so it
        can fail on one stage alone)."""
        if self._runner is None:
            return super().setup_optimizers(trainer)
        own_error: Exception | None = None
        try:
            super().setup_optimizers(trainer)
        except Exception as error:
            own_error = error
        problem = None
        if own_error is not None:
            problem = optimizer_problem(own_error, self.lightning_module, trainer.callbacks, self.global_rank)
        problem = first_problem(problem)
        if problem is not None:
            raise ValueError(problem) from own_error


def _zeroing_is_lightnings_own(module: LightningModule, callbacks: list[Callback]) -> bool:
    """Whether Lightning zeroes this module's gradients itself with its default `optimizer.zero_grad()` and no hook
    looks at them just before: automatic optimisation, no `optimizer_zero_grad` override, and no
    `on_before_zero_grad` on the module or any callback."""
    if not module.automatic_optimization:
        return False
    if _defines(module, "optimizer_zero_grad", LightningModule) or _defines(
        module, "on_before_zero_grad", LightningModule
    ):
        return False
    return not any(_defines(callback, "on_before_zero_grad", Callback) for callback in callbacks)


def _defines(instance: object, hook: str, base: type) -> bool:
    """Whether `instance` has its own `hook`, from its class or set on the instance (as `LambdaCallback` does with
    the hooks it is given, any callable)."""
    return hook in vars(instance) or getattr(type(instance), hook, None) is not getattr(base, hook)
