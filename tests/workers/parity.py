"""Parity scenarios: every strategy trains through a real Trainer and must end with the same parameters as
single-process training on the same global batches (run by `run.py`)."""

from __future__ import annotations

import os

from tests.models import TP_PLAN, ParityModule, RegressionData, global_batches, loader, reference_train
from tests.workers.common import BATCH, STEPS, full_params, trainer_for


def run_case(name, strategy, dp, optimizer="sgd", accumulate=1, clip_norm=None, clip_value=None, results=None, **tk):
    data = RegressionData()
    module = ParityModule(optimizer=optimizer)
    kwargs = dict(tk)
    if accumulate > 1:
        kwargs["accumulate_grad_batches"] = accumulate
    if clip_norm is not None:
        kwargs.update(gradient_clip_val=clip_norm, gradient_clip_algorithm="norm")
    if clip_value is not None:
        kwargs.update(gradient_clip_val=clip_value, gradient_clip_algorithm="value")
    trainer = trainer_for(strategy, **kwargs)
    trainer.fit(module, loader(data, BATCH))
    got = full_params(trainer)
    if trainer.global_rank == 0:
        want = reference_train(
            optimizer, global_batches(data, dp, BATCH, STEPS, accumulate), clip_norm=clip_norm, clip_value=clip_value
        )
        assert set(got) == set(want), (sorted(got), sorted(want))
        results[name] = {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want)}
    return trainer


def group_2d(results):
    from lightning_dpar import FSDPTensorParallelStrategy

    world = int(os.environ["WORLD_SIZE"])
    tp = 2 if world % 2 == 0 else 1
    dp = world // tp
    for opt in ("sgd", "sgd_momentum", "sgd_foreach", "adam", "adamw"):
        run_case(
            f"2d_{opt}", FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN), dp, opt, results=results
        )
    run_case(
        "2d_accumulate",
        FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN),
        dp,
        accumulate=2,
        results=results,
    )
    run_case(
        "2d_clip_norm",
        FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN),
        dp,
        clip_norm=0.05,
        results=results,
    )
    run_case(
        "2d_clip_value",
        FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan=TP_PLAN),
        dp,
        clip_value=0.01,
        results=results,
    )


def group_fsdp(results):
    from lightning_dpar import FullyShardStrategy

    world = int(os.environ["WORLD_SIZE"])
    for opt in ("sgd", "adamw"):
        run_case(f"fsdp_{opt}", "dpar_fsdp", world, opt, results=results)
    run_case("fsdp_accumulate", "dpar_fsdp", world, accumulate=2, results=results)
    run_case("fsdp_clip_norm", "dpar_fsdp", world, clip_norm=0.05, results=results)
    if world % 2 == 0:
        run_case("hsdp_adam", FullyShardStrategy(replicate_size=2), world, "adam", results=results)


def group_replicate(results):
    from lightning_dpar import ReplicateStrategy

    world = int(os.environ["WORLD_SIZE"])
    for opt in ("sgd", "adam"):
        run_case(f"replicate_{opt}", "dpar_replicate", world, opt, results=results)
    run_case(
        "replicate_accumulate",
        ReplicateStrategy(bucket_cap_mb=1, gradient_as_bucket_view=True),
        world,
        accumulate=2,
        results=results,
    )
    run_case("replicate_clip_norm", "dpar_replicate", world, clip_norm=0.05, results=results)
    run_case("replicate_static_graph", ReplicateStrategy(static_graph=True), world, "adam", results=results)
    run_case("replicate_find_unused", ReplicateStrategy(find_unused_parameters=True), world, results=results)
    # bf16-compressed gradient all-reduce: close to, but measurably different from, the fp32 reference.
    run_case("replicate_bf16_compress", ReplicateStrategy(comm_hook="bf16_compress"), world, results=results)
    calls = []

    def counting_hook(process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        calls.append(bucket.index())
        return default_hooks.allreduce_hook(process_group, bucket)

    run_case("replicate_callable_hook", ReplicateStrategy(comm_hook=counting_hook), world, results=results)
    if "replicate_callable_hook" in results:
        results["replicate_callable_hook"]["hook_calls"] = len(calls)
    if world % 2 == 0:
        run_case(
            "replicate_tp_adamw",
            ReplicateStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN),
            world // 2,
            "adamw",
            results=results,
        )
        run_case(
            "replicate_tp_bf16_compress",
            ReplicateStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, comm_hook="bf16_compress"),
            world // 2,
            results=results,
        )


GROUPS = {"2d": group_2d, "fsdp": group_fsdp, "replicate": group_replicate}
