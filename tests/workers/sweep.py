"""The sweep's fixed multi-rank set (`tests/launched/test_sweep.py`): draws made once from a seed, and draws kept
from longer hunts (`tests.support.sweep.multi_rank_draws`), each trained through a real Trainer under its layout on 2
or 4 gloo ranks and compared with one process on the same global batches (Muon: with Lightning's DDP, `run_draw`
says why), or refused on every rank, by name, before the first step."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch.distributed as dist

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import loader
from tests.support.sweep import (
    Draw,
    SweepData,
    SweepModule,
    differences,
    initial_params,
    multi_rank_draws,
    reference_train,
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


def sweep_trainer(strategy: Any, draw: Draw) -> L.Trainer:
    return trainer_for(strategy, max_steps=draw.steps, accumulate_grad_batches=draw.accumulate, **draw.clip_kwargs())


def fit(trainer: L.Trainer, draw: Draw) -> dict | None:
    """Train the draw: the full parameters on rank 0 (None elsewhere)."""
    trainer.fit(SweepModule(draw), loader(SweepData(draw), BATCH))
    got = full_params(trainer)
    return got if trainer.global_rank == 0 else None


def run_draw(layout: str, draw: Draw) -> dict | None:
    """Train the draw; on rank 0 its difference to the reference, or, if it was refused, every rank's error.

    The reference is one process on the same global batches, accumulating as Lightning does; for Muon, Lightning's
    DDP on the same ranks (the one-process difference is recorded as `one_process_diff`). Each rank accumulates its
    micro-batches before the ranks' gradients are summed, one process sums each micro-batch over the ranks' samples
    first: another order, whose last-bit differences Muon's bfloat16 Newton-Schulz magnifies. Measured on a drawn
    Muon run with 2 accumulated batches on 2 ranks: FSDP, DDP (this package's and Lightning's) and a hand-written DDP
    loop all end 3.1e-4 from one process and 0.0 from each other."""
    started = time.monotonic()
    strategy, dp = strategy_and_dp(layout, draw)
    trainer = sweep_trainer(strategy, draw)
    try:
        got = fit(trainer, draw)
    except Exception as error:  # a refusal: every rank must raise it, alike (gathered for the test to check)
        if not dist.is_initialized():  # refused before the strategy started the processes
            dist.init_process_group("gloo")
        errors: list[Any] = [None] * world_size()
        record = {"type": type(error).__name__, "message": str(error), "global_step": trainer.global_step}
        dist.all_gather_object(errors, record)
        return {"refused": errors}
    # Every rank trains the DDP reference (its steps are collectives), before rank 0 alone compares.
    ddp = fit(sweep_trainer("ddp", draw), draw) if draw.optimizer == "muon" else None
    if got is None:
        return None
    start = initial_params(draw)
    one_process = differences(got, reference_train(draw, SweepData(draw), dp, BATCH), start)
    result = {**one_process, "reference": "one process"}
    if ddp is not None:
        result = {**differences(got, ddp, start), "reference": "Lightning's DDP"}
        result["one_process_diff"] = one_process["max_abs_diff"]
    return {**result, "global_step": trainer.global_step, "seconds": round(time.monotonic() - started, 2)}


def group_sweep() -> Iterator[Case]:
    world = world_size()
    for layout, draw in multi_rank_draws(world, PER_LAYOUT[world], SEED):
        yield Case(case_name(layout, draw), lambda layout=layout, draw=draw: run_draw(layout, draw), timeout_s=120)


GROUPS = {"sweep": group_sweep}
