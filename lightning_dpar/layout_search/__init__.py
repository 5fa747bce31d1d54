"""Choosing the layout: a cost model as data and a search over every valid layout for a world size.

- `profiles`: hardware profiles (presets, and JSON files `calibrate` writes);
- `model_facts`: what the cost model reads off a model (parameters, layers, width, experts, batch);
- `candidates`: every layout considered for a world, and those refused by arithmetic, with the reason;
- (the activation-memory formula it falls back on is `lightning_dpar.estimates.activation_formula`);
- `cost`: one layout's per-rank peak memory and step time;
- `search`: all layouts priced and ranked, and what would fit when nothing does (pure, given a dry-run probe);
- `probe`: the dry run's per-rank numbers for a layout's mesh (the real planning and wrapping, on meta tensors);
- `report`, `cli`: the ranked table and `python -m lightning_dpar plan --auto`;
- `calibrate`: measuring this machine into a profile.

Each feature's pricing is its own folder's `cost` module, pure functions `candidates` and `cost` call: which sizes,
schedules and microbatches it offers and what it refuses, and its terms of the step time (`pipeline.cost`,
`context_parallel.cost`, `experts.cost`, `loss_parallel.cost`, `activation_checkpointing.cost`, `float8.cost`).

See docs/auto-layout.md.
"""

__all__: list[str] = []
