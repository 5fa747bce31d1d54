"""Cases for `tests/launched/test_callbacks.py`: `PerformanceMonitor` under data parallelism (global samples = batch x
dp) and tensor parallelism (a TP group counts once), and a straggler: one rank slowed by a sleep in its step."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import torch.distributed as dist
import torch.nn.functional as F

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, PerformanceMonitor, ReplicateStrategy
from tests.support.models import TP_PLAN, ParityModule, RegressionData, loader
from tests.workers.cases import Case
from tests.workers.common import BATCH, trainer_for, world_size


def monitor_case(make_strategy, dp: int, tp: int) -> dict:
    # `peak_flops` given, so MFU is computed on CPU too (the 6 * N * tokens estimate, 3 tokens per sample).
    monitor = PerformanceMonitor(warmup_steps=1, tokens_per_sample=3, peak_flops=1e12)
    module = ParityModule()
    full_parameter_count = sum(p.numel() for p in module.parameters())  # before sharding
    trainer = trainer_for(make_strategy(), max_steps=4, callbacks=[monitor])
    trainer.fit(module, loader(RegressionData(), BATCH))
    return {
        "dp": dp,
        "tp": tp,
        "rank_batch": BATCH,
        "parameter_count": full_parameter_count,
        "samples_per_record": [r["samples"] for r in monitor.records],
        "peak_memory_per_rank": monitor.peak_memory_per_rank,
        "summary": monitor.format_summary(trainer),
        "metrics": monitor.summary_metrics(trainer),
    }


#: The rank slowed down, and by how much per step (s).
SLOW_RANK, SLOW_S = 1, 0.3


class SlowRankModule(ParityModule):
    """Rank `SLOW_RANK` sleeps in each step before its forward; no synchronised logging inside the step (the others
    would wait there for it, and their own time would grow alike)."""

    def training_step(self, batch, batch_idx):
        if dist.get_rank() == SLOW_RANK:
            time.sleep(SLOW_S)
        x, y = batch
        return F.mse_loss(self(x), y)


def straggler_case() -> dict:
    monitor = PerformanceMonitor(log_every_n_steps=1, straggler_fraction=0.5, straggler_intervals=3, summary=False)
    trainer = trainer_for(ReplicateStrategy(), max_steps=8, callbacks=[monitor], log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SlowRankModule(), loader(RegressionData(), BATCH))
    return {
        "stragglers": monitor.stragglers,
        "warnings": [str(w.message) for w in caught if "Straggler" in str(w.message)],
        "spread": monitor.rank_spread,
    }


def group_monitor() -> Iterator[Case]:
    world = world_size()
    yield Case("monitor_fsdp", lambda: monitor_case(FullyShardStrategy, world, 1))
    yield Case(
        "monitor_2d",
        lambda: monitor_case(
            lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN), world // 2, 2
        ),
    )
    yield Case("monitor_straggler", straggler_case)


GROUPS = {"monitor": group_monitor}
