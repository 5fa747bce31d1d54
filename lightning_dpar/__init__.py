"""lightning_dpar: composable data, fully sharded and tensor parallelism for PyTorch Lightning.

Importing the package registers the strategy names (`"dpar_replicate"`, `"dpar_fsdp"`, `"dpar_fsdp_offload"`,
`"dpar_hsdp"`, `"dpar_2d"`, `"dpar_3d"`, `"dpar_auto"`) with Lightning, so `Trainer(strategy="dpar_2d")` works, and
the same names (but `dpar_auto` and the fault-tolerant ones) with Fabric: `Fabric(strategy="dpar_2d")`.

How a run flows: `strategies` (Lightning's hooks) -> `plan` (what goes where, as data, computed once) ->
`parallel` (the plan applied, in torchtitan's fixed order) -> `checkpoint` (its manager owns save, load and resume).
See `docs/architecture.md`. The folders, in layers (none imports one below it; the exact order is `LAYERS` in
`tests/unit/test_import_graph.py`):

- `parallel_dims`: mesh sizes (`ParallelDims`) and every mesh of a run (`ParallelMeshes`);
- `steps/`: the contract every step of the parallelisation keeps (`Step`), which each feature's folder exports;
- `conformance/`: Lightning's DDP semantics kept (buffers, `sync_batchnorm`, samplers, weight averaging) and the
  callbacks and Trainer settings a layout refuses before any collective;
- `pipeline/`: pipeline parallelism (split, schedules, stages, runtime);
- `context_parallel/`, `activation_checkpointing/`, `loss_parallel/`, `float8/`: those features, each one step (its
  `step.py`), with its estimate and its price in the layout search;
- `plan/`: the plan as data (`ModulePlan`), a strategy's frozen `PlanOptions`, the facts and slices planning finds;
- `experts/`: Mixture-of-Experts at run time (expert parallelism, router loss, expert keys);
- `parallel/`: applying a plan (`parallelize.apply_plan`), the FSDP and DDP wrappers, materialisation, compile;
- `hf_weights/`: Hugging Face and peft weights in (`pretrained=`);
- `checkpoint/`: checkpoints, behind `checkpoint.manager.CheckpointManager`, and the Hugging Face / peft exports;
- `optim/`: which optimizers are exact on which layouts, Muon on shards, clipping, the precision plugin;
- `launch/`: devices, the process group, the launchers;
- `strategies/`: the Lightning strategies (`fully_shard`, `replicate` on `base`) and their hooks by concern;
- `estimates/`: state and activation memory, and the `plan` dry run;
- `layout_search/`: the automatic layout search and `dpar_auto`;
- `fabric/`: the same strategies behind Lightning Fabric's API, each driving the Trainer-side one (`dpar_*` names
  registered in Fabric's registry too);
- `fault_tolerance/`: per-step fault tolerance across torchft replica groups (`dpar_ft_hsdp`, optional extra `ft`);
- `cli`, `__main__`, `progress`, `performance_monitor`, `ray`, `examples/`: the command line and user-facing tools;
- `_private_api`: every private API (a module per library); `helpers`: small shared helpers; `agreement`: ranks agree on
  the first problem before a collective (all three leaves).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dpar.checkpoint import CheckpointLoadError
from lightning_dpar.checkpoint.module_from_checkpoint import load_from_checkpoint
from lightning_dpar.fabric import register_fabric_strategies
from lightning_dpar.fault_tolerance import FaultTolerance, with_fault_tolerance
from lightning_dpar.hf_weights.pretrained import PretrainedWeights
from lightning_dpar.layout_search.strategy import AutoParallelStrategy
from lightning_dpar.optim.exactness import OptimizerLayoutError, declare_update_kind
from lightning_dpar.optim.precision import DparPrecision
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.performance_monitor import PerformanceMonitor
from lightning_dpar.strategies import (
    DparStrategy,
    FSDPTensorParallelStrategy,
    FullyShardStrategy,
    ReplicateStrategy,
)

__version__ = "0.1.0"

#: The registered fault-tolerant strategies: each strategy given `fault_tolerance=` is its class composed with the
#: fault-tolerant hooks (any strategy, `AutoParallelStrategy` included); these three are registered by name.
FaultTolerantFullyShardStrategy = with_fault_tolerance(
    FullyShardStrategy, "dpar_ft_hsdp", "FSDP2 in each torchft replica group, groups replicate", __name__
)
FaultTolerantReplicateStrategy = with_fault_tolerance(
    ReplicateStrategy, "dpar_ft_replicate", "DDP in each torchft replica group, groups replicate", __name__
)
FaultTolerantFSDPTensorParallelStrategy = with_fault_tolerance(
    FSDPTensorParallelStrategy, "dpar_ft_2d", "TP + FSDP2 in each torchft replica group, groups replicate", __name__
)

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
register_fabric_strategies()  # the same names in Fabric's registry (`lightning_dpar.fabric`)

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
