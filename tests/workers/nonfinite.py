"""Cases for `tests/launched/test_nonfinite.py`: a NaN or Inf put into one rank's local gradient shard after the
reduction, into one rank's loss, or into one pipeline stage only, through real Trainers on every rank. Under
`on_nonfinite="raise"` every rank raises naming the step and the parameter; under `"skip"` the run ends equal to one
process that skipped that step."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from lightning_dpar.optim.nonfinite import SKIPPED_METRIC
from tests.support.models import TP_PLAN, Net, ParityModule, RegressionData, global_batches, loader, make_optimizer
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for, world_size
from tests.workers.pipeline_common import gather_objects, pipeline_strategy, whole_model

#: The step that goes non-finite, of `STEPS`.
BAD_STEP, STEPS = 1, 3
BAD_RANK = 1


class Poisoned(ParityModule):
    """`ParityModule` whose step `BAD_STEP` goes non-finite on rank `rank`: its loss (`"loss"`), or, after the
    gradients were reduced, the first element of its first local gradient shard that has one (`"grad"`: under
    pipeline parallelism, of that rank's stage only)."""

    def __init__(self, where: str, value: float, rank: int) -> None:
        super().__init__(optimizer="adam")
        self.where, self.value, self.bad_rank = where, value, rank
        self.poisoned: str | None = None

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.where == "loss" and self._now():
            loss = loss * self.value
        return loss

    def on_after_backward(self):
        if self.where == "grad" and self._now():
            self.poisoned = poison_first_gradient(self, self.value)

    def _now(self) -> bool:
        return self.global_step == BAD_STEP and dist.get_rank() == self.bad_rank


def poison_first_gradient(module: torch.nn.Module, value: float) -> str | None:
    """Set the first element of this rank's first non-empty local gradient shard to `value`; its parameter's name."""
    for name, param in module.named_parameters():
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if local is not None and local.numel():
            local.view(-1)[0] = value
            return name
    return None


def poisoned(base: type) -> type:
    """`base` whose rank `BAD_RANK` gradient goes NaN at step `BAD_STEP` (its name in `poisoned`)."""

    class PoisonedModel(base):  # type: ignore[misc, valid-type]
        poisoned: str | None = None

        def on_after_backward(self):
            if self.global_step == BAD_STEP and dist.get_rank() == BAD_RANK:
                self.poisoned = poison_first_gradient(self, math.nan)

    return PoisonedModel


def raise_case(strategy, make_module, data) -> dict:
    """`"raise"` (the default) on a model of its own: every rank's error and the poisoned parameter."""
    module = make_module()
    error = None
    try:
        trainer_for(strategy, max_steps=STEPS).fit(module, DataLoader(data, batch_size=BATCH))
    except Exception as err:
        error = {"type": type(err).__name__, "message": str(err)}
    return {"errors": gather_objects(error), "poisoned": [p for p in gather_objects(module.poisoned) if p]}


def reference(skip: bool, clip: float | None, dp: int) -> dict[str, torch.Tensor]:
    """One process on the same global batches (Adam), `BAD_STEP` skipped (or training stopped before it)."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("adam", model.parameters())
    for step, (x, y) in enumerate(global_batches(RegressionData(), dp, BATCH, STEPS)):
        if step == BAD_STEP and not skip:
            break
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step != BAD_STEP:
            opt.step()
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def run(make_strategy, where: str, value: float, mode: str, clip: float | None, dp: int) -> dict:
    """Train `STEPS` steps; the rank-0 result: every rank's error (or none), the poisoned parameter, the largest
    difference from the one-process reference, the skip metric on every rank."""
    module = Poisoned(where, value, BAD_RANK)
    trainer = trainer_for(make_strategy(mode), max_steps=STEPS, gradient_clip_val=clip)
    error = None
    try:
        trainer.fit(module, loader(RegressionData(), BATCH))
    except Exception as err:
        error = {"type": type(err).__name__, "message": str(err)}
    pipelined = getattr(trainer.strategy.dims, "pipeline", 1) > 1
    params = whole_model(trainer) if pipelined else full_params(trainer)
    want = reference(mode == "skip", clip, dp)
    metric = trainer.callback_metrics.get(SKIPPED_METRIC)
    return {
        "errors": gather_objects(error),
        "poisoned": [p for p in gather_objects(module.poisoned) if p is not None],
        # The full parameters are on rank 0 (whose value the case returns).
        "max_abs_diff": max(float((params[k].float() - want[k]).abs().max()) for k in want) if params else None,
        "skipped_metric": gather_objects(None if metric is None else float(metric)),
        "global_step": trainer.global_step,
    }


def bit_parity_case(make_strategy) -> bool:
    """Whether `"raise"` and `"off"` train to the same bits with every value finite, clipping by norm (the guard's
    flags ride in the norm's collectives over both mesh dims)."""
    weights = {}
    for mode in ("raise", "off"):
        trainer = trainer_for(make_strategy(mode), max_steps=STEPS, gradient_clip_val=0.1)
        trainer.fit(ParityModule(optimizer="adam"), loader(RegressionData(), BATCH))
        weights[mode] = full_params(trainer)
    return all(torch.equal(weights["raise"][k], weights["off"][k]) for k in weights["off"])


def group_nonfinite() -> Iterator[Case]:
    world = world_size()
    dp2 = world // 2

    def replicate(mode):
        return ReplicateStrategy(on_nonfinite=mode)

    def fsdp(mode):
        return FullyShardStrategy(on_nonfinite=mode)

    def hsdp(mode):
        return FullyShardStrategy(replicate_size=2, on_nonfinite=mode)

    def two_d(mode):
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, on_nonfinite=mode)

    def pipeline(mode):
        return pipeline_strategy(on_nonfinite=mode)

    nan, inf = math.nan, math.inf
    # (name, strategy, where, value, mode, clip, data-parallel size)
    matrix = [
        ("replicate_grad_nan_raise_clip", replicate, "grad", nan, "raise", 1.0, world),
        ("fsdp_loss_inf_skip", fsdp, "loss", inf, "skip", None, world),
        ("two_d_grad_inf_skip_clip", two_d, "grad", inf, "skip", 1.0, dp2),
        ("pipeline_stage_grad_nan_raise", pipeline, "grad", nan, "raise", None, dp2),
        ("pipeline_stage_grad_inf_skip_clip", pipeline, "grad", inf, "skip", 1.0, dp2),
    ]
    if world == 4:
        matrix += [
            ("hsdp_grad_nan_skip_clip", hsdp, "grad", nan, "skip", 1.0, world),
            ("two_d_loss_nan_raise", two_d, "loss", nan, "raise", None, dp2),
        ]
    for name, strategy, where, value, mode, clip, dp in matrix:

        def case(strategy=strategy, where=where, value=value, mode=mode, clip=clip, dp=dp):
            return run(strategy, where, value, mode, clip, dp)

        yield Case(f"nonfinite{world}_{name}", case, timeout_s=240)
    yield Case(f"nonfinite{world}_two_d_clip_bit_parity", lambda: bit_parity_case(two_d))
    if world == 2:  # expert and context parallelism, once: every rank stops naming the parameter
        from tests.workers.context_parallel import GPTModule, gpt_data
        from tests.workers.hf_models import TokenIds
        from tests.workers.moe import ExampleMoE

        yield Case(
            "nonfinite2_ep_grad_nan_raise",
            lambda: raise_case(FullyShardStrategy(expert_parallel_size=2), poisoned(ExampleMoE), TokenIds()),
        )
        yield Case(
            "nonfinite2_cp_grad_nan_raise",
            lambda: raise_case(FullyShardStrategy(context_parallel_size=2), poisoned(GPTModule), gpt_data()),
        )


GROUPS = {"nonfinite": group_nonfinite}
