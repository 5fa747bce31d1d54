"""The package's Lightning strategies: `fully_shard` (FSDP2, HSDP, 2D and 3D) and `replicate` (DDP, and DDP + tensor
parallelism), on `base.DparStrategy` (their arguments and `setup`: plan, apply, pretrained weights, optimizers).
Lightning's other hooks every strategy shares, one mixin of `DparStrategy` per concern: `processes` (launch, ranks,
process group, device mesh), `collectives` (barrier, broadcast, data-parallel reductions), `data_loading` (sampler
shards, the loader positioned for a resume), `step_hooks` (steps, backward, optimizer step, gradient-sync control) and
`checkpoint_hooks` (save, load, removal, resume state, through the checkpoint manager); a step that takes the
training step over (the pipeline's schedule) does so through its runner (`Step.runner`). `auto`
(`AutoParallelStrategy`) is not imported here: it runs the layout search, which imports the dry run, which imports
these strategies; `lightning_dpar/__init__.py` registers it."""

from lightning_dpar.strategies.base import DparStrategy
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.strategies.replicate import ReplicateStrategy

__all__ = ["DparStrategy", "FSDPTensorParallelStrategy", "FullyShardStrategy", "ReplicateStrategy"]
