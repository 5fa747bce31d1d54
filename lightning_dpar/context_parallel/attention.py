"""Attention made context-parallel: `scaled_dot_product_attention` calls, intercepted by a `TorchFunctionMode`
while the model's repeated blocks run on this rank's part of the sequence, attend to every rank's keys and values.

Method: all-gather of keys and values (as Llama 3's training did), reassembled in global order. Under causal
attention each of this rank's two chunks attends to the keys from the sequence's start to its own chunk's end, with
torch's lower-right-aligned causal bias (`torch.nn.attention.bias.causal_lower_right`, public): on CUDA the flash and
memory-efficient kernels take it without materialising a mask, and each rank computes exactly its causal work (no
masked-out pairs); on CPU it is a boolean mask (chunk x prefix), as torch would materialise it. Full attention
attends to every key.
Exact, one collective per tensor and layer, and it runs wherever `all_gather` / `reduce_scatter` do (gloo
included). Each rank holds every rank's keys and values of one layer at a time, `size` times its own: the price of
its simplicity (a ring exchange would hold two blocks at a time; see docs/context_parallel.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.overrides import TorchFunctionMode

from lightning_dpar.context_parallel.exchange import ExchangeCounter, gather_key_value
from lightning_dpar.context_parallel.layout import HeadTailLayout

__all__ = ["ContextParallelAttention", "SdpaInterceptor", "UnsupportedAttentionError", "attend"]

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

    @property
    def active(self) -> bool:
        """Whether the blocks run on this rank's part (between the first block's input and the last one's output)."""
        return self.seq_len is not None

    def begin(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def end(self) -> None:
        self.seq_len = None

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
        keys = gather_key_value(key, self.layout, self.group, self.counter)
        values = gather_key_value(value, self.layout, self.group, self.counter)
        traced = self.group is None  # the activation estimate's trace, on fake tensors
        return attend(query, keys, values, self.layout, is_causal, traced, dropout_p=dropout_p, scale=scale, **kwargs)


def attend(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    layout: HeadTailLayout,
    is_causal: bool,
    memory_only: bool = False,
    **kwargs: Any,
) -> Tensor:
    """This rank's queries (its two chunks, in the order it holds them) attending to the whole sequence's `keys` and
    `values` (global order): each chunk to the keys up to its own end, the causal mask aligned to the lower right
    (the chunk's queries are that prefix's last ones); every key under full attention.

    `memory_only` (the activation estimate's trace on fake tensors, which cannot become a `CausalBias`): the same
    calls with an upper-left causal flag instead of the lower-right bias, wrong values but the storages of a causal
    kernel that takes no mask, which is what CUDA's flash and memory-efficient kernels do with the bias. (On CPU the
    bias is a mask per call, `cpu_mask_bytes`, which the estimate does not count.)"""
    if kwargs.pop("enable_gqa", False) and keys.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // keys.shape[-3]  # what grouped-query attention shares, spelled out
        keys, values = keys.repeat_interleave(repeat, dim=-3), values.repeat_interleave(repeat, dim=-3)
    if not is_causal:
        return F.scaled_dot_product_attention(query, keys, values, **kwargs)
    chunk = keys.shape[-2] // (2 * layout.size)
    outputs = []
    for index, queries in zip(layout.chunks(), query.split(chunk, dim=-2)):
        end = (index + 1) * chunk
        causal = {"is_causal": True} if memory_only else {"attn_mask": _lower_right(chunk, end, query.device)}
        prefix = keys[..., :end, :], values[..., :end, :]
        outputs.append(F.scaled_dot_product_attention(queries, *prefix, **causal, **kwargs))
    return torch.cat(outputs, dim=-2)


def _lower_right(queries: int, keys: int, device: torch.device) -> Tensor:
    """The lower-right causal bias of `queries` x `keys`: torch's `CausalBias` where a kernel takes it without a mask
    (CUDA's flash and memory-efficient attention), the boolean mask torch would materialise for it on CPU. A
    `CausalBias` cannot be made while a `TorchDispatchMode` runs (a profiler, a FLOP counter): the mask then too."""
    if device.type != "cpu":
        try:
            return causal_lower_right(queries, keys)
        except RuntimeError:
            pass
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


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
