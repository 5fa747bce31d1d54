"""The layout search's window on the dry run: a layout's mesh planned and wrapped for real (the `plan` dry run's
engine, a fake process group and meta tensors), reduced to the per-rank numbers the cost model needs.

The dry run is what makes the search honest about what cannot run: a tensor-parallel size that does not divide the
heads, a pipeline with more stages than layers, an expert-parallel size that does not divide the experts fail here
with the planner's own message, exactly as training would fail.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_dpar.activation_checkpointing.cost import selective_share
from lightning_dpar.activation_checkpointing.step import Checkpointing
from lightning_dpar.context_parallel.cost import check_traced
from lightning_dpar.estimates.activations import ActivationEstimate, TraceCache
from lightning_dpar.estimates.dry_run import plan, strategy_activations
from lightning_dpar.estimates.report import PlanReport
from lightning_dpar.helpers import attached_trainer
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.candidates import Layout
from lightning_dpar.layout_search.cost import MeshMemory, RankMemory
from lightning_dpar.layout_search.model_facts import facts_of
from lightning_dpar.layout_search.profiles import HardwareProfile
from lightning_dpar.layout_search.search import MeshProbe, SearchResult, search, what_would_fit
from lightning_dpar.loss_parallel.cost import gathered_output_features
from lightning_dpar.optim.precision import DparPrecision
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy

__all__ = ["default_seq_len", "dry_run_probe", "meta_copy", "probe_for_model", "search_model", "token_batch"]

#: The token-id shape one data-parallel rank's `training_step` receives under a layout (`token_batch`).
LayoutBatch = Callable[[Layout], tuple[int, int]]


def meta_copy(module: L.LightningModule) -> L.LightningModule:
    """A copy of `module` whose parameters and buffers are meta tensors (no memory), detached from any Trainer: what
    the dry run plans on. A model that builds its layers in `configure_model` is copied as it is (empty)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    trainer = attached_trainer(module)
    if trainer is not None:
        memo[id(trainer)] = None
    return copy.deepcopy(module, memo)


def dry_run_probe(
    make_module: Callable[[], L.LightningModule],
    world_size: int,
    num_nodes: int,
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
    batch: tuple[int, int] | LayoutBatch | None = None,
    traces: TraceCache | None = None,
) -> MeshProbe:
    """A probe that plans `make_module()` (a fresh meta-device model per call) with `FSDPTensorParallelStrategy` on
    the layout's sizes and `strategy_kwargs` (e.g. `tp_plan`), and returns each pipeline rank's memory (the largest
    rank's of the mesh without pipelining: ranks hold equal shards but for rounding, and rank 0 the larger part).
    A layout's loss parallel is planned and traced as training runs it (the output layer's logits sharded); its
    float8 is not (the cost model prices float8's matmuls; `lightning_dpar.layout_search.cost`).

    One dry run per mesh (`Layout.mesh_key`) gives the memory; with `batch`, the token-id shape one data-parallel
    rank's `training_step` receives (or a function of the layout giving it), each layout's schedule and
    microbatches add the activation peak of each pipeline rank, estimated as the dry run estimates it
    (`strategy_activations`) on the same plans, reusing the traces in `traces`."""
    base = dict(strategy_kwargs or {})
    traces = {} if traces is None else traces
    meshes: dict[tuple[Any, ...], tuple[list[tuple[int, int, int]], int, int]] = {}

    def probe(layout: Layout) -> MeshMemory:
        kwargs = {**base, **layout.strategy_kwargs()}
        kwargs.pop("float8", None)  # priced by the cost model, not planned: the meta model stays unconverted
        strategy = FSDPTensorParallelStrategy(**kwargs)
        strategy.precision_plugin = DparPrecision(precision)
        key = (*layout.mesh_key, layout.loss_parallel)  # loss parallel's plan refuses what the plain one accepts
        if key not in meshes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stored, unit = _rank_memory(plan(strategy, make_module(), world_size, num_nodes))
                meshes[key] = (stored, unit, _gathered_output(strategy, make_module(), layout, world_size))
        stored, unit, gathered = meshes[key]
        peaks: list[tuple[int | None, ...]] = [(None, None, None)] * len(stored)
        share = None
        if batch is not None:
            shape = batch(layout) if callable(batch) else batch
            estimate = _activations(strategy, make_module(), layout, shape, traces)
            if estimate is not None:
                peaks = [tuple(estimate.peak(r, c) for c in (False, True, "selective")) for r in range(len(stored))]
                share = selective_share(estimate.flops)
        ranks = tuple(RankMemory(*memory, *peak) for memory, peak in zip(stored, peaks))  # type: ignore[misc]
        return MeshMemory(ranks, unit, share, gathered)

    return probe


def _gathered_output(strategy: FSDPTensorParallelStrategy, module: nn.Module, layout: Layout, world_size: int) -> int:
    """The output features of the `nn.Linear` layers whose column-wise output `strategy`'s plan gathers whole on
    every tensor-parallel rank (the output layer, in a language model), on the last pipeline rank, which holds it."""
    if layout.dims.tensor_parallel == 1:
        return 0
    local = strategy.module_plan(module, layout.dims, world_size - 1)
    return gathered_output_features(module, local.tensor_parallel)


def _rank_memory(report: PlanReport) -> tuple[list[tuple[int, int, int]], int]:
    """Each pipeline rank's (parameters, gradients, optimizer) bytes, its stages summed, and the largest unit."""
    unit = report.largest_unit[1] if report.largest_unit is not None else 0
    if report.pipeline is None:
        m = report.memory
        return [(m.parameters, m.gradients, m.optimizer or 0)], unit
    stored: dict[int, tuple[int, int, int]] = {}
    for row in report.pipeline.stages:
        p, g, o = stored.get(row.pipeline_rank, (0, 0, 0))
        stored[row.pipeline_rank] = (
            p + row.memory.parameters,
            g + row.memory.gradients,
            o + (row.memory.optimizer or 0),
        )
    return [stored[r] for r in sorted(stored)], unit


def _activations(
    strategy: FSDPTensorParallelStrategy,
    module: L.LightningModule,
    layout: Layout,
    batch: tuple[int, int],
    traces: TraceCache,
) -> ActivationEstimate | None:
    """The dry run's activation estimate for `layout`, on `module` (meta) planned as each pipeline rank's first rank
    plans it; `None` when the training step cannot be traced (the formula stands in), but for a context-parallel
    layout, which is refused with the trace's error (a sequence the split cannot cut, say): training would refuse it."""
    module = strategy.precision_plugin.convert_module(module)
    d = layout.dims
    ranks_per_stage = d.world_size // d.pipeline
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [strategy.module_plan(module, d, r * ranks_per_stage) for r in range(d.pipeline)]
        estimate, why = strategy_activations(strategy, module, plans, d, batch, traces)
    if estimate is None:
        check_traced(d, why)
    return estimate


def token_batch(batch_size: int, seq_len: int) -> tuple[int, int]:
    """The token-id batch shape the search traces a training step on: `seq_len + 1` ids per sample, as a model that
    predicts the next token receives them (it cuts one off); one token more than a model that does not."""
    return (batch_size, seq_len + 1)


def default_seq_len(module: nn.Module) -> int | None:
    """The model's context length, if it says: `block_size` (hparams, or an attribute of the model or one of its
    modules, such as the example GPT's decoder) or a transformers config's `max_position_embeddings`. The modules
    are read as well as the hparams because a subclass's hparams are its own arguments (LightningCLI, for one,
    records only those), not its base class's."""
    hparams = dict(getattr(module, "hparams", {}) or {})
    candidates = [hparams.get("block_size")]
    for sub in module.modules():
        candidates += [
            getattr(sub, "block_size", None),
            getattr(getattr(sub, "config", None), "max_position_embeddings", None),
        ]
    return next((value for value in candidates if isinstance(value, int) and value > 0), None)


def search_model(
    module: L.LightningModule,
    world_size: int,
    num_nodes: int,
    profile: HardwareProfile,
    batch_size: int | BatchRule,
    seq_len: int | None = None,
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
    activation_checkpointing: Checkpointing | None = None,
    suggest: bool = False,
    loss_parallel: bool = False,
    float8: str | None = None,
    float8_skip: Sequence[str] | None = None,
) -> SearchResult:
    """The layout search for `module` (any device; planned on meta copies) on `world_size` ranks: what `plan --auto`
    prints and `AutoParallelStrategy` chooses from. `batch_size`: samples per data-parallel rank, or the rule giving
    them for each data-parallel size (a global batch); `seq_len` defaults to the model's context length; with
    `suggest`, a search where nothing fits also says what would (`what_would_fit`, more dry runs on larger
    worlds). `loss_parallel`: the layouts that can run it run it (`enumerate_layouts`); `float8`: every layout priced
    with that recipe, its converted matmuls being the `nn.Linear` layers `float8_linears` finds, with `float8_skip`'s
    patterns left alone."""
    rule = batch_size if isinstance(batch_size, BatchRule) else BatchRule(per_rank=batch_size)
    sizes = rule.sizes(world_size)
    batches = [b for b in sizes.values() if isinstance(b, int)]
    if not batches:
        reasons = "; ".join(f"{d}: {why}" for d, why in sizes.items())
        raise ValueError(f"No data-parallel size of {world_size} ranks gets a batch ({reasons}).")
    template = meta_copy(module)
    with torch.device("meta"):  # the layers a model builds in `configure_model` (Lightning's hook is idempotent)
        template.configure_model()
    seq_len = seq_len if seq_len is not None else default_seq_len(template)
    if seq_len is None:
        raise ValueError(
            "The sequence length is unknown: the model has no `block_size` nor `config.max_position_embeddings`. Pass"
            " `seq_len` (`--seq-len` to `plan --auto`, `seq_len=` to `AutoParallelStrategy`)."
        )
    # the batch of the largest data-parallel size
    facts = facts_of(template, seq_len, batches[-1], precision, float8_skip)
    length = seq_len

    def batch(layout: Layout) -> tuple[int, int]:
        per_rank = rule.at(layout.dims.data_parallel)
        assert isinstance(per_rank, int), "the search refuses the sizes without a batch"
        return token_batch(per_rank, length)

    traces: TraceCache = {}  # the same traces serve every world, the larger ones `what_would_fit` tries included
    probe = dry_run_probe(lambda: meta_copy(template), world_size, num_nodes, precision, strategy_kwargs, batch, traces)
    varying = None if rule.per_rank is not None else rule
    result = search(
        facts, world_size, num_nodes, profile, probe, activation_checkpointing, varying, loss_parallel, float8
    )
    if suggest and result.best is None:
        return replace(
            result,
            suggestion=what_would_fit(result, probe_for_model(template, precision, strategy_kwargs, batch, traces)),
        )
    return result


def probe_for_model(
    module: L.LightningModule,
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
    batch: tuple[int, int] | LayoutBatch | None = None,
    traces: TraceCache | None = None,
) -> Callable[[int, int], MeshProbe]:
    """`what_would_fit`'s probe factory for `module`: the dry-run probe on another world."""
    template = meta_copy(module)
    return lambda world, nodes: dry_run_probe(
        lambda: meta_copy(template), world, nodes, precision, strategy_kwargs, batch, traces
    )
