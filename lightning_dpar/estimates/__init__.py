"""`python -m lightning_dpar plan`: what a strategy will do to a model on N ranks, without launching anything.

The model is built on the meta device (no memory), a fake process group of N ranks stands in for the real one
(collectives do nothing), and the training code path then runs on that model (`dry_run`). The printed placements and
local shapes are those of the real run, a bad plan fails with the error training would raise, and a 65B-parameter
plan (`examples/plan/gpt_70b.yaml`) takes seconds on a laptop.

With pipeline parallelism a rank holds only its stages, so the report adds one row per stage (`PipelineReport`):
each pipeline rank is planned the same way on its own meta copy of the model, and its stages' memory is what their
ranks would hold. Llama 3 405B on 1024 ranks (`examples/plan/llama3_405b.yaml`, 16 stages) also takes seconds.

Modules: `dry_run` (`plan`: run the training code path on the fake world), `report` (what is reported, and `render()`),
`cli` (the argparse command line). Memory formulas are `lightning_dpar.estimates.state_memory`'s, activations
`lightning_dpar.estimates.activations`' (given a batch shape, from a trace of one step: `activation_trace`, with
tensor parallelism followed by `tensor_parallel_trace`), or `activation_formula`'s for a model that cannot be traced.
What a feature does to these figures is asked of the feature's own `estimate` module, pure arithmetic on numbers:
`lightning_dpar.pipeline.estimate` (microbatches in flight, stage shares, receive buffers, a rank's peak; the bubble
is `lightning_dpar.pipeline.schedule`'s), `lightning_dpar.activation_checkpointing.estimate` (the figure of each
setting, what a checkpointed layer keeps, the recomputed FLOPs), `lightning_dpar.loss_parallel.estimate` (the
logits' vocabulary shard) and `lightning_dpar.experts.estimate` (the report's expert-parallel section)."""

from lightning_dpar.estimates.cli import main
from lightning_dpar.estimates.dry_run import plan
from lightning_dpar.estimates.report import ROOT, ParamRow, PipelineReport, PlanReport, StageRow

__all__ = ["ROOT", "ParamRow", "PipelineReport", "PlanReport", "StageRow", "main", "plan"]
