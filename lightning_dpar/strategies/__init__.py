"""The package's Lightning strategies: `base` (Lightning's hooks every strategy shares), `fully_shard` (FSDP2, HSDP,
2D and 3D), `replicate` (DDP, and DDP + tensor parallelism), and `pipeline_steps` (the step hooks routed through a
pipeline schedule)."""

from lightning_dpar.strategies.base import DparStrategy
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.strategies.replicate import ReplicateStrategy

__all__ = ["DparStrategy", "FSDPTensorParallelStrategy", "FullyShardStrategy", "ReplicateStrategy"]
