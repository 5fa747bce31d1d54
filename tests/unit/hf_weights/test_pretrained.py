"""Pretrained Hugging Face weights (`lightning_dpar.hf_weights.pretrained`), in process: key matching, prefixes, ties
and shapes, refused directories, renamed keys, the `--format hf` export names and the load summary. The runs through
real Trainers on 2 and 4 gloo ranks (loading into shards, fine-tuning parity, strictness, export, memory) are in
`tests/launched/test_pretrained.py` (workers in `tests/workers/pretrained.py`), which uses the tiny models and the
weights directory defined here."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_dpar.checkpoint import hf_export
from lightning_dpar.hf_weights.pretrained import (
    PretrainedLoadError,
    PretrainedWeights,
    checkpoint_shapes,
    infer_prefix,
    load_pretrained,
    map_keys,
    to_pretrained_weights,
)
from tests.support.hf_configs import decoder_settings
from tests.support.models import Net

transformers = pytest.importorskip("transformers")

TINY = decoder_settings(tie_word_embeddings=True)  # GQA: two query heads per key/value head


def save_llama(path, config: dict, max_shard_size: str) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(path, max_shard_size=max_shard_size)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pretrained")
    save_llama(path / "tiny_llama", TINY, "20KB")  # several shard files and an index
    save_llama(path / "tiny_llama_untied", {**TINY, "tie_word_embeddings": False}, "20KB")  # for pipeline stages
    from safetensors.torch import save_file

    torch.manual_seed(0)
    (path / "net_weights").mkdir()
    save_file(Net().state_dict(), path / "net_weights" / "model.safetensors")  # one file, no index
    return path


MODEL = {"net.model.embed.weight": (8, 4), "net.model.layers.0.w": (4, 4), "net.lm_head.weight": (8, 4)}


def test_prefix_is_inferred_from_where_the_keys_fit():
    checkpoint = ["model.embed.weight", "model.layers.0.w", "lm_head.weight"]
    assert infer_prefix(list(MODEL), checkpoint) == "net."
    assert infer_prefix(["model.layers.0.w", "head.w"], ["layers.0.w"]) == "model."  # a base model's checkpoint
    with pytest.raises(PretrainedLoadError, match="another model's weights"):
        infer_prefix(list(MODEL), ["encoder.block.0.w"])
    with pytest.raises(PretrainedLoadError, match=r"several prefixes.*'a\.', 'b\.'"):
        infer_prefix(["a.w", "b.w"], ["w"])


def test_keys_are_matched_with_ties_shapes_and_both_kinds_of_gap_named():
    tied = [["net.model.embed.weight", "net.lm_head.weight"]]
    checkpoint = {"model.embed.weight": (8, 4), "model.layers.0.w": (4, 4)}
    mapping = map_keys(MODEL, checkpoint, "net.", tied)
    assert mapping.missing == [] and mapping.unexpected == []  # lm_head comes with its tied embedding
    assert mapping.to_model == {
        "model.embed.weight": "net.model.embed.weight",
        "model.layers.0.w": "net.model.layers.0.w",
    }
    untied = map_keys(MODEL, {**checkpoint, "model.layers.1.w": (4, 4)}, "net.")
    assert untied.missing == ["net.lm_head.weight"] and untied.unexpected == ["model.layers.1.w"]
    problems = untied.problems(strict=True)
    assert "'net.lm_head.weight'" in problems[0] and "'model.layers.1.w'" in problems[1]
    assert untied.problems(strict=False) == []
    shaped = map_keys(MODEL, {"model.layers.0.w": (4, 2)}, "net.")
    assert shaped.problems(strict=False) == ["shapes differ: model.layers.0.w: checkpoint (4, 2), model (4, 4)"]
    both = map_keys(MODEL, {"model.embed.weight": (8, 4), "lm_head.weight": (8, 4)}, "net.", tied)
    assert list(both.to_model) == ["model.embed.weight"]  # one read per shared parameter


def test_a_directory_without_weights_is_refused_when_the_strategy_is_built(tmp_path):
    with pytest.raises(PretrainedLoadError, match="holds no weights"):
        to_pretrained_weights(tmp_path)
    with pytest.raises(PretrainedLoadError, match="does not exist"):
        to_pretrained_weights(PretrainedWeights(str(tmp_path / "nope")))
    save_llama(tmp_path, TINY, "1GB")
    assert to_pretrained_weights(tmp_path) == PretrainedWeights(str(tmp_path))  # one model.safetensors
    (tmp_path / "model-old.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    with pytest.raises(PretrainedLoadError, match=r"besides the model's \['model.safetensors'\]: \['model-old"):
        to_pretrained_weights(tmp_path)


def test_checkpoint_shapes_come_from_every_shard_file(shared_dir):
    index = json.loads((shared_dir / "tiny_llama" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    shapes = checkpoint_shapes(shared_dir / "tiny_llama")
    assert set(shapes) == set(index["weight_map"])
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads x head_dim 8


def _record(config: dict) -> dict:
    model_config = transformers.LlamaConfig(**config)
    return {"prefix": "net.", "class": "LlamaForCausalLM", "config": model_config.to_json_string()}


def test_hf_export_names_drop_the_prefix_and_the_tied_copy_and_refuse_a_mismatch():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    shapes = {f"net.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    names, left_out = hf_export.hf_tensor_names(_record(TINY), {**shapes, "loss_scale": ()})
    assert left_out == ["loss_scale"]
    assert "lm_head.weight" not in names and names["model.norm.weight"] == "net.model.norm.weight"
    assert len(names) == len(shapes) - 1
    del shapes["net.model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(hf_export.ExportError, match=r"not in the checkpoint: 'model\.layers\.1\.mlp\.up_proj"):
        hf_export.hf_tensor_names(_record(TINY), shapes)
    wrong = _record({**TINY, "num_key_value_heads": 4})  # the config says 4 kv heads, the weights have 2
    with pytest.raises(hf_export.ExportError, match=r"shapes differ: model\.layers\.0\.self_attn\.k_proj\.weight"):
        hf_export.hf_tensor_names(wrong, {f"net.{k}": tuple(v.shape) for k, v in model.state_dict().items()})


NEOX = decoder_settings(num_key_value_heads=None)


def test_renamed_checkpoint_keys_load_and_export_as_transformers_names_them(tmp_path):
    """transformers 5 stores GPT-NeoX's `lm_head.weight` as `embed_out.weight` (as every Pythia checkpoint does):
    loading renames it like `from_pretrained` (without, strict loading refused the model's own save), and the
    export names it like `save_pretrained`."""
    config = transformers.GPTNeoXConfig(**NEOX, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    assert "embed_out.weight" in checkpoint_shapes(tmp_path)
    torch.manual_seed(1)
    holder = torch.nn.Module()
    holder.net = transformers.GPTNeoXForCausalLM(config)
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):  # DCP, no group
        mapping = load_pretrained(holder, PretrainedWeights(str(tmp_path))).mapping
    assert mapping.to_model["lm_head.weight"] == "net.lm_head.weight"
    want = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(holder.net.state_dict()[k], v) for k, v in want.items())
    record = {"prefix": "net.", "class": "GPTNeoXForCausalLM", "config": config.to_json_string()}
    names, _ = hf_export.hf_tensor_names(record, {f"net.{k}": tuple(v.shape) for k, v in want.items()})
    assert names["embed_out.weight"] == "net.lm_head.weight" and set(names) == set(checkpoint_shapes(tmp_path))


def test_strip_prefix_refuses_names_outside_it():
    assert hf_export.strip_prefix(["net.a", "net.b"], "net.") == {"a": "net.a", "b": "net.b"}
    with pytest.raises(hf_export.ExportError, match=r"1 tensors are not under it, e\.g\. \['head\.w'\]"):
        hf_export.strip_prefix(["net.a", "head.w"], "net.")


def test_a_load_reports_what_it_loaded_how_many_bytes_this_rank_read_and_how_long_it_took(tmp_path):
    """The strategy logs `summary()` on rank 0: `pretrained=` printed nothing before."""
    import lightning as L
    from safetensors.torch import save_file

    from lightning_dpar.hf_weights.pretrained import load_pretrained

    torch.manual_seed(0)
    saved = Net().state_dict()
    half = {k: v.half() for k, v in saved.items()}  # bytes read count the checkpoint's dtype, not the model's
    save_file(half, tmp_path / "model.safetensors")
    module = L.LightningModule()
    module.net = Net()
    loaded = load_pretrained(module, PretrainedWeights(str(tmp_path)))
    assert all(torch.equal(module.net.state_dict()[k], v.float()) for k, v in half.items())
    assert loaded.prefix == "net." and len(loaded.mapping.to_model) == len(saved)
    assert loaded.bytes_read == sum(v.numel() * 2 for v in saved.values()) and loaded.seconds > 0
    line = loaded.summary()
    assert f"{str(tmp_path)!r} into `net`: {len(saved)} tensors in " in line
    number, unit = re.search(r"this rank read ([\d.]+) (B|KiB|MiB)", line).groups()
    assert float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit] == pytest.approx(loaded.bytes_read, rel=0.05)
