"""The package's Lightning strategies."""

from lightning_dpar.strategies.base import DparStrategy
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.strategies.replicate import ReplicateStrategy

__all__ = ["DparStrategy", "FSDPTensorParallelStrategy", "FullyShardStrategy", "ReplicateStrategy"]
