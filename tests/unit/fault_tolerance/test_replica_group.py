"""The step protocol through a real `Trainer` in one process: one replica group of one rank, a real torchft
lighthouse and `Manager` (quorum, the average across groups, commit) on a one-rank gloo group. With
`num_replica_groups=2` and only group 0 up, each step is a survivor's step: it trains group 0's shard of each global
batch and nothing else, which is what one process training those samples computes (the launched tests cover two
groups, kills and healing: `tests/launched/test_fault_tolerance.py`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from lightning_dpar import FaultTolerance, FaultTolerantFullyShardStrategy
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


def test_a_lone_group_trains_its_shard_of_each_global_batch(group_store):
    groups = 2
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        config = FaultTolerance(replica_group=0, num_replica_groups=groups, lighthouse=lighthouse.address(), timeout=20)
        strategy = FaultTolerantFullyShardStrategy(fault_tolerance=config)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        data = RegressionData()
        module = ParityModule(optimizer="adam")
        trainer.fit(module, loader(data, BATCH))
    finally:
        lighthouse.shutdown()
    history = strategy.replica_groups.history
    assert [(h.batch_idx, h.participants, h.committed) for h in history] == [(b, 1, True) for b in range(STEPS)]
    assert strategy.replica_groups.closed  # the manager was shut down with the strategy
    order = list(DistributedSampler(data, num_replicas=groups, rank=0, shuffle=True, seed=0))
    batches = [
        (data.x[order[b * BATCH : (b + 1) * BATCH]], data.y[order[b * BATCH : (b + 1) * BATCH]]) for b in range(STEPS)
    ]
    want = reference_train("adam", batches)
    got = {name: p.detach().full_tensor() for name, p in module.named_parameters()}
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
