"""`FaultTolerance`: the small frozen config that turns the data-parallel replicas of a run into torchft replica
groups, resolved from its arguments and the environment, and checked before any collective.

Each replica group is its own launch (one `torchrun` per group, or one Ray Train replica group): its ranks shard the
model among themselves (FSDP, tensor parallelism), and the groups average their gradients through torchft, which
lets a group drop out and rejoin without stopping the others. See docs/fault_tolerance.md.
"""

from __future__ import annotations

import http.client
import os
import time
from dataclasses import dataclass, replace
from urllib.parse import urlparse

__all__ = [
    "LIGHTHOUSE_ENV",
    "LIGHTHOUSE_PROBE_TIMEOUT",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_GROUP_ENV",
    "FaultTolerance",
    "LighthouseUnreachableError",
    "check_lighthouse_reachable",
    "check_world_split",
]

#: torchft's own variable for the lighthouse address (its `Manager` and Ray's `TorchftConfig` read and set it).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: This launch's replica group, 0-based (torchft's examples use the same name).
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
#: How many replica groups the job has when all are up.
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"


#: The longest the lighthouse check waits for an answer (seconds; `quorum_timeout` when that is shorter).
LIGHTHOUSE_PROBE_TIMEOUT = 10.0


class LighthouseUnreachableError(ConnectionError):
    """No torchft lighthouse answers at the configured address."""


@dataclass(frozen=True)
class FaultTolerance:
    """Per-step fault tolerance across replica groups (torchft).

    Args:
        replica_group: this launch's group, `0 <= replica_group < num_replica_groups`; default: `$REPLICA_GROUP_ID`.
        num_replica_groups: the number of groups when all are up; default: `$NUM_REPLICA_GROUPS`. It fixes which
            samples each group trains (group `g` takes shard `g` of every global batch), so it must be the same in
            every group's launch.
        lighthouse: the lighthouse address, `http://host:port`; default: `$TORCHFT_LIGHTHOUSE`.
        min_replica_groups: a step commits only with at least this many groups in its quorum (torchft's
            `min_replica_size`); below it the survivors wait in the quorum instead of stepping.
        group_size: the ranks of one group, if given: the launch's world must equal it (a guard for launchers that
            split one world into groups).
        timeout: seconds for collectives across groups, commits and healing transfers; a group that hangs (rather
            than dies) is dropped after it.
        quorum_timeout: seconds a group waits for a quorum (a relaunched group waits here for the others); it also
            bounds the check that the lighthouse answers at all (at most `LIGHTHOUSE_PROBE_TIMEOUT` of it).
        start_timeout: seconds the first quorum of a run (or of a restart of every group) waits until every one of
            the `num_replica_groups` groups has joined it; then it fails naming the missing groups. A run never
            starts with fewer groups, whatever `--min_replicas` the lighthouse got (a group that started alone would
            train batches whose other shards are never trained). A group relaunched into a running job does not wait
            for all: it heals from the live groups.
    """

    replica_group: int | None = None
    num_replica_groups: int | None = None
    lighthouse: str | None = None
    min_replica_groups: int = 1
    group_size: int | None = None
    timeout: float = 60.0
    quorum_timeout: float = 120.0
    start_timeout: float = 300.0

    def resolved(self, environ: dict[str, str] | None = None) -> FaultTolerance:
        """The config with every unset field taken from the environment, validated; raises `ValueError` naming the
        field, the bad value, what is valid and where to set it."""
        env = os.environ if environ is None else environ
        groups = self.num_replica_groups
        if groups is None:
            groups = _int_from_env(env, NUM_REPLICA_GROUPS_ENV, "num_replica_groups")
        group = self.replica_group
        if group is None:
            group = _int_from_env(env, REPLICA_GROUP_ENV, "replica_group")
        lighthouse = self.lighthouse or env.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(
                f"No torchft lighthouse address: pass `FaultTolerance(lighthouse='http://host:29510')` or set"
                f" ${LIGHTHOUSE_ENV}. Start one with `torchft_lighthouse --min_replicas 1` (docs/fault_tolerance.md)."
            )
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"`num_replica_groups={groups!r}` is invalid: expected a positive integer.")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise ValueError(
                f"`replica_group={group!r}` is invalid with `num_replica_groups={groups}`: expected an integer in"
                f" 0..{groups - 1} (set it per launch, e.g. `{REPLICA_GROUP_ENV}=0 torchrun ...`)."
            )
        if not 1 <= self.min_replica_groups <= groups:
            raise ValueError(
                f"`min_replica_groups={self.min_replica_groups!r}` is invalid: expected 1..{groups} (the number of"
                " replica groups)."
            )
        for name in ("timeout", "quorum_timeout", "start_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"`{name}={value!r}` is invalid: expected a positive number of seconds.")
        if self.group_size is not None and (isinstance(self.group_size, bool) or self.group_size < 1):
            raise ValueError(f"`group_size={self.group_size!r}` is invalid: expected a positive integer or None.")
        return replace(self, replica_group=group, num_replica_groups=groups, lighthouse=lighthouse)


def _int_from_env(env: object, name: str, field: str) -> int:
    value = env.get(name)  # type: ignore[attr-defined]
    if value is None:
        raise ValueError(
            f"`FaultTolerance({field}=...)` is not set and neither is ${name}: every replica group's launch must say"
            f" which group it is and how many there are (e.g. `{REPLICA_GROUP_ENV}=0 {NUM_REPLICA_GROUPS_ENV}=2"
            " torchrun ...`)."
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is invalid: expected an integer (for `{field}`).") from None


def check_world_split(total_ranks: int, group_size: int) -> int:
    """The number of replica groups when `total_ranks` ranks are split into groups of `group_size`; raises
    `ValueError` when the size does not divide the world."""
    if group_size < 1 or total_ranks % group_size:
        sizes = [d for d in range(1, total_ranks + 1) if total_ranks % d == 0]
        raise ValueError(
            f"A replica group of {group_size} ranks does not divide the world of {total_ranks} ranks: every group"
            f" must have the same ranks (the same shards). Choose a group size among {sizes}."
        )
    return total_ranks // group_size


def check_lighthouse_reachable(address: str, timeout: float = LIGHTHOUSE_PROBE_TIMEOUT) -> None:
    """Ask the lighthouse for its status page (an HTTP GET on its port, which torchft's lighthouse serves beside its
    RPCs); raises `LighthouseUnreachableError` naming the address and `$TORCHFT_LIGHTHOUSE` when nothing listens, or
    when something accepts the connection but sends no HTTP answer within `timeout` seconds (a wrong port, a hung
    lighthouse), before any process group or quorum waits on it."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ValueError(
            f"Lighthouse address {address!r} is invalid: expected `http://host:port` (from"
            f" `FaultTolerance(lighthouse=...)` or ${LIGHTHOUSE_ENV})."
        )
    started = time.monotonic()
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/status")
        connection.getresponse().read()
    except (OSError, http.client.HTTPException) as error:
        waited = time.monotonic() - started
        what = (
            f"nothing answered within {waited:.1f} s (a connection was accepted, no HTTP answer came)"
            if isinstance(error, TimeoutError)
            else f"{type(error).__name__}: {error}"
        )
        raise LighthouseUnreachableError(
            f"No torchft lighthouse answers at {address} ({what}); the address comes from"
            f" `FaultTolerance(lighthouse=...)` or ${LIGHTHOUSE_ENV}. Start it first (`torchft_lighthouse"
            " --min_replicas 1 --bind [::]:29510`) and point every replica group at it."
        ) from error
    finally:
        connection.close()
