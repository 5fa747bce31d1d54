"""Measuring one real training step's activation memory, to check `lightning_dpar.estimates.activations`' estimate
against: `ActivationMeter` reads the CPU allocator's record, `StorageMeter` follows tensor storages (for tensor
parallelism, where the allocator's record misses frees made by gloo's threads; see its docstring).

`ActivationMeter` (a Lightning callback) profiles one step's forward and backward with `profile_memory=True`: the
profiler then records every allocation and free of the CPU allocator (the bytes malloc'd for tensors, kernels'
scratch buffers included), with its address and the operator or `record_function` scope it happened in. From those
it rebuilds each allocation's lifetime during the step, and counts the ones that are activations:

- allocations made before the step are not counted (the profiler does not see them: parameters, optimizer state);
- a parameter's gradient is not an activation: allocations still alive at a parameter's `.grad` address when the
  step ends, those made inside FSDP's scopes (`FSDP::...`: all-gathered parameters, reduce-scatter buffers, the
  sharded gradients), and those FSDP frees (the unsharded gradients it reduces) are left out;
- everything else the step allocates is activation memory: saved tensors, activation-checkpointed inputs and their
  recomputation, activation gradients, tensor-parallel collectives' outputs, kernels' scratch.

`retained` is what is alive when the forward ends (`on_before_backward`), `peak` the most alive at once during the
forward and backward: the two numbers `lightning_dpar.estimates.activations.Footprint` estimates. Allocator numbers, not
Python-level bookkeeping: the estimate traces tensors on fake storage, the meter counts real malloc'd bytes, so the
two do not share a mechanism that could hide the same mistake. Deterministic on one rank: one thread allocates and
frees, and the same program allocates the same sizes in the same order on every run.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import lightning as L
import torch
import torch.utils._pytree as pytree
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

FORWARD_END = "activation_meter::forward_end"


@dataclass(frozen=True)
class Measured:
    retained: int
    peak: int


def _scopes(node) -> list[str]:
    names = []
    while node is not None:
        names.append(node.name)
        node = node.parent
    return names


def _in_fsdp(node) -> bool:
    return any(name.startswith("FSDP::") for name in _scopes(node))


class ActivationMeter(L.Callback):
    """Measures the activations of training step `step` (0-based) on this rank; `measured` holds the result."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.measured: Measured | None = None
        self._profile: profile | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._profile is not None:
            with record_function(FORWARD_END):  # an instant on the profiler's clock
                pass

    def on_after_backward(self, trainer, pl_module):
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        grads = set()
        for p in pl_module.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grads.add(grad.data_ptr())
        self.measured = _activations(self._profile, grads)
        self._profile = None


def _activations(prof: profile, grads: set[int]) -> Measured:
    allocations = []
    forward_end = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            allocations.append(node)
        elif node.name == FORWARD_END:
            forward_end.append(node.start_time_ns)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    (forward_end,) = forward_end
    allocations.sort(key=lambda node: node.start_time_ns)
    lives, open_ = [], {}
    for node in allocations:
        fields = node.extra_fields
        if fields.alloc_size > 0:
            life = {"size": fields.alloc_size, "start": node.start_time_ns, "end": None, "skip": _in_fsdp(node)}
            open_[fields.ptr] = life
            lives.append(life)
        elif fields.ptr in open_:
            life = open_.pop(fields.ptr)
            life["end"] = node.start_time_ns
            life["skip"] |= _in_fsdp(node)  # an unsharded gradient FSDP reduced and freed
    for ptr in grads:
        if ptr in open_:
            open_[ptr]["skip"] = True
    return measured_from(lives, forward_end)


class StorageMeter(L.Callback):
    """Measures the activations of training step `step` on this rank by following tensor storages, where the CPU
    allocator's record cannot be trusted: with tensor parallelism, gloo's threads free the collectives' tensors (an
    all-gather's input and output) and the profiler, which listens on the training thread only, never sees those
    frees (`ActivationMeter` then counts them alive to the end, by a different amount on each run).

    A `TorchDispatchMode` sees every operator the step runs on this thread (DTensor's and FSDP's included) and notes
    each new storage an operator outputs (a DTensor's local shard, an async collective's buffer); a weak reference to
    the storage's Python object says when it dies, whichever thread frees it (torch keeps that object alive exactly as
    long as the storage). Not activations, as for `ActivationMeter`: storages that existed before the step
    (parameters, optimizer state, the batch), parameters' gradients, and what FSDP's collectives and copies read or
    write (`c10d.*` and `fsdp.*` operators: all-gathered parameters, unsharded and reduce-scattered gradients).
    `tests/unit/estimates/test_activations.py` checks on one rank that it agrees with `ActivationMeter`.
    """

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.measured: Measured | None = None
        self._mode: _StorageLives | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.step:
            return
        existing = [*pl_module.parameters(), *pl_module.buffers(), *pytree.tree_leaves(batch)]
        for optimizer in trainer.optimizers:
            existing += [v for state in optimizer.state.values() for v in state.values()]
        self._mode = _StorageLives()
        for tensor in existing:
            if isinstance(tensor, torch.Tensor):
                self._mode.note_existing(tensor)
        self._mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._mode is not None:
            self._mode.forward_end = self._mode.clock
            self._mode.clock += 1

    def on_after_backward(self, trainer, pl_module):
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        mode.refs.clear()  # later deaths (the step's gradients, say) change nothing measured
        grads = {_key(p.grad) for p in pl_module.parameters() if p.grad is not None}
        self.measured = mode.result(grads)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    while True:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        elif hasattr(tensor, "elem") and type(tensor) is not torch.Tensor:  # AsyncCollectiveTensor
            tensor = tensor.elem
        else:
            return tensor


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return _local(tensor).untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


def _key(tensor: torch.Tensor) -> int | None:
    storage = _storage(tensor)
    return None if storage is None else storage._cdata


class _StorageLives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.existing: dict[int, weakref.ref] = {}  # a dead storage's address is reused: forget it when it dies
        self.clock = 0
        self.forward_end = 0
        self.live: dict[int, dict] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.lives: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for tensor in inputs:  # an input whose creation it did not see existed before the step (FSDP's unsharded
            if _key(tensor) not in self.live:  # parameters are storages it resizes, not new ones)
                self.note_existing(tensor)
        out = func(*args, **kwargs)
        fsdp = func.namespace in ("c10d", "fsdp")
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = _local(tensor).untyped_storage()
            key = storage._cdata
            if key in self.existing or key in self.live:
                continue
            life = {"size": storage.nbytes(), "start": self.clock, "end": None, "skip": False}
            self.live[key] = life
            self.lives.append(life)
            self.refs[key] = weakref.ref(storage, functools.partial(self._died, key))
        if fsdp:
            for tensor in [*inputs, *pytree.tree_leaves(out)]:
                if isinstance(tensor, torch.Tensor) and _key(tensor) in self.live:
                    self.live[_key(tensor)]["skip"] = True
        self.clock += 1
        return out

    def note_existing(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None and storage._cdata not in self.existing:
            key = storage._cdata
            self.existing[key] = weakref.ref(storage, lambda ref: self.existing.pop(key, None))

    def _died(self, key: int, ref) -> None:
        self.live.pop(key)["end"] = self.clock
        del self.refs[key]

    def result(self, grads: set[int]) -> Measured:
        for key in grads & set(self.live):
            self.live[key]["skip"] = True
        return measured_from(self.lives, self.forward_end)


def measured_from(lives: list[dict], forward_end: int) -> Measured:
    """Kept and peak bytes from storage lives (`size`, `start`, `end` or None, `skip`): what is alive across the
    forward's end, and the most alive at once (each meter's clock: the profiler's, or the storage tracker's)."""
    events = []
    retained = 0
    for life in lives:
        if life["skip"]:
            continue
        events.append((life["start"], life["size"]))
        if life["end"] is not None:
            events.append((life["end"], -life["size"]))
        if life["start"] <= forward_end and (life["end"] is None or life["end"] > forward_end):
            retained += life["size"]
    live = peak = 0
    for _, change in sorted(events):
        live += change
        peak = max(peak, live)
    return Measured(retained, peak)
