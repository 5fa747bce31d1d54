"""lightning_dpar: composable data, fully sharded and tensor parallelism for PyTorch Lightning.

Importing the package registers the strategy names (`"dpar_replicate"`, `"dpar_fsdp"`, `"dpar_fsdp_offload"`,
`"dpar_hsdp"`, `"dpar_2d"`, `"dpar_3d"`, `"dpar_auto"`) with Lightning, so `Trainer(strategy="dpar_2d")` works.

How a step flows: `strategies` (Lightning's hooks) -> `plan` (what goes where, as data) -> `parallelize` (applied)
-> `checkpoint` (its manager owns save, load and resume). See `docs/architecture.md`. Packages and modules:

- `strategies/`: the Lightning strategies (`fully_shard`, `replicate` on `base`) and their hooks by concern
  (`processes`, `collectives`, `data_loading`, `step_hooks`, `checkpoint_hooks`, `pipeline_steps`);
- `plan/`: planning, one function `plan_modules` (see its docstring for its modules);
- `pipeline/`: pipeline parallelism (split, schedules, stages, runtime);
- `checkpoint/`: checkpoints, behind `checkpoint.manager.CheckpointManager`;
- `mesh`: mesh sizes and the device mesh; `parallelize`: applying a plan; `materialize`: meta tensors into shards;
- `ties`: tied parameters; `precision`, `clipping`: precision and gradient clipping; `optimizers`,
  `optimizer_probe`, `shard_probe`, `distributed_muon`: optimizers on shards; `buffers`, `batchnorm`, `sampling`:
  DDP semantics kept;
  `callback_checks`, `trainer_checks`: callbacks and Trainer settings a layout refuses before any collective;
- `pretrained`, `key_matching`, `hf_keys`, `peft_keys`: Hugging Face and peft weights; `consolidate`: a checkpoint
  to one file (or a Hugging Face / peft directory);
- `compilation`, `comm_hooks`, `unit_guard`, `unit_outputs`: compile options, DDP hooks, unit guards;
- `dry_run/`: the `plan` dry run (engine, report, CLI; `plan_report` keeps its old import path); `memory`: the
  memory model it reports;
- `launchers`, `process_group`: starting the ranks; `cli`, `__main__`, `progress`, `performance_monitor`,
  `weight_averaging`, `examples/`: the command line and the rest of the user-facing tools;
- `_private_api`: every private torch / Lightning API; `helpers`: small shared helpers, a leaf.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dpar.checkpoint import CheckpointLoadError
from lightning_dpar.checkpoint.inference import load_from_checkpoint
from lightning_dpar.fault_tolerance import (
    FaultTolerance,
    FaultTolerantFSDPTensorParallelStrategy,
    FaultTolerantFullyShardStrategy,
    FaultTolerantReplicateStrategy,
)
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
from lightning_dpar.strategies.auto import AutoParallelStrategy

__version__ = "0.1.0"

for _strategy in (
    ReplicateStrategy,
    FullyShardStrategy,
    FSDPTensorParallelStrategy,
    AutoParallelStrategy,
    FaultTolerantFullyShardStrategy,
    FaultTolerantReplicateStrategy,
    FaultTolerantFSDPTensorParallelStrategy,
):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "AutoParallelStrategy",
    "CheckpointLoadError",
    "DparPrecision",
    "DparStrategy",
    "FSDPTensorParallelStrategy",
    "FaultTolerance",
    "FaultTolerantFSDPTensorParallelStrategy",
    "FaultTolerantFullyShardStrategy",
    "FaultTolerantReplicateStrategy",
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
