"""Fused mixture-of-experts parameters and their per-expert checkpoint tensors (`lightning_dpar.experts.keys`), pure:
which per-expert key belongs to which fused parameter, which experts and rows a block of the fused tensor needs, what a
checkpoint lacks, and the split back for the export; and the rules transformers declares
(`lightning_dpar.hf_weights.hf_keys.expert_merges`), checked against what `save_pretrained` writes. Loading and
exporting real models is in `tests/unit/hf_weights/test_moe_weights.py` (one rank) and
`tests/launched/test_moe_weights.py` (two)."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_dpar.experts.keys import ExpertMerge, group_experts, pieces, split_fused

GATE_UP = ExpertMerge(("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"), "mlp.experts.gate_up_proj")
DOWN = ExpertMerge(("mlp.experts.*.down_proj.weight",), "mlp.experts.down_proj")
MIXTRAL = ExpertMerge((".experts.*.w1.weight", ".experts.*.w3.weight"), ".experts.gate_up_proj")
E, ROWS, H = 3, 4, 5  # experts, intermediate size (rows per part), hidden


def per_expert(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-expert gate/up/down tensors of one layer, and the fused tensors built from them the way transformers
    does (stack the experts, concatenate gate and up): `torch.cat` per expert here, not the code under test."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(E):
        for name, shape in (("gate_proj", (ROWS, H)), ("up_proj", (ROWS, H)), ("down_proj", (H, ROWS))):
            tensors[f"model.layers.1.mlp.experts.{e}.{name}.weight"] = torch.randn(shape, generator=g)
    key = "model.layers.1.mlp.experts.{}.{}.weight".format
    gate_up = torch.stack([torch.cat([tensors[key(e, "gate_proj")], tensors[key(e, "up_proj")]]) for e in range(E)])
    down = torch.stack([tensors[key(e, "down_proj")] for e in range(E)])
    return tensors, gate_up, down


def test_a_per_expert_key_names_its_fused_parameter_expert_and_part():
    assert GATE_UP.match("model.layers.1.mlp.experts.12.up_proj.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj",
        12,
        1,
    )
    assert GATE_UP.match("model.layers.1.mlp.experts.0.gate_proj.weight")[1:] == (0, 0)
    assert MIXTRAL.match("model.layers.0.mlp.experts.2.w3.weight") == ("model.layers.0.mlp.experts.gate_up_proj", 2, 1)
    for other in (
        "model.layers.1.mlp.experts.gate_up_proj",  # already fused
        "model.layers.1.xmlp.experts.0.gate_proj.weight",  # not on a name boundary
        "model.layers.1.mlp.experts.0.gate_proj.weight_scale",  # not the end of the name
        "model.layers.1.mlp.shared_expert.gate_proj.weight",  # a dense MLP beside the experts
    ):
        assert GATE_UP.match(other) is None, other
    assert GATE_UP.expert_names("model.layers.1.mlp.experts.gate_up_proj", 2) == [
        ["model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"],
        ["model.layers.1.mlp.experts.1.gate_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"],
    ]
    assert GATE_UP.expert_names("model.layers.1.mlp.experts.down_proj", 2) is None


def test_per_expert_keys_group_into_fused_parameters_with_their_shapes_and_the_rest_stays():
    tensors, gate_up, down = per_expert()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()} | {"model.norm.weight": (H,)}
    grouped, fused, conflicts = group_experts(shapes, [GATE_UP, DOWN])
    assert grouped == {
        "model.norm.weight": (H,),
        "model.layers.1.mlp.experts.gate_up_proj": tuple(gate_up.shape),
        "model.layers.1.mlp.experts.down_proj": tuple(down.shape),
    }
    assert conflicts == [] and fused["model.layers.1.mlp.experts.gate_up_proj"].num_experts == E
    both = group_experts({**shapes, "model.layers.1.mlp.experts.down_proj": tuple(down.shape)}, [GATE_UP, DOWN])[2]
    assert len(both) == 1 and "'model.layers.1.mlp.experts.down_proj' both as one tensor and as per-expert" in both[0]
    assert group_experts(shapes, [])[0] == shapes  # no rule (not a transformers MoE): nothing is grouped


@pytest.mark.parametrize("which", ["gate_up_proj", "down_proj"])
def test_every_block_of_the_fused_tensor_is_assembled_from_only_the_slices_inside_it(which):
    """Every block a shard can be (any experts, rows and columns: FSDP or expert-parallel shards of dim 0, row
    splits that end inside gate or up): the pieces, read from the per-expert tensors, equal the fused tensor's block,
    and no piece reads a row or column outside it."""
    tensors, gate_up, down = per_expert()
    fused_tensor = gate_up if which == "gate_up_proj" else down
    _, fused, _ = group_experts({k: tuple(v.shape) for k, v in tensors.items()}, [GATE_UP, DOWN])
    group = fused[f"model.layers.1.mlp.experts.{which}"]
    dims = fused_tensor.shape
    spans = [[(o, n) for o in range(d) for n in range(1, d - o + 1)] for d in dims]
    for block in itertools.product(*spans):
        offsets, lengths = [o for o, _ in block], [n for _, n in block]
        out = torch.full(lengths, float("nan"))
        read = 0
        for piece in pieces(group, offsets, lengths):
            out[piece.dest] = tensors[piece.key][piece.source]
            read += tensors[piece.key][piece.source].numel()
        want = fused_tensor[tuple(slice(o, o + n) for o, n in block)]
        assert torch.equal(out, want), block
        assert read == want.numel(), block  # nothing outside the block, nothing twice


def test_a_block_names_just_the_experts_and_parts_it_spans():
    tensors, _, _ = per_expert()
    _, fused, _ = group_experts({k: tuple(v.shape) for k, v in tensors.items()}, [GATE_UP, DOWN])
    group = fused["model.layers.1.mlp.experts.gate_up_proj"]
    # Expert 1's rows 2..5: the end of its gate and the start of its up; none of experts 0 and 2.
    got = [(p.key.split(".")[5:7], p.source[0], p.dest[:2]) for p in pieces(group, [1, 2, 0], [1, 4, H])]
    assert got == [
        (["1", "gate_proj"], slice(2, 4), (0, slice(0, 2))),
        (["1", "up_proj"], slice(0, 2), (0, slice(2, 4))),
    ]


def test_missing_misshaped_and_surplus_experts_are_each_named_with_the_expected_shape():
    tensors, gate_up, _ = per_expert()
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    shapes.pop("model.layers.1.mlp.experts.1.up_proj.weight")
    shapes["model.layers.1.mlp.experts.2.gate_proj.weight"] = (ROWS, H + 1)
    shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] = (ROWS, H)  # a fourth expert the model lacks
    group = group_experts(shapes, [GATE_UP, DOWN])[1]["model.layers.1.mlp.experts.gate_up_proj"]
    problems = group.check(tuple(gate_up.shape), model_name="net.model.layers.1.mlp.experts.gate_up_proj")
    intro = (
        "'net.model.layers.1.mlp.experts.gate_up_proj' (3, 8, 5) is 3 experts' gate_proj then up_proj of (4, 5) each"
    )
    assert problems == [
        f"{intro}, but the checkpoint lacks 'model.layers.1.mlp.experts.1.up_proj.weight'",
        f"{intro}, but the checkpoint's 'model.layers.1.mlp.experts.2.gate_proj.weight' is (4, 6)",
        f"{intro}, but the checkpoint has 4 experts, beyond them 'model.layers.1.mlp.experts.3.gate_proj.weight'",
    ]
    complete = group_experts({k: tuple(v.shape) for k, v in tensors.items()}, [GATE_UP])[1]
    assert complete["model.layers.1.mlp.experts.gate_up_proj"].check(tuple(gate_up.shape)) == []
    # Names as the files have them: the caller translates (Mixtral's `mlp.` is `block_sparse_moe.` on disk).
    renamed = group.check(tuple(gate_up.shape), file_name=lambda n: n.replace(".mlp.", ".block_sparse_moe."))
    assert "lacks 'model.layers.1.block_sparse_moe.experts.1.up_proj.weight'" in renamed[0]


def test_a_fused_parameter_splits_back_into_the_per_expert_tensors_in_checkpoint_order():
    tensors, gate_up, down = per_expert()
    parts = split_fused("model.layers.1.mlp.experts.gate_up_proj", tuple(gate_up.shape), [DOWN, GATE_UP], "net.x")
    assert list(parts)[:3] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
    ]
    assert {part.name for part in parts.values()} == {"net.x"}  # read from the checkpoint's own name
    for name, part in parts.items():
        assert part.shape(gate_up.shape) == tuple(tensors[name].shape)
        assert torch.equal(gate_up[part.index()], tensors[name]), name
    downs = split_fused("model.layers.1.mlp.experts.down_proj", tuple(down.shape), [GATE_UP, DOWN])
    assert all(torch.equal(down[part.index()], tensors[name]) for name, part in downs.items())
    assert len(downs) == E
    assert split_fused("model.layers.1.mlp.gate.weight", (E, H), [GATE_UP, DOWN]) is None


# ---------------------------------------------------------------------- the rules transformers declares
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_transformers_rules_group_what_save_pretrained_writes_into_the_models_own_parameters(kind, tmp_path):
    """The rules read from transformers' conversion mapping turn the keys `save_pretrained` writes (after the
    class's renames) into exactly the model's parameter names and shapes."""
    pytest.importorskip("transformers")
    from lightning_dpar.hf_weights import hf_keys
    from lightning_dpar.hf_weights.pretrained import checkpoint_shapes
    from tests.support import moe

    model = moe.source(kind)
    model.save_pretrained(tmp_path)
    on_disk = checkpoint_shapes(tmp_path)
    merges = hf_keys.model_expert_merges(model)
    assert len(merges) == 2
    loaded = {hf_keys.loaded_names(model, on_disk)[k]: shape for k, shape in on_disk.items()}
    grouped, fused, conflicts = group_experts(loaded, merges)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert grouped == want and conflicts == [] and len(fused) == 4  # 2 layers x (gate_up, down)
    assert hf_keys.expert_merges("LlamaForCausalLM", "llama") == []  # a dense model: no rule
