"""One rank's part in the torchft replica groups: the `Manager`, and the step protocol the strategy runs around
Lightning's optimizer step.

Per step, on every rank of every live group:

1. `start_step`: a quorum with the lighthouse (synchronous: a group that must heal has healed when it returns, before
   the forward). The quorum fixes the groups that take part in this step.
2. Lightning's closure (forward, backward; FSDP reduces gradients inside the group), then `average_gradients`: every
   gradient's local shard is averaged over the groups in the quorum (one flat all-reduce per dtype).
3. Clipping and `on_before_optimizer_step` hooks, then `commit`: torchft's `should_commit`; the optimizer steps only
   if every group of the quorum finished the step without error. A step that does not commit changes no weights.

`history` records each step (batch index, groups in the quorum, committed, wall time) for the callbacks and tests
that report what the survivors did while a group was down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_dpar.fault_tolerance.config import FaultTolerance

__all__ = ["HealRecord", "ReplicaGroups", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One step as this rank saw it."""

    batch_idx: int
    #: torchft's step counter before the step (committed steps since the job started).
    ft_step: int
    #: Groups in this step's quorum, and this group's rank among them.
    participants: int
    participating_rank: int | None
    committed: bool
    wall_time: float


@dataclass(frozen=True)
class HealRecord:
    """A heal of this rank from a live peer."""

    ft_step: int
    batch_idx: int | None
    bytes_received: int
    wall_time: float


class ReplicaGroups:
    """This rank's torchft `Manager` and the per-step protocol (see the module docstring)."""

    def __init__(
        self,
        config: FaultTolerance,
        group_rank: int,
        group_size: int,
        device: torch.device,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.config = config
        timeout, quorum_timeout = timedelta(seconds=config.timeout), timedelta(seconds=config.quorum_timeout)
        pg = ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else ProcessGroupNCCL(timeout=timeout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=config.min_replica_groups,
            use_async_quorum=False,  # heal before the forward, so a healed group trains this very step
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            lighthouse_addr=config.lighthouse,
            # torchft derives global ranks from the id's trailing digits: the group number.
            replica_id=f"dpar_group_{config.replica_group}",
            init_sync=True,  # step 0 starts every group from one group's weights
        )
        self.history: list[StepRecord] = []
        self.heals: list[HealRecord] = []
        #: Lightning's global step at each checkpoint this group wrote (`writes_checkpoints`).
        self.saved: list[int] = []
        self._quorum_ready = False
        self._step_started = 0.0
        #: Whether `shutdown` ran (the manager is gone; a later `fit` makes a new one).
        self.closed = False

    def start_step(self) -> None:
        """The quorum for the next step, unless `join` already took it."""
        if not self._quorum_ready:
            self.manager.start_quorum()
        self._quorum_ready = False
        self._step_started = time.time()

    def join(self) -> None:
        """Take the first step's quorum now (in `setup`, before Lightning's loop starts): a relaunched group heals
        here, so its loop and sampler start at the batch the live groups are about to train."""
        self.manager.start_quorum()
        self._quorum_ready = True

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def average_gradients(self, params: Iterable[Tensor]) -> None:
        """Average each gradient's local shard over the groups in the quorum: one flat all-reduce per dtype."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for param in params:
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def commit(self, batch_idx: int) -> bool:
        """Whether the optimizer may step (every group of the quorum finished this step); recorded in `history`."""
        ft_step = self.manager.current_step()
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        committed = self.manager.should_commit()
        self.history.append(StepRecord(batch_idx, ft_step, participants, rank, committed, time.time()))
        return committed

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the checkpoints: the first group of the current quorum (a dead group never
        blocks a save, and two groups never write the same files)."""
        return self.manager.participating_rank() == 0

    def shutdown(self) -> None:
        if not self.closed:
            self.manager.shutdown(wait=False)
            self.closed = True
