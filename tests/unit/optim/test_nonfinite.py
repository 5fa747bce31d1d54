"""The non-finite step guard (`lightning_dpar/optim/nonfinite.py`), in-process on a one-rank gloo group: the mode
refused by name, no false alarm on large finite gradients (with and without the clipping fold), the consecutive-skip
limit, and through real one-rank Trainers: `"skip"` equal to one process that skipped the step (optimizer step count
held, the learning-rate scheduler advanced as with fp16's GradScaler), once per optimizer step under gradient
accumulation, `"raise"` leaving the weights as before under manual optimisation, and `"raise"` bit-identical to
`"off"` when every value is finite. Multi-rank agreement: `tests/launched/test_nonfinite.py`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpar import FullyShardStrategy, ReplicateStrategy
from lightning_dpar.optim.clipping import GradientClipper
from lightning_dpar.optim.nonfinite import SKIPPED_METRIC, NonFiniteError, NonFiniteGuard
from tests.support.models import Net, ParityModule, RegressionData, global_batches, loader, make_optimizer
from tests.workers.common import BATCH, full_params, trainer_for

STEPS, BAD_STEP = 3, 1


def test_an_invalid_mode_is_refused_naming_it_the_valid_ones_and_the_fix():
    with pytest.raises(ValueError, match=r"`on_nonfinite='ignore'` is invalid: use 'raise' .* 'skip' .* 'off'"):
        FullyShardStrategy(on_nonfinite="ignore")


def _guarded_step(guard: NonFiniteGuard, params: list[nn.Parameter], clip: float | None) -> bool:
    """One checked step of `params` (as the strategy runs it, the clipper folding the flags when `clip`); whether
    the optimizer step ran."""
    stepped = []
    clipper = GradientClipper()

    def step(closure):
        closure()
        if clip is not None:
            clipper.clip_grad_norm_(params, clip, fold=guard.pending.flags, before_scaling=guard.decide)
        stepped.append(True)

    guard.optimizer_step(
        step,
        lambda: None,
        parameters=lambda: params,
        names=lambda: {id(p): f"w{i}" for i, p in enumerate(params)},
        global_step=7,
        device=torch.device("cpu"),
        deferred=clip is not None,
    )
    return bool(stepped)


def _params(*values: float) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(3)) for _ in values]
    for param, value in zip(params, values):
        param.grad = torch.full((3,), value)
    return params


@pytest.mark.parametrize("clip", [None, 1.0])
def test_large_finite_gradients_are_no_false_alarm_and_inf_is_named(gloo_world, clip):
    """1e20 squared overflows float32: phase one suspects it, the exact scan clears it; the step runs."""
    assert _guarded_step(NonFiniteGuard("raise"), _params(1.0, 1e20), clip)
    with pytest.raises(NonFiniteError, match=r"global step 7: the gradients of rank 0: w1\. Every rank stops"):
        _guarded_step(NonFiniteGuard("raise"), _params(1.0, math.inf), clip)


def test_skips_in_a_row_beyond_the_limit_raise(gloo_world):
    guard = NonFiniteGuard("skip", max_consecutive_skips=2)
    assert not _guarded_step(guard, _params(math.nan), None)
    assert _guarded_step(guard, _params(1.0), None) and guard.consecutive_skips == 0  # a good step resets the run
    assert not _guarded_step(guard, _params(math.nan), None)
    assert not _guarded_step(guard, _params(math.nan), None)
    with pytest.raises(NonFiniteError, match="2 steps in a row were skipped"):
        _guarded_step(guard, _params(math.nan), None)
    assert guard.skipped_steps == 3


class _Poisoned(ParityModule):
    """Adam with a learning-rate halving every step; the gradient of `model.out.weight` NaN at `BAD_STEP` (after
    backward, so after the gradients were reduced), or the loss at batch `bad_batch`."""

    def __init__(self, bad_batch: int | None = None) -> None:
        super().__init__(optimizer="adam")
        self.bad_batch = bad_batch

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if batch_idx == self.bad_batch else loss

    def on_after_backward(self):
        if self.bad_batch is None and self.global_step == BAD_STEP:
            self.model.out.weight.grad[0, 0] = math.nan

    def configure_optimizers(self):
        optimizer = make_optimizer("adam", self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _one_process(skipped: set[int], stop: int = STEPS, accumulate: int = 1) -> dict[str, torch.Tensor]:
    """Adam on the same batches, the optimizer steps in `skipped` left out; the scheduler steps every step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer("adam", model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    for step, (x, y) in enumerate(global_batches(RegressionData(), 1, BATCH * accumulate, stop)):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step not in skipped:
            optimizer.step()
        scheduler.step()
    return {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_skip_equals_one_process_that_skipped_the_step_and_the_scheduler_advances(gloo_world):
    trainer = trainer_for(ReplicateStrategy(on_nonfinite="skip"), max_steps=STEPS, devices=1)
    trainer.fit(_Poisoned(), loader(RegressionData(), BATCH))
    assert _max_diff(full_params(trainer), _one_process({BAD_STEP})) < 1e-6
    optimizer = trainer.optimizers[0]
    assert {float(s["step"]) for s in optimizer.state.values()} == {STEPS - 1.0}  # the skipped step is not counted
    assert trainer.global_step == STEPS  # Lightning's loop counts it, as a GradScaler skip
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS  # ... and steps the scheduler
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**STEPS)
    assert float(trainer.callback_metrics[SKIPPED_METRIC]) == 1.0


def test_accumulated_micro_batches_are_checked_once_per_optimizer_step(gloo_world):
    """A NaN loss in the first of two micro-batches skips that optimizer step once (not per micro-batch)."""
    trainer = trainer_for(FullyShardStrategy(on_nonfinite="skip"), max_steps=2, devices=1, accumulate_grad_batches=2)
    trainer.fit(_Poisoned(bad_batch=0), loader(RegressionData(), BATCH))
    assert trainer.strategy.nonfinite.skipped_steps == 1 and trainer.global_step == 2
    assert _max_diff(full_params(trainer), _one_process({0}, stop=2, accumulate=2)) < 1e-6


class _Manual(_Poisoned):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = ParityModule.training_step(self, batch, batch_idx)
        self.manual_backward(loss)  # runs `on_after_backward`: the gradient poisoned at `BAD_STEP`
        optimizer.step()


def test_manual_optimisation_is_guarded_and_raise_moves_no_weight(gloo_world):
    trainer = trainer_for(ReplicateStrategy(), max_steps=STEPS, devices=1)
    with pytest.raises(NonFiniteError, match=f"global step {BAD_STEP}: the gradients of rank 0: model.out.weight"):
        trainer.fit(_Manual(), loader(RegressionData(), BATCH))
    assert _max_diff(full_params(trainer), _one_process(set(), stop=BAD_STEP)) < 1e-6
    assert {float(s["step"]) for s in trainer.optimizers[0].state.values()} == {float(BAD_STEP)}


def test_with_every_value_finite_the_guard_changes_no_bit(gloo_world):
    """Gradient-norm clipping carries the guard's flags: the norm, and so the weights, are those of `"off"`."""
    weights = {}
    for mode in ("raise", "off"):
        trainer = trainer_for(FullyShardStrategy(on_nonfinite=mode), max_steps=STEPS, devices=1, gradient_clip_val=0.1)
        trainer.fit(ParityModule(optimizer="adam"), loader(RegressionData(), BATCH))
        weights[mode] = full_params(trainer)
    assert all(torch.equal(weights["raise"][k], weights["off"][k]) for k in weights["off"])
