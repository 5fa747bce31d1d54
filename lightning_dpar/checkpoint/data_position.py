"""Where the training data stands within an epoch, and a sampler that can start an epoch there.

Lightning repositions a dataloader mid-epoch only if the loader is stateful; a plain `DataLoader` would restart the
epoch from its first batch. The training loader's `DistributedSampler` (the one Lightning inserts) is therefore
swapped for a `ResumableDistributedSampler` (`make_resumable`), which can start an epoch part-way.

The data rule. A checkpoint records how many samples of the current epoch's global order the data-parallel ranks
have consumed (`batches done x batch size x data-parallel size`). On resume, that prefix of the epoch's shuffled
order is skipped and the rest is dealt out to the new data-parallel ranks (`rest[rank::dp]`). With the same
data-parallel size this is exactly the stream the uninterrupted run would have read; with another size every
remaining sample is still seen once in this epoch, none repeats, and the epoch's batch count on each rank becomes
`batches done + ceil(remaining per rank / batch size)`. A loader with a custom sampler cannot start part-way: with
the same data-parallel size the strategy replays and drops the batches already seen; otherwise the epoch restarts,
with a warning.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

__all__ = ["DataPosition", "ResumableDistributedSampler", "make_resumable"]


@dataclass(frozen=True)
class DataPosition:
    """How far the data-parallel ranks got into an epoch; stored in the checkpoint's `meta.pt`."""

    epoch: int
    batches: int  # batches each rank completed in this epoch (Lightning's batch progress)
    consumed: int  # samples of the epoch's global order consumed by all data-parallel ranks together

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch after a consumed prefix of its global order.

    Without a resume position it yields exactly what `DistributedSampler` yields.
    """

    batch_size: int
    _start: DataPosition | None

    @classmethod
    def adopt(cls, sampler: DistributedSampler, batch_size: int) -> ResumableDistributedSampler:
        """Take over the configuration (dataset, replicas, rank, seed, shuffle, epoch) of Lightning's sampler."""
        resumable = cls.__new__(cls)
        resumable.__dict__.update(sampler.__dict__)
        resumable.batch_size = batch_size
        resumable._start = None
        return resumable

    def start_at(self, position: DataPosition) -> None:
        self._start = position

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._start is not None and self._start.epoch != epoch:
            self._start = None  # a resume position applies to its own epoch only

    def position(self, batches_done: int) -> DataPosition:
        """Where the ranks are after `batches_done` batches of the current epoch (counting from a resume point)."""
        start = self._active_start()
        base_batches, base_consumed = (start.batches, start.consumed) if start else (0, 0)
        consumed = base_consumed + (batches_done - base_batches) * self.batch_size * self.num_replicas
        return DataPosition(self.epoch, batches_done, consumed)

    def _active_start(self) -> DataPosition | None:
        return self._start if self._start is not None and self._start.epoch == self.epoch else None

    def _remaining_for_rank(self, start: DataPosition) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        rest = order[start.consumed :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        elif rest and len(rest) % self.num_replicas:
            padding = self.num_replicas - len(rest) % self.num_replicas
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
        return rest[self.rank :: self.num_replicas]

    def __iter__(self):  # type: ignore[no-untyped-def]
        start = self._active_start()
        if start is None:
            return super().__iter__()
        return iter(self._remaining_for_rank(start))

    def __len__(self) -> int:
        start = self._active_start()
        if start is None:
            return super().__len__()
        # Lightning counts this epoch's batches from its start: report the batches already done plus the rest.
        return start.batches * self.batch_size + len(self._remaining_for_rank(start))


def make_resumable(dataloader: object) -> ResumableDistributedSampler | None:
    """Swap the `DistributedSampler` Lightning inserted into a training `DataLoader` for a resumable one.

    Only the plain case is taken over (a `BatchSampler` with a fixed batch size over a `DistributedSampler`);
    a custom sampler or batch sampler is left alone (see the module docstring for how it resumes).
    """
    if not isinstance(dataloader, DataLoader):
        return None
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler or type(batch_sampler.sampler) is not DistributedSampler:
        return None
    sampler = ResumableDistributedSampler.adopt(batch_sampler.sampler, batch_sampler.batch_size)
    # `DataLoader` forbids re-assigning its sampler, but its batch sampler (which Lightning built) is a plain object.
    batch_sampler.sampler = sampler
    return sampler
