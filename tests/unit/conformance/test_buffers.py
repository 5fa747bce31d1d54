"""`BufferSync` (`lightning_dpar.conformance.buffers`) on a real 2-rank gloo group, two processes started here
(no Lightning import, a second or two): DDP's schedule of buffer broadcasts from the group's first rank, by dtype,
and checkpoint copies that leave each rank's own buffers alone. Through real Trainers under every strategy this is
the conformance matrix's BatchNorm rows (`tests/launched/test_conformance.py`)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_dpar.conformance.buffers import BufferSync, broadcast_from_first


def _module(rank: int) -> nn.Module:
    module = nn.BatchNorm1d(3)
    with torch.no_grad():
        module.running_mean.fill_(float(rank + 1))
        module.num_batches_tracked.fill_(10 * (rank + 1))
    return module


def _run(rank: int, init_file: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        module = _module(rank)
        sync = BufferSync(module, group)
        seen = {}
        # A checkpoint holds rank 0's buffers; each rank keeps its own until the next forward.
        state = sync.first_rank_copies(module.state_dict())
        seen["checkpoint_mean"] = state["running_mean"].tolist()
        seen["own_mean_after_checkpoint"] = module.running_mean.tolist()
        sync.before_forward()  # the first forward: broadcast (both dtypes)
        seen["first"] = (module.running_mean.tolist(), int(module.num_batches_tracked))
        module.running_mean.add_(rank + 1.0)  # each rank's own update in that forward
        sync.after_forward(synced_training=False)  # a `no_sync` micro-batch: no broadcast before the next
        sync.before_forward()
        seen["after_no_sync"] = module.running_mean.tolist()
        sync.after_forward(synced_training=True)
        sync.before_forward()
        seen["after_synced"] = module.running_mean.tolist()
        module.running_mean = torch.full((3,), 5.0 * (rank + 1))  # reassigned: the new tensor is the buffer
        sync.after_forward(synced_training=True)
        sync.before_forward()
        seen["after_reassigned"] = module.running_mean.tolist()
        torch.save(seen, os.path.join(results, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: not the fast lane's in-process kind
def test_buffers_follow_ddps_broadcast_schedule_on_two_ranks(tmp_path):
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as init_file:
        pass
    os.unlink(init_file.name)
    mp.start_processes(_run, args=(init_file.name, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    seen = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    for rank, got in enumerate(seen):
        assert got["checkpoint_mean"] == [1.0] * 3
        assert got["own_mean_after_checkpoint"] == [float(rank + 1)] * 3
        assert got["first"] == ([1.0] * 3, 10)  # rank 0's, both the float and the int64 buffer
        assert got["after_no_sync"] == [1.0 + rank + 1.0] * 3  # not broadcast: each rank's own update kept
        assert got["after_synced"] == [2.0] * 3  # rank 0's again
        assert got["after_reassigned"] == [5.0] * 3  # the reassigned buffer, rank 0's


def test_one_rank_or_no_group_broadcasts_nothing(gloo_world):
    module = _module(rank=1)
    sync = BufferSync(module, dist.group.WORLD)  # one rank
    sync.before_forward()
    assert module.running_mean.tolist() == [2.0] * 3
    assert sync.first_rank_copies({"running_mean": module.running_mean}) == {"running_mean": module.running_mean}


def test_broadcast_from_first_keeps_each_tensors_shape_and_dtype(gloo_world):
    tensors = [torch.ones(2, 2), torch.tensor([3], dtype=torch.int64), torch.zeros(3)]
    broadcast_from_first(tensors, dist.group.WORLD)
    assert [t.shape for t in tensors] == [torch.Size([2, 2]), torch.Size([1]), torch.Size([3])]
    assert [t.dtype for t in tensors] == [torch.float32, torch.int64, torch.float32]
    assert tensors[0].tolist() == [[1.0, 1.0], [1.0, 1.0]] and tensors[1].item() == 3 and tensors[2].sum() == 0
