"""The fault-tolerant strategies by registered name, class and LightningCLI YAML, and their refusals through a real
`Trainer`, raised before any process group exists."""

from __future__ import annotations

import pickle
import socket
import time

import lightning as L
import pytest
import torch.distributed as dist
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_dpar
from lightning_dpar.fault_tolerance import FaultTolerance, LighthouseUnreachableError
from lightning_dpar.fault_tolerance.strategy import FaultTolerantHooks, with_fault_tolerance

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("dpar_ft_hsdp", lightning_dpar.FaultTolerantFullyShardStrategy),
        ("dpar_ft_replicate", lightning_dpar.FaultTolerantReplicateStrategy),
        ("dpar_ft_2d", lightning_dpar.FaultTolerantFSDPTensorParallelStrategy),
    ],
)
def test_registered_names(name, cls):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
    assert type(trainer.strategy) is cls
    assert trainer.strategy.fault_tolerance == FaultTolerance()  # everything from the environment, when it starts


def test_lightning_cli_takes_the_config(tmp_path):
    config = tmp_path / "config.yaml"
    strategy = {
        "class_path": "lightning_dpar.FaultTolerantFullyShardStrategy",
        "init_args": {
            "fault_tolerance": {"replica_group": 1, "num_replica_groups": 3, "lighthouse": "http://lh:29510"},
            "reshard_after_forward": False,
        },
    }
    config.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": strategy}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    got = cli.trainer.strategy
    assert isinstance(got, lightning_dpar.FaultTolerantFullyShardStrategy)
    assert got.fault_tolerance == FaultTolerance(replica_group=1, num_replica_groups=3, lighthouse="http://lh:29510")


@pytest.mark.parametrize(
    "strategy",
    [lightning_dpar.FullyShardStrategy, lightning_dpar.ReplicateStrategy, lightning_dpar.AutoParallelStrategy],
)
def test_every_strategy_takes_fault_tolerance_as_an_argument(strategy):
    """No subclass per strategy: the argument composes the hooks with the strategy's own class, once per class."""
    config = FaultTolerance(replica_group=1, num_replica_groups=2, lighthouse="http://lh:29510")
    composed = strategy(fault_tolerance=config)
    assert isinstance(composed, strategy) and isinstance(composed, FaultTolerantHooks)
    assert composed.fault_tolerance == config
    assert type(strategy(fault_tolerance=FaultTolerance())) is type(composed)  # the same class, made once
    assert not isinstance(strategy(), FaultTolerantHooks)  # none given: no fault tolerance
    assert with_fault_tolerance(type(composed)) is type(composed)


def test_the_registered_classes_are_the_strategies_composed():
    assert lightning_dpar.FullyShardStrategy(fault_tolerance=FaultTolerance()).__class__ is (
        lightning_dpar.FaultTolerantFullyShardStrategy
    )
    assert pickle.loads(pickle.dumps(lightning_dpar.FaultTolerantFullyShardStrategy)) is (
        lightning_dpar.FaultTolerantFullyShardStrategy
    )
    assert L.Trainer(accelerator="cpu", devices=1, strategy="dpar_auto", logger=False).strategy.strategy_name == (
        "dpar_auto"
    )


def test_lightning_cli_composes_fault_tolerance_with_a_strategy_by_its_own_class_path(tmp_path):
    config = tmp_path / "config.yaml"
    strategy = {
        "class_path": "lightning_dpar.FullyShardStrategy",
        "init_args": {"fault_tolerance": {"replica_group": 0, "num_replica_groups": 2, "lighthouse": "http://lh:1"}},
    }
    config.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": strategy}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    assert isinstance(cli.trainer.strategy, lightning_dpar.FaultTolerantFullyShardStrategy)
    assert cli.trainer.strategy.fault_tolerance.num_replica_groups == 2


def test_a_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"`fault_tolerance=\{'replica_group': 0\}` is invalid: expected a"):
        lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance={"replica_group": 0})


def test_no_lighthouse_fails_before_any_process_group(monkeypatch):
    pytest.importorskip("torchft")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="dpar_ft_hsdp", logger=False, max_steps=1)
    with pytest.raises(LighthouseUnreachableError, match=rf"at http://127.0.0.1:{port} .*TORCHFT_LIGHTHOUSE"):
        trainer.fit(BoringModel())
    assert not dist.is_initialized()


def test_a_silent_lighthouse_fails_within_quorum_timeout_before_any_process_group(monkeypatch):
    """Something accepts connections at the address and never answers: refused through the Trainer within
    `quorum_timeout` (here 1 s, shorter than the 10 s probe bound), naming the address and the variable."""
    pytest.importorskip("torchft")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        config = FaultTolerance(replica_group=0, num_replica_groups=2, lighthouse=address, quorum_timeout=1)
        strategy = lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance=config)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=1)
        started = time.monotonic()
        refused = rf"at {address} \(nothing answered within 1\.\d s.*TORCHFT_LIGHTHOUSE"
        with pytest.raises(LighthouseUnreachableError, match=refused):
            trainer.fit(BoringModel())
        assert time.monotonic() - started < 3
    assert not dist.is_initialized()


def test_gradient_accumulation_fails_before_any_process_group(monkeypatch):
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)  # a lighthouse that answers: the refusal is next
    try:
        config = FaultTolerance(replica_group=0, num_replica_groups=2, lighthouse=lighthouse.address())
        strategy = lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance=config)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, accumulate_grad_batches=2)
        with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` is not supported"):
            trainer.fit(BoringModel())
    finally:
        lighthouse.shutdown()
    assert not dist.is_initialized()


def test_a_group_that_joined_by_healing_refuses_a_checkpoint():
    strategy = lightning_dpar.FaultTolerantFullyShardStrategy(fault_tolerance=FaultTolerance())
    strategy._joined_at_batch = 60  # what `_heal` records when a relaunched group joins a running job
    with pytest.raises(RuntimeError, match=r"joined training at batch 60; `fit\(ckpt_path='last'\)` would load an"):
        strategy.load_checkpoint("last")
