"""States shaped like the model that callbacks put into a checkpoint besides its `state_dict`: the training weights
Lightning's `WeightAveraging` sets aside under `current_model_state` (its `state_dict` then holds the averaged
weights), and the averaged weights `StochasticWeightAveraging` keeps in its callback state (`average_model_state`).

Under a sharded strategy these hold DTensor shards, or, with pipeline parallelism, only this stage's tensors, like the
model's own state, so they are saved and loaded the way the model is:

- sharded format: each is written by DCP under a top-level key of its own (every rank its shards) and replaced in
  `meta.pt` by a marker naming that key; a load reads it into tensors laid out like the model's (resharding to this
  run's layout) and puts it back where the marker was;
- full format: each is gathered into whole tensors on rank 0 like the model, and a load lays it out like the model.

A load that finds such states also hands Lightning the loaded `state_dict` (callbacks that read one read both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "SHARDED_ENTRY",
    "distribute_like",
    "gather_whole",
    "holds_dtensors",
    "keyed_like",
    "marked_entries",
    "model_shaped_entries",
]

#: The `meta.pt` marker of a state written to DCP: `{SHARDED_ENTRY: top-level DCP key}`.
SHARDED_ENTRY = "dpar_sharded_entry"
#: The DCP key prefix of model-shaped callback states (callback state keys hold dots and braces, DCP keys cannot).
CALLBACK_STATE_PREFIX = "callback_state_"

Place = tuple[dict[str, Any], str, str]  # (container, key in it, top-level DCP key)


def keyed_like(model_keys: set[str]) -> Callable[[Any], bool]:
    """Whether a value is a state keyed like the model's (a non-empty dict of tensors under model keys)."""

    def test(value: Any) -> bool:
        return (
            isinstance(value, Mapping)
            and bool(value)
            and all(isinstance(k, str) and k in model_keys and isinstance(v, Tensor) for k, v in value.items())
        )

    return test


def holds_dtensors(value: Any) -> bool:
    """Whether a value is a state holding DTensor shards."""
    return isinstance(value, Mapping) and any(isinstance(v, DTensor) for v in value.values())


def model_shaped_entries(checkpoint: dict[str, Any], is_state: Callable[[Any], bool]) -> Iterator[Place]:
    """Where `checkpoint` (Lightning's dict) holds states for which `is_state` holds: top-level entries and fields
    of callback states. The callback states are copied first, so the caller may replace entries without touching
    the callbacks' own dicts."""
    for key, value in list(checkpoint.items()):
        if key != "callbacks" and is_state(value):
            yield checkpoint, key, key
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, dict):
        checkpoint["callbacks"] = callbacks = {k: dict(v) if isinstance(v, dict) else v for k, v in callbacks.items()}
        index = 0
        for state in callbacks.values():
            if isinstance(state, dict):
                for field, value in list(state.items()):
                    if is_state(value):
                        yield state, field, f"{CALLBACK_STATE_PREFIX}{index}"
                        index += 1


def marked_entries(metadata: dict[str, Any]) -> Iterator[Place]:
    """The markers a sharded save left in `meta.pt`, with the DCP key each names."""

    def marker(value: Any) -> str | None:
        return value.get(SHARDED_ENTRY) if isinstance(value, dict) and len(value) == 1 else None

    for key, value in metadata.items():
        if marker(value) is not None:
            yield metadata, key, marker(value)
    callbacks = metadata.get("callbacks")
    if isinstance(callbacks, dict):
        for state in callbacks.values():
            if isinstance(state, dict):
                for field, value in state.items():
                    if marker(value) is not None:
                        yield state, field, marker(value)


def gather_whole(state: Mapping[str, Any]) -> dict[str, Any]:
    """Whole CPU tensors of a state of DTensors (a collective on each DTensor's mesh, in key order: every rank holds
    the same keys)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


def distribute_like(state: Mapping[str, Tensor], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Whole tensors (every rank holds them) laid out like `like`'s tensors of the same names."""
    laid_out = {}
    for key, value in state.items():
        target = like[key]
        value = value.to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):
            value = distribute_tensor(value, target.device_mesh, target.placements)
        laid_out[key] = value
    return laid_out
