"""Mixture-of-experts weights in and out, in this process (a one-rank gloo group, real Trainers): `pretrained=` reads
every on-disk layout of a transformers MoE directory (`tests/support/moe.py`) into `dpar_fsdp`'s parameters exactly,
a directory that lacks an expert or has one mis-shaped is refused naming it, and `consolidate --format hf` writes
what `save_pretrained` writes. The same on two ranks is `tests/launched/test_moe_weights.py`; the key and block
arithmetic is `tests/unit/experts/test_keys.py`."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dpar import FullyShardStrategy, PretrainedWeights
from lightning_dpar.checkpoint.consolidate import main as consolidate
from lightning_dpar.hf_weights.pretrained import PretrainedLoadError, checkpoint_shapes, load_pretrained
from tests.support import moe
from tests.workers.common import full_params, trainer_for
from tests.workers.pretrained import CaptureStart, CausalLM, TokenData

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    moe.write_layouts(root)
    return root


def assert_equal_to(params: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> None:
    assert {k for k in params if k.startswith(prefix)} == {prefix + k for k in want}
    for name, tensor in want.items():
        assert torch.equal(params[prefix + name], tensor), name


@pytest.mark.parametrize("layout", moe.LAYOUTS)
@pytest.mark.parametrize("kind", moe.KINDS)
def test_every_layout_loads_into_fsdp_parameters_exactly(gloo_world, layouts, kind, layout):
    path = str(layouts / f"{kind}_{layout}")
    module = CausalLM(path)  # other random weights than the checkpoint's
    random_init = module.model.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(random_init, moe.source(kind).model.layers[0].mlp.experts.gate_up_proj)
    capture = CaptureStart()
    trainer = trainer_for(FullyShardStrategy(pretrained=path), devices=1, max_steps=1, callbacks=[capture])
    trainer.fit(module, DataLoader(TokenData(128, n=4), batch_size=2))
    assert_equal_to(capture.params, moe.source(kind).state_dict(), "model.")


def test_a_missing_or_misshaped_expert_is_refused_naming_it_before_anything_is_read(tmp_path):
    """Strict or not: a fused parameter cannot be loaded without all of its experts. Names are the files' own
    (Mixtral's `block_sparse_moe.`), each with the shape expected."""
    from safetensors.torch import save_file

    state = moe.per_expert_tensors("mixtral", moe.source("mixtral").state_dict())
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    state["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(moe.HIDDEN, 8)
    save_file(state, tmp_path / "model.safetensors")
    holder = torch.nn.Module()
    holder.net = moe.source("mixtral", seed=1)
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(PretrainedLoadError) as raised:
            load_pretrained(holder, PretrainedWeights(str(tmp_path), strict=strict))
        message = str(raised.value)
        assert (
            "'net.model.layers.1.mlp.experts.gate_up_proj' (4, 32, 32) is 4 experts' w1 then w3 of (16, 32) each, but"
            " the checkpoint lacks 'model.layers.1.block_sparse_moe.experts.3.w3.weight'" in message
        )
        assert "the checkpoint's 'model.layers.0.block_sparse_moe.experts.2.w2.weight' is (32, 8)" in message
        assert "complete the directory (every expert, as `save_pretrained` writes it)" in message
        assert "strict=False" not in message  # it would not help
    assert all(torch.equal(v, before[k]) for k, v in holder.state_dict().items())  # nothing was read


def test_a_directory_with_fewer_experts_than_the_model_names_the_first_one_it_lacks(layouts):
    holder = torch.nn.Module()
    config = moe.config("qwen3_moe")
    config.num_experts = 6
    holder.net = transformers.Qwen3MoeForCausalLM(config)
    with pytest.raises(
        PretrainedLoadError, match=r"the checkpoint lacks 'model\.layers\.0\.mlp\.experts\.4\.gate_proj"
    ):
        load_pretrained(holder, PretrainedWeights(str(layouts / "qwen3_moe_save_pretrained")))


@pytest.mark.parametrize("kind", moe.KINDS)
def test_hf_export_names_are_save_pretrained_names_each_a_part_of_the_checkpoint_tensor(layouts, kind):
    """The names `--format hf` writes, checked against the class without a checkpoint: one per expert and part,
    exactly `save_pretrained`'s keys, each read as its rows of the fused checkpoint tensor."""
    from lightning_dpar.checkpoint import hf_export
    from lightning_dpar.experts.keys import ExpertPart

    model = moe.source(kind)
    record = {"prefix": "net.", "class": type(model).__name__, "config": model.config.to_json_string()}
    state = model.state_dict()
    names, left_out = hf_export.hf_tensor_names(record, {f"net.{k}": tuple(v.shape) for k, v in state.items()})
    on_disk = checkpoint_shapes(layouts / f"{kind}_save_pretrained")
    assert left_out == [] and set(names) == set(on_disk)
    written = moe.per_expert_tensors(kind, state)  # split by hand
    for name, source in names.items():
        tensor = state[source.name[4:]][source.index()] if isinstance(source, ExpertPart) else state[source[4:]]
        assert torch.equal(tensor, written[name]), name


@pytest.mark.parametrize("kind", moe.KINDS)
def test_hf_export_writes_what_save_pretrained_writes_and_from_pretrained_loads_it_exactly(
    gloo_world, layouts, tmp_path, kind
):
    path = str(layouts / f"{kind}_save_pretrained")
    trainer = trainer_for(FullyShardStrategy(pretrained=path), devices=1, max_steps=2)
    trainer.fit(CausalLM(path), DataLoader(TokenData(128, n=8), batch_size=2))
    trained = full_params(trainer)
    trainer.save_checkpoint(tmp_path / "moe.ckpt")
    assert consolidate([str(tmp_path / "moe.ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert set(checkpoint_shapes(tmp_path / "hf")) == set(checkpoint_shapes(path))  # per expert, original names
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert_equal_to(trained, model.state_dict(), "model.")
    trained_down = trained["model.model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(trained_down, moe.source(kind).model.layers[0].mlp.experts.down_proj)  # it trained
