"""`ckpt_path="last"` (`lightning_dpar/launch/launchers.py`) in-process: a real `Trainer(devices=1)` on a one-rank gloo
group resolves it to the newest complete checkpoint of its `ModelCheckpoint` directory, skipping an incomplete newer
one, and starts from scratch when there is none. Launching ranks (script, fork) is `tests/launched/test_launch.py`."""

from __future__ import annotations

import logging
import shutil

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dpar import FullyShardStrategy
from tests.support.models import ParityModule, RegressionData, loader
from tests.workers.common import BATCH, trainer_for


def _fit(tmp_path, steps: int, ckpt_path=None):
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    trainer = trainer_for(
        FullyShardStrategy(), max_steps=steps, devices=1, enable_checkpointing=True, callbacks=[callback]
    )
    trainer.fit(ParityModule(), loader(RegressionData(n=32), BATCH), ckpt_path=ckpt_path)
    return trainer


def test_last_resolves_to_the_newest_complete_checkpoint(gloo_world, tmp_path, caplog):
    _fit(tmp_path, 2)
    ckpts = tmp_path / "ckpts"
    newest = ckpts / "epoch=0-step=3.ckpt"
    shutil.copytree(ckpts / "epoch=0-step=2.ckpt", newest)
    (newest / "meta.pt").unlink()  # killed before it was published: not a complete checkpoint
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path, 4, ckpt_path="last")
    assert f"`ckpt_path='last'` resolves to {str(ckpts / 'epoch=0-step=2.ckpt')!r}" in caplog.text
    assert trainer.global_step == 4
    assert "Resuming epoch 0 after 2 batches: exact" in caplog.text


def test_last_without_any_checkpoint_starts_from_scratch(gloo_world, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path, 2, ckpt_path="last")
    assert trainer.global_step == 2 and "resolves to" not in caplog.text


def _fit_impl(model, train_dataloaders=None, ckpt_path=None):
    """Stands for the Trainer function whose arguments are resolved (`Trainer._fit_impl`'s parameters)."""


def test_only_a_ckpt_path_of_last_is_replaced_and_where_it_was_given(tmp_path):
    import lightning as L

    from lightning_dpar.launch.launchers import resolve_last_checkpoint_argument
    from tests.support.checkpoint_files import write_sharded

    trainer = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path)], enable_progress_bar=False)
    (tmp_path / "epoch=0-step=1.ckpt").mkdir()
    saved = str(write_sharded(tmp_path / "epoch=0-step=1.ckpt"))
    assert resolve_last_checkpoint_argument(_fit_impl, ("m",), {"ckpt_path": "last"}, trainer) == (
        ("m",),
        {"ckpt_path": saved},
    )
    assert resolve_last_checkpoint_argument(_fit_impl, ("m", None, "last"), {}, trainer) == (("m", None, saved), {})
    for args, kwargs, given in [
        (("m",), {"ckpt_path": "best"}, trainer),  # not "last"
        (("m",), {"ckpt_path": "last"}, None),  # no trainer
        (("m",), {"no_such_argument": 1}, trainer),  # not this function's arguments: Lightning will say so
    ]:
        assert resolve_last_checkpoint_argument(_fit_impl, args, kwargs, given) == (args, kwargs)
    empty = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path / "none")], enable_progress_bar=False)
    assert resolve_last_checkpoint_argument(_fit_impl, ("m",), {"ckpt_path": "last"}, empty)[1] == {"ckpt_path": "last"}
