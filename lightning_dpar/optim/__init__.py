"""Optimizers on sharded parameters, exactly: which optimizers train as one process would, and the numerics around
the step.

- `exactness`: the rule that decides whether an optimizer's update is exact on shards (`declare_update_kind`,
  `OptimizerLayoutError`);
- `update_probe`, `shard_probe`: the probes that test an unknown optimizer's update on whole and sharded tensors;
- `distributed_muon`: Muon's whole-matrix update on sharded parameters;
- `clipping`: gradient-norm clipping over every mesh a parameter is split on;
- `nonfinite`: the non-finite step guard (`on_nonfinite`): each step's loss and reduced gradients checked before
  clipping, the ranks agreeing in one small all-reduce (or in the clipping norm's), the step raised or skipped;
- `precision`: `DparPrecision`, the precision plugin (mixed and true half precision) that owns clipping.
"""

__all__: list[str] = []
