"""Staging for async saves: copy this rank's shards into CPU buffers kept from one save to the next, in one fused
copy, so training can change its parameters while the background thread writes the copy.

DCP's own stager deep-copies the state dict object by object (each DTensor through its Python deepcopy), which on a
state of a few hundred small tensors costs more than the copy itself. Here the tensors are collected once, copied
with one `torch._foreach_copy_` (the documented "foreach" operation; tensor by tensor from a GPU) into buffers
allocated on the first save (pinned on GPU machines), and handed out as DTensors with their original mesh and
placements; everything else in the state dict (optimizer hyperparameters, step counters) is copied as plain values.
The DTensor wrapping each buffer is kept too: wrapping goes through autograd (`DTensor.from_local`) and costs about
as much as the copy on a CPU state of this size, and a buffer's wrapper stays valid while its layout does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

__all__ = ["ReusedBufferStager"]


@dataclass(frozen=True)
class _Slot:
    """Where the `index`-th tensor of the state dict goes back in."""

    index: int


@dataclass(frozen=True)
class _Wrapper:
    """The DTensor handed out for a buffer, and the layout it was made for."""

    buffer: torch.Tensor
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dtensor: DTensor

    def fits(self, buffer: torch.Tensor, source: DTensor) -> bool:
        return (
            self.buffer is buffer
            and self.mesh is source.device_mesh
            and self.placements == source.placements
            and self.shape == source.shape
            and self.stride == source.stride()
        )


class ReusedBufferStager:
    """Copies a state dict into CPU buffers reused across saves. Synchronous (the copy is complete when `stage`
    returns). Not thread-safe: one save at a time (the writer waits for the previous write before staging again,
    since that write reads the buffers)."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: list[torch.Tensor] = []
        self._wrappers: list[_Wrapper | None] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` whose tensors live in this stager's CPU buffers."""
        tensors: list[torch.Tensor] = []
        skeleton = _collect(state_dict, tensors)
        sources = [(t.to_local() if isinstance(t, DTensor) else t).detach() for t in tensors]
        buffers = self._buffers_for(sources)
        if buffers and all(source.device.type == "cpu" for source in sources):
            torch._foreach_copy_(buffers, sources)
        else:  # device to (pinned) host: plain blocking copies, whose semantics do not depend on foreach's device rules
            for buffer, source in zip(buffers, sources):
                buffer.copy_(source)
        return _fill(skeleton, self._wrapped(buffers, tensors))

    def close(self) -> None:
        self._buffers = []
        self._wrappers = []

    def _buffers_for(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The kept buffer of each position if it still fits (same shape, stride and dtype), else a new one."""
        buffers = []
        for position, source in enumerate(sources):
            kept = self._buffers[position] if position < len(self._buffers) else None
            if kept is None or not _same_layout(kept, source):
                kept = torch.empty_strided(
                    source.size(), source.stride(), dtype=source.dtype, device="cpu", pin_memory=self.pin_memory
                )
            buffers.append(kept)
        self._buffers = buffers
        return buffers

    def _wrapped(self, buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each buffer as what its source was: a DTensor of the same mesh, placements and global shape (the kept
        wrapper when it still fits), or the plain buffer."""
        staged: list[torch.Tensor] = []
        wrappers: list[_Wrapper | None] = []
        for position, (buffer, source) in enumerate(zip(buffers, tensors)):
            wrapper = None
            if isinstance(source, DTensor):
                wrapper = self._wrappers[position] if position < len(self._wrappers) else None
                if wrapper is None or not wrapper.fits(buffer, source):
                    dtensor = DTensor.from_local(
                        buffer,
                        source.device_mesh,
                        source.placements,
                        run_check=False,
                        shape=source.shape,
                        stride=source.stride(),
                    )
                    wrapper = _Wrapper(
                        buffer, source.device_mesh, source.placements, source.shape, source.stride(), dtensor
                    )
            wrappers.append(wrapper)
            staged.append(wrapper.dtensor if wrapper is not None else buffer)
        self._wrappers = wrappers
        return staged


def _same_layout(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.size() == source.size() and buffer.stride() == source.stride() and buffer.dtype == source.dtype


def _collect(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The state dict with each tensor replaced by its `_Slot`; other values copied (the original stays live)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, (str, int, float, bool, type(None))):  # immutable: nothing to copy
        return obj
    if isinstance(obj, dict):
        return {key: _collect(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_collect(value, tensors) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_collect(value, tensors) for value in obj)
    return copy.deepcopy(obj)


def _fill(skeleton: Any, staged: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return staged[skeleton.index]
    if isinstance(skeleton, dict):
        return {key: _fill(value, staged) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(value, staged) for value in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(value, staged) for value in skeleton)
    return skeleton
