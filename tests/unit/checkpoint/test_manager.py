"""The checkpoint manager (`lightning_dpar/checkpoint/manager.py`) through Lightning's own flow, in-process: a real
`Trainer(devices=1)` on a one-rank gloo group saves sharded, full and background checkpoints, resumes from them
exactly, removes superseded ones and refuses bad ones. Resharding to other world sizes is in the launched tests
(`tests/launched/test_checkpoint_reshard.py`)."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dpar import FullyShardStrategy, ReplicateStrategy
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from tests.support.models import ParityModule, RegressionData, loader
from tests.workers.common import BATCH, full_params, trainer_for

TOTAL_STEPS = 5


class _Noisy(ParityModule):
    """Adam (optimizer state to restore) and dropout (an RNG stream to restore): a resume is exact only if both are."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")

    def forward(self, x):
        return F.dropout(self.model(x), p=0.3, training=self.training)


def _fit(strategy, steps, tmp_path, ckpt_path=None, module=None, **kwargs):
    module = module if module is not None else _Noisy()
    trainer = trainer_for(strategy, max_steps=steps, devices=1, default_root_dir=tmp_path, **kwargs)
    trainer.fit(module, loader(RegressionData(n=32), BATCH), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def uninterrupted(gloo_world, tmp_path):
    torch.manual_seed(7)
    return full_params(_fit(FullyShardStrategy(), TOTAL_STEPS, tmp_path))


def _interrupted(tmp_path, saver, loader_strategy, caplog=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    trainer = _fit(saver, 2, tmp_path)
    path = str(tmp_path / "step=2.ckpt")
    trainer.save_checkpoint(path)
    trainer.strategy.wait_for_checkpoint()
    torch.manual_seed(123)  # the resume restores the checkpoint's streams, not this seed
    with caplog.at_level(logging.INFO) if caplog is not None else nullcontext():
        resumed = _fit(loader_strategy, TOTAL_STEPS, tmp_path, ckpt_path=path)
    assert resumed.global_step == TOTAL_STEPS
    return full_params(resumed)


def _max_diff(got, want) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_sharded_resume_mid_epoch_is_exact(uninterrupted, tmp_path, caplog):
    got = _interrupted(tmp_path, FullyShardStrategy(), FullyShardStrategy(), caplog)
    assert _max_diff(got, uninterrupted) == 0.0
    assert sorted(os.listdir(tmp_path / "step=2.ckpt")) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert "Resuming epoch 0 after 2 batches: exact" in caplog.text


def test_full_checkpoint_is_one_loadable_file_and_resumes_exactly(uninterrupted, tmp_path):
    got = _interrupted(tmp_path, FullyShardStrategy(checkpoint_format="full"), FullyShardStrategy())
    assert _max_diff(got, uninterrupted) == 0.0
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=False)
    assert set(saved["state_dict"]) == set(ParityModule().state_dict())
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())  # whole tensors, not shards
    assert saved["global_step"] == 2 and len(saved["optimizer_states"]) == 1


def test_background_save_resumes_exactly(uninterrupted, tmp_path):
    got = _interrupted(tmp_path, FullyShardStrategy(async_save=True), FullyShardStrategy())
    assert _max_diff(got, uninterrupted) == 0.0


def test_a_sharded_checkpoint_loads_under_another_strategy(uninterrupted, tmp_path):
    got = _interrupted(tmp_path, FullyShardStrategy(), ReplicateStrategy())
    assert _max_diff(got, uninterrupted) < 1e-6


@pytest.mark.parametrize("async_save", [False, True])
def test_model_checkpoint_keeps_the_newest_and_links_last_to_it(gloo_world, tmp_path, async_save):
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=1, save_last="link")
    trainer = _fit(
        FullyShardStrategy(async_save=async_save), 3, tmp_path, enable_checkpointing=True, callbacks=[callback]
    )
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert os.readlink(tmp_path / "ckpts" / "last.ckpt") == "epoch=0-step=3.ckpt"
    assert (tmp_path / "ckpts" / "epoch=0-step=3.ckpt" / ".metadata").exists()
    assert trainer.strategy.async_save is async_save


def test_validate_from_a_checkpoint_reads_the_weights_only(gloo_world, tmp_path):
    trainer = _fit(FullyShardStrategy(), 2, tmp_path, module=ParityModule())
    trained = full_params(trainer)
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    fresh = ParityModule()
    evaluator = trainer_for(FullyShardStrategy(), devices=1, default_root_dir=tmp_path)
    evaluator.validate(fresh, loader(RegressionData(n=8), 8), ckpt_path=tmp_path / "trained.ckpt", verbose=False)
    assert _max_diff(full_params(evaluator), trained) == 0.0


def test_a_missing_or_broken_checkpoint_is_refused_by_name(gloo_world, tmp_path):
    with pytest.raises(CheckpointLoadError, match=r"nowhere\.ckpt"):
        _fit(FullyShardStrategy(), 1, tmp_path, ckpt_path=str(tmp_path / "nowhere.ckpt"))
    trainer = _fit(FullyShardStrategy(), 1, tmp_path, module=ParityModule())
    trainer.save_checkpoint(tmp_path / "broken.ckpt")
    (tmp_path / "broken.ckpt" / ".metadata").unlink()
    with pytest.raises(CheckpointLoadError, match=r"broken\.ckpt"):
        _fit(FullyShardStrategy(), 2, tmp_path, ckpt_path=str(tmp_path / "broken.ckpt"))


class _Wider(ParityModule):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)
        self.strict_loading = False


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_lenient_loading_names_the_keys_it_left_alone(gloo_world, tmp_path, checkpoint_format):
    trainer = _fit(FullyShardStrategy(checkpoint_format=checkpoint_format), 1, tmp_path, module=ParityModule())
    trained = full_params(trainer)
    trainer.save_checkpoint(tmp_path / "narrow.ckpt")
    wider = _Wider()
    fresh_extra = wider.extra.weight.detach().clone()
    evaluator = trainer_for(FullyShardStrategy(), devices=1, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"strict_loading=False.*not in the checkpoint.*extra\.weight"):
        evaluator.validate(wider, loader(RegressionData(n=8), 8), ckpt_path=tmp_path / "narrow.ckpt", verbose=False)
    loaded = full_params(evaluator)
    assert _max_diff({k: loaded[k] for k in trained}, trained) == 0.0
    assert torch.equal(loaded["extra.weight"], fresh_extra)


def test_save_checkpoint_refuses_storage_options(gloo_world, tmp_path):
    trainer = _fit(FullyShardStrategy(), 1, tmp_path, module=ParityModule())
    with pytest.raises(TypeError, match="does not take `storage_options`"):
        trainer.strategy.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
def test_the_manager_saves_and_loads_model_and_optimizer_state_alone(gloo_world, tmp_path, checkpoint_format):
    import lightning as L
    from torch import nn

    from lightning_dpar.checkpoint.manager import CheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saving = CheckpointManager(checkpoint_format, async_save=False)
    lightning_part = {"epoch": 3, "global_step": 7, "pytorch-lightning_version": L.__version__}
    checkpoint = {
        "state_dict": saving.model_state(model),
        "optimizer_states": [saving.optimizer_state(model, optimizer)],
        **lightning_part,
    }
    path = tmp_path / "step=7.ckpt"
    saving.save(checkpoint, path, {"strategy": "test"})
    saving.wait()
    assert path.is_dir() == (checkpoint_format == "sharded")
    fresh = nn.Sequential(nn.Linear(3, 2))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    loading = CheckpointManager("sharded", async_save=False)  # loads read whichever format the path holds
    assert loading.load(path, fresh, [fresh_optimizer], strict=True, fitting=False) == lightning_part
    assert torch.equal(fresh[0].weight, model[0].weight) and torch.equal(fresh[0].bias, model[0].bias)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh_optimizer.state[fresh[0].weight][name], optimizer.state[model[0].weight][name])


def test_the_manager_refuses_an_unknown_format_and_background_full_saves():
    from lightning_dpar.checkpoint.manager import CheckpointManager

    with pytest.raises(ValueError, match=r"`checkpoint_format='zip'` is invalid; use 'sharded' or 'full'"):
        CheckpointManager("zip", async_save=False)
    with pytest.raises(ValueError, match=r"`async_save=True` needs `checkpoint_format='sharded'`, not 'full'"):
        CheckpointManager("full", async_save=True)
    assert CheckpointManager("sharded", async_save=True).async_save
