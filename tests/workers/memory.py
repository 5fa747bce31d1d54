"""Cases for `tests/launched/test_memory.py`: memory features through real Trainers. Each case records where tensors
live and what FSDP2 / activation checkpointing actually did, and compares the trained parameters with a run without the
feature."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import lightning as L
import torch
import torch.utils._pytree as pytree
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, ParityModule, RegressionData, loader
from tests.workers.cases import Case
from tests.workers.common import BATCH, full_params, trainer_for


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


STRATEGIES = {
    "fsdp": lambda **kw: FullyShardStrategy(**kw),
    "replicate": lambda **kw: ReplicateStrategy(**kw),
    "2d": lambda **kw: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kw),
}
AC_SETTINGS = {"off": False, "on": True, "by_class": ["Block"]}


@functools.cache
def _ac_run(strategy: str, setting: str) -> dict:
    """Activation checkpointing `AC_SETTINGS[setting]`: layer calls, saved activations and the trained parameters."""
    SavedActivationsModule.saved_numel = 0
    trainer, _, probe, _ = _run_memory_case(
        STRATEGIES[strategy](activation_checkpointing=AC_SETTINGS[setting]),
        module=SavedActivationsModule(optimizer="adam"),
    )
    params = full_params(trainer)
    return {"fc1_calls": probe.fc1_calls, "saved_numel": SavedActivationsModule.saved_numel, "params": params}


def activation_checkpointing_case(strategy: str, setting: str) -> dict | None:
    """The block's layers run again in backward; gradients are unchanged."""
    run, reference = _ac_run(strategy, setting), _ac_run(strategy, "off")
    if not run["params"]:  # full parameters are gathered on rank 0 only
        return None
    return {
        "fc1_calls": run["fc1_calls"],
        "saved_numel": run["saved_numel"],
        "max_diff_to_no_ac": _max_diff(run["params"], reference["params"]),
    }


@functools.cache
def _reshard_run(value: bool | int) -> dict:
    """`reshard_after_forward=value`: the first block's registered parameters right after its forward."""
    trainer, _, probe, _ = _run_memory_case(FullyShardStrategy(reshard_after_forward=value))
    return {**probe.after_forward, "params": full_params(trainer)}


def reshard_case(value: bool | int) -> dict | None:
    """reshard_after_forward as FSDP2 defines it; compared with the default (`True`)."""
    run, reference = _reshard_run(value), _reshard_run(True)
    if not run["params"]:
        return None
    return {
        **{k: v for k, v in run.items() if k != "params"},
        "max_diff_to_reshard_true": _max_diff(run["params"], reference["params"]),
    }


def offload_case() -> dict | None:
    """CPU offload: sharded params, grads and optimizer state live on the CPU; training is unchanged."""
    trainer, module, _, _ = _run_memory_case("dpar_fsdp_offload")
    optimizer = trainer.optimizers[0]
    fsdp_params = [p for m in module.modules() if isinstance(m, FSDPModule) for p in _fsdp_params(m)]
    params = full_params(trainer)
    without_offload = _reshard_run(True)["params"]  # plain `FullyShardStrategy()` on the same module and data
    if not params:
        return None
    return {
        "param_devices": _local_device_types(module.parameters()),
        "grad_devices": _local_device_types(p.grad for p in module.parameters() if p.grad is not None),
        "optimizer_state_devices": _local_device_types(
            t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
        ),
        "every_param_offloaded": bool(fsdp_params) and all(p.offload_to_cpu for p in fsdp_params),
        "max_diff_to_no_offload": _max_diff(params, without_offload),
    }


def bf16_case(strategy: str) -> dict | None:
    """bf16-mixed: bf16 compute, fp32 master params and gradients, fp32 gradient reduction."""
    # SGD: its update is linear in the gradient, so bf16 rounding stays visible at its own scale (Adam's
    # normalisation would turn a rounded near-zero gradient into a full `lr`-sized step).
    trainer, module, probe, collectives = _run_memory_case(
        STRATEGIES[strategy](), module=ParityModule(optimizer="sgd"), precision="bf16-mixed"
    )
    params = full_params(trainer)
    fp32_trainer, _, fp32_probe, _ = _run_memory_case(STRATEGIES[strategy](), module=ParityModule(optimizer="sgd"))
    fp32_params = full_params(fp32_trainer)
    if not params:
        return None
    return {
        "compute": probe.compute,
        "fp32_compute": fp32_probe.compute,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "grad_dtypes": sorted(probe.grad_dtypes),
        "collective_dtypes": {k: sorted(v) for k, v in collectives.seen.items()},
        "max_diff_to_fp32": _max_diff(params, fp32_params),
    }


def group_memory() -> Iterator[Case]:
    for strategy in STRATEGIES:
        for setting in AC_SETTINGS:
            yield Case(f"ac_{strategy}_{setting}", lambda s=strategy, a=setting: activation_checkpointing_case(s, a))
    yield Case("offload", offload_case)
    for value in (True, False, 2):
        yield Case(f"reshard_{value}", lambda value=value: reshard_case(value))
    for strategy in STRATEGIES:
        yield Case(f"bf16_{strategy}", lambda s=strategy: bf16_case(s))


def _fsdp_params(module):
    """FSDP2's per-parameter records (`offload_to_cpu` is only visible there; test-only private access)."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return group.fsdp_params if group is not None else []


GROUPS = {"memory": group_memory}
