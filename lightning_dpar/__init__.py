"""lightning_dpar: composable data, fully sharded and tensor parallelism for PyTorch Lightning.

Importing the package registers the strategy names (`"dpar_replicate"`, `"dpar_fsdp"`, `"dpar_fsdp_offload"`,
`"dpar_hsdp"`, `"dpar_2d"`) with Lightning, so `Trainer(strategy="dpar_2d")` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dpar.checkpoint import CheckpointLoadError
from lightning_dpar.checkpoint.inference import load_from_checkpoint
from lightning_dpar.mesh import ParallelDims
from lightning_dpar.optimizers import OptimizerLayoutError, declare_update_kind
from lightning_dpar.performance_monitor import PerformanceMonitor
from lightning_dpar.precision import DparPrecision
from lightning_dpar.pretrained import PretrainedWeights
from lightning_dpar.strategies import (
    DparStrategy,
    FSDPTensorParallelStrategy,
    FullyShardStrategy,
    ReplicateStrategy,
)

__version__ = "0.1.0"

for _strategy in (ReplicateStrategy, FullyShardStrategy, FSDPTensorParallelStrategy):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "CheckpointLoadError",
    "DparPrecision",
    "DparStrategy",
    "FSDPTensorParallelStrategy",
    "FullyShardStrategy",
    "OptimizerLayoutError",
    "ParallelDims",
    "PerformanceMonitor",
    "PretrainedWeights",
    "ReplicateStrategy",
    "__version__",
    "declare_update_kind",
    "load_from_checkpoint",
]
