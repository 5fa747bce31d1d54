"""The default process group the strategy starts, and ending it before the process exits.

A process that exits with live process groups leaves torch to tear down their communication threads while the
interpreter shuts down, where a thread still running aborts the whole process ("terminate called without an active
exception", SIGABRT) although training succeeded. So the group the strategy created is destroyed when the process
exits normally (an `atexit` hook, which runs before that shutdown), and only that one: a group the user (or another
library) created before the strategy stays theirs to end.

Not at `teardown`: the same process may `validate` or `test` after `fit`, and the sharded parameters live on the
mesh built over that group. The checkpoint writer ends its own group and thread itself (`checkpoint.writer`).
"""

from __future__ import annotations

import atexit
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

from lightning_dpar._private_api import init_dist_connection

__all__ = ["start_process_group"]


def start_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta | None, device_id: torch.device | None
) -> None:
    """Initialise the default process group (Lightning's way: its environment variables and log line) and have it
    destroyed when the process exits. Call only when no default group exists: one that does is not ours."""
    init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    atexit.register(_destroy_at_exit, dist.group.WORLD)


def _destroy_at_exit(world: dist.ProcessGroup | None) -> None:
    """Destroy every process group if the default one is still the group we created (the user may have destroyed it
    and started another). Ctrl+C cannot interrupt it half-way."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if dist.is_initialized() and dist.group.WORLD is world:
            dist.destroy_process_group()
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot be restored from here
            signal.signal(signal.SIGINT, previous)
