"""torch.distributed's private names the package relies on: composable activation checkpointing and `replicate`,
functional collectives, DTensor's local-shard arithmetic, mesh flattening and unflattening, DCP's fsspec reader, and
the process-group registries a forked child must forget. Each has no public equivalent in torch 2.11 to 2.15; each
says why it is needed and, where versions differ, which were checked."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

# Composable activation checkpointing: unlike `checkpoint_wrapper` it does not insert a wrapper module, so parameter
# names (and therefore checkpoints) are identical with and without activation checkpointing.
from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_activations

# Composable DDP, as in torch's `test/distributed/_composable/test_replicate.py`: `replicate()` (bucket_cap_mb,
# gradient_as_bucket_view, comm hooks) only exists here; the public `DistributedDataParallel` wrapper would change
# every FQN by inserting `module.`.
from torch.distributed._composable.replicate import replicate as ddp_replicate

# The traceable (functional) all-reduce: DDP's Python reducer runs comm hooks inside the compiled-autograd trace,
# where only functional collectives can be captured; torch's own compress hooks use the same function.
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.distributed.device_mesh import DeviceMesh

# Which block of a full tensor a DTensor's local shard is (shape and offset per dim): what torch's own full-state-dict
# loading uses (`_state_dict_utils._distribute_tensors`) to copy each rank's part out of a full tensor every rank holds;
# it lets a full-format load slice the memory-mapped file instead of scattering whole tensors from rank 0.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as local_shape_and_offset

# DCP's reader for fsspec URLs (`s3://`, `memory://`). DCP picks it itself from a URL `checkpoint_id`, but to read the
# index without `pickle.load` (see `checkpoint.safe_io`) we subclass it, which needs the class. torch 2.15 made its
# module public (`fsspec_filesystem`) and deprecated the private one; torch 2.11-2.14 only have the private one.
try:
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader
except ImportError:  # torch < 2.15
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

# `DTensor.to_local()` after an asynchronous redistribution (torch's `ColwiseParallel` / `RowwiseParallel` redistribute
# their output with `async_op=True`) returns an `AsyncCollectiveTensor`, which waits for the collective on first use.
# Fed as an input to a compiled block, torch 2.13's AOTAutograd replaces it by its inner tensor, which has no autograd
# history: the compiled graph is built as if the input needed no gradient, and the gradient to the module that
# produced it is dropped without an error (pytorch/pytorch#191113). Waiting with the functional `wait_tensor` op, whose
# backward is the identity, gives a plain tensor that keeps the history, without a copy. There is no public way to
# tell such a tensor or to wait on it. Checked on torch 2.11.0 (not affected, and unchanged by the wait) and 2.13.0.
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed._functional_collectives import wait_tensor as _wait_tensor

__all__ = [
    "AsyncCollectiveTensor",
    "FsspecReader",
    "checkpoint_activations",
    "ddp_replicate",
    "flatten_mesh",
    "forget_inherited_process_groups",
    "functional_all_reduce",
    "is_composable_replicated",
    "local_shape_and_offset",
    "unflatten_mesh",
    "waited",
]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of a multi-dim submesh (e.g. replicate x shard -> data_parallel).

    `DeviceMesh._flatten` is the only way to get such a dim that later `mesh[name]` lookups (Lightning users'
    `self.device_mesh["data_parallel"]`) resolve to; torch's own trainers (torchtitan) use it for the same reason."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`mesh` with its dim `dim` viewed as several dims (`shard` -> `(expert_shard, expert)`), on the same root mesh.

    `DeviceMesh._unflatten` is the only way to get sub-dims of an existing dim whose meshes share the world mesh's
    root, which `fully_shard` needs to compose with a parameter already distributed on one of them (expert weights
    sharded over `expert`, FSDP over `expert_shard`); torchtitan builds its expert meshes the same way.

    The dim is passed by index: torch 2.11's `_unflatten` inverts its check of a dim given by name and rejects every
    existing name ("dim shard specified in _unflatten is not in ('replicate', 'shard', ...)"); an index takes the
    same path in every version. Checked on torch 2.11.0, 2.13.0 and 2.15.0."""
    return mesh._unflatten(list(mesh.mesh_dim_names or ()).index(dim), sizes, names)


def is_composable_replicated(module: nn.Module) -> bool:
    """Whether `ddp_replicate` was applied to this module (its registry is the only record of it)."""
    from torch.distributed._composable.contract import _get_registry

    return "replicate" in (_get_registry(module) or {})


def waited(output: Any) -> Any:
    """`output` with every `AsyncCollectiveTensor` in it (a tensor, or one level of tuple / list) waited on and
    replaced by a plain tensor carrying the same autograd history; anything else is returned as it is."""
    if isinstance(output, AsyncCollectiveTensor):
        return _wait_tensor(output)
    if type(output) in (tuple, list) and any(isinstance(item, AsyncCollectiveTensor) for item in output):
        return type(output)(waited(item) for item in output)
    return output


# A forked child (the layout search's, `layout_search.isolated`) must plan on a fake process group of its own, but
# inherits this process's groups: torch keeps them in module-level maps behind `distributed_c10d._world` (documented
# there as an experimental extension point) and refuses a second default group. Shutting the inherited groups down
# (`destroy_process_group`), or only dropping the last reference to one, runs its destructor, which joins gloo threads
# that do not exist in the child (an abort: "std::system_error: Invalid argument") or aborts NCCL communicators the
# parent still uses. The child therefore takes them out of torch's maps and keeps them referenced until it exits (by
# `os._exit`, which runs no destructor). The group counter is kept, so the child's new group names never repeat an
# inherited one in torch's C++ registry. Checked on torch 2.11.0, 2.13.0 and 2.15.0.
_FORGOTTEN_PROCESS_GROUPS: list[Any] = []


def forget_inherited_process_groups() -> None:
    """In a forked child: no process group, as if none had been started (the parent's are untouched)."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    registries = [getattr(world, name) for name in _C10D_REGISTRIES if getattr(world, name, None) is not None]
    _FORGOTTEN_PROCESS_GROUPS.append((world.default_pg, [registry.copy() for registry in registries]))
    for registry in registries:
        registry.clear()
    world.default_pg = None


#: Every map and list of process-group state `_world` keeps (those of newer torch versions when present): the groups,
#: their names, ranks, backends and tags, pending coalesced collectives, torchcomms communicators (which the child's
#: `destroy_process_group` would otherwise finalize) and flight-recorder hooks (torch 2.15).
_C10D_REGISTRIES = (
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "tags_to_pg",
    "pg_to_tag",
    "pg_coalesce_state",
    "comms",
    "pg_flight_recorder_hooks",
)
