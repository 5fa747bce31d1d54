"""Every private torch / Lightning API the package relies on, in one place.

Each import below has no public equivalent in the versions we support (torch>=2.11, lightning>=2.6). Keeping them
here means an upgrade that moves one of them breaks exactly one module, and a reader can audit the whole exposure.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.nn as nn

# Lightning's launchers, process-group initialisation and reduction helper: the building blocks every built-in
# Lightning strategy uses; re-implementing them would diverge from Lightning's env handling (SLURM, torchelastic).
from lightning.fabric.utilities.distributed import (  # noqa: F401
    _get_default_process_group_backend_for_device as default_process_group_backend,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: F401
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available  # noqa: F401
from lightning.fabric.utilities.imports import _IS_INTERACTIVE as IS_INTERACTIVE  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import (  # noqa: F401
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput  # noqa: F401
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: F401
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)

# Composable activation checkpointing: unlike `checkpoint_wrapper` it does not insert a wrapper module, so parameter
# names (and therefore checkpoints) are identical with and without activation checkpointing.
from torch.distributed._composable.checkpoint_activation import checkpoint as checkpoint_activations  # noqa: F401

# Composable DDP. The seeds' `replicate()` (bucket_cap_mb, gradient_as_bucket_view, comm hooks) only exists here;
# the public `DistributedDataParallel` wrapper would change every FQN by inserting `module.`.
from torch.distributed._composable.replicate import replicate as ddp_replicate  # noqa: F401

# The traceable (functional) all-reduce: DDP's Python reducer runs comm hooks inside the compiled-autograd trace,
# where only functional collectives can be captured; torch's own compress hooks use the same function.
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all ranks of a multi-dim submesh (e.g. replicate x shard -> data_parallel).

    `DeviceMesh._flatten` is the only way to get such a dim that later `mesh[name]` lookups (Lightning users'
    `self.device_mesh["data_parallel"]`) resolve to; torch's own trainers (torchtitan) use it for the same reason.
    """
    return mesh._flatten(name)


def is_composable_replicated(module: nn.Module) -> bool:
    """Whether `ddp_replicate` was applied to this module (its registry is the only record of it)."""
    from torch.distributed._composable.contract import _get_registry

    registry = _get_registry(module)
    return registry is not None and "replicate" in registry


# DCP's reader for fsspec URLs (`s3://`, `memory://`). DCP picks it itself from a URL `checkpoint_id`, but to read the
# index without `pickle.load` (see `checkpoint.safe_io`) we subclass it, which needs the class.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: E402,F401


def unfetched_training_iterator(trainer: Any) -> Any | None:
    """The iterator Lightning's fit loop draws training batches from, if it has not pre-fetched any yet.

    Lightning has no public handle on it. We need it to skip the batches a non-resumable loader (custom sampler)
    already yielded before a mid-epoch checkpoint; with pre-fetched batches queued, skipping there would be wrong.
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or getattr(fetcher, "batches", None) or getattr(fetcher, "iterator", None) is None:
        return None
    return fetcher.iterator


def compiled_autograd(compiler: Callable[[Any], Any]) -> AbstractContextManager[None]:
    """Capture each backward pass into one graph compiled by `compiler` (compiled autograd).

    Lightning calls `loss.backward()` outside any `torch.compile` region, so the public switch
    (`torch._dynamo.config.compiled_autograd`, which only applies to backwards inside compiled code) cannot reach
    it; this context manager is torch's own entry point for that case (`enable` before torch 2.9, `_enable` since).
    """
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


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group of `world_size` ranks inside this one process, whose collectives do nothing.

    The `plan` dry-run uses it to build the real device mesh and run the real `parallelize_module` / `fully_shard`
    calls on meta tensors without launching processes. torch registers the `"fake"` backend only when its testing
    module `torch.testing._internal.distributed.fake_pg` is imported; there is no public equivalent.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


# The base class of Lightning's launchers: the only hook that runs before Lightning resolves `ckpt_path="last"`
# (in `Trainer._fit_impl` and friends), where a crashed save must be looked past (`checkpoint.discovery`).
from lightning.pytorch.strategies.launchers.launcher import _Launcher as Launcher  # noqa: E402,F401


def model_checkpoint_dir(callback: Any, trainer: Any) -> str | None:
    """The directory a `ModelCheckpoint` saves into. Before `fit` sets it up, only its private resolver knows (it
    derives the directory from the trainer's root directory and logger)."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))
