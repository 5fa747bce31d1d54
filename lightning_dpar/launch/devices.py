"""The one check every launcher gets before the process group: the devices each process sees match the ranks.

A strategy lays out `Trainer(devices=d, num_nodes=n)` as `n` nodes of `d` processes, the process of local rank `r`
using the `r`-th device. A launcher that starts processes itself (torchrun, SLURM, Ray Train, ...) decides how many
there are. If the two disagree, the local rank indexes past the device list (an `IndexError` deep in Lightning), or
the mesh is built for another world than the one that exists; both are caught here, on every rank, before any rank
waits in a collective.
"""

from __future__ import annotations

__all__ = ["check_devices_match_ranks", "devices_ranks_problem"]

#: The cluster environments whose processes are Ray Train workers (compared by class name: `ray` is optional).
RAY_ENVIRONMENTS = ("RayLightningEnvironment",)


def devices_ranks_problem(
    devices: int, num_nodes: int, local_rank: int, world_size: int, environment: str
) -> str | None:
    """What is wrong when `devices` per process group of a node and `num_nodes` do not match the `world_size` ranks
    and this process's `local_rank` that the cluster `environment` (its class name) reports; None if they match."""
    if local_rank < devices and devices * num_nodes == world_size:
        return None
    expected = devices * num_nodes
    found = (
        f"{environment} runs {world_size} rank(s) and this process is local rank {local_rank}, but each process sees"
        f" {devices} device(s) (`Trainer(devices={devices}, num_nodes={num_nodes})`: laid out as"
        f" {num_nodes} node(s) x {devices} = {expected} rank(s), local ranks 0 to {devices - 1})."
    )
    if environment in RAY_ENVIRONMENTS:
        fix = (
            " Under Ray Train each worker sees only its own device: pass the Trainer through"
            " `lightning_dpar.ray.prepare_trainer(trainer)` (not `ray.train.lightning.prepare_trainer`), which sets"
            " the devices and nodes from Ray's worker group."
        )
    else:
        fix = (
            " Set `Trainer(devices=<processes per node>, num_nodes=<nodes>)` to what the launcher starts, so that"
            f" devices x num_nodes = {world_size} and every local rank has a device."
        )
    return found + fix


def check_devices_match_ranks(
    devices: int, num_nodes: int, local_rank: int, world_size: int, environment: object
) -> None:
    """Raise `ValueError` (see `devices_ranks_problem`) unless the devices match the ranks; no collective."""
    problem = devices_ranks_problem(devices, num_nodes, local_rank, world_size, type(environment).__name__)
    if problem is not None:
        raise ValueError(problem)
