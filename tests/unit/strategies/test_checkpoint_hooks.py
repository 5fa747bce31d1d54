"""The strategies' checkpoint options (`lightning_dpar.strategies.checkpoint_hooks`) in process: `async_save` is
settable between saves and needs the sharded format. Lightning's checkpoint flow through real Trainers on 2 gloo ranks
is in `tests/launched/test_checkpoint.py` (workers in `tests/workers/checkpoint.py`)."""

from __future__ import annotations

import pytest


def test_async_save_is_settable_between_saves_and_needs_the_sharded_format():
    import lightning_dpar

    strategy = lightning_dpar.FullyShardStrategy(async_save=True)
    assert strategy.async_save
    strategy.async_save = False
    assert not strategy.async_save
    with pytest.raises(ValueError, match=r"`async_save=True` needs `checkpoint_format='sharded'`, not 'full'"):
        lightning_dpar.FullyShardStrategy(checkpoint_format="full", async_save=True)
    full = lightning_dpar.ReplicateStrategy(checkpoint_format="full")
    with pytest.raises(ValueError, match="not 'full'"):
        full.async_save = True


def test_the_strategy_loads_after_setup_and_restores_the_optimizers_itself():
    from lightning_dpar import ReplicateStrategy
    from lightning_dpar.strategies.checkpoint_hooks import CheckpointHooks

    strategy = ReplicateStrategy()
    assert isinstance(strategy, CheckpointHooks)
    # Shards load only into the wrapped model, and `load_checkpoint` reads the optimizer shards itself.
    assert strategy.restore_checkpoint_after_setup and not strategy.lightning_restore_optimizer
    with pytest.raises(TypeError, match=r"ReplicateStrategy.save_checkpoint does not take `storage_options`"):
        strategy.save_checkpoint({}, "unused.ckpt", storage_options={"compress": True})
