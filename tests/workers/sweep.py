"""The sweep's fixed multi-rank set (`tests/launched/test_sweep.py`): draws made once from a seed
(`tests.support.sweep.seeded_draws`), each trained through a real Trainer under its layout on 2 or 4 gloo ranks and
compared with one process on the same global batches, or refused on every rank, by name, before the first step."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import loader
from tests.support.sweep import (
    Draw,
    SweepData,
    SweepModule,
    differences,
    initial_params,
    reference_train,
    seeded_draws,
)
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for, world_size

#: Draws per layout of each launch (`tests.support.sweep.MULTI_RANK_LAYOUTS` lists the layouts), and the seed they are
#: drawn from; both may be raised for a longer hunt (`DPAR_SWEEP_PER_LAYOUT=20 DPAR_SWEEP_SEED=7 pytest ...`: the
#: test file reads the same variables).
PER_LAYOUT = {world: int(os.environ.get("DPAR_SWEEP_PER_LAYOUT", n)) for world, n in {2: 5, 4: 4}.items()}
SEED = int(os.environ.get("DPAR_SWEEP_SEED", "1234"))


def strategy_and_dp(layout: str, draw: Draw) -> tuple[Any, int]:
    """The layout's strategy on this launch's world, and its data-parallel size (the reference's global batch)."""
    world = world_size()
    if layout == "fsdp":
        return FullyShardStrategy(), world
    if layout == "hsdp":
        return FullyShardStrategy(replicate_size=2), world
    if layout == "replicate":
        return ReplicateStrategy(), world
    if layout in ("tp", "tp_fsdp"):
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=draw.tp_plan()), world // 2
    if layout == "replicate_tp":
        return ReplicateStrategy(tensor_parallel_size=2, tp_plan=draw.tp_plan()), world // 2
    if layout in ("pp", "pp_fsdp"):
        return FullyShardStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B"), world // 2
    if layout == "pp_tp":
        pipeline = dict(pipeline_parallel_size=2, pipeline_schedule="1F1B")
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=draw.tp_plan(), **pipeline), world // 4
    raise ValueError(layout)


def case_name(layout: str, draw: Draw) -> str:
    return f"{layout}:{draw.name}"


def run_draw(layout: str, draw: Draw) -> dict | list | None:
    """Train the draw; on rank 0 its difference to one process, or, if it was refused, every rank's error."""
    started = time.monotonic()
    data = SweepData(draw)
    strategy, dp = strategy_and_dp(layout, draw)
    trainer = trainer_for(strategy, max_steps=draw.steps, accumulate_grad_batches=draw.accumulate, **draw.clip_kwargs())
    try:
        trainer.fit(SweepModule(draw), loader(data, BATCH))
    except Exception as error:  # a refusal: every rank must raise it, alike (gathered for the test to check)
        if not dist.is_initialized():  # refused before the strategy started the processes
            dist.init_process_group("gloo")
        errors: list[Any] = [None] * world_size()
        record = {"type": type(error).__name__, "message": str(error), "global_step": trainer.global_step}
        dist.all_gather_object(errors, record)
        return {"refused": errors}
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = reference_train(draw, data, dp, BATCH)
    result = differences({k: v for k, v in got.items()}, want, initial_params(draw))
    return {**result, "global_step": trainer.global_step, "seconds": round(time.monotonic() - started, 2)}


def group_sweep() -> Iterator[Case]:
    world = world_size()
    for layout, draw in seeded_draws(world, PER_LAYOUT[world], SEED):
        yield Case(case_name(layout, draw), lambda layout=layout, draw=draw: run_draw(layout, draw), timeout_s=120)


GROUPS = {"sweep": group_sweep}
