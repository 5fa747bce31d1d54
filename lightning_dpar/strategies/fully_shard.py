"""FSDP2 (`fully_shard`), HSDP, and 2D FSDP + tensor parallelism."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar._private_api import StrategyRegistryType
from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingSetting
from lightning_dpar.context_parallel import check_settings
from lightning_dpar.context_parallel.loss import check_loss_mode
from lightning_dpar.float8.config import Float8Setting, check_float8_device, resolve_float8
from lightning_dpar.parallel_dims import ParallelDims, SizeArg
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.split import SplitSpec
from lightning_dpar.plan import ModuleSelector, PlanOptions, TPPlanSpec
from lightning_dpar.plan.module_plan import DataParallelSettings
from lightning_dpar.strategies.base import DparStrategy

__all__ = [
    "FSDPTensorParallelStrategy",
    "FullyShardStrategy",
]


class FullyShardStrategy(DparStrategy):
    """Shard parameters, gradients and optimizer state over data-parallel ranks with FSDP2's `fully_shard`.

    Args:
        shard_modules: blocks that get their own `fully_shard` (class names or module-name globs). Default: every
            child of every `nn.ModuleList` (the repeated transformer blocks). Each top-level child of the
            LightningModule is always a unit of its own.
        reshard_after_forward: free unsharded params after forward (`True`), keep them (`False`), or reshard to a
            smaller group of this size (`int`), as `fully_shard` defines it.
        replicate_size: HSDP: number of replica groups (`"auto"`: one per node); each group shards the model.
        cpu_offload: keep sharded params, gradients and optimizer state in CPU memory.
        activation_checkpointing: `True` (each sharded block recomputed whole in backward),
            `"selective"` (the same blocks keep their matmul and attention outputs and recompute only the cheap
            ops: torchtitan's op-level policy; see docs/efficiency.md), or a list of class names / module-name globs.
        pipeline_parallel_size: pipeline stages' ranks: the model is split between its repeated blocks, and each
            group of `world / pipeline_parallel_size` ranks holds one stage (or `pipeline_stages_per_rank`). See
            `docs/pipeline.md`.
        pipeline_schedule: `"GPipe"`, `"1F1B"`, `"Interleaved1F1B"`, `"LoopedBFS"`, `"InterleavedZeroBubble"` or
            `"ZBVZeroBubble"` (see `lightning_dpar.pipeline.schedule`).
        pipeline_microbatches: microbatches per batch (default: one per stage); the batch size must divide by it.
        pipeline_stages_per_rank: stages each pipeline rank holds (2 or more for the interleaved and V schedules).
        pipeline_split: `"auto"` (blocks spread evenly) or the names of the units starting stages 1, 2, ...
        pipeline_call_order: module names in the order the forward calls them, for a model that registers its
            units in another order (LitGPT: `["transformer", "lm_head"]`); default: registration order.
        context_parallel_size: ranks splitting each sequence (`"auto"`: one node's ranks left by tensor
            parallelism); they share each batch, and FSDP shards over them too. See docs/context_parallel.md.
        context_parallel_loss: where the final norm, the head and the loss run under context parallelism:
            `"whole"` (default: the last block's output gathered, then any loss on the whole sequence, exact) or
            `"per_rank"` (each rank's own tokens through the head and a transformers causal LM's own loss, summed
            over the ranks: no whole-sequence logits; the model must be called with `labels=`).
        float8: float8 training with torchao (the `float8` extra): a recipe name (`"tensorwise"`, `"rowwise"`,
            `"rowwise_with_gw_hp"`) or a `torchao.float8.Float8LinearConfig` (`emulate=True` runs it on a CPU). Each
            `nn.Linear` but those of `float8_skip` becomes torchao's `Float8Linear` before tensor parallelism and
            FSDP; parameters stay in their precision (fp32 master weights). See docs/efficiency.md.
        float8_skip: module-name patterns (fnmatch) kept in high precision; default: the output layer. Linears
            whose dimensions (or tensor-parallel shards) are not multiples of 16 are always kept.
        **kwargs: see `DparStrategy`.
    """

    strategy_name = "dpar_fsdp"

    def __init__(
        self,
        shard_modules: Sequence[ModuleSelector] | None = None,
        reshard_after_forward: bool | int = True,
        replicate_size: SizeArg = 1,
        cpu_offload: bool = False,
        activation_checkpointing: ActivationCheckpointingSetting = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int = 1,
        pipeline_split: SplitSpec = "auto",
        pipeline_call_order: Sequence[str] | None = None,
        context_parallel_size: SizeArg = 1,
        context_parallel_loss: Literal["whole", "per_rank"] = "whole",
        float8: Float8Setting | None = None,
        float8_skip: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(
            replicate_size=replicate_size,
            activation_checkpointing=activation_checkpointing,
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline=PipelineConfig.of(
                pipeline_schedule, pipeline_microbatches, pipeline_stages_per_rank, pipeline_split, pipeline_call_order
            ),
            **kwargs,
        )
        if isinstance(reshard_after_forward, bool) or (
            isinstance(reshard_after_forward, int) and reshard_after_forward > 1
        ):
            self._reshard_after_forward = reshard_after_forward
        else:
            raise ValueError(
                f"`reshard_after_forward={reshard_after_forward!r}` is invalid: use True, False or an int > 1 (the"
                " size of the group to reshard to)."
            )
        self._shard_modules = None if shard_modules is None else list(shard_modules)
        self._cpu_offload = cpu_offload
        self._context_parallel_size = context_parallel_size
        self._context_parallel_loss = check_loss_mode(context_parallel_loss)  # before the process group
        self._float8 = resolve_float8(float8, float8_skip, type(self).__name__)  # torchao imported, values checked

    @property
    def cpu_offload(self) -> bool:
        """Whether sharded parameters, gradients and optimizer state live in CPU memory."""
        return self._cpu_offload

    @override
    def _computes_whole_updates(self, optimizer: Optimizer) -> bool:
        # Offloaded shards live in CPU memory, which the accelerator's collectives do not gather from.
        return not self._cpu_offload and super()._computes_whole_updates(optimizer)

    @property
    @override
    def plan_options(self) -> PlanOptions:
        return replace(
            super().plan_options,
            shards=True,
            shard_modules=self._shard_modules,
            context_parallel_loss=self._context_parallel_loss,
            float8=self._float8,
            data_parallel=DataParallelSettings("fully_shard", self._reshard_after_forward, self._cpu_offload),
        )

    # ------------------------------------------------------------------ context parallelism, float8's device
    @override
    def _check_before_collectives(self, dims: ParallelDims) -> None:
        super()._check_before_collectives(dims)
        if self._float8 is not None:
            check_float8_device(self._float8, self.root_device, type(self).__name__)
        if dims.context > 1:
            check_settings(type(self).__name__, dims.context, self._compile_options)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register("dpar_fsdp", cls, description="FSDP2 fully_shard", override=True)
        strategy_registry.register(
            "dpar_fsdp_offload", cls, description="FSDP2 with CPU offload", override=True, cpu_offload=True
        )
        strategy_registry.register(
            "dpar_hsdp",
            cls,
            description="HSDP: shard within a node, replicate across nodes",
            override=True,
            replicate_size="auto",
        )
        strategy_registry.register(
            "dpar_cp",
            cls,
            description="FSDP2 with context parallelism over one node's ranks",
            override=True,
            context_parallel_size="auto",
        )
        strategy_registry.register(
            "dpar_ep",
            cls,
            description="FSDP2 with expert parallelism over one node's ranks",
            override=True,
            expert_parallel_size="auto",
        )
        cls.register_class_names(strategy_registry)


class FSDPTensorParallelStrategy(FullyShardStrategy):
    """2D parallelism: tensor parallelism on the `tensor_parallel` mesh dim, FSDP2 on the `data_parallel` dim.

    The TP plan comes from, first found: the `tp_plan` argument, a `tp_plan` attribute on the LightningModule, or
    the LightningModule's own `configure_model` (written for Lightning's `ModelParallelStrategy`, using
    `self.device_mesh["tensor_parallel"]` / `["data_parallel"]`), which is adopted as is.

    Args:
        tensor_parallel_size: ranks per TP group (`"auto"`: the devices of one node).
        data_parallel_size: ranks seeing different batches (`"auto"`: world / tensor_parallel_size).
        tp_plan: `{module-name pattern: "colwise" | "rowwise" | "sequence_parallel" | ParallelStyle}`.
        **kwargs: see `FullyShardStrategy`.
    """

    strategy_name = "dpar_2d"

    def __init__(
        self,
        tensor_parallel_size: SizeArg = "auto",
        data_parallel_size: SizeArg = "auto",
        tp_plan: TPPlanSpec | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size, tp_plan=tp_plan, **kwargs
        )

    @property
    @override
    def plan_options(self) -> PlanOptions:
        """A `ModelParallelStrategy`-style `configure_model` runs unchanged; FSDP is added if it only applied TP."""
        return replace(super().plan_options, adopts_parallelized=True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register("dpar_2d", cls, description="2D: FSDP2 + tensor parallelism", override=True)
        strategy_registry.register(
            "dpar_3d",
            cls,
            description="3D: pipeline 2 x FSDP2 x tensor parallel 2",
            override=True,
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
        )
        cls.register_class_names(strategy_registry)
