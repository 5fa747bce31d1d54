"""The process hooks (`lightning_dpar.strategies.processes`), in process: the launcher each start method and cluster
environment gets, each rank's device, and the device mesh asked for before it exists. Launching ranks for real is in
`tests/launched/test_launch.py`."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from lightning_dpar import FullyShardStrategy
from lightning_dpar.launch.launchers import InPlaceLauncher, InteractiveLauncher, ScriptLauncher
from lightning_dpar.strategies.processes import ProcessHooks

CPUS = [torch.device("cpu")] * 2


@pytest.mark.parametrize(
    ("start_method", "launcher"),
    [("popen", ScriptLauncher), ("fork", InteractiveLauncher), ("spawn", InteractiveLauncher)],
)
def test_each_start_method_gets_its_launcher(start_method, launcher):
    strategy = FullyShardStrategy(
        start_method=start_method, parallel_devices=CPUS, cluster_environment=LightningEnvironment()
    )
    assert isinstance(strategy, ProcessHooks)
    strategy._configure_launcher()
    assert type(strategy.launcher) is launcher
    assert strategy.num_processes == 2


def test_processes_started_outside_run_in_place(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    strategy = FullyShardStrategy(
        start_method="spawn", parallel_devices=CPUS, cluster_environment=TorchElasticEnvironment()
    )
    strategy._configure_launcher()
    assert type(strategy.launcher) is InPlaceLauncher


def test_the_rank_and_the_device_and_the_mesh_before_it_exists(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "2")
    devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    strategy = FullyShardStrategy(parallel_devices=devices, cluster_environment=LightningEnvironment())
    strategy.num_nodes = 3
    assert strategy.root_device == devices[1]
    strategy.set_world_ranks()
    assert (strategy.global_rank, strategy.world_size) == (2 * 2 + 1, 3 * 2)
    with pytest.raises(RuntimeError, match=r"The device mesh exists once the processes are initialised"):
        _ = strategy.device_mesh
    assert FullyShardStrategy().num_processes == 0
