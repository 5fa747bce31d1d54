"""One rank's part in the torchft replica groups: the `Manager`, and the step protocol the strategy runs around
Lightning's optimizer step.

Per step, on every rank of every live group:

1. `start_step`: a quorum with the lighthouse (synchronous: a group that must heal has healed when it returns, before
   the forward). The quorum fixes the groups that take part in this step. Then the group's ranks agree that a heal
   was whole (`_quorum`): if any rank healed and another failed, every rank raises `HealFailedError`.
2. Lightning's closure (forward, backward; FSDP reduces gradients inside the group), then `average_gradients`: every
   gradient's local shard is averaged over the groups in the quorum (one flat all-reduce per dtype).
3. Clipping and `on_before_optimizer_step` hooks, then `commit`: torchft's `should_commit`; the optimizer steps only
   if every group of the quorum finished the step without error. A step that does not commit changes no weights.
   A step the non-finite guard skipped (NaN or Inf after the average) votes against committing (`vote_against`).

The first quorum (`join`, in the strategy's `setup`) is taken again until it holds every group, unless it finds a
running job (a live group has committed steps: this group heals from it); see `FaultTolerance.start_timeout`.

`history` records each step (batch index, the groups in the quorum, committed, wall time) and `heals` each heal, for
the callbacks and tests that report what the survivors did while a group was down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dpar.fault_tolerance.config import REPLICA_GROUP_ENV, FaultTolerance

__all__ = ["HealFailedError", "HealRecord", "ReplicaGroups", "StartTimeoutError", "StepRecord"]

#: Seconds between two tries of the first quorum while groups are missing from it.
START_POLL_INTERVAL = 0.5


class HealFailedError(RuntimeError):
    """A heal reached some ranks of a group and not others: the group stops whole rather than train mixed state."""


class StartTimeoutError(TimeoutError):
    """The first quorum of a run did not hold every replica group within `FaultTolerance.start_timeout`."""


@dataclass(frozen=True)
class StepRecord:
    """One step as this rank saw it."""

    batch_idx: int
    #: torchft's step counter before the step (committed steps since the job started).
    ft_step: int
    #: The number of groups in this step's quorum, and this group's rank among them.
    participants: int
    participating_rank: int | None
    committed: bool
    wall_time: float
    #: The groups (`replica_group` numbers) in this step's quorum, ascending.
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class HealRecord:
    """A heal of this rank from a live peer: the state it received replaced its own.

    A relaunched group's ranks record one when it joins a running job; a group that fell behind a committed step
    records one mid-run. At the start of a run torchft's initial synchronisation copies each rank's weights as built
    from one group (chosen per group rank), and those ranks record one with `ft_step` 0 and `batch_idx` None (before
    any batch or checkpoint load).
    """

    #: torchft's step counter after the heal: the live group's committed steps.
    ft_step: int
    #: The batch the live group was about to train, where this group continues; None before any batch.
    batch_idx: int | None
    #: Bytes of tensor data this rank received (its shards of the weights and optimizer state, loop state).
    bytes_received: int
    #: When the state was applied (`time.time()`).
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

        self.config = config
        self.device = device
        self._group_size = group_size
        timeout, quorum_timeout = timedelta(seconds=config.timeout), timedelta(seconds=config.quorum_timeout)
        pg = _recording_process_group(device, timeout)
        self._pg = pg
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
            self._quorum(joining=False)
        self._quorum_ready = False
        self._step_started = time.time()

    def join(self) -> None:
        """Take the first step's quorum now (in `setup`, before Lightning's loop starts): a relaunched group heals
        here, so its loop and sampler start at the batch the live groups are about to train. Before any group has
        committed a step, a quorum without every group is taken again (every `START_POLL_INTERVAL` s) until all
        joined or `start_timeout` passed; raises `StartTimeoutError` naming the missing groups."""
        config = self.config
        assert config.num_replica_groups is not None
        everyone = tuple(range(config.num_replica_groups))
        deadline = time.monotonic() + config.start_timeout
        while True:
            try:  # the whole remaining budget: torchft's `Manager` is unusable after a quorum that timed out
                self._quorum(joining=True, timeout=max(deadline - time.monotonic(), 0.1))
            except TimeoutError as error:  # the lighthouse formed no quorum in time
                if time.monotonic() < deadline - 1:
                    raise
                raise self._start_timeout_error(everyone, None) from error
            if self.groups == everyone or self.manager.current_step() > 0:
                break  # every group, or a running job this group healed into
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._start_timeout_error(everyone, self.groups)
            time.sleep(min(START_POLL_INTERVAL, remaining))
        self._quorum_ready = True

    def _start_timeout_error(self, everyone: tuple[int, ...], seen: tuple[int, ...] | None) -> StartTimeoutError:
        config = self.config
        if seen is None:
            found = "the lighthouse formed no quorum (it waits for `--min_replicas` groups)"
            missing = [g for g in everyone if g != config.replica_group]
        else:
            found = f"the last quorum held groups {list(seen)}"
            missing = [g for g in everyone if g not in seen]
        return StartTimeoutError(
            f"Replica group {config.replica_group}: the first quorum of this run did not hold all"
            f" {config.num_replica_groups} groups within `start_timeout={config.start_timeout}` s ({found}); missing:"
            f" groups {missing}. A run starts with every group (`num_replica_groups={config.num_replica_groups}`):"
            f" launch the missing groups with `{REPLICA_GROUP_ENV}=<g>` and the same lighthouse, or raise"
            " `FaultTolerance(start_timeout=...)`."
        )

    def _quorum(self, joining: bool, timeout: float | None = None) -> None:
        """One torchft quorum, then the group's agreement that whatever heal it brought reached every rank: a heal
        that reached some ranks and not others raises `HealFailedError` on every rank of the group (before any
        forward on mixed state); at the join, a failed heal or quorum raises too (nothing was trained yet)."""
        heals_before = len(self.heals)
        self.manager.start_quorum(timeout=None if timeout is None else timedelta(seconds=timeout))
        healed = len(self.heals) > heals_before
        error = self.manager.errored()
        flags = torch.tensor([int(healed), int(error is not None)], device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flags)
        else:
            gathered = [flags]
        healed_ranks = [r for r, f in enumerate(gathered) if f[0]]
        failed_ranks = [r for r, f in enumerate(gathered) if f[1]]
        if failed_ranks and (healed_ranks or joining):
            heal = self.heals[-1] if healed else None
            raise HealFailedError(
                f"Replica group {self.config.replica_group} failed to heal from a live group"
                f" (quorum of groups {list(self.groups)}"
                + (f", torchft step {heal.ft_step}, batch {heal.batch_idx}" if heal is not None else "")
                + f"): ranks {healed_ranks} received the state, ranks {failed_ranks} failed"
                f" ({'this rank: ' + str(error) if error is not None else 'see their logs'}). No rank of the group"
                " trains on part of a heal: every rank stops. Relaunch the group: it heals again from a live group"
                " (if no group is left, relaunch every group with the same `ckpt_path`)."
            ) from error

    @property
    def groups(self) -> tuple[int, ...]:
        """The groups in the current quorum (`replica_group` numbers, ascending): torchft numbers a quorum's ranks
        `group * group_size + group_rank` (the group from `replica_id`'s trailing digits)."""
        return tuple(sorted({rank // self._group_size for rank in self._pg.quorum_ranks}))

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
        self.history.append(StepRecord(batch_idx, ft_step, participants, rank, committed, time.time(), self.groups))
        return committed

    def vote_against(self, batch_idx: int, reason: str) -> None:
        """This step is not committed by this group (its ranks skipped the optimizer step): the error is reported to
        torchft, whose commit vote then fails on every rank of the group; recorded in `history`."""
        self.manager.report_error(RuntimeError(reason))
        self.commit(batch_idx)

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the checkpoints: the first group of the current quorum (a dead group never
        blocks a save, and two groups never write the same files)."""
        return self.manager.participating_rank() == 0

    def shutdown(self) -> None:
        if not self.closed:
            self.manager.shutdown(wait=False)
            self.closed = True


def _recording_process_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's process group across the groups (gloo on CPU, NCCL on GPU) that keeps the ranks of the quorum it was
    last configured for (`quorum_ranks`): torchft's `Manager` passes them to `configure` at each new quorum and keeps
    no other record of which groups a quorum holds."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupGloo if device.type == "cpu" else ProcessGroupNCCL

    class Recording(base):  # type: ignore[misc, valid-type]
        quorum_ranks: list[int] = []

        @override
        def configure(self, *args: Any, **kwargs: Any) -> None:
            # torchft 0.2.0 calls configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
            # group_world_size, global_ranks).
            ranks = kwargs["global_ranks"] if "global_ranks" in kwargs else args[7] if len(args) > 7 else None
            self.quorum_ranks = list(ranks or [])
            super().configure(*args, **kwargs)

    return Recording(timeout=timeout)
