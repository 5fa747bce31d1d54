"""Lightning's private names (`lightning_dpar._private_api.lightning`) against a real Trainer: a Lightning upgrade
that moves one fails here first."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from lightning_dpar._private_api.lightning import (
    StrategyRegistryType,
    attach_device_mesh,
    averaged_copy,
    detect_anomaly_requested,
    layer_sync_requested,
    model_checkpoint_dir,
    replace_model_checkpoint_link,
    trainer_and_mesh,
    training_data_source,
    unfetched_training_iterator,
)

QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def test_the_registry_type_is_the_public_registrys():
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry, StrategyRegistryType)


def test_trainer_flags_read_before_setup():
    plain = L.Trainer(accelerator="cpu", devices=1, enable_checkpointing=False, **QUIET)
    assert not detect_anomaly_requested(plain) and not layer_sync_requested(plain.strategy)
    flagged = L.Trainer(accelerator="cpu", strategy="ddp", devices=1, sync_batchnorm=True, detect_anomaly=True, **QUIET)
    assert detect_anomaly_requested(flagged) and layer_sync_requested(flagged.strategy)


def test_the_checkpoint_directory_before_fit(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, **QUIET)
    assert model_checkpoint_dir(ModelCheckpoint(dirpath=tmp_path / "given"), trainer) == str(tmp_path / "given")
    assert model_checkpoint_dir(ModelCheckpoint(), trainer) == str(tmp_path / "checkpoints")  # no logger


def test_the_mesh_a_module_holds_and_its_trainer(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    fake_world(2)
    model = BoringModel()
    assert trainer_and_mesh(model) == (None, None)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    attach_device_mesh(model, mesh)
    assert model.device_mesh is mesh  # Lightning's public property
    trainer = L.Trainer(accelerator="cpu", devices=1, **QUIET)
    model.trainer = trainer
    assert trainer_and_mesh(model) == (trainer, mesh)


class Recorder(Callback):
    """What the private readers see once `fit` has started, before the first batch is fetched."""

    def on_train_start(self, trainer, pl_module):
        self.source = training_data_source(trainer)
        self.iterator = unfetched_training_iterator(trainer)


def test_a_fit_shows_its_data_source_the_links_it_makes_and_the_averaged_copy(tmp_path):
    links: list[tuple[str, str]] = []
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last="link")
    replace_model_checkpoint_link(checkpoint, lambda trainer, target, link: links.append((target, link)))
    averaging, recorder = WeightAveraging(), Recorder()
    assert averaged_copy(averaging) is None  # before its setup
    assert unfetched_training_iterator(L.Trainer(**QUIET)) is None  # no fit: nothing to draw from
    model = BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[checkpoint, averaging, recorder], **QUIET)
    trainer.fit(model)
    assert recorder.source is model  # BoringModel's own `train_dataloader`
    assert isinstance(recorder.iterator, CombinedLoader)  # what the fit loop draws its batches from
    assert [link for _, link in links] == [str(tmp_path / "last.ckpt")]
    assert links[0][0].startswith(str(tmp_path / "epoch=0-step=2"))
    copy = averaged_copy(averaging)
    assert isinstance(copy, BoringModel) and copy is not model
    assert torch.equal(copy.layer.weight.detach().cpu(), averaging._average_model.module.layer.weight.detach().cpu())
