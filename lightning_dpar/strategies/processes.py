"""Lightning's process hooks, as one mixin of `DparStrategy`: how the ranks are launched, each rank's place and
device, the mesh sizes resolved and checked, the process group started and the device mesh built
(`DparStrategy.setup_environment` calls `_resolve_world`, its own checks, then `_join_process_group`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_dpar._private_api import IS_INTERACTIVE, attach_device_mesh
from lightning_dpar.launch.devices import check_devices_match_ranks
from lightning_dpar.launch.launchers import InPlaceLauncher, InteractiveLauncher, ScriptLauncher
from lightning_dpar.launch.process_group import start_process_group
from lightning_dpar.parallel_dims import ParallelDims, ParallelMeshes, SizeArg

__all__ = ["ProcessHooks", "StartMethod"]

StartMethod = Literal["popen", "fork", "spawn"]


class ProcessHooks(ParallelStrategy):
    """The process hooks of `DparStrategy`, which holds the size arguments they read (set in its `__init__`)."""

    _tensor_parallel_size: SizeArg
    _data_parallel_size: SizeArg
    _replicate_size: SizeArg
    _pipeline_parallel_size: int
    _process_group_backend: str | None
    _timeout: timedelta | None
    _start_method: StartMethod
    #: This run's mesh sizes, resolved in `setup_environment`.
    dims: ParallelDims | None
    meshes: ParallelMeshes | None
    _expert_parallel_size: SizeArg
    #: Ranks splitting each sequence (`lightning_dpar.context_parallel`); set by the strategies that support it.
    _context_parallel_size: SizeArg = 1

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
        if self.meshes is None:
            raise RuntimeError("The device mesh exists once the processes are initialised (in `configure_model`).")
        return self.meshes.world

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
            expert_parallel_size=self._expert_parallel_size,
            context_parallel_size=self._context_parallel_size,
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

    def _resolve_world(self) -> ParallelDims:
        """This process's rank, its device checked against the ranks, and the mesh sizes: pure arithmetic, so a bad
        size fails identically on every rank, before any collective, and never hangs."""
        self.set_world_ranks()
        check_devices_match_ranks(  # before `root_device` indexes the devices with the local rank
            self.num_processes, self.num_nodes, self.local_rank, self.world_size, self.cluster_environment
        )
        super().setup_environment()  # Lightning's: the accelerator's device
        return self.resolve_dims(self.world_size, self.num_processes, self.num_nodes)

    def _join_process_group(self, dims: ParallelDims) -> ParallelMeshes:
        """The process group (one that existed before is left alone) and this run's meshes, attached to the
        LightningModule (`self.device_mesh` in `configure_model`). Fit then validate reuse the meshes the parameters
        already live on."""
        self.start_process_group()
        meshes = self.meshes if self.meshes is not None else dims.build_meshes(self.root_device)
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, meshes.world)
        return meshes

    def start_process_group(self) -> None:
        """The default process group, with this strategy's backend and timeout, unless one exists (which is left
        alone); the one started here is destroyed when the process exits. Fabric's strategies
        (`lightning_dpar.fabric`) start theirs here too."""
        if dist.is_initialized():
            return
        reset_seed()
        self._process_group_backend = self._process_group_backend or dist.get_default_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        start_process_group(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
