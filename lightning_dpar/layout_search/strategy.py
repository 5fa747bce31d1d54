"""`AutoParallelStrategy` (`"dpar_auto"`): the layout chosen by the layout search, then trained as
`FSDPTensorParallelStrategy` would train it chosen by hand.

The choice happens in `resolve_dims`, which `setup_environment` calls before the process group exists: every rank
runs the same deterministic search (`lightning_dpar.layout_search`, in a child process: `layout.isolated`) on a meta
copy of
the same model, so all ranks choose the
same layout without a collective. The chosen sizes, pipeline schedule, microbatches, activation checkpointing and loss
parallel are then set on this strategy, and everything after (plan, wrappers, steps, checkpoints) is
`FSDPTensorParallelStrategy`'s. Loss parallel is the user's to allow (`loss_parallel=True`: the search cannot see a
loss that reads the logits whole), float8 the user's to ask for (`float8=`, passed on to the base class as given).

The batch each layout is priced at is read where Lightning reads the training data (`strategies.auto_batch`): a
module's `train_dataloader()` is called once per data-parallel size considered, with `distributed_sampler_kwargs`
answering that size, since its loader may size the per-rank batch from it; once the layout is chosen the sampler
kwargs are the chosen mesh's, and the loader Lightning builds must yield the batch the layout was chosen for.

Not imported by `lightning_dpar.strategies` (the search imports the dry run, which imports the strategies); the
package registers it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dpar._private_api import StrategyRegistryType, training_data_source
from lightning_dpar.activation_checkpointing.step import Checkpointing
from lightning_dpar.helpers import attached_trainer
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.candidates import Layout
from lightning_dpar.layout_search.data_batch import (
    check_count,
    check_loader,
    check_no_size_fits,
    read_batch_sizes,
    resolve_batch_rule,
)
from lightning_dpar.layout_search.isolated import search_anywhere
from lightning_dpar.layout_search.profiles import GIB, HardwareProfile, check_float8, get_profile
from lightning_dpar.layout_search.report import render_choice
from lightning_dpar.layout_search.search import SearchResult
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.plan import ModuleSelector, TPPlanSpec
from lightning_dpar.strategies.fully_shard import FSDPTensorParallelStrategy

__all__ = ["AutoParallelStrategy"]

#: Sizes the search chooses; giving one would contradict it.
_CHOSEN = (
    "tensor_parallel_size",
    "data_parallel_size",
    "replicate_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "pipeline_schedule",
    "pipeline_microbatches",
    "pipeline_stages_per_rank",
)


def _base_defaults() -> dict[str, Any]:
    """The default of each argument of `FSDPTensorParallelStrategy` and the classes it passes `**kwargs` on to."""
    defaults: dict[str, Any] = {}
    for cls in reversed(FSDPTensorParallelStrategy.__mro__):
        init = cls.__dict__.get("__init__")
        if init is not None:
            for name, parameter in inspect.signature(init).parameters.items():
                if parameter.default is not inspect.Parameter.empty:
                    defaults[name] = parameter.default
    return defaults


class AutoParallelStrategy(FSDPTensorParallelStrategy):
    """Choose the fastest layout that fits the device memory, print it with two runners-up and why, and train it.

    Args:
        profile: a hardware preset (`"cpu-gloo"`, `"h100-node"`) or the path of a JSON profile written by
            `python -m lightning_dpar calibrate`.
        device_memory: GiB one rank may use (default: the profile's).
        batch_size: sequences per data-parallel rank per step, whatever the layout (default: read from the training
            data, see `global_batch_size`).
        global_batch_size: sequences per optimizer step over all data-parallel ranks, whatever the layout: each
            data-parallel rank trains `global_batch_size / data-parallel size` (torchtitan's and Megatron's
            `global_batch_size`), so a layout with fewer data-parallel ranks gives each a larger share, and sizes that
            do not divide it are not considered. The training loader must yield that share: a loader sized from
            `trainer.distributed_sampler_kwargs["num_replicas"]` does; a `DataLoader` of fixed `batch_size` `b`
            leaves only the data-parallel size `global_batch_size / b`. Not with `batch_size`. Without either, the
            batch is read where Lightning reads the training data: the `DataLoader` given to `fit`, the data
            module's `batch_size` attribute, else the `train_dataloader()` of the data module or the
            LightningModule, called once per data-parallel size considered (with `distributed_sampler_kwargs`
            answering that size) before `setup()`; a hook that cannot run before `setup()` is refused, asking for
            one of the two.
        seq_len: tokens per sequence (default: the model's `block_size` or `config.max_position_embeddings`).
        activation_checkpointing: `None` lets the search decide; `False`, `"selective"` or `True` (full) fixes it.
        loss_parallel: allow loss parallel (the output layer's logits kept sharded over the vocabulary, the
            cross-entropy computed vocabulary-parallel): every candidate with tensor parallelism and without pipeline
            or context parallelism then runs with it, and is priced with its logits sharded; the others run without.
            Off by default because a loss with `label_smoothing`, or a step that reads the logits whole (`argmax`, a
            metric), fails under it at its first use, which the search cannot see. The `tp_plan` must give the
            output layer `"colwise_gather_output"` (else those candidates are rejected, saying so).
        float8: a torchao float8 recipe (`"tensorwise"`, `"rowwise"`, `"rowwise_with_gw_hp"`) to train with: every
            candidate is priced with its converted matmuls at the profile's float8 rate, and the chosen layout
            trains with `float8=` set. Refused when built on a profile without float8 matmuls (`"cpu-gloo"`, an
            A100's). `float8_skip=` (patterns of `nn.Linear` modules to leave alone) goes on to the strategy and
            is read by the cost model.
        tp_plan: as for `FSDPTensorParallelStrategy`; the search plans with it.
        shard_modules: as for `FullyShardStrategy`.
        expert_modules: as for `FullyShardStrategy`.
        **kwargs: see `FullyShardStrategy` and `DparStrategy`, except the sizes and pipeline settings the search
            chooses (`tensor_parallel_size`, `replicate_size`, `pipeline_*`, `expert_parallel_size`, ...).
    """

    strategy_name = "dpar_auto"

    def __init__(
        self,
        profile: str = "cpu-gloo",
        device_memory: float | None = None,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        activation_checkpointing: Checkpointing | None = None,
        tp_plan: TPPlanSpec | None = None,
        shard_modules: Sequence[ModuleSelector] | None = None,
        expert_modules: Sequence[ModuleSelector] | None = None,
        loss_parallel: bool = False,
        float8: str | None = None,
        **kwargs: Any,
    ) -> None:
        # LightningCLI (jsonargparse) fills the base classes' arguments it finds behind `**kwargs` with their defaults:
        # those say nothing (and `_apply` sets the chosen ones), only a value the user set contradicts the search.
        # `kwargs` goes on to the base class unchanged: jsonargparse reads that call to know which arguments to fill.
        defaults = _base_defaults()
        given = sorted(name for name in _CHOSEN if name in kwargs and kwargs[name] != defaults.get(name))
        if given:
            raise ValueError(
                f"AutoParallelStrategy chooses {given} itself. Remove them, or use FSDPTensorParallelStrategy with"
                " the sizes you want."
            )
        if batch_size is not None and global_batch_size is not None:
            raise ValueError(
                f"`batch_size={batch_size}` and `global_batch_size={global_batch_size}` both fix the batch: give"
                " `global_batch_size` (per optimizer step, split over the chosen data-parallel size) or `batch_size`"
                " (per data-parallel rank), not both."
            )
        check_count("batch_size", batch_size)
        check_count("global_batch_size", global_batch_size)
        if device_memory is not None and not device_memory > 0:
            raise ValueError(f"`device_memory={device_memory!r}` is invalid: give the GiB one rank may use (> 0).")
        if not isinstance(loss_parallel, bool):
            raise TypeError(f"`loss_parallel={loss_parallel!r}` must be True or False.")
        resolved = self._with_memory(get_profile(profile), device_memory)  # an unknown profile fails here
        check_float8(float8, resolved)  # on every rank alike, before any collective
        if float8 is not None:
            kwargs["float8"] = float8  # the strategy trains with float8 (`FullyShardStrategy(float8=...)`)
        super().__init__(
            tp_plan=tp_plan,
            shard_modules=shard_modules,
            expert_modules=expert_modules,
            tensor_parallel_size=1,
            **kwargs,
        )
        self._profile: HardwareProfile = resolved
        self._batch_size = batch_size
        self._global_batch_size = global_batch_size
        #: The per-rank batch of each data-parallel size the layout was chosen with (set in `resolve_dims`).
        self.batch_rule: BatchRule | None = None
        #: What `distributed_sampler_kwargs` answers while a `train_dataloader()` is read before the mesh exists.
        self._reading_sampler: dict[str, int] | None = None
        self._seq_len = seq_len
        self._fixed_checkpointing = activation_checkpointing
        self._allow_loss_parallel = loss_parallel
        self._search_float8 = float8
        skip = kwargs.get("float8_skip")
        self._search_float8_skip = None if skip is None else tuple(skip)
        self._planning_kwargs = {
            name: value
            for name, value in (
                ("tp_plan", tp_plan),
                ("shard_modules", shard_modules),
                ("expert_modules", expert_modules),
                # every candidate with context parallelism is planned and estimated with the user's loss mode
                ("context_parallel_loss", kwargs.get("context_parallel_loss")),
            )
            if value is not None
        }
        #: The search this strategy chose from (set in `resolve_dims`).
        self.search_result: SearchResult | None = None

    @staticmethod
    def _with_memory(profile: HardwareProfile, device_memory: float | None) -> HardwareProfile:
        """`profile` with `device_memory` GiB per rank, when given."""
        return profile if device_memory is None else profile.with_memory(int(device_memory * GIB))

    @property
    def search_settings(self) -> dict[str, Any]:
        """What `plan --auto` reads off this strategy so its table shows the choice training will make."""
        return {
            "profile": self._profile,
            "device_memory": self._profile.device_memory,
            "batch_size": self._batch_size,
            "global_batch_size": self._global_batch_size,
            "seq_len": self._seq_len,
            "strategy_kwargs": dict(self._planning_kwargs),
            "loss_parallel": self._allow_loss_parallel,
            "float8": self._search_float8,
            "float8_skip": self._search_float8_skip,
        }

    @property
    def chosen(self) -> Layout | None:
        """The layout chosen, once the sizes are resolved."""
        return self.search_result.best.layout if self.search_result and self.search_result.best else None

    def _batch_rule(self, world_size: int) -> BatchRule:
        """The per-rank batch of each data-parallel size of `world_size` ranks (`strategies.auto_batch`)."""
        read = None
        if self._batch_size is None:
            trainer = attached_trainer(self.lightning_module)
            source = training_data_source(trainer) if trainer is not None else None
            source = source if source is not None else self.lightning_module  # Lightning's default source
            read = read_batch_sizes(source, world_size, self._loader_at)
        rule = resolve_batch_rule(self._batch_size, self._global_batch_size, read)
        check_no_size_fits(rule, world_size)
        return rule

    def _loader_at(self, source: Any, data_parallel: int) -> Any:
        """`source.train_dataloader()` as it would be built on `data_parallel` data-parallel ranks."""
        self._reading_sampler = {"num_replicas": data_parallel, "rank": 0}
        try:
            return source.train_dataloader()
        finally:
            self._reading_sampler = None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The chosen mesh's data-parallel size and rank; while the layout is being chosen, the size being read."""
        if self._reading_sampler is not None:
            return dict(self._reading_sampler)
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Refuse a training loader whose batch is not the one the layout was chosen for."""
        trainer = attached_trainer(self.lightning_module)
        rule, dims = self.batch_rule, self.dims
        training = trainer is not None and trainer.state.stage == RunningStage.TRAINING
        if training and rule is not None and dims is not None:
            check_loader(dataloader, rule.at(dims.data_parallel), dims.data_parallel, rule)
        return super().process_dataloader(dataloader)

    @override
    def resolve_dims(self, world_size: int, devices_per_node: int, num_nodes: int) -> ParallelDims:
        """Search the layouts of this world (once), take the best, and resolve its sizes as the base class does."""
        if self.search_result is None or self.search_result.world_size != world_size:
            self._choose(world_size, num_nodes)
        return super().resolve_dims(world_size, devices_per_node, num_nodes)

    def _choose(self, world_size: int, num_nodes: int) -> None:
        module = self.lightning_module
        if module is None:
            raise ValueError(
                "AutoParallelStrategy chooses from the model, which this strategy does not have yet. For a dry run,"
                " use `python -m lightning_dpar plan --auto ...`."
            )
        precision = self.precision_plugin.precision
        rule = self._batch_rule(world_size)
        result = search_anywhere(
            module,
            world_size,
            num_nodes,
            self._profile,
            rule if rule.per_rank is None else rule.per_rank,
            self._seq_len,
            precision,
            self._planning_kwargs,
            self._fixed_checkpointing,
            suggest=True,
            loss_parallel=self._allow_loss_parallel,
            float8=self._search_float8,
            float8_skip=self._search_float8_skip,
            in_child=True,  # the dry run's fake worlds must not precede this process's real one (layout.isolated)
        )
        if result.best is None:
            would_fit = result.suggestion.describe() if result.suggestion is not None else ""
            smallest = result.too_big[0].layout.describe() if result.too_big else "none runs"
            raise ValueError(
                f"No layout of {world_size} ranks fits {self._profile.device_memory / GIB:.2f} GiB per device"
                f" (profile {self._profile.name}; the smallest, {smallest}). {would_fit}. Add devices,"
                " raise `device_memory`, or lower the batch size."
            )
        self.search_result, self.batch_rule = result, rule
        self._apply(result.best.layout)
        rank_zero_info(render_choice(result))

    def _apply(self, layout: Layout) -> None:
        """Set the chosen layout's sizes and settings where `FSDPTensorParallelStrategy` reads them."""
        d = layout.dims
        self._tensor_parallel_size = d.tensor_parallel
        self._data_parallel_size = "auto"
        self._replicate_size = d.replicate
        self._pipeline_parallel_size = d.pipeline
        self._expert_parallel_size = d.expert
        self._context_parallel_size = d.context
        self._activation_checkpointing = layout.activation_checkpointing
        self._loss_parallel = layout.loss_parallel  # the option `FSDPTensorParallelStrategy(loss_parallel=)` sets
        if layout.schedule is not None:
            self._pipeline_config = PipelineConfig.of(
                layout.schedule, layout.microbatches, layout.stages_per_rank, "auto"
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register(
            "dpar_auto", cls, description="the fastest layout that fits, chosen by the layout search", override=True
        )
        cls.register_class_names(strategy_registry)
