"""A user's own `LightningCLI(MyModule)` (not the package's CLI) accepts the package's strategies by class name and by
import path, with or without init args."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_dpar

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


class MyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("args", "cls", "attributes"),
    [
        (["--trainer.strategy=FullyShardStrategy"], lightning_dpar.FullyShardStrategy, {}),
        (["--trainer.strategy=ReplicateStrategy"], lightning_dpar.ReplicateStrategy, {}),
        (["--trainer.strategy=lightning_dpar.ReplicateStrategy"], lightning_dpar.ReplicateStrategy, {}),
        (
            ["--trainer.strategy=lightning_dpar.strategies.fully_shard.FSDPTensorParallelStrategy"],
            lightning_dpar.FSDPTensorParallelStrategy,
            {},
        ),
        (
            ["--trainer.strategy=FullyShardStrategy", "--trainer.strategy.cpu_offload=true"],
            lightning_dpar.FullyShardStrategy,
            {"cpu_offload": True},
        ),
        (
            [
                "--trainer.strategy=lightning_dpar.FSDPTensorParallelStrategy",
                "--trainer.strategy.tensor_parallel_size=2",
            ],
            lightning_dpar.FSDPTensorParallelStrategy,
            {"_tensor_parallel_size": 2},
        ),
    ],
)
def test_users_lightning_cli_accepts_class_names_and_import_paths(args, cls, attributes):
    cli = LightningCLI(MyModule, run=False, trainer_defaults={"accelerator": "cpu", "devices": 2}, args=args)
    strategy = cli.trainer.strategy
    assert type(strategy) is cls
    assert {name: getattr(strategy, name) for name in attributes} == attributes


def test_trainer_accepts_a_class_name_in_any_case():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="FSDPTensorParallelStrategy")
    assert type(trainer.strategy) is lightning_dpar.FSDPTensorParallelStrategy
