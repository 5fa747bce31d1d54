"""The package's strategies behind Lightning Fabric's API, for users who keep their own training loop.

One implementation: each Fabric strategy holds the Trainer-side strategy of the same name and arguments (`engine`,
a `lightning_dpar.strategies.DparStrategy`), and every decision is the engine's: the mesh sizes and their checks
(`ParallelDims`), the process group and meshes (`ParallelMeshes`), the plan (`parallelize.plan_modules`, through the
engine's `_plan_for`), the parallelisation (`apply_plan`, every step of `parallelize.STEPS`), the optimizers' exactness
checks, gradient-sync control, clipping over every mesh, the non-finite step guard, and checkpoints (the
`CheckpointManager`, writing the Trainer's layout). What this module adds is only the mapping of Fabric's hooks onto
those calls. The engine's hooks it calls by their underscored names (`_resolve_world`, `_parallelize`,
`_step_forward`, ...) are the package's own, shared with the Trainer's hooks rather than copied:

| Fabric | here | the engine (Trainer side) |
| --- | --- | --- |
| `Fabric(strategy=...)` | `__init__` | the same arguments, refused by `refusals` if Fabric cannot drive them |
| `fabric.launch()` | `setup_environment` | `_resolve_world`, `start_process_group`, `ParallelDims.build_meshes` |
| `fabric.init_module(empty_init=True)` | `module_init_context` | `tensor_init_context` (meta device) |
| `fabric.setup(model, optimizer)` | `setup_module`, `setup_optimizer` | `_parallelize`, `prepare_optimizers` |
| the model's forward | forward hooks | `_step_forward` (buffer broadcast, router loss, what each step does around it) |
| `fabric.backward` | `backward` | the guard's loss flag (and replicate's unsynced gradients) |
| `fabric.no_backward_sync` | `_backward_sync_control` | `block_backward_sync` |
| `fabric.clip_gradients` | `clip_gradients_norm`/`_value` | `DparPrecision.clip_norm`/`clip_grad_by_value` |
| `optimizer.step()` | `optimizer_step` | the non-finite guard, then FSDP units resharded |
| `fabric.save`/`fabric.load` | `save_checkpoint`/`load_checkpoint` | `write_checkpoint`, `CheckpointManager.load` |
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, ClassVar

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import __version__ as lightning_version
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar._private_api import (
    IS_INTERACTIVE,
    BackwardSyncControl,
    FabricMultiProcessingLauncher,
    FabricSubprocessScriptLauncher,
    StrategyRegistryType,
    optimizers_to_device,
)
from lightning_dpar.fabric.refusals import check_fabric_arguments, check_fabric_model
from lightning_dpar.fabric.state import rebind_optimizer, split_state
from lightning_dpar.optim.nonfinite import parameter_names
from lightning_dpar.optim.precision import DparPrecision
from lightning_dpar.parallel import data_parallel
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.strategies import DparStrategy
from lightning_dpar.strategies import FSDPTensorParallelStrategy as TrainerFSDPTensorParallelStrategy
from lightning_dpar.strategies import FullyShardStrategy as TrainerFullyShardStrategy
from lightning_dpar.strategies import ReplicateStrategy as TrainerReplicateStrategy

__all__ = [
    "DparFabricStrategy",
    "FSDPTensorParallelStrategy",
    "FullyShardStrategy",
    "ReplicateStrategy",
]


class DparFabricStrategy(ParallelStrategy):
    """Base of the Fabric strategies: Fabric's hooks mapped onto the Trainer-side strategy `engine_class`, built with
    the same arguments (see that class for them). Not registered itself; use a concrete subclass."""

    #: The Trainer-side strategy whose plan, steps, meshes and checkpoints this one drives.
    engine_class: ClassVar[type[DparStrategy]] = DparStrategy

    def __init__(self, **kwargs: Any) -> None:
        check_fabric_arguments(type(self).__name__, kwargs)
        #: The Trainer-side strategy of the same arguments, which makes every decision.
        self.engine: DparStrategy = self.engine_class(**kwargs)
        super().__init__()
        self._num_nodes = 1
        self._backward_sync_control = _BlockBackwardSync(self.engine)
        self._module: nn.Module | None = None
        self._forward_contexts: list[ExitStack] = []
        self._optimizer_steps = 0

    # ------------------------------------------------------------------ the world
    # What Fabric's connector sets on the strategy (devices, cluster environment, accelerator) is stored on the
    # engine, whose ranks, device and launch arguments are then the ones Fabric configured.
    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self.engine.parallel_devices

    @parallel_devices.setter
    @override
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        self.engine.parallel_devices = parallel_devices

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:  # type: ignore[override]
        return self.engine.cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment | None) -> None:
        self.engine.cluster_environment = environment

    @property
    @override
    def accelerator(self) -> Accelerator | None:
        return self.engine.accelerator

    @accelerator.setter
    @override
    def accelerator(self, accelerator: Accelerator) -> None:
        self.engine.accelerator = accelerator  # type: ignore[assignment]

    @property
    @override
    def root_device(self) -> torch.device:
        return self.engine.root_device

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return self.engine.num_processes

    @property
    def dims(self) -> ParallelDims | None:
        """This run's mesh sizes (the engine's), resolved in `setup_environment`."""
        return self.engine.dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The world mesh (dims `replicate`, `shard`, `tensor_parallel`, flattened `data_parallel`)."""
        return self.engine.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard of the data per data-parallel rank: tensor-parallel peers see the same batches."""
        return self.engine.distributed_sampler_kwargs

    @property
    @override
    def precision(self) -> DparPrecision:
        return self.engine.precision_plugin

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric's connector hands us the plugin it picked for `Fabric(precision=...)`; the engine translates it
        # (by its `precision` name) and refuses what it cannot do, as for the Trainer's.
        self.engine.precision_plugin = precision  # type: ignore[assignment]

    def _set_world_ranks(self) -> None:
        # Fabric's connector calls this (as on its own ModelParallelStrategy) before `_configure_launcher`, after
        # setting `_num_nodes` (as on its own strategies).
        self.engine.num_nodes = self.num_nodes
        self.engine.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        start_method = self.engine._start_method
        start_method = "fork" if start_method == "popen" and IS_INTERACTIVE else start_method
        if self.cluster_environment.creates_processes_externally:
            return
        if start_method == "popen":
            self._launcher = FabricSubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = FabricMultiProcessingLauncher(self, start_method=start_method)

    @override
    def setup_environment(self) -> None:
        """The engine's pass up to the model: ranks and mesh sizes checked (pure, alike on every rank, before any
        collective), then the process group and every mesh. The plan waits for `fabric.setup`, where the model is;
        it is pure too, so a plan that does not fit fails on every rank alike."""
        engine = self.engine
        engine.num_nodes = self.num_nodes
        engine.dims = engine._resolve_world()
        engine.start_process_group()
        engine.meshes = engine.dims.build_meshes(engine.root_device)

    # ------------------------------------------------------------------ the model
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """With `empty_init=True` the model is built on the meta device; `setup_module` materialises only this
        rank's shards, with the model's own initialisers."""
        return self.engine.tensor_init_context(empty_init)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # `setup_module` moves the parallel model (its shards only)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The engine's plan applied to `module` in place (as `Trainer.fit` does to a LightningModule), pretrained
        weights read into the shards, and the engine's per-forward work hooked around the model's forward."""
        if self._module is not None:
            raise ValueError(
                f"`{type(self).__name__}` parallelises one model per Fabric (its plan, meshes and checkpoints are"
                " for that model); this Fabric already set one up. Put the models in one `nn.Module`, or use one"
                " Fabric per model."
            )
        check_fabric_model(module, type(self).__name__)
        engine = self.engine
        if isinstance(engine, TrainerReplicateStrategy):
            engine.prepare_ddp_mode()
        engine._parallelize(module)  # type: ignore[arg-type]
        engine.checkpoints.load_pretrained(module, None, engine.plan.tied if engine.plan is not None else ())
        module.to(engine.root_device)
        engine.model = module
        engine._prepare_step_forward(module)
        self._hook_forward(module)
        self._module = module
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """`fabric.setup(model, optimizer)`: the optimizers, built on the whole model's parameters, re-pointed at
        the parallel model's (same names) before any step."""
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        parallel = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, parallel)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The engine's checks (updates needing whole tensors refused on split parameters; Muon's distributed form),
        then the optimizer's state on this rank's device."""
        self.engine.prepare_optimizers([optimizer])
        optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def _hook_forward(self, module: nn.Module) -> None:
        """Run the engine's `_step_forward` around each forward of the root module, as the Trainer runs it around
        each step's: DDP's buffer broadcast, a MoE model's global router loss, no key/value cache in training."""

        def enter(hooked: nn.Module, args: tuple[Any, ...]) -> None:
            stack = ExitStack()
            stack.enter_context(self.engine._step_forward(hooked.training, args))
            self._forward_contexts.append(stack)

        def leave(hooked: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._forward_contexts:
                self._forward_contexts.pop().close()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    # ------------------------------------------------------------------ the step
    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """`tensor.backward()`, its finiteness noted for the non-finite guard."""
        if self.engine.nonfinite is not None:
            self.engine.nonfinite.note_loss(tensor)
        tensor.backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The step through the engine's non-finite guard (`on_nonfinite`: the ranks agree on the gradients' and
        losses' finiteness and raise or skip alike), then every FSDP unit's parameters sharded again."""
        guard, engine = self.engine.nonfinite, self.engine
        if guard is None:
            output = optimizer.step(**kwargs)
        else:
            module = self._module

            def step(closure: Callable[[], Any]) -> Any:
                closure()
                return optimizer.step(**kwargs)

            output = guard.optimizer_step(
                step,
                lambda: None,
                parameters=lambda: list(self.precision.main_params(optimizer)),
                names=lambda: parameter_names([module] if module is not None else []),
                global_step=self._optimizer_steps,
                device=self.root_device,
                deferred=False,
            )
        data_parallel.reshard(engine.applied.fsdp_modules if engine.applied is not None else [])
        self._optimizer_steps += 1
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip over every mesh (sharded and tensor-parallel gradients counted once); returns the norm before."""
        norm = self.precision.clip_norm(optimizer, max_norm, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):  # the same norm on every rank: all raise
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is {norm.item()}, not finite, so"
                " `fabric.clip_gradients` cannot clip them. Pass `error_if_nonfinite=False` to clip anyway, or find"
                " the non-finite loss (`on_nonfinite='skip'` skips such steps on every rank)."
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.clip_grad_by_value(optimizer, clip_val)

    # ------------------------------------------------------------------ collectives (the engine's)
    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Over the data-parallel ranks by default (one entry per distinct batch), as on the Trainer side."""
        return self.engine.all_gather(tensor, group, sync_grads)

    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Over the data-parallel ranks by default: tensor-parallel peers hold the same values."""
        return self.engine.reduce(tensor, group, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.engine.barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.engine.broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self.engine.reduce_boolean_decision(decision, all)

    # ------------------------------------------------------------------ checkpoints (the engine's manager)
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write the Trainer's checkpoint of the state's model and optimizers (sharded, atomic, optionally in the
        background with `async_save`; or one file with `checkpoint_format="full"`), the state's other keys at its
        top level: a Trainer run loads it, `consolidate` reads it."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"`{type(self).__name__}` writes through its checkpoint manager, which takes neither `storage_options`"
                " nor `filter`; use `checkpoint_weights='trainable'` on the strategy to leave a frozen base out."
            )
        split = split_state(state, type(self).__name__)
        engine = self.engine
        checkpoint = {
            "pytorch-lightning_version": lightning_version,  # what a Trainer's load reads first
            **split.rest,
            "state_dict": engine.model_checkpoint_state(split.model),
            "optimizer_states": [engine.checkpoints.optimizer_state(split.model, opt) for _, opt in split.optimizers],
        }
        engine.write_checkpoint(checkpoint, path, None, split.model)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the state's model and optimizers in place from a checkpoint of any layout and world size
        (resharded by the checkpoint manager; a bad checkpoint raises the same error on every rank), and its other
        keys from the checkpoint's top level; returns the checkpoint's keys the state did not ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"`{type(self).__name__}.load_checkpoint` restores a state holding the model set up by `fabric.setup`:"
                f" pass `fabric.load(path, {{'model': model, 'optimizer': optimizer}})`, not {type(state).__name__}."
            )
        split = split_state(state, type(self).__name__)
        engine = self.engine
        optimizers = [optimizer for _, optimizer in split.optimizers]
        tied = engine.plan.tied if engine.plan is not None else ()
        rest = engine.checkpoints.load(path, split.model, optimizers, strict, fitting=False, tied=tied)
        missing = [key for key in split.rest if key not in rest]
        if strict and missing:
            raise KeyError(
                f"The checkpoint {str(path)!r} has no {missing}, which the state to load asks for. Its keys: "
                f"{sorted(rest)}. Load with `strict=False` to leave those keys as they are."
            )
        for key in split.rest:
            if key in rest:
                state[key] = rest.pop(key)
        return rest

    # ------------------------------------------------------------------ the rest
    @property
    def async_save(self) -> bool:
        """Whether sharded saves are written in the background (the engine's `async_save`)."""
        return self.engine.async_save

    @async_save.setter
    def async_save(self, enabled: bool) -> None:
        self.engine.async_save = enabled

    def wait_for_checkpoint(self) -> None:
        """Block until a background save is complete under its final name (call it before reading the checkpoint,
        and before the script ends)."""
        self.engine.wait_for_checkpoint()

    @override
    def teardown(self) -> None:
        self.engine.teardown()

    @classmethod
    def register_names(cls, registry: StrategyRegistryType, trainer_registry: StrategyRegistryType) -> None:
        """Register, in Fabric's `registry`, every name the Trainer's `trainer_registry` has for `engine_class` (with
        the same description and arguments), and this class's name and import path."""
        for name, entry in trainer_registry.items():
            if entry["strategy"] is cls.engine_class and name.startswith("dpar"):
                registry.register(name, cls, entry["description"], override=True, **entry["init_params"])
        for name in {cls.__name__, f"lightning_dpar.fabric.{cls.__name__}"}:
            registry.register(name.lower(), cls, f"{cls.__name__} under Fabric", override=True)


class _BlockBackwardSync(BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: the engine's `block_backward_sync` (no gradient all-reduce or
    reduce-scatter on accumulation's non-final micro-batches)."""

    def __init__(self, engine: DparStrategy) -> None:
        self.engine = engine

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.engine.block_backward_sync() if enabled else nullcontext()


class FullyShardStrategy(DparFabricStrategy):
    """FSDP2, HSDP and CPU offload under Fabric: `lightning_dpar.FullyShardStrategy`'s arguments and plan (pipeline
    and context parallelism refused: they need the Trainer's steps, `lightning_dpar.fabric.refusals`)."""

    engine_class = TrainerFullyShardStrategy


class FSDPTensorParallelStrategy(DparFabricStrategy):
    """Tensor parallelism with FSDP2 under Fabric: `lightning_dpar.FSDPTensorParallelStrategy`'s arguments and plan
    (`tp_plan=`, a `tp_plan` attribute on the model, or `"auto"` for a transformers model)."""

    engine_class = TrainerFSDPTensorParallelStrategy


class ReplicateStrategy(DparFabricStrategy):
    """DDP (composable `replicate`), or DDP with tensor parallelism, under Fabric: `lightning_dpar.ReplicateStrategy`'s
    arguments and plan."""

    engine_class = TrainerReplicateStrategy
    engine: TrainerReplicateStrategy

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Then the gradients DDP does not average (parameters on the root module itself, or frozen when it wrapped
        the model) averaged once the backward synchronised, before any clipping, as the Trainer's closure does."""
        super().backward(tensor, module, *args, **kwargs)
        self.engine.after_backward(synced=not self.engine._backward_sync_blocked)
