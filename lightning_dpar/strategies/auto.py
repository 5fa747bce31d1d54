"""`AutoParallelStrategy` (`"dpar_auto"`): the layout chosen by the layout search, then trained as
`FSDPTensorParallelStrategy` would train it chosen by hand.

The choice happens in `resolve_dims`, which `setup_environment` calls before the process group exists: every rank
runs the same deterministic search (`lightning_dpar.layout`, in a child process: `layout.isolated`) on a meta copy of
the same model, so all ranks choose the
same layout without a collective. The chosen sizes, pipeline schedule, microbatches and activation checkpointing are
then set on this strategy, and everything after (plan, wrappers, steps, checkpoints) is `FSDPTensorParallelStrategy`'s.

Not imported by `lightning_dpar.strategies` (the search imports the dry run, which imports the strategies); the
package registers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dpar._private_api import StrategyRegistryType, training_data_source
from lightning_dpar.helpers import attached_trainer
from lightning_dpar.layout.candidates import Layout
from lightning_dpar.layout.isolated import search_anywhere
from lightning_dpar.layout.profiles import GIB, HardwareProfile, get_profile
from lightning_dpar.layout.report import render_choice
from lightning_dpar.layout.search import SearchResult
from lightning_dpar.mesh import ParallelDims
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


class AutoParallelStrategy(FSDPTensorParallelStrategy):
    """Choose the fastest layout that fits the device memory, print it with two runners-up and why, and train it.

    Args:
        profile: a hardware preset (`"cpu-gloo"`, `"h100-node"`) or the path of a JSON profile written by
            `python -m lightning_dpar calibrate`.
        device_memory: GiB one rank may use (default: the profile's).
        batch_size: sequences per data-parallel rank per step (default: the training `DataLoader`'s `batch_size`,
            or the data module's `batch_size` attribute).
        seq_len: tokens per sequence (default: the model's `block_size` or `config.max_position_embeddings`).
        activation_checkpointing: `None` lets the search decide; `True` / `False` fixes it.
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
        seq_len: int | None = None,
        activation_checkpointing: bool | None = None,
        tp_plan: TPPlanSpec | None = None,
        shard_modules: Sequence[ModuleSelector] | None = None,
        expert_modules: Sequence[ModuleSelector] | None = None,
        **kwargs: Any,
    ) -> None:
        given = sorted(name for name in _CHOSEN if name in kwargs)
        if given:
            raise ValueError(
                f"AutoParallelStrategy chooses {given} itself. Remove them, or use FSDPTensorParallelStrategy with"
                " the sizes you want."
            )
        if device_memory is not None and not device_memory > 0:
            raise ValueError(f"`device_memory={device_memory!r}` is invalid: give the GiB one rank may use (> 0).")
        super().__init__(
            tp_plan=tp_plan,
            shard_modules=shard_modules,
            expert_modules=expert_modules,
            tensor_parallel_size=1,
            **kwargs,
        )
        self._profile: HardwareProfile = get_profile(profile)  # an unknown profile fails here, on every rank
        if device_memory is not None:
            self._profile = self._profile.with_memory(int(device_memory * GIB))
        self._batch_size = batch_size
        self._seq_len = seq_len
        self._fixed_checkpointing = activation_checkpointing
        self._planning_kwargs = {
            name: value
            for name, value in (
                ("tp_plan", tp_plan),
                ("shard_modules", shard_modules),
                ("expert_modules", expert_modules),
            )
            if value is not None
        }
        #: The search this strategy chose from (set in `resolve_dims`).
        self.search_result: SearchResult | None = None

    @property
    def search_settings(self) -> dict[str, Any]:
        """What `plan --auto` reads off this strategy so its table shows the choice training will make."""
        return {
            "profile": self._profile,
            "device_memory": self._profile.device_memory,
            "batch_size": self._batch_size,
            "seq_len": self._seq_len,
            "strategy_kwargs": dict(self._planning_kwargs),
        }

    @property
    def chosen(self) -> Layout | None:
        """The layout chosen, once the sizes are resolved."""
        return self.search_result.best.layout if self.search_result and self.search_result.best else None

    def _training_batch_size(self) -> int:
        if self._batch_size is not None:
            return self._batch_size
        source = training_data_source(attached_trainer(self.lightning_module))
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
        raise ValueError(
            "AutoParallelStrategy cannot see the per-rank batch size (the training data is not a DataLoader or data"
            " module with a `batch_size`). Pass `batch_size=` (sequences per data-parallel rank per step)."
        )

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
        result = search_anywhere(
            module,
            world_size,
            num_nodes,
            self._profile,
            self._training_batch_size(),
            self._seq_len,
            precision,
            self._planning_kwargs,
            self._fixed_checkpointing,
            suggest=True,
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
        self.search_result = result
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
        self._activation_checkpointing = layout.activation_checkpointing
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
