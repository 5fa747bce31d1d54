"""`FaultTolerance` resolved from arguments and the environment, and the refusals before any collective: each bad
input names the value, what is valid and the fix."""

from __future__ import annotations

import socket

import pytest

from lightning_dpar.fault_tolerance.checks import check_fault_tolerance, check_trainer
from lightning_dpar.fault_tolerance.config import (
    FaultTolerance,
    LighthouseUnreachableError,
    check_lighthouse_reachable,
    check_world_split,
)
from lightning_dpar.parallel_dims import ParallelDims

ENV = {"TORCHFT_LIGHTHOUSE": "http://localhost:29510", "REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"}


def test_everything_unset_comes_from_the_environment():
    resolved = FaultTolerance().resolved(ENV)
    assert (resolved.replica_group, resolved.num_replica_groups, resolved.lighthouse) == (
        1,
        2,
        ENV["TORCHFT_LIGHTHOUSE"],
    )
    # Arguments win over the environment.
    assert FaultTolerance(replica_group=0, lighthouse="http://h:1").resolved(ENV).replica_group == 0


def test_no_lighthouse_names_the_argument_and_the_variable():
    with pytest.raises(ValueError, match=r"lighthouse=.*\$TORCHFT_LIGHTHOUSE"):
        FaultTolerance().resolved({k: v for k, v in ENV.items() if k != "TORCHFT_LIGHTHOUSE"})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"REPLICA_GROUP_ID": None}, r"\$REPLICA_GROUP_ID"),
        ({"NUM_REPLICA_GROUPS": None}, r"\$NUM_REPLICA_GROUPS"),
        ({"REPLICA_GROUP_ID": "2"}, r"`replica_group=2` is invalid with `num_replica_groups=2`: .* 0\.\.1"),
        ({"REPLICA_GROUP_ID": "one"}, r"\$REPLICA_GROUP_ID='one' is invalid: expected an integer"),
        ({"NUM_REPLICA_GROUPS": "0"}, r"`num_replica_groups=0` is invalid"),
    ],
)
def test_bad_group_numbers(env, match):
    environ = {**ENV, **env}
    with pytest.raises(ValueError, match=match):
        FaultTolerance().resolved({k: v for k, v in environ.items() if v is not None})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (FaultTolerance(min_replica_groups=3), r"`min_replica_groups=3` is invalid: expected 1\.\.2"),
        (FaultTolerance(timeout=0), r"`timeout=0` is invalid: expected a positive number of seconds"),
        (FaultTolerance(group_size=0), r"`group_size=0` is invalid"),
    ],
)
def test_bad_fields(config, match):
    with pytest.raises(ValueError, match=match):
        config.resolved(ENV)


def test_a_group_size_that_does_not_divide_the_world():
    assert check_world_split(8, 2) == 4
    with pytest.raises(ValueError, match=r"group of 3 ranks does not divide the world of 8 ranks.*\[1, 2, 4, 8\]"):
        check_world_split(8, 3)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_an_unreachable_lighthouse_names_the_address_and_the_variable():
    address = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(
        LighthouseUnreachableError, match=rf"No torchft lighthouse answers at {address}.*TORCHFT_LIGHTHOUSE"
    ):
        check_lighthouse_reachable(address, timeout=2)
    with pytest.raises(ValueError, match="expected `http://host:port`"):
        check_lighthouse_reachable("http://nohost")


def test_a_reachable_lighthouse_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_lighthouse_reachable(f"http://127.0.0.1:{server.getsockname()[1]}", timeout=2)


def _dims(pipeline: int = 1, world: int = 2) -> ParallelDims:
    return ParallelDims.resolve(world_size=world, devices_per_node=world, pipeline_parallel_size=pipeline)


def test_pipeline_parallelism_is_refused_by_name(monkeypatch):
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"pipeline parallelism \(`pipeline_parallel_size=2`\) is not supported"):
        check_fault_tolerance(FaultTolerance(), _dims(pipeline=2), reach_lighthouse=False)


def test_a_launch_that_is_not_one_group(monkeypatch):
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"`FaultTolerance\(group_size=4\)` but this launch has 2 ranks"):
        check_fault_tolerance(FaultTolerance(group_size=4), _dims(), reach_lighthouse=False)


class _Trainer:
    def __init__(self, accumulate: int = 1, automatic: bool = True) -> None:
        self.accumulate_grad_batches = accumulate
        self.lightning_module = type("M", (), {"automatic_optimization": automatic})()


def test_trainer_settings_the_step_protocol_cannot_run():
    check_trainer(_Trainer(), [object()])
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` is not supported"):
        check_trainer(_Trainer(accumulate=2))
    with pytest.raises(ValueError, match="needs automatic optimisation"):
        check_trainer(_Trainer(automatic=False))
    with pytest.raises(ValueError, match="exactly one optimizer; `configure_optimizers` returned 2"):
        check_trainer(_Trainer(), [object(), object()])


def test_expert_parallelism_stays_inside_a_group(monkeypatch):
    """Expert parallelism borrows ranks from the shard dim, which lies inside a replica group: accepted."""
    pytest.importorskip("torchft")
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    dims = ParallelDims.resolve(world_size=4, devices_per_node=4, expert_parallel_size=2)
    assert dims.expert == 2
    assert check_fault_tolerance(FaultTolerance(), dims, reach_lighthouse=False).num_replica_groups == 2
