"""Every private torch / Lightning API the package relies on, in one place.

Each import below has no public equivalent in the versions we support (torch>=2.11, lightning>=2.6). Keeping them
here means an upgrade that moves one of them breaks exactly one module, and a reader can audit the whole exposure.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn as nn

# The type of Lightning's strategy registry, which `Strategy.register_strategies(registry)` receives: the public
# `StrategyRegistry` is an instance of it, and the class itself is only exported privately.
from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType

# Lightning's launchers, process-group initialisation and reduction helper: the building blocks every built-in
# Lightning strategy uses; re-implementing them would diverge from Lightning's env handling (SLURM, torchelastic).
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE

# Moves optimizer state to the device the way Lightning's own strategies do in `setup` (keeping `step` where
# `torch.optim` expects it); Lightning has no public helper for it.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

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

__all__ = [
    "IS_INTERACTIVE",
    "LIGHTNING_SUBCLASS_HOOKS",
    "FakeTensorMode",
    "FsspecReader",
    "Launcher",
    "MultiProcessingLauncher",
    "StrategyRegistryType",
    "SubprocessScriptLauncher",
    "TorchDispatchMode",
    "WorkerOutput",
    "adopt_metric_state",
    "attach_device_mesh",
    "checkpoint_activations",
    "compiled_autograd",
    "ddp_replicate",
    "detect_anomaly_requested",
    "flatten_mesh",
    "functional_all_reduce",
    "grouped_mm",
    "init_dist_connection",
    "is_composable_replicated",
    "layer_sync_requested",
    "local_shape_and_offset",
    "metric_step_value",
    "model_checkpoint_dir",
    "muon_adjusted_lr",
    "muon_init_group",
    "muon_newton_schulz",
    "optimizers_to_device",
    "privateuse1_backend_name",
    "replace_model_checkpoint_link",
    "replace_muon_group_step",
    "storage_key",
    "swap_ddp_optimize_mode",
    "swapped_parameters",
    "sync_ddp_if_available",
    "trainer_and_mesh",
    "training_data_source",
    "transformers_attention_implementation",
    "transformers_module_initialiser",
    "transformers_supports_sdpa",
    "transformers_tp_plan_attribute",
    "tree_leaves",
    "tree_map",
    "unfetched_training_iterator",
    "unflatten_mesh",
    "unpacked_positions_on_fake_tensors",
    "view_base",
    "waited",
]


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of a multi-dim submesh (e.g. replicate x shard -> data_parallel).

    `DeviceMesh._flatten` is the only way to get such a dim that later `mesh[name]` lookups (Lightning users'
    `self.device_mesh["data_parallel"]`) resolve to; torch's own trainers (torchtitan) use it for the same reason."""
    return mesh._flatten(name)


def grouped_mm() -> Callable[..., torch.Tensor] | None:
    """`torch._grouped_mm(input, weights, offs=...)`, one matmul per group of rows, where this torch has it: no public
    grouped GEMM exists; torchtitan's and transformers' `grouped_mm` experts use it (it runs on CPU too, in fp32)."""
    return getattr(torch, "_grouped_mm", None)


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`mesh` with its dim `dim` viewed as several dims (`shard` -> `(expert_shard, expert)`), on the same root mesh.

    `DeviceMesh._unflatten` is the only way to get sub-dims of an existing dim whose meshes share the world mesh's
    root, which `fully_shard` needs to compose with a parameter already distributed on one of them (expert weights
    sharded over `expert`, FSDP over `expert_shard`); torchtitan builds its expert meshes the same way.

    The dim is passed by index: torch 2.11's `_unflatten` inverts its check of a dim given by name and rejects every
    existing name ("dim shard specified in _unflatten is not in ('replicate', 'shard', ...)"); an index takes the
    same path in every version. Checked on torch 2.11.0, 2.13.0 and 2.15.0."""
    return mesh._unflatten(list(mesh.mesh_dim_names or ()).index(dim), sizes, names)


@contextmanager
def swapped_parameters(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Register `tensors` in place of `module`'s own parameters of the same names while the context is open, then
    put back exactly the objects that were there.

    Expert parallelism runs an experts module's own `forward` on its local experts: the module must see plain local
    tensors (its `forward` indexes them by local expert id) where FSDP registered DTensors. `module._parameters` is
    the only place `nn.Module` looks parameters up; `torch.func.functional_call` swaps them too but calls the module
    again, which would run FSDP's hooks twice. transformers' expert parallelism swaps them the same way."""
    saved = {name: module._parameters[name] for name in tensors}
    try:
        module._parameters.update(tensors)  # type: ignore[arg-type]
        yield
    finally:
        module._parameters.update(saved)


def layer_sync_requested(strategy: Any) -> bool:
    """Whether `Trainer(sync_batchnorm=True)` was given (Lightning's private `_layer_sync`; no public accessor)."""
    return getattr(strategy, "_layer_sync", None) is not None


def detect_anomaly_requested(trainer: Any) -> bool:
    """Whether the Trainer was made with `detect_anomaly=True` (kept only as `_detect_anomaly`; refused in setup)."""
    return bool(getattr(trainer, "_detect_anomaly", False))


def privateuse1_backend_name() -> str:
    """The out-of-tree device backend's name, which `SyncBatchNorm` accepts (only `torch._C` exposes it)."""
    return torch._C._get_privateuse1_backend_name()


def is_composable_replicated(module: nn.Module) -> bool:
    """Whether `ddp_replicate` was applied to this module (its registry is the only record of it)."""
    from torch.distributed._composable.contract import _get_registry

    return "replicate" in (_get_registry(module) or {})


# DCP's reader for fsspec URLs (`s3://`, `memory://`). DCP picks it itself from a URL `checkpoint_id`, but to read the
# index without `pickle.load` (see `checkpoint.safe_io`) we subclass it, which needs the class. torch 2.15 made its
# module public (`fsspec_filesystem`) and deprecated the private one; torch 2.11-2.14 only have the private one.
try:
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader
except ImportError:  # torch < 2.15
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader


def unfetched_training_iterator(trainer: Any) -> Any | None:
    """The iterator Lightning's fit loop draws training batches from, if it has not pre-fetched any yet (no public
    handle): where the batches a non-resumable loader already yielded before a mid-epoch checkpoint are skipped."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or getattr(fetcher, "batches", None) or getattr(fetcher, "iterator", None) is None:
        return None
    return fetcher.iterator


def training_data_source(trainer: Any) -> Any | None:
    """What `trainer.fit` was given to train on (a `DataLoader`, a `LightningDataModule`, or the LightningModule
    itself), before any loader is built.

    Lightning has no public handle on it before `setup`. `AutoParallelStrategy` reads the per-rank batch size from it
    in `setup_environment`, to choose the layout before the process group exists (microbatches must divide it)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    return getattr(source, "instance", None)


def compiled_autograd(compiler: Callable[[Any], Any]) -> AbstractContextManager[None]:
    """Capture each backward pass into one graph compiled by `compiler` (compiled autograd).

    Lightning calls `loss.backward()` outside any `torch.compile` region, so the public switch
    (`torch._dynamo.config.compiled_autograd`, which only applies to backwards inside compiled code) cannot reach
    it; this context manager is torch's own entry point for that case (`enable` before torch 2.9, `_enable` since)."""
    from torch._dynamo import compiled_autograd as ca

    enable = getattr(ca, "_enable", None) or ca.enable
    return enable(compiler)


def swap_ddp_optimize_mode(mode: Any) -> Any:
    """Set dynamo's `optimize_ddp` mode and return the previous one. `"python_reducer"` makes DDP all-reduce
    gradients from Python hooks that compiled autograd traces and Inductor buckets; DDP reads the mode when it is
    built (on the first forward), dynamo whenever it compiles. Only a config attribute exists for it."""
    import torch._dynamo

    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = mode
    return previous


def attach_device_mesh(module: Any, mesh: DeviceMesh) -> None:
    """Make `mesh` the LightningModule's public `device_mesh` (what `configure_model` parallelises with).

    Lightning's `device_mesh` property is read-only; its own `ModelParallelStrategy` sets the attribute behind it."""
    module._device_mesh = mesh


# The base class of Lightning's launchers: the only hook that runs before Lightning resolves `ckpt_path="last"`
# (in `Trainer._fit_impl` and friends), where a crashed save must be looked past (`checkpoint.discovery`).
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher  # noqa: E402


def model_checkpoint_dir(callback: Any, trainer: Any) -> str | None:
    """The directory a `ModelCheckpoint` saves into: before `fit` sets it up, only its private resolver knows."""
    return str(callback.dirpath or callback._ModelCheckpoint__resolve_ckpt_dir(trainer))


def replace_model_checkpoint_link(callback: Any, link: Callable[[Any, str, str], None]) -> None:
    """Make `callback` (a `ModelCheckpoint`) make its `save_last="link"` link with `link(trainer, filepath, linkpath)`,
    shadowing (for this instance only) the private static `_link_checkpoint` Lightning calls right after the save
    returns: with an async save the checkpoint is still being written then (no public hook)."""
    callback._link_checkpoint = link


#: Lightning private names a strategy or launcher subclass must override or set: Lightning's extension points for
#: them are private, so there is no public way. `tests/unit/test_private_api.py` accepts `self._name` uses of
#: Lightning's private names only if listed here.
LIGHTNING_SUBCLASS_HOOKS = {
    "_configure_launcher": "Strategy subclasses choose their launcher here (Lightning's abstract hook).",
    "_launcher": "the attribute `_configure_launcher` must set; Lightning reads it to launch the processes.",
    "_precision_plugin": "the attribute behind `Strategy.precision_plugin`, which we override to translate plugins.",
    "_strategy": "the strategy a `_MultiProcessingLauncher` subclass launches, stored by its base class.",
    "_collect_rank_zero_results": "the launcher's hook for what rank 0 hands back to the interactive process; ours"
    " gathers the sharded weights (Lightning's sends rank 0's shards only).",
}


def transformers_module_initialiser(model: Any) -> Any:
    """A transformers `PreTrainedModel`'s per-module initialiser, `_init_weights(module)`: what its own
    `post_init` / `init_weights` apply to every submodule (and where rotary `inv_freq` is recomputed). transformers
    has no public per-module entry point, and meta init must initialise one module at a time."""
    return model._init_weights


def transformers_tp_plan_attribute(model: Any) -> Any:
    """The whole-model tensor-parallel plan transformers merges in `post_init` (`_tp_plan`); read-only, and the
    only place the plans of the model's heads (e.g. `lm_head`) are combined with the base model's."""
    return getattr(model, "_tp_plan", None)


def transformers_supports_sdpa(module: Any) -> bool:
    """Whether a transformers model's family has an SDPA attention at all (class flag `_supports_sdpa`; Gemma 2 not)."""
    return bool(getattr(type(module), "_supports_sdpa", True))


def transformers_attention_implementation(module: Any) -> str | None:
    """The attention implementation a transformers model runs (`config._attn_implementation`: `"sdpa"`, `"eager"`,
    `"flash_attention_2"`, `"flex_attention"`, ...), or None for a module without a transformers config. transformers
    has no public reader; `_attn_implementation` is what its own attention layers dispatch on (checked on
    transformers 5.24)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


@contextmanager
def unpacked_positions_on_fake_tensors() -> Iterator[None]:
    """Inside, transformers' packed-sequence check (`masking_utils.find_packed_sequence_indices`) reports one sequence
    per row for fake position ids, as it does for the `0 .. n-1` a decoder makes itself: unable to read fake values,
    it reports packing, and a traced step builds a `tokens x tokens` causal mask the real step (no attention mask)
    never builds. No public switch; checked on transformers 5.17 and 5.24; a no-op without it."""
    utils = sys.modules.get("transformers.masking_utils")  # not imported: no transformers model to trace
    original = getattr(utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    utils.find_packed_sequence_indices = lambda ids: None if isinstance(ids, FakeTensor) else original(ids)
    try:
        yield
    finally:
        utils.find_packed_sequence_indices = original


def adopt_metric_state(metric: Any, states: dict[str, Any], update_count: int, step_value: Any = None) -> None:
    """Give a torchmetrics `Metric` the states of its copy on another rank (a pipeline's last stage, which updated
    it), and the value its last `forward` returned there (what Lightning logs for `on_step`). torchmetrics keeps the
    number of updates (`_update_count`, which `compute` checks), the cached result (`_computed`) and the last
    forward's value (`_forward_cache`) privately and has no public way to set them."""
    for name, value in states.items():
        setattr(metric, name, value)
    metric._update_count = update_count
    metric._computed = None
    metric._forward_cache = step_value


def metric_step_value(metric: Any) -> Any:
    """The value a torchmetrics `Metric`'s last `forward` returned, which Lightning logs for `on_step` (private
    `_forward_cache`; no public accessor)."""
    return metric._forward_cache


def view_base(tensor: Any) -> Any:
    """The tensor `tensor` is an autograd-recorded view of, or None (`Tensor._base`): the only way to tell such a
    view, which FSDP warns about when a unit returns one (it reads `_base` itself), from a tensor of its own."""
    return tensor._base


# torch.optim.Muon's own Newton-Schulz iteration and learning-rate adjustment: the distributed step
# (`lightning_dpar.optim.distributed_muon`) calls the very functions `Muon.step` calls, so it computes bit for bit what
# Muon computes on the whole matrix under DDP. torch has no public functional form of them.
from torch.optim._muon import _adjust_lr as muon_adjusted_lr  # noqa: E402
from torch.optim._muon import _zeropower_via_newtonschulz as muon_newton_schulz  # noqa: E402


def replace_muon_group_step(optimizer: torch.optim.Muon, group_step: Callable[..., bool]) -> None:
    """Make `optimizer.step` call `group_step` (which updates the sharded parameters whole and appends only the
    others) in place of `Muon._init_group(group, params, grads, momentum_buffers)`, found first as an instance
    attribute. Unlike replacing `step`, this keeps what wraps `step` working (hooks, profiler, schedulers, closures)."""
    optimizer._init_group = group_step  # type: ignore[method-assign]


def muon_init_group(optimizer: torch.optim.Muon, group: Any, params: list, grads: list, buffers: list) -> bool:
    """torch's own `Muon._init_group`: checks each parameter and creates its momentum buffer, as `step` would."""
    return torch.optim.Muon._init_group(optimizer, group, params, grads, buffers)


def averaged_copy(callback: Any) -> nn.Module | None:
    """The module holding a Lightning weight-averaging callback's averaged weights (None before its `setup`), which
    the strategy lays out like the model: `WeightAveraging` keeps an `AveragedModel` in `_average_model` (the copy is
    its `module`), `StochasticWeightAveraging` the copied LightningModule itself; neither exposes it."""
    from torch.optim.swa_utils import AveragedModel

    average = callback._average_model
    return average.module if isinstance(average, AveragedModel) else average


# The activation estimate (`lightning_dpar.estimates.activation_trace`) runs a training step on fake tensors and
# follows every tensor storage it creates. `FakeTensorMode` is torch's own way to run operators without memory (what
# `torch.compile` traces with) on a device of our choosing, so kernels are picked as on a real device; a
# `TorchDispatchMode` sees each operator's outputs; pytree reads them out of nested results (no public equivalents).
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402


def storage_key(storage: torch.UntypedStorage) -> int:
    """The address of a storage's `StorageImpl`: the same for every view of it, unique among live storages (a fake
    or meta storage has no data pointer to tell storages apart, and Python storage objects are made on demand)."""
    return storage._cdata


def trainer_and_mesh(module: nn.Module) -> tuple[Any, Any]:
    """The Trainer and device mesh a LightningModule holds, or None, without raising when none is attached (the
    public `trainer` property raises): what a copy of the module must share rather than copy."""
    return getattr(module, "_trainer", None), getattr(module, "_device_mesh", None)


# `DTensor.to_local()` after an asynchronous redistribution (torch's `ColwiseParallel` / `RowwiseParallel` redistribute
# their output with `async_op=True`) returns an `AsyncCollectiveTensor`, which waits for the collective on first use.
# Fed as an input to a compiled block, torch 2.13's AOTAutograd replaces it by its inner tensor, which has no autograd
# history: the compiled graph is built as if the input needed no gradient, and the gradient to the module that
# produced it is dropped without an error (pytorch/pytorch#191113). Waiting with the functional `wait_tensor` op, whose
# backward is the identity, gives a plain tensor that keeps the history, without a copy. There is no public way to
# tell such a tensor or to wait on it. Checked on torch 2.11.0 (not affected, and unchanged by the wait) and 2.13.0.
from torch.distributed._functional_collectives import AsyncCollectiveTensor  # noqa: E402
from torch.distributed._functional_collectives import wait_tensor as _wait_tensor  # noqa: E402


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
