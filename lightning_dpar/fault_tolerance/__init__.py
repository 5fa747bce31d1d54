"""Per-step fault tolerance with torchft (optional extra `ft`): the replica groups of a run keep training while one
is down, and a relaunched group heals from a live peer and rejoins. See docs/fault_tolerance.md.

- `config`: `FaultTolerance`, resolved from arguments and the environment; `checks`: refusals before any collective;
- `replica_group`: the torchft `Manager` and the per-step protocol (quorum, average across groups, commit);
- `healing`: what a live group sends a recovering one, and how it is applied;
- `strategy`: the hooks any strategy gets with `fault_tolerance=` (`with_fault_tolerance`; registered as
  `dpar_ft_hsdp`, `dpar_ft_replicate`, `dpar_ft_2d`).

Importing this package needs no torchft; building a `Manager` does.
"""

from lightning_dpar.fault_tolerance.config import (
    LIGHTHOUSE_ENV,
    NUM_REPLICA_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    FaultTolerance,
    LighthouseUnreachableError,
)
from lightning_dpar.fault_tolerance.replica_group import HealFailedError, StartTimeoutError
from lightning_dpar.fault_tolerance.strategy import FaultTolerantHooks, compose_fault_tolerance, with_fault_tolerance

__all__ = [
    "LIGHTHOUSE_ENV",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_GROUP_ENV",
    "FaultTolerance",
    "FaultTolerantHooks",
    "HealFailedError",
    "LighthouseUnreachableError",
    "StartTimeoutError",
    "compose_fault_tolerance",
    "with_fault_tolerance",
]
