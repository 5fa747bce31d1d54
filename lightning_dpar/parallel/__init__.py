"""The parallelisation: the ordered list of steps, the two walks over it, the model's facts, and the data-parallel
step with its wrappers.

- `parallelize`: `STEPS`, the ordered list of steps (pipeline split, float8, tensor, loss, expert and context
  parallelism, activation checkpointing, `compile`, FSDP or DDP's `replicate`, the meta tensors filled; each feature's
  step exported by its folder), `plan_modules(model, dims, options)`, which asks each step for its slice of the plan,
  and `apply_plan(model, plan, meshes, ...)`, which applies each: the functions training, the `plan` dry run and the
  layout search all call;
- `facts`: what planning finds on the model once, before any step plans, because several steps read it;
- `data_parallel`: the data-parallel step, its wrappers (`fully_shard`, `replicate`) and `reshard`;
- `fsdp_units`: the `fully_shard` wrapper that keeps a unit's outputs and gradients exact;
- `materialize`: meta tensors into each rank's own shards, with the values one process would give them;
- `compilation`: the `compile` argument's options checked, and compiled autograd's compiler;
- `ddp_comm_hooks`: the DDP communication hooks `replicate` takes.

Facts about the model (which modules, which styles, tied parameters, initialisers) come from `lightning_dpar.plan`;
the meshes from `lightning_dpar.parallel_dims`; the step contract from `lightning_dpar.steps.contract`; each
feature's step, with its slice and code, from its folder (`pipeline`, `float8`, `loss_parallel`, `experts`,
`context_parallel`, `activation_checkpointing`).
"""

__all__: list[str] = []
