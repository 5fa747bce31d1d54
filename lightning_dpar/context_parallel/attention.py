"""Attention made context-parallel: `scaled_dot_product_attention` calls, intercepted by a `TorchFunctionMode`
while the model's repeated blocks run on this rank's part of the sequence, attend to every rank's keys and values.

Method: all-gather of keys and values (as Llama 3's training did), with a boolean mask built from the tokens' global
positions. It is exact for causal attention (`is_causal=True`) and for full attention (no mask), needs one
collective per tensor and layer, and runs wherever `all_gather` / `reduce_scatter` do (gloo included). Each rank
holds every rank's keys and values of one layer at a time, `size` times its own: the price of its simplicity
(a ring exchange would hold two blocks at a time; see docs/context_parallel.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_dpar.context_parallel.exchange import ExchangeCounter, gather_key_value
from lightning_dpar.context_parallel.layout import HeadTailLayout

__all__ = ["ContextParallelAttention", "SdpaInterceptor", "UnsupportedAttentionError"]

SUPPORTED = (
    "causal attention (`is_causal=True`, no `attn_mask`) and full attention (neither), with or without grouped-query"
    " attention, dropout and `scale`"
)


class UnsupportedAttentionError(ValueError):
    """An attention call context parallelism cannot run exactly."""


class ContextParallelAttention:
    """The state of one forward under context parallelism: the whole sequence length, this rank's positions, the
    mask, and how many attention calls were made (a block that makes none is refused)."""

    def __init__(self, layout: HeadTailLayout, group: dist.ProcessGroup | None) -> None:
        self.layout = layout
        self.group = group
        self.counter = ExchangeCounter()
        self.seq_len: int | None = None
        self.calls = 0
        self.where = ""
        self._mask: Tensor | None = None

    @property
    def active(self) -> bool:
        """Whether the blocks run on this rank's part (between the first block's input and the last one's output)."""
        return self.seq_len is not None

    def begin(self, seq_len: int) -> None:
        self.seq_len, self._mask = seq_len, None

    def end(self) -> None:
        self.seq_len, self._mask = None, None

    def _causal_mask(self, device: torch.device) -> Tensor:
        """`[local, whole]`: query at global position p may see keys at positions <= p (keys in rank order)."""
        if self._mask is None or self._mask.device != device:
            assert self.seq_len is not None
            queries = self.layout.positions(self.seq_len, device=device)
            keys = self.layout.key_positions(self.seq_len, device=device)
            self._mask = queries[:, None] >= keys[None, :]
        return self._mask

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **kwargs: Any,
    ) -> Tensor:
        assert self.seq_len is not None
        local = self.seq_len // self.layout.size
        if attn_mask is not None and self.group is None:
            # Simulated (the activation estimate's trace on fake tensors): transformers cannot look into a fake
            # padding mask and builds an explicit causal mask where training, on real tensors, passes none.
            attn_mask, is_causal = None, True
        if attn_mask is not None:
            raise UnsupportedAttentionError(
                f"{self.where} called scaled_dot_product_attention with an `attn_mask` of shape"
                f" {tuple(attn_mask.shape)} under context parallelism, which supports {SUPPORTED}. Padding, document"
                " (packed-sequence) and sliding-window masks are not supported: train on unpadded sequences without"
                " an attention mask (a transformers model builds none then), or set `context_parallel_size=1`."
            )
        if query.shape[-2] != local or key.shape[-2] != local:
            raise UnsupportedAttentionError(
                f"{self.where} called scaled_dot_product_attention with {query.shape[-2]} queries and"
                f" {key.shape[-2]} keys, where this rank holds {local} of the sequence's {self.seq_len} tokens:"
                f" context parallelism supports self-attention over the split sequence ({SUPPORTED}), not cross-"
                " attention or a key/value cache."
            )
        self.calls += 1
        size = self.layout.size
        keys = gather_key_value(key, self.group, size, self.counter)
        values = gather_key_value(value, self.group, size, self.counter)
        mask = self._causal_mask(query.device) if is_causal else None
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, **kwargs
        )


class SdpaInterceptor(TorchFunctionMode):
    """Routes `torch.nn.functional.scaled_dot_product_attention` to `attention` while it is active (inside the
    blocks); every other call, and attention outside the blocks, runs unchanged. A public torch API (checked on
    torch 2.11, 2.13 and 2.15); torch's own context parallelism intercepts the same function, but maps only CUDA
    kernels."""

    def __init__(self, attention: ContextParallelAttention) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.attention.active:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)
