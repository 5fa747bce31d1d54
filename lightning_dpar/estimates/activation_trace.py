"""One training step of a model run on fake tensors, recording the life of every tensor storage it creates: when it
is created and freed, which pipeline unit created it, and whether tensor parallelism splits it over the ranks.

`lightning_dpar.estimates.activations` turns such a trace into activation bytes per rank; this module only runs and
records.

Why a fake run, not a formula: autograd, the user's `training_step` and activation checkpointing decide what stays
alive for backward, and running them is the one way that holds for any model (the example GPT, a transformers
model, a user's own). The model is copied with every parameter and buffer replaced by a `FakeTensor` on the CPU
device, so nothing is allocated or computed, yet the dispatcher picks kernels as on a real device: on the meta
device `scaled_dot_product_attention` falls back to its math kernel, which saves the (tokens x tokens) attention
probabilities, where the fused kernels of CPU and CUDA save only q, k, v, the output and the log-sum-exp.
Activation checkpointing is the strategy's own (`activation_checkpointing.apply_activation_checkpointing`), applied to
the copy, so its recomputation in backward is traced too, context-parallel where the run is; under the selective
policy the ops' outputs it keeps are storages alive from the forward to the backward, counted like any saved tensor.

Tensor parallelism is traced on the unsplit model, each storage flagged as split over the tensor-parallel ranks or
not, as its styles' layouts say (`lightning_dpar.estimates.tensor_parallel_trace`); every other op's outputs are split
when one of its inputs is (a scalar never is).
"""

from __future__ import annotations

import copy
import functools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dpar._private_api import (
    FakeTensorMode,
    TorchDispatchMode,
    storage_key,
    trainer_and_mesh,
    tree_leaves,
    tree_map,
    unpacked_positions_on_fake_tensors,
)
from lightning_dpar.activation_checkpointing.step import (
    ActivationCheckpointingPlan,
    CheckpointPolicyName,
    apply_activation_checkpointing,
)
from lightning_dpar.context_parallel.runtime import ContextParallel
from lightning_dpar.estimates.tensor_parallel_trace import Redistribution, hook_style
from lightning_dpar.experts.tracing_stand_in import replace_experts_for_tracing
from lightning_dpar.helpers import key_value_cache_configs, without_key_value_cache
from lightning_dpar.loss_parallel.estimate import vocabulary_parallel_gradient

__all__ = ["StepTrace", "StorageLife", "trace_step", "training_loss"]


@dataclass
class StorageLife:
    """One storage the step created: its size, the clock ticks it was created at and freed at (`None`: alive at the
    end), the index of the unit that created it (-1 without units), whether tensor parallelism splits it, and
    whether it ended as a parameter's gradient (not an activation)."""

    nbytes: int
    created: int
    freed: int | None
    unit: int
    split: bool
    gradient: bool = False

    def alive_at(self, tick: int) -> bool:
        return self.created <= tick and (self.freed is None or self.freed > tick)


@dataclass(frozen=True)
class StepTrace:
    """The storages of one forward and backward; `forward_end` is the tick between them. `unit_inputs[i]` is the
    size and split flag of unit i's first tensor input (what a pipeline stage starting at unit i receives and keeps
    per microbatch). `unmodelled` names tensor-parallel styles the trace does not know (their tensors count whole).
    `flops` are the step's matmul and attention FLOPs, forward and backward with any recomputation (`_op_flops`; an
    op whose output selective checkpointing hands back is not run again, so not counted again)."""

    storages: tuple[StorageLife, ...]
    forward_end: int
    units: tuple[str, ...]
    unit_inputs: tuple[tuple[int, bool] | None, ...]
    unmodelled: tuple[str, ...] = ()
    flops: int = 0


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
        return None


def _op_flops(func: Any, args: Sequence[Any]) -> int:
    """The FLOPs of one matmul or attention op (2 per multiply-add; attention's two products, and twice that for
    its backward's four), 0 for any other op. Counted here rather than with `torch.utils.flop_counter.FlopCounterMode`,
    whose module tracking hooks every module's outputs for backward and so keeps activations alive that the step
    frees (the traced peak under full checkpointing grew by a third with it), and which does not know CPU's fused
    attention."""
    name = func.__name__
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm.default", "addmm.default"):
        a, b = tensors[-2:]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if name in ("bmm.default", "baddbmm.default"):
        a, b = tensors[-2:]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name.startswith("_scaled_dot_product") and len(tensors) >= 3:
        q, k = tensors[0], tensors[1]
        forward = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        return 2 * forward if "backward" in name else forward
    return 0


#: An op a trace runs its own way: given the op, its arguments and whether a tensor is split over the tensor-parallel
#: ranks, its output, or `None` to run the op as it is.
Intercept = Callable[[Any, Sequence[Any], Callable[[torch.Tensor], bool]], "torch.Tensor | None"]


class _Recorder(TorchDispatchMode):
    """Records every storage an op outputs for the first time, and the tick it dies at, and the FLOPs of the
    matmul and attention ops run (`_op_flops`).

    A storage's Python object lives exactly as long as the storage (torch keeps it alive while any tensor or autograd
    holds the storage), so a weak reference's callback says when it dies: no polling.
    """

    def __init__(self, intercept: Intercept | None = None) -> None:
        super().__init__()
        self.intercept = intercept
        self.clock = 0
        self.lives: dict[int, StorageLife] = {}  # live storages by StorageImpl address
        self.refs: dict[int, weakref.ref] = {}
        self.done: list[StorageLife] = []
        self.known: set[int] = set()  # storages that exist before the step: parameters, buffers, the batch
        self.unit = lambda: -1
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        intercepted = self.intercept(func, args, self.is_split) if self.intercept is not None else None
        if intercepted is not None:
            self.clock += 1
            return intercepted
        out = func(*args, **kwargs)
        self.flops += _op_flops(func, args)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        split = any(life.split for life in map(self.life, inputs) if life is not None)
        for tensor in tree_leaves(out):
            storage = _storage(tensor) if isinstance(tensor, torch.Tensor) else None
            if (
                storage is not None
                and storage_key(storage) not in self.lives
                and storage_key(storage) not in self.known
            ):
                key = storage_key(storage)
                split_here = split and tensor.dim() > 0  # a scalar from a shard (a partial loss) is whole everywhere
                self.lives[key] = StorageLife(storage.nbytes(), self.clock, None, self.unit(), split_here)
                self.refs[key] = weakref.ref(storage, functools.partial(self._died, key))
        self.clock += 1
        return out

    def _died(self, key: int, ref: weakref.ref) -> None:
        life = self.lives.pop(key)
        del self.refs[key]
        life.freed = self.clock
        self.done.append(life)

    def life(self, tensor: torch.Tensor) -> StorageLife | None:
        storage = _storage(tensor)
        return None if storage is None else self.lives.get(storage_key(storage))

    def is_split(self, tensor: torch.Tensor) -> bool:
        life = self.life(tensor)
        return life is not None and life.split

    def mark(self, tensor: torch.Tensor, split: bool) -> None:
        life = self.life(tensor)
        if life is not None:
            life.split = split

    def tick(self) -> int:
        """The tick that separates what came before from what comes after."""
        self.clock += 1
        return self.clock - 1


class _Units:
    """Which unit is computing: the innermost unit whose forward is running; between units, the next one (code
    between units computes that unit's input); in backward, the unit whose output's gradient was last reached."""

    def __init__(self, root: nn.Module, units: Sequence[str], recorder: _Recorder) -> None:
        self.stack: list[int] = []
        self.last_done = -1
        self.backward_unit: int | None = None
        self.in_backward = False
        self.count = len(units)
        self.inputs: list[tuple[int, bool] | None] = [None] * len(units)
        for index, fqn in enumerate(units):
            module = root.get_submodule(fqn)
            module.register_forward_pre_hook(self._enter(index, recorder), with_kwargs=True)
            module.register_forward_hook(self._leave(index))
        recorder.unit = self.current

    def current(self) -> int:
        if not self.count:
            return -1
        if self.stack:
            return self.stack[-1]
        if self.in_backward:
            return self.count - 1 if self.backward_unit is None else self.backward_unit
        return min(self.last_done + 1, self.count - 1)

    def _enter(self, index: int, recorder: _Recorder) -> Callable:
        def hook(mod, args, kwargs):
            self.stack.append(index)
            first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
            if first is not None and self.inputs[index] is None:
                life = recorder.life(first)
                self.inputs[index] = (first.untyped_storage().nbytes(), bool(life and life.split))

        return hook

    def _leave(self, index: int) -> Callable:
        def hook(mod, args, out):
            self.stack.pop()
            if self.in_backward:
                return
            self.last_done = index
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(self._reached(index))

        return hook

    def _reached(self, index: int) -> Callable:
        def hook(grad_outputs):
            self.backward_unit = index

        return hook


def training_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of `module.training_step(batch, 0)` (a tensor, or a dict's `"loss"`); for a plain module, its
    output's sum."""
    step = getattr(module, "training_step", None)
    with without_key_value_cache(key_value_cache_configs(module)):  # as the strategies train (`StepHooks`)
        output = step(batch, 0) if step is not None else module(batch)
    if isinstance(output, Mapping):
        output = output["loss"]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the training step returned {type(output).__name__}, not a loss tensor")
    return output if output.dim() == 0 else output.float().sum()


def _fake_copy(module: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> nn.Module:
    """A copy of `module` whose parameters and buffers are fake CPU tensors (tied ones stay tied); floating-point
    parameters cast to `dtype` when given (what FSDP2's mixed-precision policy computes with)."""
    keep = {id(v): v for v in trainer_and_mesh(module) if v is not None}  # shared, not copied
    params = {id(p): p for p in module.parameters()} | {id(b): b for b in module.buffers()}
    buffers = {id(b) for b in module.buffers()}
    memo: dict[int, Any] = dict(keep)
    fakes: dict[int, torch.Tensor] = {}
    with mode:
        for key, tensor in params.items():
            cast = dtype if dtype is not None and tensor.is_floating_point() and key not in buffers else None
            fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=cast or tensor.dtype, device="cpu")
            fakes[key] = nn.Parameter(fake, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    memo.update(fakes)
    return copy.deepcopy(module, memo)


def _fake_batch(batch: Any, mode: FakeTensorMode) -> Any:
    """A shape tuple -> token ids of that shape; any pytree of tensors -> zeros of their shapes and dtypes."""
    with mode:
        if isinstance(batch, (tuple, torch.Size)) and all(isinstance(d, int) for d in batch):
            return torch.zeros(tuple(batch), dtype=torch.long)
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t, batch)


def trace_step(
    module: nn.Module,
    batch: Any,
    *,
    tensor_parallel: Mapping[str, ParallelStyle] | None = None,
    activation_checkpointing: Sequence[str] = (),
    checkpoint_policy: CheckpointPolicyName = "full",
    units: Sequence[str] = (),
    compute_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss: Callable[[nn.Module, Any], torch.Tensor] = training_loss,
    context_parallel: int = 1,
    context_parallel_loss: str | None = None,
    loss_parallel: bool = False,
) -> StepTrace:
    """Run `loss(module, batch)` and its backward once on a fake copy of `module` (on any device, meta included),
    with `tensor_parallel` styles traced and `activation_checkpointing` applied to the named modules
    (`checkpoint_policy`: `"full"` or `"selective"`); with `context_parallel > 1`, as one context-parallel rank runs
    it (the sequence split at the blocks, keys and values gathered:
    `lightning_dpar.context_parallel.ContextParallel.simulate`), and with `context_parallel_loss` (the plan's causal
    LM) that model's head and loss on the rank's own tokens (`context_parallel_loss="per_rank"`).

    `batch` is the shape of a token-id batch or a pytree of tensors (only shapes and dtypes are read). `units` are
    the pipeline units in call order: each storage records which one created it. `compute_dtype` casts floating
    parameters (FSDP2's mixed precision); `autocast_dtype` runs under CPU autocast (the `replicate` wrapper's).
    `loss_parallel`: the cross-entropy of split logits is torch's vocabulary-parallel one (`loss_parallel()`),
    whose backward hands the loss's gradient through the log-softmax's unchanged.
    """
    mode = FakeTensorMode()
    fake = _fake_copy(module, mode, compute_dtype)
    replace_experts_for_tracing(fake)  # MoE layers: their dense equivalent (`lightning_dpar.experts.tracing_stand_in`)
    recorder = _Recorder(vocabulary_parallel_gradient if loss_parallel else None)
    redistribute = Redistribution(recorder)
    unmodelled = [
        f"{fqn}: {type(style).__name__}"
        for fqn, style in (tensor_parallel or {}).items()
        if not hook_style(fake.get_submodule(fqn), style, redistribute)
    ]
    context = ContextParallel.simulate(fake, context_parallel, context_parallel_loss) if context_parallel > 1 else None
    checkpointing = ActivationCheckpointingPlan(list(activation_checkpointing), checkpoint_policy)
    apply_activation_checkpointing(fake, checkpointing, context.checkpoint_contexts if context else None)
    tracker = _Units(fake, units, recorder)
    fake_batch = _fake_batch(batch, mode)
    existing = [*fake.parameters(), *fake.buffers(), *tree_leaves(fake_batch)]
    recorder.known = {storage_key(t.untyped_storage()) for t in existing if isinstance(t, torch.Tensor)}
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    with ExitStack() as stack, warnings.catch_warnings():
        # A training step that logs warns that no Trainer is attached: nothing is logged in a trace.
        warnings.filterwarnings("ignore", message=".*self.log.*")
        stack.enter_context(mode)
        stack.enter_context(recorder)
        if not (isinstance(batch, Mapping) and "position_ids" in batch):  # the model makes its positions: unpacked
            stack.enter_context(unpacked_positions_on_fake_tensors())
        # The sequence is split around the forward only, as the strategy's step does (`step_hooks._step_forward`):
        # a block recomputed in backward is split by its checkpoint's `context_fn`.
        with autocast, context.active() if context is not None else nullcontext():
            output = loss(fake, fake_batch)
        forward_end = recorder.tick()
        tracker.in_backward = True
        output.backward()
        del output
        recorder.tick()
        gradients = {storage_key(p.grad.untyped_storage()) for p in fake.parameters() if p.grad is not None}
        for key in gradients & set(recorder.lives):
            recorder.lives[key].gradient = True
    recorder.refs.clear()  # what is still alive is alive at the end: no callback changes the trace later
    storages = (*recorder.done, *recorder.lives.values())
    return StepTrace(
        tuple(storages),
        forward_end,
        tuple(units),
        tuple(tracker.inputs),
        tuple(unmodelled),
        recorder.flops,
    )
