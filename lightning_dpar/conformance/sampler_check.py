"""A training loader's own `DistributedSampler` (`Trainer(use_distributed_sampler=False)`) checked against the mesh.

Lightning's DDP gives every rank different batches, so a user's `DistributedSampler(dataset)`, which shards over the
world, is right there. With tensor or pipeline parallelism only the data-parallel ranks see different batches:
tensor-parallel peers and pipeline stages must see the same ones (the last stage computes the loss on its own
loader's labels). A sampler that shards over the world instead would silently train on mismatched rows, so it is
refused before the first step. The check compares the number of shards, which is the same on every rank, so every
rank raises together.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler

__all__ = [
    "check_sampler_shards",
]


def check_sampler_shards(dataloader: object, num_replicas: int, world_size: int) -> None:
    """Refuse a `DistributedSampler` in `dataloader` (as its sampler or its batch sampler's) that splits the data
    into other than `num_replicas` (the data-parallel size) shards."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for sampler in (getattr(dataloader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas != num_replicas:
            raise ValueError(
                f"The training loader's `DistributedSampler` splits the data into {sampler.num_replicas} shards, but"
                f" only {num_replicas} of the {world_size} ranks see different batches (the others are their tensor-"
                " parallel peers or pipeline stages, which need the same batches). With"
                " `Trainer(use_distributed_sampler=False)`, build it with"
                " `DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)`"
                f" (num_replicas={num_replicas}, rank=this rank's data-parallel rank), or let Lightning add it"
                " (`use_distributed_sampler=True`)."
            )
