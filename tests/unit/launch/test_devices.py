"""The device/rank check every launcher gets (`lightning_dpar.launch.devices`), in process: the problem names both
counts and the fix, and a local rank past the devices fails before the process group. Under Ray Train it is exercised by
`tests/launched/test_ray_train.py`."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_dpar.launch.devices import devices_ranks_problem


def test_device_rank_problem_names_both_counts_and_the_fix():
    assert devices_ranks_problem(2, 1, 1, 2, "TorchElasticEnvironment") is None
    assert devices_ranks_problem(4, 2, 3, 8, "SLURMEnvironment") is None
    problem = devices_ranks_problem(1, 1, 1, 2, "RayLightningEnvironment")
    assert "runs 2 rank(s)" in problem and "local rank 1" in problem and "sees 1 device(s)" in problem
    assert "lightning_dpar.ray.prepare_trainer(trainer)" in problem
    problem = devices_ranks_problem(2, 1, 0, 4, "SLURMEnvironment")  # local ranks fit, the world does not
    assert "runs 4 rank(s)" in problem and "devices x num_nodes = 4" in problem
    assert "Trainer(devices=<processes per node>, num_nodes=<nodes>)" in problem


def test_local_rank_past_the_devices_fails_before_the_process_group(monkeypatch):
    """A launcher that starts the processes (`LOCAL_RANK` set) with more local ranks than `Trainer(devices=...)`:
    before the check, `root_device` raised `IndexError: list index out of range`."""
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="dpar_fsdp", logger=False)
    with pytest.raises(ValueError, match=r"this process is local rank 1, but each process sees 1 device"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()
