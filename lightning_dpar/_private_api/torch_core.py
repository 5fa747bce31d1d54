"""torch's other private names the package relies on (outside `torch.distributed`): grouped matmuls, module
parameter swaps, compiled autograd and dynamo's DDP mode, Muon's own step functions, and the fake-tensor and
dispatch machinery of the activation estimate. Each has no public equivalent in torch 2.11 to 2.15; each says why it
is needed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn as nn

# The activation estimate (`lightning_dpar.estimates.activation_trace`) runs a training step on fake tensors and
# follows every tensor storage it creates. `FakeTensorMode` is torch's own way to run operators without memory (what
# `torch.compile` traces with) on a device of our choosing, so kernels are picked as on a real device; a
# `TorchDispatchMode` sees each operator's outputs; pytree reads them out of nested results (no public equivalents).
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# torch.optim.Muon's own Newton-Schulz iteration and learning-rate adjustment: the distributed step
# (`lightning_dpar.optim.distributed_muon`) calls the very functions `Muon.step` calls, so it computes bit for bit what
# Muon computes on the whole matrix under DDP. torch has no public functional form of them.
from torch.optim._muon import _adjust_lr as muon_adjusted_lr
from torch.optim._muon import _zeropower_via_newtonschulz as muon_newton_schulz
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "compiled_autograd",
    "grouped_mm",
    "log_softmax_backward_op",
    "muon_adjusted_lr",
    "muon_init_group",
    "muon_newton_schulz",
    "privateuse1_backend_name",
    "replace_muon_group_step",
    "selective_checkpoint_private_ops",
    "storage_key",
    "swap_ddp_optimize_mode",
    "swapped_parameters",
    "tree_leaves",
    "tree_map",
    "view_base",
]


def grouped_mm() -> Callable[..., torch.Tensor] | None:
    """`torch._grouped_mm(input, weights, offs=...)`, one matmul per group of rows, where this torch has it: no public
    grouped GEMM exists; torchtitan's and transformers' `grouped_mm` experts use it (it runs on CPU too, in fp32)."""
    return getattr(torch, "_grouped_mm", None)


#: The private operators whose outputs selective activation checkpointing keeps (torchtitan's save list): every fused
#: attention kernel torch dispatches `scaled_dot_product_attention` to (CPU's included, which the CPU tests and the
#: activation estimate's trace run), the functional reduce-scatter of sequence parallelism, float8's scaled matmul.
#: `torch.utils.checkpoint`'s policy sees operators, and these have no public names. Checked on torch 2.11, 2.13 and
#: 2.15 (all present); one a torch version lacks is left out, not an error.
_SELECTIVE_CHECKPOINT_PRIVATE_OPS = (
    ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_flash_attention"),
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable"),
    ("_c10d_functional", "reduce_scatter_tensor"),
    ("aten", "_scaled_mm"),
)


def selective_checkpoint_private_ops() -> frozenset[Any]:
    """The `.default` overloads of `_SELECTIVE_CHECKPOINT_PRIVATE_OPS` this torch has."""
    found = set()
    for namespace, name in _SELECTIVE_CHECKPOINT_PRIVATE_OPS:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


def log_softmax_backward_op() -> Any:
    """`aten._log_softmax_backward_data.default`, the log-softmax's backward operator. The activation estimate's trace
    runs it as torch's `loss_parallel()` does (`lightning_dpar.loss_parallel.estimate.vocabulary_parallel_gradient`),
    which hands the cross-entropy's gradient through it unchanged; an operator has no public name. Present on torch
    2.11, 2.13, 2.15."""
    return torch.ops.aten._log_softmax_backward_data.default


@contextmanager
def swapped_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Register `tensors` in place of `module`'s own parameters of the same names while the context is open, then
    put back exactly the objects that were there.

    Expert parallelism runs an experts module's own `forward` on its local experts: the module must see plain local
    tensors (its `forward` indexes them by local expert id) where FSDP registered DTensors. `module._parameters` is
    the only place `nn.Module` looks parameters up; `torch.func.functional_call` swaps them too but calls the module
    again, which would run FSDP's hooks twice. transformers' expert parallelism swaps them the same way."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        module._parameters.update(tensors)  # type: ignore[arg-type]
        yield
    finally:
        module._parameters.update(saved)


def privateuse1_backend_name() -> str:
    """The out-of-tree device backend's name, which `SyncBatchNorm` accepts (only `torch._C` exposes it)."""
    return torch._C._get_privateuse1_backend_name()


def compiled_autograd(compiler: Callable[[Any], Any]) -> AbstractContextManager[None]:
    """Capture each backward pass into one graph compiled by `compiler` (compiled autograd).

    Lightning calls `loss.backward()` outside any `torch.compile` region, so the public switch
    (`torch._dynamo.config.compiled_autograd`, which only applies to backwards inside compiled code) cannot reach
    it; this context manager is torch's own entry point for that case (`enable` before torch 2.9, `_enable` since)."""
    from torch._dynamo import compiled_autograd as ca

    enable = getattr(ca, "_enable", None) or ca.enable
    return enable(compiler)


def swap_ddp_optimize_mode(mode: Any) -> Any:
    """Set dynamo's `optimize_ddp` mode and return the previous one. `"python_reducer"` makes DDP all-reduce
    gradients from Python hooks that compiled autograd traces and Inductor buckets; DDP reads the mode when it is
    built (on the first forward), dynamo whenever it compiles. Only a config attribute exists for it."""
    import torch._dynamo

    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = mode
    return previous


def view_base(tensor: Any) -> Any:
    """The tensor `tensor` is an autograd-recorded view of, or None (`Tensor._base`): the only way to tell such a
    view, which FSDP warns about when a unit returns one (it reads `_base` itself), from a tensor of its own."""
    return tensor._base


def replace_muon_group_step(optimizer: torch.optim.Muon, group_step: Callable[..., bool]) -> None:
    """Make `optimizer.step` call `group_step` (which updates the sharded parameters whole and appends only the
    others) in place of `Muon._init_group(group, params, grads, momentum_buffers)`, found first as an instance
    attribute. Unlike replacing `step`, this keeps what wraps `step` working (hooks, profiler, schedulers, closures)."""
    optimizer._init_group = group_step  # type: ignore[method-assign]


def muon_init_group(optimizer: torch.optim.Muon, group: Any, params: list, grads: list, buffers: list) -> bool:
    """torch's own `Muon._init_group`: checks each parameter and creates its momentum buffer, as `step` would."""
    return torch.optim.Muon._init_group(optimizer, group, params, grads, buffers)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The address of a storage's `StorageImpl`: the same for every view of it, unique among live storages (a fake
    or meta storage has no data pointer to tell storages apart, and Python storage objects are made on demand)."""
    return storage._cdata
