"""Applying a plan: the one pass that turns a model into its parallel form, in torchtitan's fixed order.

- `parallelize`: `STEPS`, the ordered list of steps (pipeline split, tensor, expert and context parallelism,
  activation checkpointing, `compile`, FSDP or DDP's `replicate`, the meta tensors filled), and `apply_plan(model,
  plan, meshes, ...)`, which walks it: the function training and the `plan` dry run both call;
- `fsdp_units`: the `fully_shard` wrapper that keeps a unit's outputs and gradients exact;
- `materialize`: meta tensors into each rank's own shards, with the values one process would give them;
- `compilation`: the `compile` argument's options checked, and compiled autograd's compiler;
- `ddp_comm_hooks`: the DDP communication hooks `replicate` takes.

Facts about the model (which modules, which styles, tied parameters, initialisers) come from `lightning_dpar.plan`;
the meshes from `lightning_dpar.parallel_dims`. Mixture-of-Experts layers are wrapped by `lightning_dpar.experts`.
"""

__all__: list[str] = []
