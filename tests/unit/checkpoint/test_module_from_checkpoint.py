"""`load_from_checkpoint(cls, path)` (`lightning_dpar.checkpoint.module_from_checkpoint`): a LightningModule from a
sharded directory or a full file, in one process, with Lightning's own hyperparameter and `strict` handling. The
refusals of damaged and hostile checkpoints are in `test_safety.py`."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.module_from_checkpoint import load_from_checkpoint
from tests.support.checkpoint_files import Tiny, write_sharded

LIGHTNING_VERSION = {"pytorch-lightning_version": L.__version__}


def test_a_sharded_directory_gives_the_module_its_weights_and_hyperparameters(tmp_path):
    path = write_sharded(tmp_path / "sharded", width=6)
    saved = {"state_dict": {name: torch.empty_like(t) for name, t in Tiny(6).state_dict().items()}}
    dcp.load(saved, checkpoint_id=path, no_dist=True)  # what the shards hold, read by DCP itself
    model = load_from_checkpoint(Tiny, path)
    assert model.hparams.width == 6 and model.layer.in_features == 6
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["state_dict"][name]), name
    assert not torch.equal(model.layer.weight, Tiny(6).layer.weight)  # the trained step, not a fresh init


def test_a_full_file_is_passed_to_lightning_with_its_arguments(tmp_path):
    path = tmp_path / "full.ckpt"
    state = {name: tensor + 1 for name, tensor in Tiny().state_dict().items()}
    torch.save(
        {"state_dict": state, "hyper_parameters": {"width": 4}, "pytorch-lightning_version": L.__version__}, path
    )
    model = load_from_checkpoint(Tiny, path, map_location="cpu")
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    state["unknown.weight"] = torch.zeros(1)
    torch.save(
        {"state_dict": state, "hyper_parameters": {"width": 4}, "pytorch-lightning_version": L.__version__}, path
    )
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "unknown.weight"'):
        load_from_checkpoint(Tiny, path)
    assert load_from_checkpoint(Tiny, path, strict=False).hparams.width == 4


def test_a_path_that_holds_no_checkpoint_is_refused_naming_it(tmp_path):
    with pytest.raises(CheckpointLoadError, match=str(tmp_path / "nothing")):
        load_from_checkpoint(Tiny, tmp_path / "nothing")
