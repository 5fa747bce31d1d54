"""Data parallelism with full parameters on every rank (DDP semantics), optionally with tensor parallelism."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar._private_api import StrategyRegistryType, compiled_autograd, swap_ddp_optimize_mode
from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingSetting
from lightning_dpar.conformance.unit_guard import UnitCallGuard
from lightning_dpar.parallel import data_parallel, parallelize
from lightning_dpar.parallel.compilation import compiled_autograd_compiler
from lightning_dpar.parallel.ddp_comm_hooks import COMPRESS_HOOK_DTYPES, CommHook, resolve_comm_hook
from lightning_dpar.parallel_dims import ParallelDims, SizeArg
from lightning_dpar.plan import ModuleSelector, PlanOptions, TPPlanSpec
from lightning_dpar.plan.module_plan import DataParallelSettings
from lightning_dpar.strategies.base import DparStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "ReplicateStrategy",
]


class ReplicateStrategy(DparStrategy):
    """Composable `replicate` (DDP): every rank holds the full model; gradients are all-reduced.

    With `tensor_parallel_size > 1` and a `tp_plan`, the model is first tensor-parallelised and then replicated
    across the data-parallel dim of a 2D mesh (DDP + TP). DDP's bucketed reducer cannot hold tensor-parallel
    (DTensor) parameters across steps, so that mode replicates with FSDP2 over a shard group of size 1: the same
    all-reduce, full parameters on every rank.

    Args:
        bucket_cap_mb: gradient bucket size, as in `DistributedDataParallel` (DDP mode only).
        gradient_as_bucket_view: as in `DistributedDataParallel` (DDP mode only).
        static_graph: as in `DistributedDataParallel` (DDP mode only).
        find_unused_parameters: as in `DistributedDataParallel` (DDP mode only).
        ignored_modules: class names or module-name globs whose gradients are not synchronised.
        comm_hook: `"bf16_compress"`, `"fp16_compress"` or a DDP comm-hook callable. With TP the two names set the
            gradient all-reduce dtype; callables need DDP mode.
        tensor_parallel_size: ranks per tensor-parallel group (1: pure data parallel).
        tp_plan: see `FSDPTensorParallelStrategy`.
        activation_checkpointing: `True` (each repeated block recomputed whole in backward),
            `"selective"` (the same blocks keep their matmul and attention outputs and recompute only the cheap
            ops: torchtitan's op-level policy; see docs/efficiency.md), or a list of class names / module-name globs.
        compiled_autograd: with `compile`, also capture each backward pass in one compiled graph. DDP then
            all-reduces from traced per-parameter hooks (its "python reducer") and Inductor fuses them into buckets
            of `bucket_cap_mb`; without it, compiled blocks run under DDP's usual C++ reducer and dynamo's DDP
            optimizer splits their graphs at bucket boundaries. DDP mode only (no `tensor_parallel_size > 1`).
        **kwargs: see `DparStrategy`.
    """

    strategy_name = "dpar_replicate"

    def __init__(
        self,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        ignored_modules: Sequence[ModuleSelector] = (),
        comm_hook: CommHook | None = None,
        tensor_parallel_size: SizeArg = 1,
        tp_plan: TPPlanSpec | None = None,
        activation_checkpointing: ActivationCheckpointingSetting = False,
        compiled_autograd: bool = False,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("expert_parallel_size", 1) != 1:
            raise ValueError(
                f"`ReplicateStrategy` does not split experts (`expert_parallel_size={kwargs['expert_parallel_size']}`):"
                " every DDP replica holds the whole model. Use `FullyShardStrategy` (`strategy='dpar_ep'`) or"
                " `FSDPTensorParallelStrategy`, whose expert-parallel ranks hold different experts of each MoE layer."
            )
        if kwargs.get("pipeline_parallel_size", 1) != 1:
            raise ValueError(
                f"`ReplicateStrategy` does not pipeline (`pipeline_parallel_size={kwargs['pipeline_parallel_size']}`):"
                " use `FullyShardStrategy` or `FSDPTensorParallelStrategy` (`strategy='dpar_3d'`), whose stages"
                " shard or replicate within each stage."
            )
        super().__init__(
            tensor_parallel_size=tensor_parallel_size,
            tp_plan=tp_plan,
            activation_checkpointing=activation_checkpointing,
            **kwargs,
        )
        self._ddp_kwargs: dict[str, Any] = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        if bucket_cap_mb is not None:
            self._ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self._comm_hook_spec = comm_hook
        self._comm_hook = resolve_comm_hook(comm_hook)  # validates the name early
        self._ignored_modules = list(ignored_modules)
        if compiled_autograd and self._compile_options is None:
            raise ValueError(
                "`compiled_autograd=True` compiles the backward of a compiled model; it needs `compile=True` (or a"
                " dict of torch.compile options) as well."
            )
        self._compiled_autograd = compiled_autograd
        self._previous_ddp_optimize_mode: Any = None
        self._unit_guard: UnitCallGuard | None = None
        self._direct_parameters: list[nn.Parameter] = []
        self._frozen_at_wrap: list[nn.Parameter] = []

    @override
    def resolve_dims(self, world_size: int, devices_per_node: int, num_nodes: int) -> ParallelDims:
        # Every data-parallel rank is a replica: the shard dim has size 1.
        dims = super().resolve_dims(world_size, devices_per_node, num_nodes)
        if dims.tensor_parallel > 1:
            self._check_tp_compatible_options()  # a configuration error: before the plan is even looked at
        return ParallelDims(world_size, replicate=dims.data_parallel, shard=1, tensor_parallel=dims.tensor_parallel)

    @property
    @override
    def plan_options(self) -> PlanOptions:
        # DDP mode: tied parameters inside one unit. With tensor parallelism the planner makes the wrapper FSDP
        # replicas, reducing gradients in the compress hook's dtype if one is named.
        settings = DataParallelSettings(
            "replicate",
            ddp_kwargs=self._ddp_kwargs,
            comm_hook=self._comm_hook,
            reduce_dtype=COMPRESS_HOOK_DTYPES.get(self._comm_hook_spec),  # type: ignore[arg-type]
        )
        return replace(
            super().plan_options,
            ddp_units=True,
            ignored_modules=tuple(self._ignored_modules),
            data_parallel=settings,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.prepare_ddp_mode()
        super().setup(trainer)

    def prepare_ddp_mode(self) -> None:
        """In DDP mode (no tensor parallelism), before the model is wrapped: bf16-mixed by autocast (DDP has no
        mixed-precision policy) and, with `compiled_autograd`, DDP's python reducer, which composable `replicate`
        picks when it builds its reducer at the first forward. The Trainer's `setup` and Fabric's
        (`lightning_dpar.fabric`) both call this."""
        assert self.dims is not None
        if self.dims.tensor_parallel == 1:
            self.precision_plugin.autocast_on(self.root_device.type)
            if self._compiled_autograd and self._previous_ddp_optimize_mode is None:
                self._previous_ddp_optimize_mode = swap_ddp_optimize_mode("python_reducer")

    @override
    def _parallelize(self, module: nn.Module) -> parallelize.AppliedPlan:
        applied = super()._parallelize(module)
        plan = applied.plan
        assert self.dims is not None
        if self.dims.tensor_parallel == 1:
            # DDP wraps children only: parameters on the LightningModule itself are all-reduced here, once per
            # optimizer step (after the last micro-batch's backward, before clipping).
            self._direct_parameters = [p for _, p in module.named_parameters(recurse=False) if p.requires_grad]
            # DDP's reducer also leaves out parameters frozen when it wraps the model. One unfrozen later (a
            # finetuning callback) would train on this rank's batches alone, as under Lightning's DDP, where the
            # ranks' copies drift apart; its gradients are averaged here instead, from the step it requires them.
            not_synced = data_parallel.ignored_parameters(module, plan.ignored)
            self._frozen_at_wrap = [p for p in module.parameters() if not p.requires_grad and p not in not_synced]
        if self.dims.tensor_parallel == 1 and not self._compiled_autograd:
            # Compiled autograd traces the backward, hooks included; the guard's check is eager-only.
            units = {name: module.get_submodule(name) for name in plan.data_parallel_roots}
            self._unit_guard = UnitCallGuard({n: u for n, u in units.items() if u in applied.grad_sync_modules})
        return applied

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._unsynced_parameters():
            closure = partial(self._closure_then_average_gradients, closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _unsynced_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters DDP does not average: those on the root module itself, and those frozen when it
        wrapped the model and trainable now (every rank unfreezes the same ones at the same step: callbacks run alike
        everywhere)."""
        return self._direct_parameters + [p for p in self._frozen_at_wrap if p.requires_grad]

    def _closure_then_average_gradients(self, closure: Callable[[], Any]) -> Any:
        """Run the closure (forward and backward), then average the gradients DDP does not."""
        result = closure()
        self.average_unsynced_gradients()
        return result

    def after_backward(self, synced: bool) -> None:
        """After a backward outside Lightning's loop (Fabric's, `lightning_dpar.fabric`): the gradients DDP does not
        average are averaged once the backward synchronised (`synced`: not inside `no_backward_sync`), before any
        clipping, and the unit guard starts over."""
        if synced:
            self.average_unsynced_gradients()
        if self._unit_guard is not None:
            self._unit_guard.reset()

    def average_unsynced_gradients(self) -> None:
        """Average the gradients of `_unsynced_parameters` over the data-parallel group (collective)."""
        parameters = self._unsynced_parameters()
        if not parameters:
            return
        group = self.data_parallel_group
        for parameter in parameters:
            if parameter.grad is None:  # unused on this rank: every rank must all-reduce the same sizes
                parameter.grad = torch.zeros_like(parameter)
        gradients = [p.grad for p in parameters]
        if group is not None:
            flat = torch.cat([g.reshape(-1) for g in gradients])
            dist.all_reduce(flat, group=group)
            flat.div_(dist.get_world_size(group))
            for gradient, averaged in zip(gradients, flat.split([g.numel() for g in gradients])):
                gradient.copy_(averaged.view_as(gradient))

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if not self._compiled_autograd:
            try:
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            finally:
                if self._unit_guard is not None:
                    self._unit_guard.reset()
        assert self._compile_options is not None
        with compiled_autograd(compiled_autograd_compiler(self._compile_options)):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def teardown(self) -> None:
        if self._previous_ddp_optimize_mode is not None:
            swap_ddp_optimize_mode(self._previous_ddp_optimize_mode)
            self._previous_ddp_optimize_mode = None
        super().teardown()

    def _check_tp_compatible_options(self) -> None:
        ddp_only = {k: v for k, v in self._ddp_kwargs.items() if v}
        if self._compiled_autograd:
            ddp_only["compiled_autograd"] = True
        if self._comm_hook_spec is not None and self._comm_hook_spec not in COMPRESS_HOOK_DTYPES:
            ddp_only["comm_hook"] = self._comm_hook_spec  # a callable, or an import path resolved to one
        if ddp_only:
            raise ValueError(
                f"{sorted(ddp_only)} configure DDP's bucketed reducer, which is not used with"
                f" `tensor_parallel_size={self._tensor_parallel_size}`. Remove them, or use"
                " comm_hook='bf16_compress'/'fp16_compress' to reduce gradients in lower precision."
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register("dpar_replicate", cls, description="Composable DDP (replicate)", override=True)
        cls.register_class_names(strategy_registry)
