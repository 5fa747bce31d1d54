"""The package's strategies under Lightning Fabric, for users who keep their own training loop (LitGPT's scripts
among them): `lightning_dpar.fabric.FullyShardStrategy`, `FSDPTensorParallelStrategy` and `ReplicateStrategy`, with
the Trainer-side classes' names and arguments, each driving the Trainer-side strategy of the same arguments
(`strategy`: Fabric's hooks mapped onto it; `state`: Fabric's save/load state in the Trainer's checkpoint layout;
`refusals`: what Fabric cannot drive, refused at construction). `register_fabric_strategies` puts the Trainer's
`dpar_*` names in Fabric's registry (`import lightning_dpar` calls it): `Fabric(strategy="dpar_2d")`. See
docs/fabric.md."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dpar.fabric.strategy import (
    DparFabricStrategy,
    FSDPTensorParallelStrategy,
    FullyShardStrategy,
    ReplicateStrategy,
)

__all__ = [
    "DparFabricStrategy",
    "FSDPTensorParallelStrategy",
    "FullyShardStrategy",
    "ReplicateStrategy",
    "register_fabric_strategies",
]


def register_fabric_strategies() -> None:
    """Register in Fabric's registry the names the Trainer's registry has for the three strategies (`dpar_fsdp`,
    `dpar_hsdp`, `dpar_2d`, ...: the names whose feature Fabric cannot drive refuse by name when constructed), and
    each class's name. Call after the Trainer-side names are registered."""
    for strategy in (ReplicateStrategy, FullyShardStrategy, FSDPTensorParallelStrategy):
        strategy.register_names(STRATEGY_REGISTRY, StrategyRegistry)
