"""Cases for `tests/launched/test_precision.py`: Trainer precision through every strategy: which dtypes the forward
computes in, the weights are kept in, the gradients arrive in, and how far bf16 training lands from the fp32
reference."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, ParityModule, RegressionData, global_batches, loader, reference_train
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _dtype_names(tensors) -> list[str]:
    return sorted({str(_local(t).dtype).removeprefix("torch.") for t in tensors})


class PrecisionProbe(ParityModule):
    """Records the dtype of a hidden activation, of the loss, of the optimizer's params and of their gradients."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.seen: dict[str, list[str]] = {"activation": [], "loss": []}

    def on_fit_start(self) -> None:
        def record(_module, _inputs, output):
            self.seen["activation"] = _dtype_names([output])

        self.model.layers[0].fc1.register_forward_hook(record)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y.to(self.dtype))
        self.seen["loss"] = _dtype_names([loss])
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen["params"] = _dtype_names(params)
        self.seen["grads"] = _dtype_names([p.grad for p in params if p.grad is not None])


def precision_case(make_strategy, dp: int, precision: str):
    data = RegressionData()
    module = PrecisionProbe()
    trainer = trainer_for(make_strategy(), precision=precision)
    trainer.fit(module, loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = reference_train("sgd", global_batches(data, dp, BATCH, STEPS))
    return {
        **module.seen,
        "max_abs_diff": max((got[k].float() - want[k]).abs().max().item() for k in want),
        "backend": torch.distributed.get_backend(),
    }


def group_precision() -> Iterator[Case]:
    world = world_size()
    tp = 2 if world % 2 == 0 else 1
    strategies = {
        "2d": (lambda: FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN), world // tp),
        "fsdp": (FullyShardStrategy, world),
        "replicate": (ReplicateStrategy, world),
    }
    for strategy_name, (make_strategy, dp) in strategies.items():
        for precision in ("bf16-mixed", "bf16-true"):
            yield Case(
                f"precision_{strategy_name}_{precision}",
                lambda make_strategy=make_strategy, dp=dp, precision=precision: precision_case(
                    make_strategy, dp, precision
                ),
            )


GROUPS = {"precision": group_precision}
