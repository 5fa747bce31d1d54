"""Cases for `tests/launched/test_callbacks.py`: `PerformanceMonitor` under data parallelism (global samples = batch x
dp) and tensor parallelism (a TP group counts once)."""

from __future__ import annotations

from collections.abc import Iterator

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, PerformanceMonitor
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


def group_monitor() -> Iterator[Case]:
    world = world_size()
    yield Case("monitor_fsdp", lambda: monitor_case(FullyShardStrategy, world, 1))
    yield Case(
        "monitor_2d",
        lambda: monitor_case(
            lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN), world // 2, 2
        ),
    )


GROUPS = {"monitor": group_monitor}
