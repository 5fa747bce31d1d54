"""Lightning conformance: what keeps a parallel run behaving as Lightning's DDP does, and the refusals, before any
collective, of what a layout cannot run exactly (each names the Trainer flag or callback and what to change).

- `buffers`: buffers kept equal across ranks, as DDP's broadcast keeps them;
- `batchnorm`: `sync_batchnorm=True` over the data-parallel group, and batch norm in pipeline stages;
- `sampler_check`: the sampler a strategy needs for distinct per-rank data;
- `weight_averaging`: Lightning's weight-averaging callbacks on sharded parameters;
- `callback_checks`, `trainer_checks`: callbacks and Trainer settings a layout refuses;
- `unit_guard`: an error, at the first backward, for a DDP unit whose own `forward` never ran (its gradients would
  not be synchronised).
"""

__all__: list[str] = []
