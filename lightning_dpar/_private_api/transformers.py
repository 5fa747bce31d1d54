"""transformers' private names the package relies on: a model's per-module initialiser, its merged tensor-parallel
plan, its attention implementation, and the packed-sequence check the activation trace must answer as a real step
does. Checked on transformers 5.17 and 5.24; each says why it is needed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_dpar._private_api.torch_core import FakeTensor

__all__ = [
    "transformers_attention_implementation",
    "transformers_module_initialiser",
    "transformers_supports_sdpa",
    "transformers_tp_plan_attribute",
    "unpacked_positions_on_fake_tensors",
]


def transformers_module_initialiser(model: Any) -> Any:
    """A transformers `PreTrainedModel`'s per-module initialiser, `_init_weights(module)`: what its own
    `post_init` / `init_weights` apply to every submodule (and where rotary `inv_freq` is recomputed). transformers
    has no public per-module entry point, and meta init must initialise one module at a time."""
    return model._init_weights


def transformers_tp_plan_attribute(model: Any) -> Any:
    """The whole-model tensor-parallel plan transformers merges in `post_init` (`_tp_plan`); read-only, and the
    only place the plans of the model's heads (e.g. `lm_head`) are combined with the base model's."""
    return getattr(model, "_tp_plan", None)


def transformers_supports_sdpa(module: Any) -> bool:
    """Whether a transformers model's family has an SDPA attention at all (class flag `_supports_sdpa`; Gemma 2 not)."""
    return bool(getattr(type(module), "_supports_sdpa", True))


def transformers_attention_implementation(module: Any) -> str | None:
    """The attention implementation a transformers model runs (`config._attn_implementation`: `"sdpa"`, `"eager"`,
    `"flash_attention_2"`, `"flex_attention"`, ...), or None for a module without a transformers config. transformers
    has no public reader; `_attn_implementation` is what its own attention layers dispatch on (checked on
    transformers 5.24)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


@contextmanager
def unpacked_positions_on_fake_tensors() -> Iterator[None]:
    """Inside, transformers' packed-sequence check (`masking_utils.find_packed_sequence_indices`) reports one sequence
    per row for fake position ids, as it does for the `0 .. n-1` a decoder makes itself: unable to read fake values,
    it reports packing, and a traced step builds a `tokens x tokens` causal mask the real step (no attention mask)
    never builds. No public switch; checked on transformers 5.17 and 5.24; a no-op without it."""
    utils = sys.modules.get("transformers.masking_utils")  # not imported: no transformers model to trace
    original = getattr(utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    utils.find_packed_sequence_indices = lambda ids: None if isinstance(ids, FakeTensor) else original(ids)
    try:
        yield
    finally:
        utils.find_packed_sequence_indices = original
