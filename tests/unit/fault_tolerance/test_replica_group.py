"""The step protocol through a real `Trainer` in one process: one replica group of one rank, a real torchft
lighthouse and `Manager` (quorum, the average across groups, commit) on a one-rank gloo group. A job of one group
trains every sample of each global batch, as one process does; a job of two groups whose other group never comes is
refused at its first quorum, naming the missing group, whatever `--min_replicas` the lighthouse got (the launched
tests cover two groups, kills and healing: `tests/launched/test_fault_tolerance.py`)."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lightning_dpar import FaultTolerance, FaultTolerantFullyShardStrategy
from lightning_dpar.fault_tolerance.replica_group import StartTimeoutError
from tests.support.models import ParityModule, RegressionData, loader, reference_train

coordination = pytest.importorskip("torchft.coordination")

STEPS, BATCH = 3, 4


@pytest.fixture
def group_store(gloo_world, monkeypatch):
    """The store a group's `Manager` meets its ranks at (torchrun's or Lightning's in a launched run)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    yield store


def _trainer(config: FaultTolerance) -> tuple[L.Trainer, FaultTolerantFullyShardStrategy]:
    strategy = FaultTolerantFullyShardStrategy(fault_tolerance=config)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return trainer, strategy


def test_a_job_of_one_group_trains_every_sample_of_each_global_batch(group_store):
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        config = FaultTolerance(replica_group=0, num_replica_groups=1, lighthouse=lighthouse.address(), timeout=20)
        trainer, strategy = _trainer(config)
        data = RegressionData()
        module = ParityModule(optimizer="adam")
        trainer.fit(module, loader(data, BATCH))
    finally:
        lighthouse.shutdown()
    history = strategy.replica_groups.history
    assert [(h.batch_idx, h.participants, h.groups, h.committed) for h in history] == [
        (b, 1, (0,), True) for b in range(STEPS)
    ]
    assert strategy.replica_groups.closed  # the manager was shut down with the strategy
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    batches = [
        (data.x[order[b * BATCH : (b + 1) * BATCH]], data.y[order[b * BATCH : (b + 1) * BATCH]]) for b in range(STEPS)
    ]
    want = reference_train("adam", batches)
    got = {name: p.detach().full_tensor() for name, p in module.named_parameters()}
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6


@pytest.mark.parametrize(
    ("min_replicas", "found"),
    [(1, r"the last quorum held groups \[0\]"), (2, "the lighthouse formed no quorum")],
)
def test_the_first_quorum_waits_for_every_group_then_names_the_missing(group_store, min_replicas, found):
    """`--min_replicas 1` lets the lighthouse form a quorum of group 0 alone: it is not trained on, group 0 asks
    again until `start_timeout`; with `--min_replicas 2` no quorum forms. Either way no step is taken and the error
    names group 1."""
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=100)
    try:
        config = FaultTolerance(
            replica_group=0, num_replica_groups=2, lighthouse=lighthouse.address(), timeout=20, start_timeout=2
        )
        trainer, strategy = _trainer(config)
        started = time.monotonic()
        with pytest.raises(StartTimeoutError, match=rf"start_timeout=2\b.*{found}.*missing: groups \[1\]"):
            trainer.fit(ParityModule(optimizer="adam"), loader(RegressionData(), BATCH))
        waited = time.monotonic() - started
    finally:
        lighthouse.shutdown()
    assert 2 <= waited < 6, waited
    assert strategy.replica_groups.history == []
