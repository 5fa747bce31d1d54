"""`FaultTolerance` resolved from arguments and the environment, and the refusals before any collective: each bad
input names the value, what is valid and the fix."""

from __future__ import annotations

import socket
import time

import pytest

from lightning_dpar.fault_tolerance.config import (
    FaultTolerance,
    LighthouseUnreachableError,
    check_lighthouse_reachable,
    check_world_split,
)

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
        (FaultTolerance(start_timeout=-1), r"`start_timeout=-1` is invalid: expected a positive number of seconds"),
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


def test_a_lighthouse_that_accepts_and_never_answers_is_refused_within_the_bound():
    """A listening socket nobody serves (a wrong port, a hung lighthouse): the connection is accepted, no answer
    comes; refused after the bound, like a closed port, naming the address and the variable."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(
            LighthouseUnreachableError,
            match=rf"No torchft lighthouse answers at {address} \(nothing answered within 1\.\d s .*TORCHFT_LIGHTHOUSE",
        ):
            check_lighthouse_reachable(address, timeout=1)
        assert time.monotonic() - started < 3


def test_a_real_lighthouse_passes():
    coordination = pytest.importorskip("torchft.coordination")
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        check_lighthouse_reachable(lighthouse.address(), timeout=5)
    finally:
        lighthouse.shutdown()
