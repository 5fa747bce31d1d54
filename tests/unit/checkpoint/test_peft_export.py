"""Adapters out of checkpoints a real Trainer wrote in this process (one-rank gloo group): `consolidate --format
peft` is what `PeftModel.from_pretrained` loads, `--format hf --merge-adapters` equals `merge_and_unload()`, from a
full checkpoint and from an adapter-only one (whose merge needs `--base`). The same on 2 and 4 ranks, with resume,
is `tests/launched/test_adapter_checkpoints.py`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint.consolidate import main as consolidate
from tests.support.hf_configs import decoder_config
from tests.workers.adapter_checkpoints import LoraLM, TokenData
from tests.workers.common import trainer_for

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    transformers.LlamaForCausalLM(decoder_config()).save_pretrained(path)
    return path


@pytest.fixture(params=["all", "trainable"])
def trained(request, gloo_world, base, tmp_path):
    """Two LoRA steps under `dpar_fsdp` on one rank, saved with `checkpoint_weights=<param>`: the checkpoint and the
    trained peft model."""
    strategy = FullyShardStrategy(pretrained=str(base), checkpoint_weights=request.param)
    trainer = trainer_for(strategy, devices=1, max_steps=2)
    module = LoraLM(str(base))
    trainer.fit(module, DataLoader(TokenData(), batch_size=2))
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.model.state_dict().items()}
    return request.param, tmp_path / "lora.ckpt", {k: v.detach().clone() for k, v in state.items()}


def _trained_model(base, state: dict[str, torch.Tensor]):
    """A plain (unsharded) peft model holding the trained values."""
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    model.load_state_dict(state)
    return model


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_peft_export_loads_with_the_trained_adapters(trained, base, tmp_path):
    _, ckpt, state = trained
    assert consolidate([str(ckpt), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "adapter"
    ).state_dict()
    assert _max_diff(loaded, state) == 0.0
    assert any("lora_B" in k and state[k].abs().max() > 0 for k in state)  # trained away from peft's zero init


def test_merged_export_equals_merge_and_unload(trained, base, tmp_path):
    _, ckpt, state = trained
    assert (
        consolidate([str(ckpt), str(tmp_path / "merged"), "--format", "hf", "--merge-adapters", "--base", str(base)])
        == 0
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert _max_diff(merged, _trained_model(base, state).merge_and_unload().state_dict()) == 0.0


def test_only_an_adapter_only_checkpoint_needs_base_to_merge(trained, base, tmp_path, capsys):
    """A full checkpoint holds the base it trained on; an adapter-only one is refused without `--base`."""
    weights, ckpt, state = trained
    code = consolidate([str(ckpt), str(tmp_path / "merged"), "--format", "hf", "--merge-adapters"])
    if weights == "trainable":
        assert code == 1
        assert "adapter-only checkpoint: the merge needs its frozen base" in capsys.readouterr().err
    else:
        assert code == 0
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert _max_diff(merged.state_dict(), _trained_model(base, state).merge_and_unload().state_dict()) == 0.0
