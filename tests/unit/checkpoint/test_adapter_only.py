"""Adapter-only checkpoints (`checkpoint_weights="trainable"`) and adapter export, the pure logic in process: key
selection, base fingerprint, refusal messages, peft names, the option from YAML and consolidate's adapter options.
The runs through real Trainers on 2 and 4 gloo ranks (exact resume, refusals, exports from the checkpoints they
wrote) are in `tests/launched/test_adapter_checkpoints.py` (workers in `tests/workers/adapter_checkpoints.py`)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint.adapter_only import (
    ADAPTER_ONLY_KEY,
    AdapterOnlySaves,
    base_fingerprint,
    base_keys,
    check_keys,
    required_base,
)
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.hf_weights.pretrained import PretrainedWeights, match_pretrained
from tests.support.hf_configs import decoder_settings

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY = decoder_settings(tie_word_embeddings=True)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def save_llama(path, seed: int = 0, max_shard_size: str = "20KB") -> None:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path, max_shard_size=max_shard_size)


def lora_llama(seed: int = 1):
    torch.manual_seed(seed)
    return peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)), peft.LoraConfig(**LORA))


class Holder(torch.nn.Module):
    """What a LightningModule looks like to the key logic: the peft model held as `self.model`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("adapters")
    save_llama(path / "base", seed=0)
    save_llama(path / "other_base", seed=5)  # same architecture, other values
    return path


# ---------------------------------------------------------------------- in process
def test_base_keys_are_the_frozen_parameters_the_directory_supplies(shared_dir):
    """LoRA's adapters train and are kept; every frozen base weight is named by the pretrained directory under its
    peft name (`q_proj.base_layer.weight`), so all of them are left out, the tied head included."""
    module = Holder(lora_llama())
    _, prefix, mapping = match_pretrained(module, PretrainedWeights(str(shared_dir / "base")))
    assert prefix == "model.base_model.model."
    assert mapping.missing == [] and mapping.unexpected == []  # adapters are not base weights: not missing
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in mapping.to_model.values()
    left_out = AdapterOnlySaves(PretrainedWeights(str(shared_dir / "base"))).left_out(module, ())
    trainable = {k for k, p in module.named_parameters() if p.requires_grad}
    assert trainable and not trainable & set(left_out)
    assert set(left_out) | trainable == set(module.state_dict())
    assert "model.base_model.model.lm_head.weight" in left_out  # tied to the embedding the directory holds


def test_a_frozen_inactive_adapter_is_no_base_weight_and_stays_in_the_checkpoint(shared_dir):
    module = Holder(lora_llama())
    module.model.add_adapter("other", peft.LoraConfig(**LORA))  # not the active one: frozen
    inactive = {k for k, p in module.named_parameters() if ".other." in k}
    assert inactive and not any(p.requires_grad for k, p in module.named_parameters() if k in inactive)
    left_out = AdapterOnlySaves(PretrainedWeights(str(shared_dir / "base"))).left_out(module, ())
    assert not inactive & set(left_out)
    assert all(".base_layer." in k or ".lora_" not in k for k in left_out)


def test_a_frozen_parameter_the_directory_lacks_stays_in_the_checkpoint():
    assert base_keys({"a.weight", "b.weight"}, supplied={"a.weight", "c.weight"}) == ["a.weight"]


def test_base_fingerprint_tells_other_values_apart_and_not_a_copy(shared_dir, tmp_path):
    import shutil

    base, other = str(shared_dir / "base"), str(shared_dir / "other_base")
    shutil.copytree(base, tmp_path / "copy")
    assert base_fingerprint(base) == base_fingerprint(str(tmp_path / "copy"))  # a copy elsewhere is the same base
    assert base_fingerprint(base) != base_fingerprint(other)
    save_llama(tmp_path / "one_file", seed=0, max_shard_size="1GB")  # same tensors, other file layout
    assert base_fingerprint(base) == base_fingerprint(str(tmp_path / "one_file"))


def test_resume_without_the_base_or_with_another_is_refused_saying_what_to_pass(shared_dir):
    base, other = str(shared_dir / "base"), str(shared_dir / "other_base")
    record = {ADAPTER_ONLY_KEY: {"base_keys": ["w"], "base_path": base, "base_fingerprint": base_fingerprint(base)}}
    assert required_base({}, None, "c.ckpt") == []  # a full checkpoint needs nothing
    assert required_base(record, PretrainedWeights(base), "c.ckpt") == ["w"]
    with pytest.raises(CheckpointLoadError, match=rf"adapter-only.*no `pretrained=`.*Pass `pretrained='{base}'`"):
        required_base(record, None, "c.ckpt")
    with pytest.raises(CheckpointLoadError, match=rf"`pretrained='{other}'` holds other weights.*\('{base}'"):
        required_base(record, PretrainedWeights(other), "c.ckpt")


def test_reading_an_adapter_only_checkpoint_without_a_base_is_refused_with_the_ways_to_read_it():
    from lightning_dpar.checkpoint.adapter_only import refuse_without_base

    refuse_without_base({}, "c.ckpt", "--format lightning")  # a full checkpoint
    record = {ADAPTER_ONLY_KEY: {"base_keys": ["w"], "base_path": "llama-base", "base_fingerprint": "f"}}
    with pytest.raises(
        CheckpointLoadError, match=r"--format lightning cannot .* `pretrained='llama-base'`.*--format peft"
    ):
        refuse_without_base(record, "c.ckpt", "--format lightning")


def test_adapter_only_keys_must_complete_the_model_under_strict_loading():
    check_keys({"a"}, {"a", "w"}, ["w"], strict=True, url="c")
    with pytest.raises(CheckpointLoadError, match=r"Missing in the checkpoint and its base: \['b'\]"):
        check_keys({"a"}, {"a", "b", "w"}, ["w"], strict=True, url="c")
    check_keys({"a"}, {"a", "b", "w"}, ["w"], strict=False, url="c")
    with pytest.raises(CheckpointLoadError, match="base tensors the model lacks"):
        check_keys({"a"}, {"a"}, ["w"], strict=False, url="c")


def test_trainable_checkpoints_need_pretrained_and_the_option_is_checked(shared_dir):
    with pytest.raises(ValueError, match=r"`checkpoint_weights='trainable'` .* pass `pretrained=`"):
        FullyShardStrategy(checkpoint_weights="trainable")
    with pytest.raises(ValueError, match=r"`checkpoint_weights='adapters'` is invalid; use 'all'"):
        FullyShardStrategy(checkpoint_weights="adapters", pretrained=str(shared_dir / "base"))
    strategy = FullyShardStrategy(checkpoint_weights="trainable", pretrained=str(shared_dir / "base"))
    saves = strategy.checkpoints.adapter_only
    assert isinstance(saves, AdapterOnlySaves) and saves.pretrained.path == str(shared_dir / "base")
    assert FullyShardStrategy(pretrained=str(shared_dir / "base")).checkpoints.adapter_only is None  # the default


def test_peft_names_of_the_exported_adapter_are_peft_own():
    from lightning_dpar.checkpoint.peft_export import peft_model_record, peft_tensor_names

    module = Holder(lora_llama())
    record = peft_model_record(module)["peft_model"]
    assert record["prefix"] == "model."
    assert json.loads(record["adapters"]["default"])["r"] == 4
    names = peft_tensor_names(module.model, "default")
    assert names["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] == (
        "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    )
    assert set(names) == set(peft.get_peft_model_state_dict(module.model))
    assert peft_model_record(torch.nn.Linear(2, 2)) == {}


@pytest.mark.usefixtures("no_pytest_argv")
def test_checkpoint_weights_from_yaml(tmp_path, shared_dir):
    import yaml
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    init_args = {"pretrained": str(shared_dir / "base"), "checkpoint_weights": "trainable"}
    strategy = {"class_path": "lightning_dpar.FullyShardStrategy", "init_args": init_args}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": strategy}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    saves = cli.trainer.strategy.checkpoints.adapter_only
    assert isinstance(saves, AdapterOnlySaves) and saves.pretrained.path == str(shared_dir / "base")


def test_a_wrapped_layer_weight_is_found_under_any_prefix_and_others_keep_their_names():
    from lightning_dpar.hf_weights import peft_keys

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(4, 4)
            self.k = torch.nn.Linear(4, 4)

    base = torch.nn.Module()
    base.blocks = torch.nn.ModuleList([Block(), Block()])
    module = Holder(peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q"])))
    names = {"blocks.0.q.weight": 1, "blocks.0.q.bias": 2, "blocks.1.k.weight": 3}
    assert peft_keys.with_base_layers(module, names) == {
        "blocks.0.q.base_layer.weight": 1,
        "blocks.0.q.base_layer.bias": 2,
        "blocks.1.k.weight": 3,
    }
    assert peft_keys.adapter_keys(module) == {
        f"model.base_model.model.blocks.{i}.q.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"
    }
    assert peft_keys.with_base_layers(torch.nn.Linear(2, 2), names) == names  # no peft layer: unchanged


def test_consolidate_refuses_adapter_options_with_other_formats(capsys):
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    for args, message in (
        (["--format", "peft", "--merge-adapters"], "--merge-adapters applies to --format hf only"),
        (["--format", "hf", "--base", "b"], "--base applies to --format hf --merge-adapters only"),
    ):
        with pytest.raises(SystemExit):
            consolidate(["ckpt", "out", *args])
        assert message in capsys.readouterr().err
