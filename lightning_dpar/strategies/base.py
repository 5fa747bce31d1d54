"""What every lightning_dpar strategy shares, as Lightning's hooks (each marked `@override`): process group and mesh,
launch, data-parallel sampling and reductions, precision, gradient-sync control, and checkpointing.

The hooks delegate: planning to `lightning_dpar.plan.plan_modules` (with this strategy's `plan_options`), applying
the plan to `lightning_dpar.parallelize.apply_plan`, checkpoints and resume state to the `CheckpointManager`
(`lightning_dpar.checkpoint.manager`), pretrained weights to `lightning_dpar.pretrained`, and pipelined steps to
`lightning_dpar.strategies.pipeline_steps`. A concrete strategy only says how it wraps the model for data parallelism
(`data_parallel_wrapper`) and what its arguments add to the plan (`plan_options`).
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar import distributed_muon, parallelize
from lightning_dpar._private_api import (
    IS_INTERACTIVE,
    StrategyRegistryType,
    attach_device_mesh,
    layer_sync_requested,
    optimizers_to_device,
    replace_model_checkpoint_link,
    sync_ddp_if_available,
)
from lightning_dpar.batchnorm import (
    check_sync_batchnorm_supported,
    convert_sync_batchnorm,
)
from lightning_dpar.buffers import BufferSync
from lightning_dpar.callback_checks import optimizer_problem, refuse_unsupported_callbacks
from lightning_dpar.checkpoint.adapter_only import CheckpointWeights
from lightning_dpar.checkpoint.agreement import first_problem
from lightning_dpar.checkpoint.hf_export import hf_model_record
from lightning_dpar.checkpoint.manager import CheckpointFormatName, CheckpointManager
from lightning_dpar.checkpoint.peft_export import peft_model_record
from lightning_dpar.compilation import CompileSpec, compile_options
from lightning_dpar.devices import check_devices_match_ranks
from lightning_dpar.helpers import has_parameters
from lightning_dpar.launchers import InPlaceLauncher, InteractiveLauncher, ScriptLauncher
from lightning_dpar.mesh import PIPELINE, TENSOR_PARALLEL, MeshLayout, ParallelDims, SizeArg, build_device_mesh
from lightning_dpar.optimizers import ParameterLayout, check_optimizers
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.runtime import PipelineRuntime
from lightning_dpar.plan import AUTO, ModulePlan, ModuleSelector, PlanOptions, TPPlanSpec, parse_tp_plan, plan_modules
from lightning_dpar.plan.structure import is_parallelized
from lightning_dpar.precision import DparPrecision, to_dpar_precision
from lightning_dpar.pretrained import PretrainedSpec, load_unless_resuming, read_pretrained, to_pretrained_weights
from lightning_dpar.process_group import start_process_group
from lightning_dpar.sampling import check_sampler_shards
from lightning_dpar.strategies.pipeline_steps import PipelineSteps
from lightning_dpar.trainer_checks import check_anomaly_detection, check_pipeline_optimization
from lightning_dpar.weight_averaging import lay_out_averaged_copies

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "DparStrategy",
    "StartMethod",
]

StartMethod = Literal["popen", "fork", "spawn"]

#: Lightning's warning on a mid-epoch resume whose loader has no `state_dict`; ours resumes without one.
LIGHTNING_RESUME_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def _attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer `module` is attached to, or None (`LightningModule.trainer` raises when there is none)."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:
        return None


class DparStrategy(ParallelStrategy):
    """Base of the package's strategies. Not registered itself; use a concrete subclass.

    Args:
        tensor_parallel_size: ranks per tensor-parallel group (`"auto"`: one node).
        data_parallel_size: ranks that see different batches (`"auto"`: world / tensor_parallel_size).
        replicate_size: HSDP replica groups (1: plain FSDP).
        tp_plan: `{module-name pattern: style}`; see `lightning_dpar.plan`.
        activation_checkpointing: `True` (each sharded block) or a list of class names / module-name globs.
        compile: `True`, or a dict of `torch.compile` options (`{"mode": "max-autotune"}`), compiles each block in
            place after tensor parallelism and activation checkpointing, before the data-parallel wrapper; names
            and checkpoint keys stay those of the eager model. See `lightning_dpar.compilation`.
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
        pretrained: a Hugging Face `save_pretrained` directory (or `PretrainedWeights(path, prefix, strict)`) read
            into the model once it is parallelised, each rank reading only its shards; skipped when a checkpoint is
            resumed (`ckpt_path`), but for an adapter-only checkpoint's frozen base. See `lightning_dpar.pretrained`.
    """

    strategy_name = "dpar"

    def __init__(
        self,
        *,
        tensor_parallel_size: SizeArg = 1,
        data_parallel_size: SizeArg = "auto",
        replicate_size: SizeArg = 1,
        tp_plan: TPPlanSpec | None = None,
        activation_checkpointing: bool | Sequence[ModuleSelector] = False,
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
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"`start_method={start_method!r}` is invalid; use 'popen', 'fork' or 'spawn'.")
        if pipeline_parallel_size != 1 and checkpoint_format == "full":
            raise ValueError(
                "`checkpoint_format='full'` gathers the whole model on rank 0, which holds only the first pipeline"
                f" stage with `pipeline_parallel_size={pipeline_parallel_size}`. Use `checkpoint_format='sharded'` and"
                " export one file with `python -m lightning_dpar consolidate`."
            )
        self._pipeline_parallel_size = pipeline_parallel_size
        self._pipeline_config = pipeline if pipeline is not None else PipelineConfig.of("1F1B", None, 1, "auto")
        self._pipeline: PipelineSteps | None = None
        self._tensor_parallel_size = tensor_parallel_size
        self._data_parallel_size = data_parallel_size
        self._replicate_size = replicate_size
        self._tp_plan = tp_plan if tp_plan == AUTO else parse_tp_plan(tp_plan)
        self._activation_checkpointing = activation_checkpointing
        self._compile_options = compile_options(compile)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method: StartMethod = start_method
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None
        self._data_parallel_mesh: DeviceMesh | None = None
        # Modules whose gradient all-reduce / reduce-scatter `block_backward_sync` switches off.
        self._grad_sync_modules: list[nn.Module] = []
        self._backward_sync_blocked = False
        #: DDP's buffer broadcast (`lightning_dpar.buffers`); made in `setup`, as DDP makes its own when wrapping.
        self._buffer_sync: BufferSync | None = None
        # Every FSDP unit: resharded between steps (`optimizer_step`).
        self._fsdp_modules: list[FSDPModule] = []
        self._parallelized_module: nn.Module | None = None
        #: The model's tied parameters, found before parallelism (`ModulePlan.tied`), for the pretrained load.
        self._tied: list[tuple[str, ...]] = []
        # Checkpointing (see the checkpointing section below).
        #: The single owner of save, load, async writes, removal and the resume state (`checkpoint.manager`).
        self._pretrained = to_pretrained_weights(pretrained)
        self.checkpoints = CheckpointManager(
            checkpoint_format, async_save, timeout, checkpoint_weights, self._pretrained
        )

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

    # ------------------------------------------------------------------ processes and mesh
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def device_mesh(self) -> DeviceMesh:
        """The world mesh with dims `replicate`, `shard`, `tensor_parallel` and the flattened `data_parallel`."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes are initialised (in `configure_model`).")
        return self._device_mesh

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Ranks that see different batches; metrics and logged values reduce over this group only."""
        return self._data_parallel_mesh.get_group() if self._data_parallel_mesh is not None else None

    def resolve_dims(self, world_size: int, devices_per_node: int, num_nodes: int) -> ParallelDims:
        """Mesh sizes for a world; pure arithmetic, shared with the `plan` dry-run."""
        return ParallelDims.resolve(
            world_size=world_size,
            devices_per_node=devices_per_node,
            tensor_parallel_size=self._tensor_parallel_size,
            data_parallel_size=self._data_parallel_size,
            replicate_size=self._replicate_size,
            num_nodes=num_nodes,
            pipeline_parallel_size=self._pipeline_parallel_size,
        )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        start_method = "fork" if self._start_method == "popen" and IS_INTERACTIVE else self._start_method
        if self.cluster_environment.creates_processes_externally:
            self._launcher = InPlaceLauncher()
        elif start_method == "popen":
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = InteractiveLauncher(self, start_method=start_method)

    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()
        check_devices_match_ranks(  # before `root_device` indexes the devices with the local rank
            self.num_processes, self.num_nodes, self.local_rank, self.world_size, self.cluster_environment
        )
        super().setup_environment()
        # Validate the layout before any collective: a bad size fails identically on every rank, never hangs.
        self.dims = self.resolve_dims(self.world_size, self.num_processes, self.num_nodes)
        if self.dims.pipeline > 1:
            self._pipeline_config.check(self.dims.pipeline)
            check_pipeline_optimization(self.lightning_module, self.dims.pipeline)
        if self.lightning_module is not None:
            self._check_layer_sync(self.lightning_module)
            check_anomaly_detection(_attached_trainer(self.lightning_module), self.dims.tensor_parallel)
        self._check_plan_before_collectives()
        trainer = _attached_trainer(self.lightning_module)
        if trainer is not None:
            whole_parameters = self.holds_whole_parameters(self.dims)
            refuse_unsupported_callbacks(
                trainer.callbacks, type(self).__name__, whole_parameters, self.dims.tensor_parallel
            )
        if not dist.is_initialized():
            reset_seed()
            self._process_group_backend = self._process_group_backend or dist.get_default_backend_for_device(
                self.root_device
            )
            assert self.cluster_environment is not None
            start_process_group(  # destroyed when the process exits; one that existed before is left alone
                self.cluster_environment,
                self._process_group_backend,
                timeout=self._timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        if self._device_mesh is None:  # fit then validate reuse the mesh the parameters already live on
            self._device_mesh, self._data_parallel_mesh = build_device_mesh(self.dims, self.root_device.type)
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, self._device_mesh)

    def _check_plan_before_collectives(self) -> None:
        """Resolve the plan of a model that exists already (no `configure_model`) before the process group: a plan
        that does not fit (e.g. a tensor-parallel size that does not divide a sharded dimension) fails on every rank
        with the same message, before any rank waits in a collective."""
        module = self.lightning_module
        if (
            module is not None
            and not is_overridden("configure_model", module)
            and not is_parallelized(module)  # e.g. `validate` after `fit`: planned and applied already
            and has_parameters(module)
        ):
            assert self.dims is not None
            self.module_plan(module, self.dims)

    def _check_layer_sync(self, module: nn.Module) -> None:
        """`Trainer(sync_batchnorm=True)` when fitting: refused where torch's `SyncBatchNorm` cannot run (before the
        process group for a model that exists already; in `setup` for one built in `configure_model`)."""
        trainer = _attached_trainer(module)
        if layer_sync_requested(self) and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            check_sync_batchnorm_supported(module, self.root_device)

    def holds_whole_parameters(self, dims: ParallelDims) -> bool:
        """Whether every rank holds every parameter as a plain tensor on a world of `dims` (no sharding, tensor or
        pipeline parallelism): what callbacks that re-register parameters need (`callback_checks`)."""
        return False

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def is_distributed(self) -> bool:
        # Lightning only inserts a DistributedSampler for strategies that say so; without it every rank would
        # silently train on the same batches.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self._data_parallel_mesh
        assert mesh is not None, "the data-parallel mesh is built in `setup_environment`"
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

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
        kept = {"pipeline_parallel_size": self._pipeline_parallel_size, "replicate_size": self._replicate_size}
        return PlanOptions(
            strategy=type(self).__name__,
            tp_plan=self._tp_plan,
            activation_checkpointing=self._activation_checkpointing,
            compile=self._compile_options,
            pipeline=self._pipeline_config,
            kept_size_args=tuple((name, value) for name, value in kept.items() if value != 1),
        )

    def module_plan(self, module: nn.Module, dims: ParallelDims | None = None, rank: int | None = None) -> ModulePlan:
        """What will be applied to which submodule on a world of `dims` (default: this run's), as seen by global rank
        `rank` (default: this one); see `lightning_dpar.plan.plan_modules`, which training and the `plan` dry run
        share."""
        dims = dims if dims is not None else self.dims
        assert dims is not None, "the mesh sizes are resolved in `setup_environment`"
        return plan_modules(module, dims, self.plan_options, self.global_rank if rank is None else rank)

    @abstractmethod
    def data_parallel_wrapper(self, layout: MeshLayout) -> parallelize.DataParallelWrapper:
        """The function that applies this strategy's data-parallel wrapper on `layout`; it sets no strategy state,
        so the `plan` dry run can call it on a fake world."""

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The `torch.compile` options each compile unit gets; `None` when not compiling."""
        return self._compile_options

    @property
    def pipeline_config(self) -> PipelineConfig:
        """The pipeline schedule, microbatches, stages per rank and split (used when `pipeline_parallel_size > 1`)."""
        return self._pipeline_config

    @property
    def mesh_layout(self) -> MeshLayout:
        """This run's mesh sizes, meshes and device (exists once the processes are initialised)."""
        assert self.dims is not None and self._data_parallel_mesh is not None
        return MeshLayout(self.dims, self.device_mesh, self._data_parallel_mesh, self.root_device)

    def _parallelize(self, module: pl.LightningModule) -> None:
        """The training code path: `apply_plan` with this strategy's plan and wrapper, materialising the shards."""
        plan = self.module_plan(module)
        self._tied = plan.tied
        applied = parallelize.apply_plan(
            module,
            plan,
            tensor_parallel_mesh=self.device_mesh[TENSOR_PARALLEL],
            wrap_data_parallel=self.data_parallel_wrapper(self.mesh_layout),
            compile_options=self._compile_options,
            materialize_on=self.root_device,
        )
        self._grad_sync_modules = applied.grad_sync_modules
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if applied.pipeline is not None:
            group = self.device_mesh.get_group(PIPELINE)
            runtime = PipelineRuntime(applied.pipeline, module, self._pipeline_config, group, self.root_device)
            self._pipeline = PipelineSteps(runtime)
            self.precision_plugin.reduce_norms_across(group, self.root_device)  # the norm spans every stage
            self.checkpoints.hold_pipeline_stages(applied.pipeline.remote_units, group)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if self._parallelized_module is not module:
            module = self.precision_plugin.convert_module(module)
            if layer_sync_requested(self) and trainer.state.fn == TrainerFn.FITTING:
                # As Lightning's DDP, when fitting. The layers stay `SyncBatchNorm` afterwards: DDP swaps them back in
                # teardown, but a swapped module would lose its FSDP2 parameter management.
                self._check_layer_sync(module)
                convert_sync_batchnorm(module, self.data_parallel_group)
            self._parallelize(module)
            self._parallelized_module = module
            self._load_pretrained(module, trainer)
        # Lightning's weight-averaging callbacks copied the model in their `setup`, before it was parallelised.
        lay_out_averaged_copies(trainer.callbacks, module)
        self.model_to_device()
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                replace_model_checkpoint_link(callback, self._point_last_link)
        self._buffer_sync = BufferSync(module, self.data_parallel_group)
        self._sync_metrics_over_data_parallel(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # Before the first step, alike on every rank: an update that needs whole tensors is refused on shards.
            assert self.dims is not None
            layout = ParameterLayout.of(self.dims)
            check_optimizers(self.optimizers, layout, type(self).__name__, self._computes_whole_updates)
            for optimizer in self.optimizers:
                if layout.split_by and self._computes_whole_updates(optimizer):
                    distributed_muon.install(optimizer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _computes_whole_updates(self, optimizer: Optimizer) -> bool:
        """Whether this strategy computes `optimizer`'s per-tensor updates on whole tensors when parameters are
        split across ranks (`lightning_dpar.distributed_muon`)."""
        return distributed_muon.supports(optimizer)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's `configure_optimizers`; with pipeline parallelism, an error on some stages is raised on every
        rank (each stage builds its optimizer over its own parameters, so it can fail on one stage alone)."""
        if self._pipeline is None:
            return super().setup_optimizers(trainer)
        own_error: Exception | None = None
        try:
            super().setup_optimizers(trainer)
        except Exception as error:
            own_error = error
        problem = None
        if own_error is not None:
            problem = optimizer_problem(own_error, self.lightning_module, trainer.callbacks, self.global_rank)
        problem = first_problem(problem)
        if problem is not None:
            raise ValueError(problem) from own_error

    def _load_pretrained(self, module: nn.Module, trainer: pl.Trainer) -> None:
        """Fill the parallelised parameters from `pretrained`, unless a checkpoint about to be loaded replaces them."""
        if self._pretrained is not None:
            held_elsewhere = self.checkpoints.keys_held_elsewhere
            load_unless_resuming(module, self._pretrained, trainer.ckpt_path, held_elsewhere, self._tied)

    # ------------------------------------------------------------------ steps
    @contextmanager
    def _step_forward(self, training: bool) -> Generator[None, None, None]:
        """Around each step's forward, as DDP's wrapper does: rank 0's buffers are broadcast to the data-parallel
        peers first if a training forward ran since the last broadcast (`lightning_dpar.buffers`)."""
        if self._buffer_sync is not None:
            self._buffer_sync.before_forward()
        yield
        if self._buffer_sync is not None:
            module = self.lightning_module
            # Under manual optimisation Lightning's DDP switches its gradient sync off around the step's forward
            # (`_DDPForwardRedirection`), so that forward does not mark buffers for the next broadcast either.
            manual = module is not None and not module.automatic_optimization
            synced = training and torch.is_grad_enabled() and not self._backward_sync_blocked and not manual
            self._buffer_sync.after_forward(synced)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """With pipeline parallelism: one schedule step over the batch's microbatches, forward and backward (see
        `lightning_dpar.pipeline.runtime`); returns the loss on every rank."""
        with self._step_forward(training=True):
            if self._pipeline is None:
                return super().training_step(*args, **kwargs)
            trainer = _attached_trainer(self.lightning_module)
            accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
            return self._pipeline.training_step(self.precision_plugin, args, accumulate)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The step, then every FSDP unit's parameters sharded again: a root, or a unit no backward went through
        (all its parameters frozen), keeps them unsharded, and callbacks between steps must see the shards
        (`parallelize.reshard`)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        parallelize.reshard(self._fsdp_modules)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """With pipeline parallelism the schedule already ran every microbatch's backward inside `training_step`;
        its gradients are added here, between the hooks around backward."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self._pipeline.backward(self, closure_loss)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._pipeline is None:
                output = super().validation_step(*args, **kwargs)
                parallelize.reshard(self._fsdp_modules)  # see `optimizer_step`
                return output
            return self._pipeline.eval_step(self.precision_plugin, "validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._pipeline is None:
                return super().test_step(*args, **kwargs)
            return self._pipeline.eval_step(self.precision_plugin, "test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_forward(training=False):
            if self._pipeline is None:
                return super().predict_step(*args, **kwargs)
            return self._pipeline.eval_step(self.precision_plugin, "predict_step", args)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _sync_metrics_over_data_parallel(self, module: nn.Module) -> None:
        """torchmetrics `Metric`s sync over data-parallel peers only; TP peers hold the same values."""
        from torchmetrics import Metric

        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.process_group = self.data_parallel_group

    # ------------------------------------------------------------------ gradient sync
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient all-reduce / reduce-scatter on non-final micro-batches of gradient accumulation."""
        for module in self._grad_sync_modules:
            module.set_requires_gradient_sync(False)
        self._backward_sync_blocked = True
        try:
            yield
        finally:
            self._backward_sync_blocked = False
            for module in self._grad_sync_modules:
                module.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized() or name == "Trainer.save_checkpoint":
            # Lightning's barrier after each save: a synchronous save already ends in a collective on which every
            # rank learns its outcome, and an async one must not wait for anything; it would only add a round trip.
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src)
        return objects[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over the data-parallel group by default: tensor-parallel peers hold identical values."""
        if not isinstance(tensor, Tensor):
            return tensor
        return sync_ddp_if_available(tensor, group if group is not None else self.data_parallel_group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather from data-parallel peers by default (one entry per distinct batch)."""
        return super().all_gather(tensor, group if group is not None else self.data_parallel_group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Over the whole world: every rank must take the same decision (early stopping, checkpointing).
        if not dist.is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    # ------------------------------------------------------------------ checkpointing
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards can only be loaded into the wrapped model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` loads optimizer shards itself

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state to save; its unsharded buffers are rank 0's (of each data-parallel group), as in a DDP
        checkpoint, whichever rank writes them."""
        assert self.model is not None
        state = self.checkpoints.model_state(self.model)
        return self._buffer_sync.first_rank_copies(state) if self._buffer_sync is not None else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self.checkpoints.optimizer_state(self.model, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done by `load_checkpoint`, which has the wrapped model

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done by `load_checkpoint`

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Sharded: every rank writes its shards (atomically; in the background with `async_save`). Full: rank 0
        writes one file. See `docs/checkpointing.md`."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`.")
        trainer = _attached_trainer(self.lightning_module)
        data_parallel = self.dims.data_parallel if self.dims is not None else None
        record = self.checkpoints.record(trainer, type(self).__name__, self.world_size, data_parallel)
        checkpoint.update(hf_model_record(self.lightning_module))  # for `consolidate --format hf`
        checkpoint.update(peft_model_record(self.lightning_module))  # for `consolidate --format peft`
        self.checkpoints.save(checkpoint, filepath, record)

    def _point_last_link(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """`ModelCheckpoint(save_last="link")`'s link, made only once the checkpoint it names is published."""
        if not self.checkpoints.link(filepath, linkpath, trainer.is_global_zero):
            self.barrier()  # as Lightning's: no rank reads the link before rank 0 made it

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Called by `ModelCheckpoint` for superseded checkpoints; kept until a save in flight is complete."""
        self.checkpoints.remove(filepath, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model (and, when fitting, optimizer) state in place, resharding to this layout; return the rest.
        A bad path or file raises the same `CheckpointLoadError` on every rank instead of hanging."""
        assert self.model is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        return self.checkpoints.load(
            checkpoint_path,
            self.model,
            self.optimizers if fitting else [],
            self.lightning_module.strict_loading,
            fitting,
            iteration_based=trainer.max_steps != -1,
            load_base=lambda: read_pretrained(
                self.lightning_module, self._pretrained, self.checkpoints.keys_held_elsewhere, self._tied
            ),
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training loader resumable mid-epoch and position it if a checkpoint was just loaded."""
        trainer = _attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._pipeline is not None:
            self._pipeline.check_batches(dataloader)  # before training, not at the epoch's last batch
        data_parallel = self.dims.data_parallel if self.dims is not None else None
        if data_parallel is not None:
            check_sampler_shards(dataloader, data_parallel, self.world_size)
        if self.checkpoints.resumes_mid_epoch():
            # Lightning judges resumability by the loader's own `state_dict`, which ours does not need; the one line
            # the checkpoint manager logs in `on_train_start` says whether this resume is exact instead.
            warnings.filterwarnings("ignore", message=LIGHTNING_RESUME_WARNING, category=PossibleUserWarning)
        self.checkpoints.position_loader(dataloader, data_parallel)
        return dataloader

    @override
    def on_train_start(self) -> None:
        """Restore this rank's RNG streams right before training continues (after loaders and sanity checks)."""
        trainer = _attached_trainer(self.lightning_module)
        note = self.checkpoints.start_training(trainer, self.world_size, self.global_rank)
        if note is not None:
            rank_zero_info(note)

    @property
    def async_save(self) -> bool:
        """Whether sharded saves are written in the background. Settable between saves, e.g. to `False` before a
        final save that must be on disk when `save_checkpoint` returns."""
        return self.checkpoints.async_save

    @async_save.setter
    def async_save(self, enabled: bool) -> None:
        self.checkpoints.async_save = enabled

    def wait_for_checkpoint(self) -> None:
        """Block until an `async_save` checkpoint still being written is complete under its final name.

        The next save, a load and the end of `fit` already wait; call this after your own
        `trainer.save_checkpoint(...)` if you read or copy the checkpoint before any of those happens.
        """
        self.checkpoints.wait()
        self.barrier()

    @override
    def on_train_end(self) -> None:
        """The end of `fit` waits for the last background save, so its checkpoint is complete on return."""
        self.wait_for_checkpoint()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """After an error, wait a bounded time for a background save and log how it ended (teardown follows)."""
        self.checkpoints.close()

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.checkpoints.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
