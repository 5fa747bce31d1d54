"""Mixture-of-Experts: everything the package does for experts modules. Expert parallelism is one step of the
parallelisation (`lightning_dpar.parallel.parallelize.STEPS`, bound in `step`): `plan` is its slice of the plan,
`parallel` how it is applied.

- `plan`: which modules are experts modules (the experts contract), found once and checked before any collective;
- `parallel`: expert parallelism, each rank holding whole experts and exchanging tokens with an all-to-all;
- `router_loss`: the router's auxiliary load-balancing loss, averaged the way one process would;
- `keys`: the checkpoint and Hugging Face key arithmetic of stacked and per-expert weights;
- `reader`: reading per-expert Hugging Face tensors into a fused (stacked) parameter's shards;
- `tracing_stand_in`: the dense stand-in an experts module runs as when activations are traced on fake tensors;
- `estimate`: the `plan` dry run's expert-parallel section; `cost`: what expert parallelism costs a layout in the
  layout search.
"""

__all__: list[str] = []
