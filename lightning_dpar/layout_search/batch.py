"""The batch one data-parallel rank trains on, as a function of the data-parallel size: what the layout search prices
each layout at.

Two ways to state it, as trainers do: a fixed per-rank batch (a `DataLoader`'s `batch_size`; Lightning's own
convention), or a fixed global batch split over the data-parallel ranks (torchtitan's `global_batch_size`,
Megatron's `global_batch_size`), where a layout with fewer data-parallel ranks gives each a larger share. A
`BatchRule` holds either, plus what the training data was seen to yield at each data-parallel size (a loader sized
from `trainer.distributed_sampler_kwargs`), and says for each size the batch or why there is none. Pure and
picklable: the search runs it in a child process.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dpar.helpers import divisors

__all__ = ["BatchRule"]


@dataclass(frozen=True)
class BatchRule:
    """Samples per data-parallel rank per step, for each data-parallel size.

    `per_rank`: the same at every size. `global_batch`: split evenly over the data-parallel ranks. `observed`: the
    batch the training data yields at some sizes (`(size, batch)` pairs), read off its loader; with `global_batch`
    it must agree with it, alone it is the rule where it was read (and the rule it follows elsewhere). `source`
    names the data in messages.
    """

    per_rank: int | None = None
    global_batch: int | None = None
    observed: tuple[tuple[int, int], ...] = ()
    source: str = "the training data"

    def __post_init__(self) -> None:
        for name in ("per_rank", "global_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"`{name}={value!r}` is invalid: give a positive number of samples.")
        if self.per_rank is not None and self.global_batch is not None:
            raise ValueError("Give a per-rank batch or a global batch, not both.")

    @classmethod
    def observe(cls, sizes: dict[int, int], source: str) -> BatchRule:
        """The rule of data seen to yield `sizes[d]` per rank at `d` data-parallel ranks: a fixed per-rank batch if
        every size gave the same, else a global batch if every size gave the same total, else the table."""
        if len(set(sizes.values())) == 1:
            return cls(per_rank=next(iter(sizes.values())), source=source)
        totals = {d * b for d, b in sizes.items()}
        global_batch = totals.pop() if len(totals) == 1 else None
        return cls(global_batch=global_batch, observed=tuple(sorted(sizes.items())), source=source)

    def at(self, data_parallel: int) -> int | str:
        """The per-rank batch at `data_parallel` ranks, or why no batch is possible there."""
        seen = dict(self.observed).get(data_parallel)
        if self.per_rank is not None:
            return self.per_rank
        if self.global_batch is not None:
            share, rest = divmod(self.global_batch, data_parallel)
            if rest:
                return (
                    f"a global batch of {self.global_batch} does not split evenly over {data_parallel} data-parallel"
                    " ranks"
                )
            if seen is not None and seen != share:
                return f"{self.source} yields {seen} per rank, not {self.global_batch} / {data_parallel} = {share}"
            return share
        if seen is not None and seen > 0:
            return seen
        return f"{self.source} was not read at {data_parallel} data-parallel ranks"

    def sizes(self, world_size: int) -> dict[int, int | str]:
        """`at` for every data-parallel size of `world_size` ranks (its divisors)."""
        return {d: self.at(d) for d in divisors(world_size)}

    def describe(self) -> str:
        """What the search trains, for its report: e.g. `4 sequences per data-parallel rank`."""
        if self.per_rank is not None:
            return f"{self.per_rank} sequences per data-parallel rank"
        if self.global_batch is not None:
            return f"a global batch of {self.global_batch} sequences, split over the data-parallel ranks"
        table = ", ".join(f"{b} at {d}" for d, b in self.observed)
        return f"per data-parallel rank, {table} data-parallel ranks ({self.source})"
