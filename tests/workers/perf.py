"""Compile and memory features through real Trainers (run by `run.py`).

Compile cases train the same model on the same data eagerly and compiled in one process and record losses, final
parameters, state-dict keys and dynamo's compile counters per step. Memory cases record where tensors live and what
FSDP2 / activation checkpointing actually did.
"""

from __future__ import annotations

import itertools
import os
import shutil

import lightning as L
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.models import TP_PLAN, ParityModule, RegressionData, loader
from tests.workers.common import BATCH, full_params, trainer_for, world_size

COMPILE_STEPS = 6


class StepRecorder(L.Callback):
    """Loss and dynamo's cumulative compile counters after every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[int] = []
        self.backward_captures: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.graphs.append(counters["stats"]["unique_graphs"])
        self.backward_captures.append(counters["compiled_autograd"]["captures"])


def _train(strategy, steps: int = COMPILE_STEPS, **trainer_kwargs):
    recorder = StepRecorder()
    module = ParityModule(optimizer="adam")
    trainer = trainer_for(strategy, max_steps=steps, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module, loader(RegressionData(), BATCH))
    return trainer, module, recorder


def _deltas(values: list[int]) -> list[int]:
    """New graphs / captures per step (the first entry includes everything compiled before step 1)."""
    return [values[0]] + [b - a for a, b in itertools.pairwise(values)]


COMPILE_CASES = {
    "fsdp": lambda **kw: FullyShardStrategy(**kw),
    "fsdp_activation_checkpointing": lambda **kw: FullyShardStrategy(activation_checkpointing=True, **kw),
    "2d": lambda **kw: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kw),
    "replicate": lambda **kw: ReplicateStrategy(**kw),
    "replicate_bf16_hook": lambda **kw: ReplicateStrategy(comm_hook="bf16_compress", **kw),
    "replicate_fp16_hook": lambda **kw: ReplicateStrategy(comm_hook="fp16_compress", **kw),
}
#: Compiled-autograd variants, compared against the eager run of the case named second.
COMPILED_AUTOGRAD_CASES = {
    "replicate_compiled_autograd": "replicate",
    "replicate_compiled_autograd_bf16_hook": "replicate_bf16_hook",
}


def group_compile(results):
    eager = {}
    for name, make in COMPILE_CASES.items():
        trainer, module, recorder = _train(make())
        eager[name] = {
            "losses": recorder.losses,
            "params": full_params(trainer),
            "state_keys": sorted(module.state_dict()),
            "checkpoint_keys": sorted(trainer.strategy.lightning_module_state_dict()),
        }
    runs = [(name, name, make(compile=True)) for name, make in COMPILE_CASES.items()]
    runs += [
        (name, ref, COMPILE_CASES[ref](compile={"fullgraph": False}, compiled_autograd=True))
        for name, ref in COMPILED_AUTOGRAD_CASES.items()
    ]
    for name, ref, strategy in runs:
        # Forget earlier cases' compiled code, so each case must compile its own graphs in step 1: a compile that
        # dynamo silently skipped would show as zero graphs instead of hiding behind another case's cache.
        torch._dynamo.reset()
        graphs_before = counters["stats"]["unique_graphs"]
        captures_before = counters["compiled_autograd"]["captures"]
        buckets_before = counters["inductor"]["ddp_buckets"]
        trainer, module, recorder = _train(strategy)
        params = full_params(trainer)
        compiled_units = sorted(
            fqn for fqn, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None
        )
        if trainer.global_rank == 0:
            want = eager[ref]
            results[f"compile_{name}"] = {
                "loss_max_diff": max(abs(a - b) for a, b in zip(recorder.losses, want["losses"])),
                "param_max_diff": max((params[k] - want["params"][k]).abs().max().item() for k in want["params"]),
                "steps": len(recorder.losses),
                "new_graphs_per_step": _deltas([g - graphs_before for g in recorder.graphs]),
                "backward_captures_per_step": _deltas([c - captures_before for c in recorder.backward_captures]),
                "compiled_units": compiled_units,
                "inductor_ddp_buckets": counters["inductor"]["ddp_buckets"] - buckets_before,
                "state_keys_equal": sorted(module.state_dict()) == want["state_keys"],
                "checkpoint_keys_equal": sorted(trainer.strategy.lightning_module_state_dict())
                == want["checkpoint_keys"],
                "orig_mod_in_keys": any("_orig_mod" in k for k in module.state_dict()),
            }
    dist.barrier()


def group_compile_resume(results):
    """A checkpoint written by a compiled run loads into an eager one: same keys, same values."""
    import tempfile

    path = [tempfile.mkdtemp() + "/compiled.ckpt"]
    dist.broadcast_object_list(path)
    trainer, _, _ = _train(FullyShardStrategy(compile=True), steps=2)
    trainer.save_checkpoint(path[0])
    saved = full_params(trainer)
    # max_steps already reached by the checkpoint: fit only restores it.
    resumed = trainer_for(FullyShardStrategy(), max_steps=2)
    resumed.fit(ParityModule(optimizer="adam"), loader(RegressionData(), BATCH), ckpt_path=path[0])
    loaded = full_params(resumed)
    if resumed.global_rank == 0:
        results["compile_resume"] = {
            "global_step": resumed.global_step,
            "max_abs_diff": max((saved[k] - loaded[k]).abs().max().item() for k in saved),
            "same_keys": sorted(saved) == sorted(loaded),
        }
    dist.barrier()
    if resumed.global_rank == 0:
        shutil.rmtree(os.path.dirname(path[0]), ignore_errors=True)


GROUPS = {"compile": group_compile, "compile_resume": group_compile_resume}


# ---------------------------------------------------------------------------------------------------- memory


class CollectiveDtypes(TorchDispatchMode):
    """Records the dtype of every c10d collective (all-reduce, reduce-scatter, all-gather) dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            dtypes = {str(t.dtype) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.seen.setdefault(name.split(".")[1], set()).update(dtypes)
        return func(*args, **(kwargs or {}))


class Probe(L.Callback):
    """Looks inside the first block during training: how often its first layer runs, what dtype it computes in,
    how its parameters are registered right after its forward, and the gradients' dtype after backward."""

    def __init__(self) -> None:
        self.fc1_calls = 0
        self.after_forward: dict | None = None
        self.compute: dict | None = None
        self.grad_dtypes: set[str] = set()

    def on_train_start(self, trainer, pl_module):
        block = pl_module.model.layers[0]
        block.fc1.register_forward_hook(self._count_and_dtype)
        block.register_forward_hook(self._registered_params)  # runs after fully_shard's own post-forward hook

    def _count_and_dtype(self, module, args, output):
        self.fc1_calls += 1
        if self.compute is None:
            self.compute = {
                "input": str(args[0].dtype),
                "weight": str(module.weight.dtype),
                "output": str(output.dtype),
            }

    def _registered_params(self, module, args, output):
        if self.after_forward is None and torch.is_grad_enabled():
            weight = module.fc1.weight
            is_dtensor = isinstance(weight, DTensor)
            self.after_forward = {
                "dtensor": is_dtensor,
                "mesh_size": weight.device_mesh.size() if is_dtensor else 1,
                "local_fraction": (weight.to_local() if is_dtensor else weight).numel() / (15 * 12),
            }

    def on_after_backward(self, trainer, pl_module):
        self.grad_dtypes |= {str(p.grad.dtype) for p in pl_module.parameters() if p.grad is not None}


class SavedActivationsModule(ParityModule):
    """Counts the elements autograd saves for backward outside checkpointed regions during each forward."""

    saved_numel = 0

    def training_step(self, batch, batch_idx):
        def pack(tensor):
            SavedActivationsModule.saved_numel += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return super().training_step(batch, batch_idx)


def _local_device_types(tensors) -> list[str]:
    return sorted({(t.to_local() if isinstance(t, DTensor) else t).device.type for t in tensors})


def _run_memory_case(strategy, module=None, **trainer_kwargs):
    probe = Probe()
    module = module if module is not None else ParityModule(optimizer="adam")
    trainer = trainer_for(strategy, callbacks=[probe], **trainer_kwargs)
    collectives = CollectiveDtypes()
    with collectives:
        trainer.fit(module, loader(RegressionData(), BATCH))
    return trainer, module, probe, collectives


def _max_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def group_memory(results):
    out: dict = {}
    strategies = {
        "fsdp": lambda **kw: FullyShardStrategy(**kw),
        "replicate": lambda **kw: ReplicateStrategy(**kw),
        "2d": lambda **kw: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kw),
    }
    # Activation checkpointing: the block's layers run again in backward; gradients are unchanged.
    for name, make in strategies.items():
        for ac in (False, True, ["Block"]):
            SavedActivationsModule.saved_numel = 0
            trainer, _, probe, _ = _run_memory_case(
                make(activation_checkpointing=ac), module=SavedActivationsModule(optimizer="adam")
            )
            label = {False: "off", True: "on"}.get(ac, "by_class") if not isinstance(ac, list) else "by_class"
            out[f"ac_{name}_{label}"] = {
                "fc1_calls": probe.fc1_calls,
                "saved_numel": SavedActivationsModule.saved_numel,
                "params": full_params(trainer),
            }
    # CPU offload: sharded params, grads and optimizer state live on the CPU; training is unchanged.
    trainer, module, probe, _ = _run_memory_case("dpar_fsdp_offload")
    optimizer = trainer.optimizers[0]
    fsdp_params = [p for m in module.modules() if isinstance(m, FSDPModule) for p in _fsdp_params(m)]
    out["offload"] = {
        "param_devices": _local_device_types(module.parameters()),
        "grad_devices": _local_device_types(p.grad for p in module.parameters() if p.grad is not None),
        "optimizer_state_devices": _local_device_types(
            t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ),
        "every_param_offloaded": bool(fsdp_params) and all(p.offload_to_cpu for p in fsdp_params),
        "params": full_params(trainer),
    }
    # reshard_after_forward as FSDP2 defines it, seen right after the first block's forward.
    for value in (True, False, 2):
        trainer, _, probe, _ = _run_memory_case(FullyShardStrategy(reshard_after_forward=value))
        out[f"reshard_{value}"] = {**probe.after_forward, "params": full_params(trainer)}
    # bf16-mixed: bf16 compute, fp32 master params and gradients, fp32 gradient reduction.
    for name in ("fsdp", "replicate", "2d"):
        # SGD: its update is linear in the gradient, so bf16 rounding stays visible at its own scale (Adam's
        # normalisation would turn a rounded near-zero gradient into a full `lr`-sized step).
        trainer, module, probe, collectives = _run_memory_case(
            strategies[name](), module=ParityModule(optimizer="sgd"), precision="bf16-mixed"
        )
        out[f"bf16_{name}"] = {
            "compute": probe.compute,
            "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
            "grad_dtypes": sorted(probe.grad_dtypes),
            "collective_dtypes": {k: sorted(v) for k, v in collectives.seen.items()},
            "params": full_params(trainer),
        }
        trainer, _, probe, _ = _run_memory_case(strategies[name](), module=ParityModule(optimizer="sgd"))
        out[f"bf16_{name}"]["fp32_compute"] = probe.compute
        out[f"bf16_{name}"]["fp32_params"] = full_params(trainer)
    if dist.get_rank() == 0:
        for name in strategies:
            reference = out[f"ac_{name}_off"]["params"]
            for label in ("off", "on", "by_class"):
                case = out[f"ac_{name}_{label}"]
                results[f"ac_{name}_{label}"] = {
                    "fc1_calls": case["fc1_calls"],
                    "saved_numel": case["saved_numel"],
                    "max_diff_to_no_ac": _max_diff(case.pop("params"), reference),
                }
        offload = out["offload"]
        # The run without offload: `reshard_True` is plain `FullyShardStrategy()` on the same module and data.
        offload["max_diff_to_no_offload"] = _max_diff(offload.pop("params"), out["reshard_True"]["params"])
        results["offload"] = offload
        reference = out["reshard_True"]["params"]
        for value in (True, False, 2):
            case = out[f"reshard_{value}"]
            case["max_diff_to_reshard_true"] = _max_diff(case.pop("params"), reference)
            results[f"reshard_{value}"] = case
        for name in strategies:
            case = out[f"bf16_{name}"]
            case["max_diff_to_fp32"] = _max_diff(case.pop("params"), case.pop("fp32_params"))
            results[f"bf16_{name}"] = case


def _fsdp_params(module):
    """FSDP2's per-parameter records (`offload_to_cpu` is only visible there; test-only private access)."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return group.fsdp_params if group is not None else []


GROUPS["memory"] = group_memory


# ---------------------------------------------------------------------------------------------------- monitor


def group_monitor(results):
    """PerformanceMonitor under data parallelism (global samples = batch x dp) and TP (a TP group counts once)."""
    from lightning_dpar import PerformanceMonitor

    world = world_size()
    for name, strategy, dp, tp in (
        ("fsdp", FullyShardStrategy(), world, 1),
        ("2d", FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN), world // 2, 2),
    ):
        # `peak_flops` given, so MFU is computed on CPU too (the 6 * N * tokens estimate, 3 tokens per sample).
        monitor = PerformanceMonitor(warmup_steps=1, tokens_per_sample=3, peak_flops=1e12)
        module = ParityModule()
        full_parameter_count = sum(p.numel() for p in module.parameters())  # before sharding
        trainer = trainer_for(strategy, max_steps=4, callbacks=[monitor])
        trainer.fit(module, loader(RegressionData(), BATCH))
        if trainer.global_rank == 0:
            results[f"monitor_{name}"] = {
                "dp": dp,
                "tp": tp,
                "rank_batch": BATCH,
                "parameter_count": full_parameter_count,
                "samples_per_record": [r["samples"] for r in monitor.records],
                "peak_memory_per_rank": monitor.peak_memory_per_rank,
                "summary": monitor.format_summary(trainer),
                "metrics": monitor.summary_metrics(trainer),
            }


GROUPS["monitor"] = group_monitor
