"""How a sequence is split between context-parallel ranks: head-tail (zig-zag) chunks, pure index arithmetic.

Causal attention gives a query at position `p` `p + 1` keys to attend to, so with contiguous parts the last rank
would do almost `2 * size - 1` times the first rank's attention work. The sequence is cut into `2 * size` equal
chunks and rank `r` holds chunks `r` and `2 * size - 1 - r` (one from the head, one from the tail), so every rank
does the same work to within one chunk's diagonal (`attention_work` counts it). torchtitan and Megatron balance the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["HeadTailLayout", "attention_work", "cpu_mask_bytes", "key_value_sends"]


@dataclass(frozen=True)
class HeadTailLayout:
    """The head-tail split over `size` ranks, seen from `rank`."""

    size: int
    rank: int

    def check(self, seq_len: int, where: str) -> None:
        """Refuse a sequence length the split cannot cut into `2 * size` equal chunks."""
        if seq_len % (2 * self.size):
            raise ValueError(
                f"The sequence length {seq_len} reaching {where} does not divide by 2 x context_parallel_size ="
                f" {2 * self.size}: the head-tail split gives each rank two equal chunks of the sequence. Use a"
                f" sequence length that is a multiple of {2 * self.size} (pad or crop the batch), or change"
                " `context_parallel_size`."
            )

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The indices of the two chunks (of `2 * size`) that `rank` (default: this one) holds."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r

    def positions(self, seq_len: int, rank: int | None = None, device: torch.device | None = None) -> Tensor:
        """The global positions of the tokens `rank` holds, in the order it holds them."""
        chunk = seq_len // (2 * self.size)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks(rank)])

    def key_positions(self, seq_len: int, device: torch.device | None = None) -> Tensor:
        """The global positions of every rank's tokens in rank order: the order of keys gathered from all ranks."""
        return torch.cat([self.positions(seq_len, r, device) for r in range(self.size)])

    def take(self, full: Tensor, dim: int, rank: int | None = None) -> Tensor:
        """`rank`'s part of a whole-sequence tensor, along `dim`."""
        pieces = full.chunk(2 * self.size, dim)
        first, second = self.chunks(rank)
        return torch.cat([pieces[first], pieces[second]], dim)

    def assemble(self, parts: list[Tensor], dim: int) -> Tensor:
        """The whole-sequence tensor from every rank's part (in rank order), along `dim`."""
        halves = [part.chunk(2, dim) for part in parts]
        n = self.size
        return torch.cat([halves[k][0] if k < n else halves[2 * n - 1 - k][1] for k in range(2 * n)], dim)


def attention_work(seq_len: int, size: int, balanced: bool = True) -> list[int]:
    """Query-key pairs each rank's causal attention computes (its queries times the keys each may see), with the
    head-tail split (`balanced`) or with contiguous parts. The docs' table of per-rank work comes from here."""
    if balanced:
        layout = HeadTailLayout(size, 0)
        return [int((layout.positions(seq_len, r) + 1).sum()) for r in range(size)]
    part = seq_len // size
    return [int((torch.arange(r * part, (r + 1) * part) + 1).sum()) for r in range(size)]


def key_value_sends(seq_len: int, size: int, causal: bool = True) -> tuple[list[int], list[int]]:
    """Tokens of keys (and as many of values) each rank sends per attention layer: with the all-gather (all its
    tokens to every other rank), and the least any exchange could send (each token once to each other rank that has
    a query allowed to see it: under causal attention, a rank whose last query comes at or after it)."""
    layout = HeadTailLayout(size, 0)
    held = [layout.positions(seq_len, r) for r in range(size)]
    last_query = [int(positions.max()) for positions in held]
    gathered = [len(positions) * (size - 1) for positions in held]
    least = [
        sum(int((positions <= last_query[r]).sum()) if causal else len(positions) for r in range(size) if r != j)
        for j, positions in enumerate(held)
    ]
    return gathered, least


def cpu_mask_bytes(seq_len: int, size: int, rank: int = 0) -> int:
    """Bytes of the causal masks torch materialises on CPU for one attention layer of `rank` (per sequence batch of
    one): each of its two chunks' lower-right bias becomes a `chunk x prefix` mask, kept as float for the backward.
    CUDA's flash and memory-efficient kernels take the bias without a mask (0 bytes there)."""
    chunk = seq_len // (2 * size)
    return sum(4 * chunk * (index + 1) * chunk for index in HeadTailLayout(size, rank).chunks())
