"""The launch commands of docs/fault_tolerance.md are the ones the launched tests run (`docs_commands` reads them from
the page): they must stay parseable, and the lighthouse must be the case the first-quorum rule exists for."""

from __future__ import annotations

from tests.support.fault_tolerance import GROUP_SIZE, GROUPS, docs_commands


def test_the_docs_launch_commands_are_the_tested_ones():
    commands = docs_commands()
    lighthouse = commands["lighthouse"]
    assert lighthouse[0] == "torchft_lighthouse"
    assert lighthouse[lighthouse.index("--min_replicas") + 1] == "1"  # a quorum may form with one group
    assert dict(item.split("=", 1) for item in commands["env"])["NUM_REPLICA_GROUPS"] == str(GROUPS)
    group = commands["group"]
    assert group[group.index("--nproc-per-node") + 1] == str(GROUP_SIZE) and "--master-port" in group
