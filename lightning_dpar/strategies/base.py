"""`DparStrategy`, the base of every lightning_dpar strategy: its arguments, and the hooks that parallelise the model
(`setup`: plan, apply, load pretrained weights, optimizers) with precision and teardown. Lightning's other hooks come
from one mixin per concern, each in the module named after it:

- `processes`: launch, ranks, process group and device mesh (`setup_environment`);
- `collectives`: barrier, broadcast, and reductions over the data-parallel group;
- `data_loading`: the distributed sampler's shard and the training loader positioned for a resume;
- `step_hooks`: the steps, backward, optimizer step and gradient-sync control (through a step's runner where one
  takes the training step over: the pipeline's schedule);
- `checkpoint_hooks`: save, load, removal and the resume state, delegated to the `CheckpointManager`.

The hooks delegate: planning and applying the plan to `lightning_dpar.parallel.parallelize` (`plan_modules` with this
strategy's `plan_options`, then `apply_plan`), pretrained weights to `lightning_dpar.hf_weights.pretrained`. A concrete
strategy only says what its arguments add to the plan (`plan_options`, the data-parallel wrapper's settings
included).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar._private_api import (
    StrategyRegistryType,
    layer_sync_requested,
    optimizers_to_device,
    replace_model_checkpoint_link,
)
from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingSetting
from lightning_dpar.checkpoint.adapter_only import CheckpointWeights
from lightning_dpar.checkpoint.manager import CheckpointFormatName, CheckpointManager
from lightning_dpar.conformance.batchnorm import check_sync_batchnorm_supported, convert_sync_batchnorm
from lightning_dpar.conformance.buffers import BufferSync
from lightning_dpar.conformance.callback_checks import refuse_unsupported_callbacks
from lightning_dpar.conformance.trainer_checks import check_anomaly_detection, check_pipeline_optimization
from lightning_dpar.conformance.weight_averaging import lay_out_averaged_copies
from lightning_dpar.fault_tolerance.config import FaultTolerance
from lightning_dpar.fault_tolerance.strategy import compose_fault_tolerance
from lightning_dpar.helpers import attached_trainer, has_parameters
from lightning_dpar.hf_weights.pretrained import PretrainedSpec, to_pretrained_weights
from lightning_dpar.optim import distributed_muon, shard_probe
from lightning_dpar.optim.exactness import ParameterLayout, check_optimizers
from lightning_dpar.optim.nonfinite import NonFiniteGuard, OnNonFinite, check_mode
from lightning_dpar.optim.precision import DparPrecision, to_dpar_precision
from lightning_dpar.parallel import parallelize
from lightning_dpar.parallel.compilation import CompileSpec, compile_options
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes, SizeArg
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.plan import AUTO, ModulePlan, ModuleSelector, PlanOptions, TPPlanSpec, parse_tp_plan
from lightning_dpar.plan.structure import module_structure
from lightning_dpar.steps.contract import Running, StepRunner
from lightning_dpar.strategies.checkpoint_hooks import CheckpointHooks
from lightning_dpar.strategies.collectives import Collectives
from lightning_dpar.strategies.data_loading import DataLoaderHooks
from lightning_dpar.strategies.processes import ProcessHooks, StartMethod
from lightning_dpar.strategies.step_hooks import StepHooks

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

    from lightning_dpar.experts.router_loss import GlobalRouterLoss

__all__ = [
    "DparStrategy",
    "StartMethod",
]


class DparStrategy(CheckpointHooks, StepHooks, DataLoaderHooks, Collectives, ProcessHooks):
    """Base of the package's strategies. Not registered itself; use a concrete subclass.

    Args:
        tensor_parallel_size: ranks per tensor-parallel group (`"auto"`: one node).
        data_parallel_size: ranks that see different batches (`"auto"`: world / tensor_parallel_size).
        replicate_size: HSDP replica groups (1: plain FSDP).
        tp_plan: `{module-name pattern: style}`; see `lightning_dpar.plan`.
        loss_parallel: with `tensor_parallel_size > 1`, keep the output layer's logits sharded over the vocabulary
            (the `tp_plan` gives it `"colwise_gather_output"`; loss parallel keeps that output sharded) and compute
            the cross-entropy vocabulary-parallel with torch's `loss_parallel()`, around each step's forward and
            backward: each rank holds `1 / tensor_parallel_size` of the logits. See docs/efficiency.md.
        activation_checkpointing: `True` (each sharded block recomputed whole in backward),
            `"selective"` (the same blocks keep their matmul and attention outputs and recompute only the cheap
            ops: torchtitan's op-level policy; see docs/efficiency.md), or a list of class names / module-name globs.
        compile: `True`, or a dict of `torch.compile` options (`{"mode": "max-autotune"}`), compiles each block in
            place after tensor parallelism and activation checkpointing, before the data-parallel wrapper; names
            and checkpoint keys stay those of the eager model. See `lightning_dpar.parallel.compilation`.
        process_group_backend: `"nccl"`, `"gloo"`, ...; default: the device's usual backend.
        timeout: collective timeout.
        start_method: `"popen"` re-runs the script per rank (default); `"fork"`/`"spawn"` launch from the current
            process. An interactive session (notebook, REPL) switches `"popen"` to `"fork"` automatically.
        checkpoint_format: `"sharded"` (default; a DCP directory, each rank writes its shards) or `"full"` (one file
            that `torch.load` and `LightningModule.load_from_checkpoint` read; gathers the model on rank 0).
        async_save: write sharded checkpoints in the background (staged to CPU memory first).
        checkpoint_weights: `"all"` (default) saves every parameter; `"trainable"` leaves out the frozen base that
            `pretrained=` supplies (adapter-only checkpoints, e.g. LoRA), which a resume reads from `pretrained=`
            again. See `lightning_dpar.checkpoint.adapter_only`.
        expert_parallel_size: ranks holding different experts of each MoE layer, taken from the shard ranks
            (`"auto"`: those of one node); see `lightning_dpar.experts.parallel`.
        expert_modules: the experts modules (class names or globs); default: a transformers model's
            `base_model_ep_plan`, else the experts contract (`lightning_dpar.experts.plan`).
        on_nonfinite: what a step whose loss or gradients hold NaN or Inf on any rank does, checked once per optimizer
            step after the gradients are reduced and before clipping: `"raise"` (default: every rank raises
            `NonFiniteError` before the optimizer step, naming the step, the parameters and the ranks), `"skip"`
            (the step is skipped on every rank and counted in the `nonfinite/skipped_steps` metric; too many in a
            row raise) or `"off"`. See `lightning_dpar.optim.nonfinite` and docs/nonfinite.md.
        pretrained: a Hugging Face `save_pretrained` directory (or `PretrainedWeights(path, prefix, strict)`) read
            into the model once it is parallelised, each rank reading only its shards; skipped when a checkpoint is
            resumed (`ckpt_path`), but for an adapter-only checkpoint's frozen base. See
            `lightning_dpar.hf_weights.pretrained`.
        fault_tolerance: a `FaultTolerance` makes each launch one torchft replica group, the groups replicating
            (the strategy's class is then composed with the fault-tolerant hooks, `compose_fault_tolerance`); `None`
            (default): no fault tolerance. See docs/fault_tolerance.md.
    """

    strategy_name = "dpar"

    def __init__(
        self,
        *,
        tensor_parallel_size: SizeArg = 1,
        data_parallel_size: SizeArg = "auto",
        replicate_size: SizeArg = 1,
        tp_plan: TPPlanSpec | None = None,
        loss_parallel: bool = False,
        activation_checkpointing: ActivationCheckpointingSetting = False,
        compile: CompileSpec = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        checkpoint_format: CheckpointFormatName = "sharded",
        async_save: bool = False,
        checkpoint_weights: CheckpointWeights = "all",
        pretrained: PretrainedSpec | None = None,
        pipeline_parallel_size: int = 1,
        pipeline: PipelineConfig | None = None,
        expert_parallel_size: SizeArg = 1,
        expert_modules: Sequence[ModuleSelector] | None = None,
        on_nonfinite: OnNonFinite = "raise",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        #: The non-finite step guard (`optim.nonfinite`); None with `on_nonfinite="off"`.
        self.nonfinite = NonFiniteGuard(on_nonfinite) if check_mode(on_nonfinite) != "off" else None
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"`start_method={start_method!r}` is invalid; use 'popen', 'fork' or 'spawn'.")
        if pipeline_parallel_size != 1 and checkpoint_format == "full":
            raise ValueError(
                "`checkpoint_format='full'` gathers the whole model on rank 0, which holds only the first pipeline"
                f" stage with `pipeline_parallel_size={pipeline_parallel_size}`. Use `checkpoint_format='sharded'` and"
                " export one file with `python -m lightning_dpar consolidate`."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._expert_parallel_size = expert_parallel_size
        self._expert_modules = None if expert_modules is None else list(expert_modules)
        self._pipeline_config = pipeline if pipeline is not None else PipelineConfig.of("1F1B", None, 1, "auto")
        self._runner: StepRunner | None = None
        self._tensor_parallel_size = tensor_parallel_size
        self._data_parallel_size = data_parallel_size
        self._replicate_size = replicate_size
        self._tp_plan = tp_plan if tp_plan == AUTO else parse_tp_plan(tp_plan)
        if not isinstance(loss_parallel, bool):
            raise TypeError(f"`loss_parallel={loss_parallel!r}` must be True or False.")
        self._loss_parallel = loss_parallel
        self._activation_checkpointing = activation_checkpointing
        self._compile_options = compile_options(compile)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method: StartMethod = start_method
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        #: Every mesh of the run (`ParallelDims.build_meshes`), built in `setup_environment`.
        self.meshes: ParallelMeshes | None = None
        #: The plan, computed once (`_plan_for`): before the process group for a model that exists already, else in
        #: `setup` after `configure_model`; `_planned_structure` is the model structure it was computed on.
        self.plan: ModulePlan | None = None
        self._planned_structure: tuple | None = None
        #: What applying the plan produced (`parallelize.AppliedPlan`: the parallel model, its FSDP units, the
        #: modules whose gradient sync `block_backward_sync` switches off, the pipeline stages, the context-parallel
        #: hooks), set in `setup`.
        self.applied: parallelize.AppliedPlan | None = None
        self._backward_sync_blocked = False
        #: DDP's buffer broadcast (`lightning_dpar.conformance.buffers`); made in `setup`, as DDP makes its own.
        self._buffer_sync: BufferSync | None = None
        self._router_loss: GlobalRouterLoss | None = None  # around each step's forward, as `_buffer_sync`
        # Checkpointing (the hooks: `strategies/checkpoint_hooks.py`).
        #: The single owner of save, load, async writes, removal and the resume state (`checkpoint.manager`).
        self.checkpoints = CheckpointManager(
            checkpoint_format, async_save, timeout, checkpoint_weights, to_pretrained_weights(pretrained)
        )
        if fault_tolerance is not None:  # any strategy: its class composed with the fault-tolerant hooks
            compose_fault_tolerance(self, fault_tolerance)

    @classmethod
    def register_class_names(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register the class's name and import paths, lower-cased as Lightning looks strategy strings up, so a
        LightningCLI given `--trainer.strategy=FullyShardStrategy` or `=lightning_dpar.FullyShardStrategy` (no init
        args: jsonargparse then passes the string through) builds the strategy instead of rejecting the name."""
        for name in {cls.__name__, f"lightning_dpar.{cls.__name__}", f"{cls.__module__}.{cls.__qualname__}"}:
            strategy_registry.register(
                name.lower(), cls, description=f"{cls.__name__}, by class name or import path", override=True
            )

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> DparPrecision:
        if self._precision_plugin is None:  # kept, so its cached clipping layout lives as long as the strategy
            self._precision_plugin = DparPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning's connector hands us the plugin it picked for `Trainer(precision=...)` (autocast for
        # bf16-mixed); translate it so the wrappers can do mixed precision themselves, and refuse what we cannot do.
        self._precision_plugin = to_dpar_precision(precision_plugin)

    # ------------------------------------------------------------------ before the first collective
    @override
    def setup_environment(self) -> None:
        """The pass up to the first collective, alike on every rank: ranks and mesh sizes, every refusal (and the
        plan of a model that exists already), then the process group and the meshes."""
        self.dims = self._resolve_world()
        self._check_before_collectives(self.dims)
        self.meshes = self._join_process_group(self.dims)

    def _check_before_collectives(self, dims: ParallelDims) -> None:
        """Pipeline settings, the Trainer's settings and callbacks that this layout cannot run, and the plan of a
        model that exists already (no `configure_model`): a plan that does not fit (e.g. a tensor-parallel size that
        does not divide a sharded dimension) fails on every rank with the same message, before any collective."""
        if dims.pipeline > 1:
            self._pipeline_config.check(dims.pipeline, self.root_device.type)
            check_pipeline_optimization(self.lightning_module, dims.pipeline)
        trainer = attached_trainer(self.lightning_module)
        module = self.lightning_module
        if module is not None:
            self._check_layer_sync(module)
            check_anomaly_detection(trainer, dims.tensor_parallel)
            applied_here = self.applied is not None and self.applied.module is module  # `validate` after `fit`
            if not is_overridden("configure_model", module) and not applied_here and has_parameters(module):
                self._plan_for(module, dims)
        if trainer is not None:
            plain = self.parameter_layout(dims).plain_tensors
            refuse_unsupported_callbacks(trainer.callbacks, type(self).__name__, plain, dims.tensor_parallel)

    def _plan_for(self, module: nn.Module, dims: ParallelDims) -> ModulePlan:
        """This run's plan of `module`: the one already computed if the model's structure is unchanged since (the
        `LightningModule.setup` hook, `configure_model` or `sync_batchnorm` may change it), else computed now."""
        structure = module_structure(module)
        if self.plan is None or structure != self._planned_structure:
            self.plan, self._planned_structure = self.module_plan(module, dims), structure
        return self.plan

    def _check_layer_sync(self, module: nn.Module) -> None:
        """`Trainer(sync_batchnorm=True)` when fitting: refused where torch's `SyncBatchNorm` cannot run (before the
        process group for a model that exists already; in `setup` for one built in `configure_model`)."""
        trainer = attached_trainer(module)
        if layer_sync_requested(self) and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_sync_batchnorm_supported(module, self.root_device)

    def parameter_layout(self, dims: ParallelDims) -> ParameterLayout:
        """How this strategy lays parameters out on a world of `dims`: what decides which optimizers and callbacks
        run exactly (`optim.exactness`, `conformance.callback_checks`), in training and in the `plan` dry run."""
        return ParameterLayout.of(dims, self.plan_options.shards)

    # ------------------------------------------------------------------ model setup
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init the model is built on the meta device and only shards are ever allocated (in `setup`).
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @property
    def plan_options(self) -> PlanOptions:
        """What this strategy's arguments say about the plan (`lightning_dpar.plan.planner`); subclasses add theirs."""
        kept = {
            "pipeline_parallel_size": self._pipeline_parallel_size,
            "replicate_size": self._replicate_size,
            "expert_parallel_size": self._expert_parallel_size,
        }
        return PlanOptions(
            strategy=type(self).__name__,
            tp_plan=self._tp_plan,
            loss_parallel=self._loss_parallel,
            activation_checkpointing=self._activation_checkpointing,
            compile=self._compile_options,
            pipeline=self._pipeline_config,
            kept_size_args=tuple((name, value) for name, value in kept.items() if value != 1),
            expert_modules=self._expert_modules,
        )

    def module_plan(self, module: nn.Module, dims: ParallelDims | None = None, rank: int | None = None) -> ModulePlan:
        """What will be applied to which submodule on a world of `dims` (default: this run's), as seen by global rank
        `rank` (default: this one); see `lightning_dpar.parallel.parallelize.plan_modules`, which training and the
        `plan` dry run share."""
        dims = dims if dims is not None else self.dims
        assert dims is not None, "the mesh sizes are resolved in `setup_environment`"
        return parallelize.plan_modules(module, dims, self.plan_options, self.global_rank if rank is None else rank)

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The `torch.compile` options each compile unit gets; `None` when not compiling."""
        return self._compile_options

    @property
    def pipeline_config(self) -> PipelineConfig:
        """The pipeline schedule, microbatches, stages per rank and split (used when `pipeline_parallel_size > 1`)."""
        return self._pipeline_config

    def apply_plan(
        self, module: nn.Module, plan: ModulePlan, meshes: ParallelMeshes, dry_run: bool = False
    ) -> parallelize.AppliedPlan:
        """`plan` applied to `module` on `meshes` (every step of `parallelize.STEPS`, the data-parallel wrapper's
        settings read from the plan) in this strategy's mixed precision: the training code path, which the `plan`
        dry run takes too (`dry_run`: meta tensors stay on the meta device, nothing is compiled). Sets no strategy
        state."""
        return parallelize.apply_plan(
            module,
            plan,
            meshes,
            mixed_precision=self.precision_plugin.mixed_precision_policy,
            compile_options=None if dry_run else self._compile_options,
            materialize=not dry_run,
        )

    def _parallelize(self, module: pl.LightningModule) -> parallelize.AppliedPlan:
        """This run's plan applied to `module`, shards materialised, and the runner of a step that takes the training
        step over (the pipeline's schedule) built."""
        assert self.dims is not None and self.meshes is not None, "the meshes are built in `setup_environment`"
        self.applied = applied = self.apply_plan(module, self._plan_for(module, self.dims), self.meshes)
        running = Running(
            module, self.plan_options, self.meshes, self.root_device, self.precision_plugin, self.checkpoints
        )
        self._runner = applied.step_runner(running)
        return applied

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self.applied is None or self.applied.module is not module:
            module = self.precision_plugin.convert_module(module)
            if layer_sync_requested(self) and trainer.state.fn == TrainerFn.FITTING:
                # As Lightning's DDP, when fitting. The layers stay `SyncBatchNorm` afterwards: DDP swaps them back in
                # teardown, but a swapped module would lose its FSDP2 parameter management.
                self._check_layer_sync(module)
                convert_sync_batchnorm(module, self.data_parallel_group)
            self._parallelize(module)
            self.checkpoints.load_pretrained(module, trainer.ckpt_path, self.plan.tied if self.plan else ())
        # Lightning's weight-averaging callbacks copied the model in their `setup`, before it was parallelised.
        lay_out_averaged_copies(trainer.callbacks, module)
        self.model_to_device()
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                replace_model_checkpoint_link(callback, self._point_last_link)
        self._prepare_step_forward(module)
        self.sync_metrics_over_data_parallel(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.prepare_optimizers(self.optimizers)
        self.precision_plugin.nonfinite = self.nonfinite  # gradient-norm clipping agrees on its flags
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def prepare_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Before the first step, alike on every rank (the shard probe too): updates needing whole tensors refused
        on this layout (`optim.exactness`), Muon's distributed form installed where parameters are split. The
        Trainer's `setup` and Fabric's (`lightning_dpar.fabric`) both call this."""
        assert self.dims is not None
        layout = self.parameter_layout(self.dims)
        on_shards = shard_probe.agreed(shard_probe.probe_on_shards)
        check_optimizers(optimizers, layout, type(self).__name__, self._computes_whole_updates, on_shards)
        for optimizer in optimizers:
            if layout.split_by and self._computes_whole_updates(optimizer):
                distributed_muon.install(optimizer)

    def _computes_whole_updates(self, optimizer: Optimizer) -> bool:
        """Whether this strategy computes `optimizer`'s updates on whole tensors on split parameters (Muon)."""
        return distributed_muon.supports(optimizer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.checkpoints.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
