"""What crosses a stage boundary: a unit's output, described without its data so the next stage can receive it.

A unit returns a tensor, or a tuple or list of tensors and constants (`None`, numbers, strings), possibly nested
(older transformers layers return `(hidden_states,)`). `describe` turns such a value into a picklable spec, `tensors`
lists its tensors in a fixed order, and `rebuild` puts received tensors back into the same structure. `fabricate`
builds a stand-in of the right shapes for a unit that runs on another stage, so the code between units (masks and
positions derived from a hidden state's shape) runs unchanged on every stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSpec", "ValueSpec", "describe", "fabricate", "rebuild", "tensor_specs", "tensors"]

CONSTANTS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (no data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def example(self, requires_grad: bool) -> torch.Tensor:
        """A meta tensor of this shape, as torch's `PipelineStage` takes for its input and output metadata."""
        tensor = torch.empty(self.shape, dtype=self.dtype, device="meta")
        return tensor.requires_grad_(requires_grad and self.dtype.is_floating_point)


@dataclass(frozen=True)
class SequenceSpec:
    kind: type  # tuple or list
    items: tuple[ValueSpec, ...]


@dataclass(frozen=True)
class ConstantSpec:
    value: Any


ValueSpec = TensorSpec | SequenceSpec | ConstantSpec


def describe(value: Any, where: str) -> ValueSpec:
    """The spec of a unit's output; `where` names the unit for the error on an unsupported type."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), value.dtype)
    if type(value) in (tuple, list):
        return SequenceSpec(type(value), tuple(describe(item, where) for item in value))
    if isinstance(value, CONSTANTS):
        return ConstantSpec(value)
    raise TypeError(
        f"{where} returned a {type(value).__name__}; a module at a pipeline stage boundary must return a tensor, or"
        " a tuple or list of tensors and constants, which the next stage receives. Split at another module"
        " (`pipeline_split`), or return a tuple from this one."
    )


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a value described by `describe`, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) in (tuple, list):
        for item in value:
            yield from tensors(item)


def rebuild(spec: ValueSpec, received: Iterator[torch.Tensor]) -> Any:
    """The value `spec` describes, with its tensors taken in order from `received`."""
    if isinstance(spec, TensorSpec):
        return next(received)
    if isinstance(spec, SequenceSpec):
        return spec.kind(rebuild(item, received) for item in spec.items)
    return spec.value


def fabricate(spec: ValueSpec, device: torch.device) -> Any:
    """A stand-in for the value `spec` describes: zeros of the right shapes and dtypes."""
    if isinstance(spec, TensorSpec):
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    if isinstance(spec, SequenceSpec):
        return spec.kind(fabricate(item, device) for item in spec.items)
    return spec.value


def tensor_specs(spec: ValueSpec) -> list[TensorSpec]:
    """The tensor specs of `spec`, in the order `tensors` yields the tensors."""
    if isinstance(spec, TensorSpec):
        return [spec]
    if isinstance(spec, SequenceSpec):
        return [leaf for item in spec.items for leaf in tensor_specs(item)]
    return []
