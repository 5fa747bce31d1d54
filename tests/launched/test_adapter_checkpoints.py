"""Adapter-only checkpoints (`checkpoint_weights="trainable"`) and adapter export (`consolidate --format peft`,
`--format hf --merge-adapters`) through real Trainers on 2 and 4 gloo ranks (workers in
`tests/workers/adapter_checkpoints.py`): exact resume from the base in `pretrained=`, refusals, and exports from the
checkpoints those runs wrote. The pure logic (key selection, base fingerprint, refusal messages, peft names) is
tested in process in `tests/unit/checkpoint/test_adapter_only.py`, which also holds the tiny model and base
directory used here."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

import lightning_dpar
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from tests.conftest import run_workers

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.unit.checkpoint import test_adapter_only as unit_half  # noqa: E402
from tests.unit.checkpoint.test_adapter_only import lora_llama  # noqa: E402

shared_dir = unit_half.shared_dir  # the fixture: two bases on disk


# ---------------------------------------------------------------------- through real Trainers
@pytest.fixture(scope="module")
def results2(shared_dir):
    return run_workers(2, "adapter_resume,adapter_refusal", shared_dir, timeout=900)


@pytest.fixture(scope="module")
def results4(shared_dir):
    return run_workers(4, "adapter_resume", shared_dir, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "world"),
    [("adapter_fsdp_sharded_async_2", 2), ("adapter_fsdp_full_2", 2), ("adapter_2d_sharded_4", 4)],
)
def test_resume_from_an_adapter_only_checkpoint_ends_like_the_uninterrupted_run(request, case, world):
    """Interrupted after 3 of 6 steps, saved adapter-only, resumed from a module whose adapters start from other
    random values and whose base is read from `pretrained=`: every parameter ends as in the uninterrupted run. The
    checkpoint holds the adapters alone: no base weight."""
    result = request.getfixturevalue(f"results{world}")[case]
    assert result["global_step"] == 6
    assert result["adapters_moved"] > 1e-3  # the steps after the interruption changed the adapters
    assert result["max_abs_diff"] < 1e-5
    assert len(result["stored_keys"]) == result["trainable"] == 8  # lora_A and lora_B of q and v in 2 layers
    assert all(".lora_" in key for key in result["stored_keys"])


@pytest.mark.slow
def test_resume_without_the_base_or_with_another_base_is_refused_on_every_rank(results2, shared_dir):
    result = results2["adapter_refusal"]
    base, other = str(shared_dir / "base"), str(shared_dir / "other_base")
    for message in result["messages"]["no_base"]:
        assert "adapter-only checkpoint" in message and f"Pass `pretrained={base!r}`" in message
    for message in result["messages"]["other_base"]:
        assert f"`pretrained={other!r}` holds other weights" in message and base in message


def _trained_peft_model(shared_dir, trained_file: str):
    """The peft model with the values a run trained (as saved by the worker), for comparison."""
    trained = torch.load(shared_dir / trained_file, weights_only=True)
    model = lora_llama()
    model.load_state_dict({k.removeprefix("model."): v for k, v in trained.items()})
    return model


EXPORT_SOURCES = [("adapter_fsdp_sharded_async_2", "ckpt"), ("adapter_refusal", "full_ckpt")]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "key"), EXPORT_SOURCES)
def test_peft_export_loads_with_peft_from_pretrained_with_the_trained_values(results2, shared_dir, tmp_path, case, key):
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    ckpt = results2[case][key]
    trained_file = f"{case}.trained.pt" if case != "adapter_refusal" else "all_weights.trained.pt"
    out = tmp_path / "adapter"
    assert consolidate([ckpt, str(out), "--format", "peft"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] in (
        ["q_proj", "v_proj"],
        ["v_proj", "q_proj"],
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(shared_dir / "base", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out).state_dict()
    want = _trained_peft_model(shared_dir, trained_file).state_dict()
    assert set(loaded) == set(want)
    assert max((loaded[k] - want[k]).abs().max().item() for k in want) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(("case", "key"), EXPORT_SOURCES)
def test_merged_export_equals_merge_and_unload(results2, shared_dir, tmp_path, case, key):
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    ckpt = results2[case][key]
    trained_file = f"{case}.trained.pt" if case != "adapter_refusal" else "all_weights.trained.pt"
    out = tmp_path / "merged"
    base = ["--base", str(shared_dir / "base")] if case != "adapter_refusal" else []
    assert consolidate([ckpt, str(out), "--format", "hf", "--merge-adapters", *base]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    want = _trained_peft_model(shared_dir, trained_file).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    assert max((merged[k] - want[k]).abs().max().item() for k in want) == 0.0
    unmerged = transformers.AutoModelForCausalLM.from_pretrained(shared_dir / "base", dtype=torch.float32)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q] - unmerged.state_dict()[q]).abs().max() > 1e-4  # the adapters are in it


@pytest.mark.slow
def test_merged_export_of_an_adapter_only_checkpoint_needs_its_own_base(results2, shared_dir, tmp_path, capsys):
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    ckpt = results2["adapter_fsdp_sharded_async_2"]["ckpt"]
    assert consolidate([ckpt, str(tmp_path / "a"), "--format", "hf", "--merge-adapters"]) == 1
    assert "adapter-only checkpoint: the merge needs its frozen base" in capsys.readouterr().err
    other = str(shared_dir / "other_base")
    assert consolidate([ckpt, str(tmp_path / "b"), "--format", "hf", "--merge-adapters", "--base", other]) == 1
    assert "holds other weights than the base" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # Formats that would build the model without its base are refused; so is `load_from_checkpoint`.
    assert consolidate([ckpt, str(tmp_path / "c.ckpt")]) == 1
    assert "--format lightning cannot build the model from it" in capsys.readouterr().err
    full_format = results2["adapter_fsdp_full_2"]["ckpt"]
    with pytest.raises(CheckpointLoadError, match="`load_from_checkpoint` cannot build the model from it"):
        lightning_dpar.load_from_checkpoint(L.LightningModule, full_format)
