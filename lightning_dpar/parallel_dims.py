"""The parallel mesh: how many ranks replicate, shard, hold different experts and tensor-parallelise, validated once,
and every mesh a step needs.

`ParallelDims` is pure arithmetic (no process group), so the `plan` dry-run and the strategies share the exact same
validation and error messages. Once the process group exists, `ParallelDims.build_meshes` builds the one
`ParallelMeshes` of a run: the world mesh and every view of it (data-parallel, tensor-parallel, FSDP, experts,
pipeline), each built once and handed out by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.placement_types import Placement

from lightning_dpar._private_api import flatten_mesh, unflatten_mesh
from lightning_dpar.helpers import divisors

__all__ = [
    "CONTEXT",
    "DATA_PARALLEL",
    "DATA_SHARD",
    "EXPERT",
    "EXPERT_SHARD",
    "PIPELINE",
    "REPLICATE",
    "SHARD",
    "TENSOR_PARALLEL",
    "ParallelDims",
    "ParallelMeshes",
    "SizeArg",
    "init_fake_process_group",
    "is_sharded",
]

SizeArg = Union[int, Literal["auto"]]

#: Mesh dim names. `data_parallel` is the flattened replicate x shard dim, named as Lightning's
#: `ModelParallelStrategy` names it so LightningModules written for it run unchanged.
REPLICATE, SHARD, TENSOR_PARALLEL, DATA_PARALLEL = "replicate", "shard", "tensor_parallel", "data_parallel"
#: The outermost dim, present only when `pipeline_parallel_size > 1`: ranks holding different stages of the model.
PIPELINE = "pipeline"
#: With expert parallelism the shard dim is viewed as `(expert_shard, expert)`: `expert` ranks hold different experts
#: of each MoE layer (and exchange tokens), `expert_shard` ranks FSDP-shard the same experts (torchtitan's
#: `dp_shard_mod_ep`). Every other parameter is sharded over the whole shard dim as without experts.
EXPERT, EXPERT_SHARD = "expert", "expert_shard"
#: With context parallelism the shard dim is viewed as `(data_shard, context)`: `context` ranks hold different parts
#: of the same sequences (`lightning_dpar.context_parallel`), `data_shard` ranks see different batches. FSDP still
#: shards over the whole shard dim (torchtitan's `dp_shard_cp`), so context parallelism adds no parameter memory.
CONTEXT, DATA_SHARD = "context_parallel", "data_shard"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}={value!r}` is invalid: expected a positive integer or 'auto'.")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dims; `pipeline * replicate * shard * tensor_parallel == world_size` always holds, and
    `expert` (the expert-parallel size, borrowed from the shard dim) divides `shard`."""

    world_size: int
    replicate: int
    shard: int
    tensor_parallel: int
    pipeline: int = 1
    expert: int = 1
    context: int = 1

    @property
    def expert_shard(self) -> int:
        """Ranks that FSDP-shard the same experts: the shard dim's ranks left over by expert parallelism."""
        return self.shard // self.expert

    @property
    def data_parallel(self) -> int:
        """Number of distinct batches per step: ranks that see different data (context-parallel peers share one)."""
        return self.replicate * self.shard // self.context

    @classmethod
    def resolve(
        cls,
        world_size: int,
        devices_per_node: int,
        tensor_parallel_size: SizeArg = 1,
        data_parallel_size: SizeArg = "auto",
        replicate_size: SizeArg = 1,
        num_nodes: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: SizeArg = 1,
        context_parallel_size: SizeArg = 1,
    ) -> ParallelDims:
        """Resolve `"auto"` sizes and check that they tile the world exactly.

        `tensor_parallel_size="auto"` means one node (TP wants the fastest links); `replicate_size="auto"` means one
        replica per node (HSDP: shard within a node, replicate across nodes); `data_parallel_size="auto"` takes
        what is left once the pipeline stages are set apart; `expert_parallel_size="auto"` means the shard dim's
        ranks within one node (the all-to-all that moves tokens to their experts wants the fastest links);
        `context_parallel_size="auto"` means one node's ranks left by tensor parallelism. Context-parallel ranks share
        each batch (split along the sequence), so `data_parallel_size` is world / (tensor x context parallel size).
        """
        world_size = _positive_int("world_size", world_size)
        pipeline = _positive_int("pipeline_parallel_size", pipeline_parallel_size)
        if world_size % pipeline:
            raise ValueError(
                f"`pipeline_parallel_size={pipeline}` does not divide the world size {world_size}. Choose a pipeline"
                f" size among {divisors(world_size)} or change the number of devices."
            )
        full_world, world_size = world_size, world_size // pipeline  # the ranks of one pipeline stage
        tp = (
            devices_per_node
            if tensor_parallel_size == "auto"
            else _positive_int("tensor_parallel_size", tensor_parallel_size)
        )
        replicate = num_nodes if replicate_size == "auto" else _positive_int("replicate_size", replicate_size)
        stage_ranks = f" (world size {full_world} / pipeline_parallel_size {pipeline})" if pipeline > 1 else ""
        if world_size % tp:
            raise ValueError(
                f"`tensor_parallel_size={tp}` does not divide the {'ranks per stage' if pipeline > 1 else 'world size'}"
                f" {world_size}{stage_ranks}. Choose a tensor-parallel size among {divisors(world_size)} or change"
                " the number of devices."
            )
        cp = _context_parallel_size(context_parallel_size, world_size, tp, devices_per_node, stage_ranks)
        dp = world_size // (tp * cp)
        if data_parallel_size != "auto" and _positive_int("data_parallel_size", data_parallel_size) != dp:
            raise ValueError(
                f"`data_parallel_size={data_parallel_size}` x `tensor_parallel_size={tp}`"
                f"{f' x `context_parallel_size={cp}`' if cp > 1 else ''} must equal the"
                f" {'ranks per stage' if pipeline > 1 else 'world size'} {world_size}{stage_ranks}. Set"
                f" `data_parallel_size={dp}` or 'auto'."
            )
        if dp % replicate:
            raise ValueError(
                f"`replicate_size={replicate}` must divide the data-parallel size {dp} (world size {world_size} /"
                f" tensor_parallel_size {tp}). Valid replicate sizes: {divisors(dp)}."
            )
        shard = dp // replicate * cp
        expert = _expert_parallel_size(expert_parallel_size, shard, max(devices_per_node // tp, 1), dp, replicate)
        if expert > 1 and cp > 1:
            raise ValueError(
                f"`expert_parallel_size={expert}` with `context_parallel_size={cp}` is not supported yet: both would"
                " borrow the shard dim's ranks. Use one of them (set the other to 1)."
            )
        return cls(
            world_size=full_world,
            replicate=replicate,
            shard=shard,
            tensor_parallel=tp,
            pipeline=pipeline,
            expert=expert,
            context=cp,
        )

    def describe(self) -> str:
        pipeline = f"pipeline {self.pipeline} x " if self.pipeline > 1 else ""
        shard = (
            f"shard {self.shard} (expert_shard {self.expert_shard} x expert {self.expert})"
            if self.expert > 1
            else f"shard {self.shard} (data_shard {self.shard // self.context} x context {self.context})"
            if self.context > 1
            else f"shard {self.shard}"
        )
        return (
            f"world={self.world_size} = {pipeline}replicate {self.replicate} x {shard}"
            f" x tensor_parallel {self.tensor_parallel}"
        )

    def build_meshes(self, device: torch.device, device_type: str | None = None) -> ParallelMeshes:
        """Every mesh of a world of these sizes, on the current process group (`ParallelMeshes.build`)."""
        return ParallelMeshes.build(self, device, device_type)


def _context_parallel_size(size: SizeArg, world_size: int, tp: int, devices_per_node: int, stage_ranks: str) -> int:
    """The context-parallel size: `"auto"` is one node's ranks left by tensor parallelism; any size times the
    tensor-parallel size must divide the ranks of a stage."""
    cp = max(devices_per_node // tp, 1) if size == "auto" else _positive_int("context_parallel_size", size)
    if (world_size // tp) % cp:
        raise ValueError(
            f"`context_parallel_size={cp}` does not divide the ranks left by `tensor_parallel_size={tp}`:"
            f" {world_size // tp} (world size {world_size}{stage_ranks}). Choose a context-parallel size among"
            f" {divisors(world_size // tp)} or change the number of devices."
        )
    return cp


def _expert_parallel_size(size: SizeArg, shard: int, shard_ranks_per_node: int, dp: int, replicate: int) -> int:
    """The expert-parallel size: `"auto"` is the shard dim's ranks within one node; any size must divide the shard
    dim (expert parallelism borrows its ranks from the data-parallel ranks that shard the model)."""
    if size == "auto":
        return math.gcd(shard, shard_ranks_per_node)
    expert = _positive_int("expert_parallel_size", size)
    if shard % expert:
        hsdp = f" (data-parallel size {dp} / replicate_size {replicate})" if replicate > 1 else ""
        raise ValueError(
            f"`expert_parallel_size={expert}` does not divide the data-parallel ranks that shard the model, {shard}"
            f"{hsdp}: expert parallelism borrows its ranks from them. Choose an expert-parallel size among"
            f" {divisors(shard)}, or change the number of devices, `tensor_parallel_size` or `replicate_size`."
        )
    return expert


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group of `world_size` ranks inside this one process, whose collectives do nothing.

    The `plan` dry-run uses it to build the real device mesh and run the real `parallelize_module` / `fully_shard`
    calls on meta tensors without launching processes; unit tests use it where a mesh is needed. torch's `"fake"`
    backend (`dist.Backend.FAKE`) needs no store.
    """
    dist.init_process_group("fake", rank=rank, world_size=world_size)


def is_sharded(placement: Placement) -> bool:
    """Whether a tensor with this placement holds a different part of the whole on each rank of its mesh dim.

    Not `isinstance(placement, Shard)`: FSDP over a tensor-parallel dim shards with `_StridedShard`, which is no
    `Shard` (nor `is_shard()`) in torch>=2.13. Replicated and partial (pending-reduction) placements are not sharded.
    """
    return not placement.is_replicate() and not placement.is_partial()


#: The meshes built in this process (`ParallelMeshes.build`), by (sizes, device, collective device type), each with
#: the default process group it was built on.
_BUILT_MESHES: dict[tuple[ParallelDims, torch.device, str], tuple[dist.ProcessGroup, ParallelMeshes]] = {}


@dataclass(frozen=True)
class ParallelMeshes:
    """Every mesh of a run, built once from its `ParallelDims` (`ParallelDims.build_meshes`) and handed out by name:
    training and the `plan` dry run (on a fake process group) read their meshes here and nowhere else.

    `world` has dims `(replicate, shard, tensor_parallel)`, preceded by `pipeline` when pipelining, with the
    flattened `data_parallel` dim registered on it. Rank layout is row-major, so tensor-parallel peers are adjacent
    ranks (same node), replicas are farther apart, and pipeline stages the farthest (across nodes: a stage boundary
    sends one activation per microbatch, the least traffic of all dims). `data_parallel` is that flattened dim as a
    1-D mesh (this rank's stage), kept rather than looked up because torch deprecates slicing a flattened dim from the
    world mesh (it warns on every lookup). With expert parallelism, `expert_view` is the world mesh with its shard dim
    viewed as `(expert_shard, expert)`; else `None`. With context parallelism, `context` is the 1-D `context_parallel`
    mesh (the shard dim viewed as `(data_shard, context_parallel)`) and `data_parallel` flattens
    `(replicate, data_shard)`: context-parallel peers share a batch; else `None`.
    """

    dims: ParallelDims
    world: DeviceMesh
    data_parallel: DeviceMesh
    device: torch.device
    expert_view: DeviceMesh | None = None
    context: DeviceMesh | None = None

    @classmethod
    def build(cls, dims: ParallelDims, device: torch.device, device_type: str | None = None) -> ParallelMeshes:
        """The meshes of `dims` on the current process group; `device_type` (default: `device.type`) is the one
        the meshes' collectives run on (the dry run builds CPU meshes for a meta-device model).

        Built once per layout and default process group, then reused: torch creates new process groups for every
        mesh it builds and keeps them until the process exits (a gloo group holds three threads, some of them
        polling), so a process that runs many Trainers one after the other (a sweep, a notebook, Ray workers, a
        test launch of a hundred cases) would otherwise pile up groups and slow every collective. A mesh holds no
        state of a run, so reusing it changes nothing but the groups' count. A new default process group (after
        `destroy_process_group()`) builds new meshes."""
        collective_device = device_type or device.type
        world_group = dist.group.WORLD if dist.is_initialized() else None
        for stale in [key for key, (group, _) in _BUILT_MESHES.items() if group is not world_group]:
            del _BUILT_MESHES[stale]  # meshes of a destroyed default group: their groups are gone with it
        key = (dims, device, collective_device)
        if key in _BUILT_MESHES:
            return _BUILT_MESHES[key][1]
        meshes = cls._build(dims, device, collective_device)
        _BUILT_MESHES[key] = (dist.group.WORLD, meshes)  # `init_device_mesh` starts the default group if none was
        return meshes

    @classmethod
    def _build(cls, dims: ParallelDims, device: torch.device, device_type: str) -> ParallelMeshes:
        sizes = (dims.replicate, dims.shard, dims.tensor_parallel)
        names = (REPLICATE, SHARD, TENSOR_PARALLEL)
        if dims.pipeline > 1:
            sizes, names = (dims.pipeline, *sizes), (PIPELINE, *names)
        world = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        if dims.context > 1:  # context-parallel peers (adjacent shard ranks) share a batch
            view = unflatten_mesh(world, SHARD, (dims.shard // dims.context, dims.context), (DATA_SHARD, CONTEXT))
            data_parallel = flatten_mesh(view[REPLICATE, DATA_SHARD], DATA_PARALLEL)
            return cls(dims, world, data_parallel, device, None, view[CONTEXT])
        data_parallel = flatten_mesh(world[REPLICATE, SHARD], DATA_PARALLEL)
        expert_view = None
        if dims.expert > 1:  # no expert view otherwise: it would only create process groups nothing uses
            expert_view = unflatten_mesh(world, SHARD, (dims.expert_shard, dims.expert), (EXPERT_SHARD, EXPERT))
        return cls(dims, world, data_parallel, device, expert_view)

    @property
    def tensor_parallel(self) -> DeviceMesh:
        """The 1-D `tensor_parallel` mesh `parallelize_module` takes."""
        return self.world[TENSOR_PARALLEL]

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh `fully_shard` takes: 1-D for plain FSDP, 2-D `(replicate, shard)` for HSDP."""
        return self.world[SHARD] if self.dims.replicate == 1 else self.world[REPLICATE, SHARD]

    @property
    def replicate_shard(self) -> DeviceMesh:
        """The 2-D `(replicate, shard)` mesh: the data-parallel ranks as DDP-style replicas of HSDP."""
        return self.world[REPLICATE, SHARD]

    @property
    def expert(self) -> DeviceMesh | None:
        """The 1-D `expert` mesh the experts are split over (ranks holding different experts); `None` without expert
        parallelism."""
        return self.expert_view[EXPERT] if self.expert_view is not None else None

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """The mesh `fully_shard` takes for the experts: the `expert_shard` dim, with `replicate` before it for HSDP.
        The `expert` dim is not in it: those ranks hold different experts. `None` without expert parallelism."""
        if self.expert_view is None:
            return None
        return self.expert_view[EXPERT_SHARD] if self.dims.replicate == 1 else self.expert_view[REPLICATE, EXPERT_SHARD]

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        """The process group joining this rank's pipeline stages (only with `pipeline_parallel_size > 1`)."""
        return self.world.get_group(PIPELINE)
