"""Parity scenarios for `tests/launched/test_parity.py`: every strategy trains through a real Trainer and must end with
the same parameters as single-process training on the same global batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import (
    TP_PLAN,
    ParityModule,
    RegressionData,
    SharedWeightsModule,
    global_batches,
    loader,
    reference_train,
)
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size


def parity(make_strategy: Callable[[], Any], dp: int, optimizer="sgd", accumulate=1, clip_norm=None, clip_value=None):
    """Train with the strategy; on rank 0, the largest difference to the single-process reference."""
    data = RegressionData()
    module = ParityModule(optimizer=optimizer)
    kwargs = {}
    if accumulate > 1:
        kwargs["accumulate_grad_batches"] = accumulate
    if clip_norm is not None:
        kwargs.update(gradient_clip_val=clip_norm, gradient_clip_algorithm="norm")
    if clip_value is not None:
        kwargs.update(gradient_clip_val=clip_value, gradient_clip_algorithm="value")
    trainer = trainer_for(make_strategy(), **kwargs)
    trainer.fit(module, loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want = reference_train(
        optimizer, global_batches(data, dp, BATCH, STEPS, accumulate), clip_norm=clip_norm, clip_value=clip_value
    )
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}


def shared_weights_parity(strategy: Any, dp: int, tie_top_level: bool = True) -> dict | None:
    """`SharedWeightsModule` (a block shared by every layer, two top-level modules tied) against one process."""
    data = RegressionData()
    module = SharedWeightsModule(tie_top_level=tie_top_level)
    params_before = len(list(module.parameters()))
    trainer = trainer_for(strategy)
    trainer.fit(module, loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    reference = SharedWeightsModule(tie_top_level=tie_top_level)
    optimizer = reference.configure_optimizers()
    for x, y in global_batches(data, dp, BATCH, STEPS):
        optimizer.zero_grad()
        reference.training_step((x, y), 0).backward()
        optimizer.step()
    want = reference.state_dict()
    assert set(got) == set(want), (sorted(got), sorted(want))
    layers = module.body.layers
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "block_still_shared": layers[0].ffn.fc1.weight is layers[2].ffn.fc1.weight,
        "top_level_still_tied": module.last.weight is module.first.weight,
        "params_before_after": [params_before, len(list(module.parameters()))],
    }


def group_2d() -> Iterator[Case]:
    tp = 2 if world_size() % 2 == 0 else 1
    dp = world_size() // tp

    def strategy():
        return FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN)

    for opt in ("sgd", "sgd_momentum", "sgd_foreach", "adam", "adamw"):
        yield Case(f"2d_{opt}", lambda opt=opt: parity(strategy, dp, opt))
    yield Case("2d_accumulate", lambda: parity(strategy, dp, accumulate=2))
    yield Case("2d_clip_norm", lambda: parity(strategy, dp, clip_norm=0.05))
    yield Case("2d_clip_value", lambda: parity(strategy, dp, clip_value=0.01))


def group_fsdp() -> Iterator[Case]:
    world = world_size()
    for opt in ("sgd", "adamw"):
        yield Case(f"fsdp_{opt}", lambda opt=opt: parity(lambda: "dpar_fsdp", world, opt))
    yield Case("fsdp_accumulate", lambda: parity(lambda: "dpar_fsdp", world, accumulate=2))
    yield Case("fsdp_clip_norm", lambda: parity(lambda: "dpar_fsdp", world, clip_norm=0.05))
    if world % 2 == 0:
        yield Case("hsdp_adam", lambda: parity(lambda: FullyShardStrategy(replicate_size=2), world, "adam"))
    yield Case("fsdp_shared_weights", lambda: shared_weights_parity("dpar_fsdp", world))


def counting_allreduce_hook(calls: list[int]):
    """DDP's default all-reduce comm hook, counting the buckets it reduces into `calls`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(process_group, bucket)

    return hook


def _callable_hook_case(world: int):
    calls: list[int] = []
    result = parity(lambda: ReplicateStrategy(comm_hook=counting_allreduce_hook(calls)), world)
    return None if result is None else {**result, "hook_calls": len(calls)}


def group_replicate() -> Iterator[Case]:
    world = world_size()
    for opt in ("sgd", "adam"):
        yield Case(f"replicate_{opt}", lambda opt=opt: parity(lambda: "dpar_replicate", world, opt))
    yield Case(
        "replicate_accumulate",
        lambda: parity(lambda: ReplicateStrategy(bucket_cap_mb=1, gradient_as_bucket_view=True), world, accumulate=2),
    )
    yield Case("replicate_clip_norm", lambda: parity(lambda: "dpar_replicate", world, clip_norm=0.05))
    yield Case("replicate_static_graph", lambda: parity(lambda: ReplicateStrategy(static_graph=True), world, "adam"))
    yield Case("replicate_find_unused", lambda: parity(lambda: ReplicateStrategy(find_unused_parameters=True), world))
    # bf16-compressed gradient all-reduce: close to, but measurably different from, the fp32 reference.
    yield Case("replicate_bf16_compress", lambda: parity(lambda: ReplicateStrategy(comm_hook="bf16_compress"), world))
    yield Case("replicate_callable_hook", lambda: _callable_hook_case(world))
    yield Case("replicate_shared_weights", lambda: shared_weights_parity("dpar_replicate", world, tie_top_level=False))
    if world % 2 == 0:
        yield Case(
            "replicate_tp_adamw",
            lambda: parity(lambda: ReplicateStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN), world // 2, "adamw"),
        )
        yield Case(
            "replicate_tp_bf16_compress",
            lambda: parity(
                lambda: ReplicateStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, comm_hook="bf16_compress"),
                world // 2,
            ),
        )


GROUPS = {"2d": group_2d, "fsdp": group_fsdp, "replicate": group_replicate}
