"""Tensor-parallel plans applied to ordinary models (`lightning_dpar.plan.tensor_parallel`), in-process: row-wise
embeddings, head counts and sizes that do not divide (with the fix the dry run shows), and a unit ending in a
tensor-parallel layer without FSDP's view warning (one gloo process). Training such models on 2 and 4 gloo ranks is in
`tests/launched/test_plan_apply.py` (cases in `tests/workers/plan_apply.py`)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_dpar  # noqa: F401  (the Python fix below is evaluated)
from lightning_dpar.estimates import main
from lightning_dpar.plan.styles import parse_tp_plan
from lightning_dpar.plan.tensor_parallel import TensorParallelSizeError, resolve_tp_plan, tensor_parallel_size_fix
from tests.workers.plan_apply import EmbeddingModel


def test_rowwise_embedding_keeps_the_token_ids_whole():
    styles = resolve_tp_plan(EmbeddingModel(), parse_tp_plan(EmbeddingModel.tp_plan), tensor_parallel_size=2)
    embedding = styles["net.emb"]
    assert isinstance(embedding, torch.distributed.tensor.parallel.RowwiseParallel)
    assert embedding.input_layouts == (torch.distributed.tensor.Replicate(),)


def test_head_counts_must_divide():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = 4
            self.q = nn.Linear(12, 12)  # 3 heads of 4

    with pytest.raises(ValueError, match=r"does not divide the 3 heads of 'q' \(out_features 12 = 3 heads x head_dim"):
        resolve_tp_plan(Attention(), parse_tp_plan({"q": "colwise"}), tensor_parallel_size=2)


def test_a_plan_resolves_to_module_names_pattern_by_pattern_leaving_replicated_modules_out():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    styles = resolve_tp_plan(model, parse_tp_plan({"2": "rowwise", "[04]": "colwise", "3": "replicate"}), 2)
    assert list(styles) == ["2", "0", "4"]
    assert type(styles["0"]) is ColwiseParallel and type(styles["2"]) is RowwiseParallel


def test_a_pattern_that_matches_nothing_shows_the_module_names():
    with pytest.raises(ValueError, match=r"pattern 'layers\.\*' matches no module of .*Sequential.*\['0', '1'\]"):
        resolve_tp_plan(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), parse_tp_plan({"layers.*": "colwise"}))


def test_a_weight_sharding_style_on_a_module_it_cannot_split_names_both():
    model = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"ColwiseParallel cannot shard '0' \(torch.nn.modules.normalization.LayerNo"):
        resolve_tp_plan(model, {"0": ColwiseParallel()})


@pytest.mark.parametrize(
    ("style", "attribute", "size"),
    [("colwise", "out_features", 6), ("rowwise", "in_features", 9)],
)
def test_the_split_dimension_must_divide_and_the_error_lists_the_sizes_that_do(style, attribute, size):
    model = nn.Sequential(nn.Linear(9, 6))
    with pytest.raises(TensorParallelSizeError, match=f"does not divide {attribute}={size} of module '0'") as error:
        resolve_tp_plan(model, parse_tp_plan({"0": style}), tensor_parallel_size=4)
    assert error.value.valid_sizes == [d for d in range(1, size + 1) if size % d == 0]
    resolve_tp_plan(model, parse_tp_plan({"0": style}), tensor_parallel_size=3)  # 3 divides both


def test_a_config_head_count_above_a_sharded_module_must_divide():
    class Config:
        num_key_value_heads = 2
        use_bias = True  # not a head count
        n_head = True  # a bool is not a count

    model = nn.Module()
    model.config = Config()
    model.proj = nn.Linear(8, 8)
    plan = parse_tp_plan({"proj": "colwise"})
    assert list(resolve_tp_plan(model, plan, 2)) == ["proj"]
    with pytest.raises(TensorParallelSizeError, match=r"num_key_value_heads=2 of the .* at '<root>'.*among \[1, 2\]"):
        resolve_tp_plan(model, plan, 4)


def test_the_fix_picks_the_largest_valid_size_that_tiles_the_world_and_keeps_the_other_arguments():
    fix = tensor_parallel_size_fix("FSDP3DStrategy", [1, 2, 3, 6], lambda size: 12 % size == 0 and size < 6, {"a": 2})
    assert "`strategy=lightning_dpar.FSDP3DStrategy(a=2, tensor_parallel_size=3)`" in fix
    yaml = "class_path: lightning_dpar.FSDP3DStrategy\n    init_args:\n      a: 2\n      tensor_parallel_size: 3\n"
    assert fix.endswith(yaml)
    assert "tensor_parallel_size=1)" in tensor_parallel_size_fix("S", [4], lambda size: False, {})


class FusedAttention(nn.Module):
    """LitGPT's attention layout (`litgpt.model.CausalSelfAttention`): one `qkv` Linear whose output the forward
    splits with the config's global head counts, and a `proj`."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(n_head=4, n_query_groups=2, head_size=8)
        self.qkv = nn.Linear(32, (4 + 2 * 2) * 8)
        self.proj = nn.Linear(32, 32)


def test_a_fused_qkv_split_by_global_head_counts_is_refused_by_name():
    with pytest.raises(ValueError, match=r"splits 'attn.qkv' column-wise, but it is a fused q/k/v projection") as error:
        resolve_tp_plan(nn.ModuleDict({"attn": FusedAttention()}), parse_tp_plan({"attn.qkv": "colwise"}), 2)
    assert "(4 query heads, 2 key/value groups of size 8)" in str(error.value)
    assert "`transformer.h.*.mlp.proj` rowwise" in str(error.value)  # the fix


def test_a_fused_qkv_stays_allowed_where_nothing_splits_it():
    root = nn.ModuleDict({"attn": FusedAttention()})
    assert set(resolve_tp_plan(root, parse_tp_plan({"attn.qkv": "colwise"}), 1)) == {"attn.qkv"}  # one rank
    assert set(resolve_tp_plan(root, parse_tp_plan({"attn.proj": "colwise"}), 2)) == {"attn.proj"}  # not the qkv
    mlp = FusedAttention()  # a sibling of the same width that is not the attention's `qkv` (LitGPT's MLP can be)
    mlp.fc = mlp.qkv
    del mlp.qkv
    assert set(resolve_tp_plan(nn.ModuleDict({"mlp": mlp}), parse_tp_plan({"mlp.fc": "colwise"}), 2)) == {"mlp.fc"}


def test_devices_3_with_default_2d_sizes_names_the_size_module_and_dimension(capsys):
    # The case: `devices=3` with `strategy="dpar_2d"` (tensor_parallel_size "auto" = 3) on the example GPT.
    assert main(["--world-size", "3", "--trainer.strategy=dpar_2d"]) == 1
    err = capsys.readouterr().err
    assert "`tensor_parallel_size=3` does not divide" in err and "of module 'model.blocks.0.attn.q'" in err


def test_heads_not_dividing_the_default_size_show_the_yaml_and_python_that_fix_it(capsys, tmp_path):
    """`dpar_2d` on 4 devices defaults to tensor parallel 4; 6 heads do not divide by it. The error shows the class
    form with a size that fits the model and the world (2), as YAML and as Python; both are checked to work."""
    model = ["--model.n_head=6", "--model.n_embd=96"]
    assert main(["--world-size", "4", "--trainer.strategy=dpar_2d", *model]) == 1
    err = capsys.readouterr().err
    assert "`tensor_parallel_size=4` does not divide the 6 heads of 'model.blocks.0.attn.q'" in err
    yaml = err[err.index("trainer:") :]
    assert yaml.startswith(
        "trainer:\n  strategy:\n    class_path: lightning_dpar.FSDPTensorParallelStrategy\n    init_args:\n"
        "      tensor_parallel_size: 2\n"
    )
    (tmp_path / "fix.yaml").write_text(yaml)
    assert main(["--world-size", "4", "--config", str(tmp_path / "fix.yaml"), *model]) == 0
    python = re.search(r"in Python `strategy=(.*?)`", err).group(1)
    assert python == "lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2)"
    assert eval(python).resolve_dims(4, 4, 1).tensor_parallel == 2
    # `dpar_3d` keeps its pipeline size in the fix.
    assert main(["--world-size", "4", "--trainer.strategy=dpar_3d", "--model.n_head=3", "--model.n_embd=96"]) == 1
    assert "FSDPTensorParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=1)" in capsys.readouterr().err


def test_a_unit_ending_in_a_tensor_parallel_layer_trains_exactly_without_fsdps_view_warning():
    """A tensor-parallel layer's local output is a view (`DTensor.to_local`), and FSDP warns on every step that a unit
    returning a view may "silently drop the pre-backward hook" (every HF model with a gathered `lm_head`). The unit's
    outputs are made plain aliases: no warning, no copy, the same gradients, also through an in-place op (which
    autograd refused on the view)."""
    import copy
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_dpar.parallel.data_parallel import apply_fully_shard
    from lightning_dpar.plan.structure import data_parallel_roots

    torch.manual_seed(0)
    reference = nn.Module()
    reference.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 6))
    model = copy.deepcopy(reference)
    x = torch.randn(3, 4)
    want = reference.net(x)
    want += 1
    (want**2).sum().backward()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        parallelize_module(model.net[1], mesh["tensor_parallel"], ColwiseParallel(output_layouts=Replicate()))
        roots = data_parallel_roots(model)
        apply_fully_shard(model, mesh["data_parallel"], [], lambda top_level: MixedPrecisionPolicy(), roots)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model.net(x)
        assert not [w for w in caught if "view tensor" in str(w.message)]
        got += 1
        (got**2).sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()
