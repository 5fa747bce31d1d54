"""The package's small shared helpers (`lightning_dpar.helpers`), each on values worked out by hand."""

from __future__ import annotations

import os

import pytest
from torch import nn

from lightning_dpar.helpers import (
    attached_trainer,
    class_name,
    divisors,
    format_bytes,
    group_modules,
    has_parameters,
    is_transformers_model,
    is_under,
    key_value_cache_configs,
    local_numel,
    process_memory,
    show_names,
    text_table,
    transformers_models,
    wildcard_indices,
    without_key_value_cache,
)


def test_is_under_matches_the_unit_and_what_is_inside_it_not_a_sibling_with_the_same_prefix():
    units = ["layers.1", "head"]
    assert is_under("layers.1", units)
    assert is_under("layers.1.attn.weight", units)
    assert is_under("head.bias", units)
    assert not is_under("layers.10", units)  # a prefix of the text, not of the dotted name
    assert not is_under("layers", units)
    assert not is_under("x", [])


@pytest.mark.parametrize(("n", "expected"), [(1, [1]), (12, [1, 2, 3, 4, 6, 12]), (13, [1, 13]), (8, [1, 2, 4, 8])])
def test_divisors(n, expected):
    assert divisors(n) == expected


def test_show_names_cuts_after_the_limit_in_each_style():
    names = [f"n{i}" for i in range(5)]
    assert show_names(names[:2]) == "['n0', 'n1']"
    assert show_names(names, 3) == "['n0', 'n1', 'n2', ...]"
    assert show_names(names, 3, bracketed=False) == "'n0', 'n1', 'n2'"
    assert show_names(names, 3, bracketed=False, count_rest=True) == "'n0', 'n1', 'n2' and 2 more"
    assert show_names(iter(names), 5) == "['n0', 'n1', 'n2', 'n3', 'n4']"  # any iterable, exactly at the limit


def test_class_name_qualifies_all_but_builtins():
    assert class_name(nn.Linear(1, 1)) == "torch.nn.modules.linear.Linear"
    assert class_name(nn.Linear) == "torch.nn.modules.linear.Linear"
    assert class_name(3) == "int"

    class Local:
        pass

    assert class_name(Local()) == f"{__name__}.{Local.__qualname__}"


def test_attached_trainer_is_none_for_a_detached_module_and_for_none_and_the_trainer_once_attached():
    from lightning.pytorch.demos.boring_classes import BoringModel

    assert attached_trainer(None) is None
    model = BoringModel()
    assert attached_trainer(model) is None
    import lightning as L

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model.trainer = trainer
    assert attached_trainer(model) is trainer


def test_has_parameters_looks_into_submodules():
    assert has_parameters(nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(2, 2))))
    assert not has_parameters(nn.Sequential(nn.ReLU(), nn.Dropout()))


class PreTrainedModel(nn.Module):
    """Named like transformers' base class, but defined here: `is_transformers_model` must also check the module."""


def test_a_transformers_model_is_told_by_its_base_class_and_its_module():
    assert not is_transformers_model(PreTrainedModel())
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    assert is_transformers_model(model)
    assert not is_transformers_model(nn.Linear(1, 1))
    # the outermost model only: LlamaForCausalLM holds a LlamaModel, which is one too
    holder = nn.Module()
    holder.lm = model
    holder.other = nn.Linear(1, 1)
    assert [name for name, _ in transformers_models(holder)] == ["lm"]
    assert transformers_models(model)[0][1] is model
    # one config per model that builds a cache; the causal-LM head and its base model share theirs
    assert config.use_cache is True
    assert key_value_cache_configs(holder) == (config,)
    with without_key_value_cache(key_value_cache_configs(holder)):
        assert config.use_cache is False
    assert config.use_cache is True
    config.use_cache = False
    assert key_value_cache_configs(holder) == ()


def test_without_key_value_cache_restores_the_setting_after_an_error():
    class Config:
        use_cache = True

    config = Config()
    with pytest.raises(RuntimeError, match="boom"), without_key_value_cache([config]):
        assert config.use_cache is False
        raise RuntimeError("boom")
    assert config.use_cache is True


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_process_memory_reads_this_process_in_bytes():
    resident, peak = process_memory("VmRSS"), process_memory("VmHWM")
    assert 10 * 2**20 < resident <= peak  # a Python process with torch holds well over 10 MiB
    assert resident % 1024 == 0  # the file counts kB
    assert process_memory("NoSuchField") == 0


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.50 KiB", "3.00 GiB"]


def test_a_repeated_modules_indices_become_wildcards():
    assert wildcard_indices("model.blocks.12.attn.0") == "model.blocks.*.attn.*"
    assert wildcard_indices("layer2.weight") == "layer2.weight"


def test_repeated_blocks_treated_alike_are_grouped_by_their_index():
    modules = {
        "blocks.0.attn": ["fsdp", "ac"],
        "blocks.1.attn": ["fsdp", "ac"],
        "blocks.2.attn": ["fsdp"],  # treated otherwise: a group of its own
        "blocks.10.mlp.0": ["tp"],
        "head": ["fsdp"],
        "layer2": ["fsdp"],  # a digit inside a name is not an index
    }
    assert group_modules(modules) == [
        ("blocks.*.attn", ["fsdp", "ac"], 2),
        ("blocks.*.attn", ["fsdp"], 1),
        ("blocks.*.mlp.*", ["tp"], 1),
        ("head", ["fsdp"], 1),
        ("layer2", ["fsdp"], 1),
    ]


def test_local_elements_are_this_ranks_shard(fake_world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fake_world(4)
    mesh = init_device_mesh("cpu", (4,))
    assert local_numel(distribute_tensor(torch.empty(8, 3, device="meta"), mesh, [Shard(0)])) == 2 * 3
    assert local_numel(torch.empty(3, 5, device="meta")) == 15


def test_a_text_table_aligns_its_columns_under_the_header():
    assert text_table([("a", "1"), ("bbb", "22")], ("name", "n")) == ["  name  n", "  a     1", "  bbb   22"]
    assert text_table([], ("name", "n")) == []  # no rows: no header either
