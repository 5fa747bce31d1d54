"""peft LoRA under every layout, in-process on meta models: the plan of `lightning_dpar.plan.adapters` reaches the
wrapped base layers and lays out the adapters, refuses what cannot be exact, and the memory estimate and dry-run plan
count trainable and frozen parameters. Training parity on 2 and 4 gloo ranks is in `tests/launched/test_peft.py`
(cases in `tests/workers/peft.py`). Skipped without peft."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

pytest.importorskip("peft")
pytest.importorskip("transformers")

import lightning_dpar
from lightning_dpar.estimates import plan
from lightning_dpar.estimates.state_memory import estimate_memory
from lightning_dpar.plan import parse_tp_plan, resolve_tp_plan
from lightning_dpar.plan.adapters import AdapterLayoutError, adapter_tp_plan, base_name_prefixes
from tests.support.hf_configs import llama_plan_splits_the_embedding
from tests.workers.peft import ALL_LINEAR, BASE_NAMES_PLAN, LoraLlama

LAYER = "net.base_model.model.model.layers.0"


def meta_lora(targets=ALL_LINEAR, **lora) -> LoraLlama:
    with torch.device("meta"):
        module = LoraLlama(targets)
    if lora:  # rebuild with other LoraConfig options
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from tests.workers.hf_models import llama_config

        with torch.device("meta"):
            module.net = get_peft_model(
                LlamaForCausalLM(llama_config()), LoraConfig(r=4, target_modules=targets, **lora)
            )
    return module


def tp_styles(module, tp_plan="auto", world=4) -> dict:
    strategy = lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=tp_plan)
    return strategy.module_plan(module, strategy.resolve_dims(world, world, 1)).tensor_parallel


def test_auto_plan_reaches_the_base_layers_of_a_peft_model():
    """The issue's reproduction: `tp_plan="auto"` on `get_peft_model(Llama, LoraConfig(q_proj, v_proj))` failed with
    "ColwiseParallel cannot shard '...q_proj' (Linear)"."""
    styles = tp_styles(meta_lora(["q_proj", "v_proj"]))
    q = f"{LAYER}.self_attn.q_proj"
    assert type(styles[f"{q}.base_layer"]) is ColwiseParallel
    lora_b = styles[f"{q}.lora_B.default"]  # column-wise like its base, on the replicated lora_A output
    assert type(lora_b) is ColwiseParallel and lora_b.input_layouts == (Replicate(),)
    assert lora_b.output_layouts == (Shard(-1),)
    assert f"{q}.lora_A.default" not in styles and q not in styles  # lora_A replicated; the wrapper itself untouched
    assert type(styles[f"{LAYER}.self_attn.k_proj"]) is ColwiseParallel  # not adapted: as in the base model


def test_row_wise_base_layers_get_a_row_wise_lora_a_and_a_replicated_lora_b():
    styles = tp_styles(meta_lora())
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        fqn = f"{LAYER}.{name}"
        assert type(styles[f"{fqn}.base_layer"]) is RowwiseParallel
        lora_a = styles[f"{fqn}.lora_A.default"]
        assert type(lora_a) is RowwiseParallel
        assert (lora_a.input_layouts, lora_a.output_layouts) == ((Shard(-1),), (Replicate(),))
        assert f"{fqn}.lora_B.default" not in styles
    adapted = [fqn for fqn in styles if ".lora_" in fqn]
    assert len(adapted) == 2 * 7  # one adapter module per adapted projection, in both layers


def test_a_plan_for_the_base_models_names_keeps_working_after_get_peft_model():
    module = meta_lora()
    assert base_name_prefixes(module) == [("net", "net.base_model.model")]
    own = tp_styles(module, BASE_NAMES_PLAN)
    auto = tp_styles(module)
    layers = {fqn: type(style) for fqn, style in auto.items() if ".layers." in fqn}
    assert {fqn: type(style) for fqn, style in own.items()} == layers


def test_the_issues_hand_pointed_plan_keeps_its_entries():
    """The workaround the issue found (the base layer and lora_B named by hand) resolves as written."""
    module = meta_lora(["q_proj"])
    hand = {
        "net.base_model.model.model.layers.*.self_attn.q_proj.base_layer": "colwise",
        "net.base_model.model.model.layers.*.self_attn.q_proj.lora_B.default": "colwise",
    }
    styles = tp_styles(module, hand)
    want = [
        f"net.base_model.model.model.layers.{i}.self_attn.q_proj.{m}"
        for i in (0, 1)
        for m in ("base_layer", "lora_B.default")
    ]
    assert sorted(styles) == sorted(want)


@pytest.mark.parametrize(
    ("style", "adapter", "want"),
    [
        ("colwise_gather_output", "lora_B", ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())),
        ("rowwise_split_input", "lora_A", RowwiseParallel(input_layouts=Replicate())),
    ],
)
def test_transformers_style_names_give_the_adapters_the_matching_layouts(style, adapter, want):
    """A base with a gathered output gets a gathered lora_B; a base that splits a whole input, a lora_A that does."""
    module = meta_lora(["q_proj"])
    styles = tp_styles(module, {"net.model.layers.*.self_attn.q_proj": style})
    got = styles[f"{LAYER}.self_attn.q_proj.{adapter}.default"]
    assert type(got) is type(want)
    assert (got.input_layouts, got.output_layouts) == (want.input_layouts, want.output_layouts)


def test_a_base_style_on_a_shard_of_the_tokens_is_refused_for_its_adapter():
    sequence_sharded = ColwiseParallel(input_layouts=Shard(1))
    with pytest.raises(AdapterLayoutError, match=r"with input layout S\(1\): the replicated lora_A would see a shard"):
        tp_styles(meta_lora(["q_proj"]), {"net.model.layers.*.self_attn.q_proj": sequence_sharded})


def test_a_model_without_peft_gets_its_plan_unchanged():
    from tests.workers.hf_models import LlamaModule

    with torch.device("meta"):
        module = LlamaModule(build_seed=None)
    own = parse_tp_plan({"net.model.layers.*.mlp.up_proj": "colwise"})
    assert adapter_tp_plan(module, own) == own


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"lora_dropout": 0.1}, r"has `lora_dropout=0.1`: each tensor-parallel rank would draw its own dropout mask"),
        ({"use_dora": True}, r"is a LoRA variant \(peft\.tuners\.lora\.variants\.DoraLinearVariant"),
    ],
)
def test_adapters_that_cannot_be_exact_under_tensor_parallelism_are_refused(lora, message):
    with pytest.raises(AdapterLayoutError, match=message) as error:
        tp_styles(meta_lora(["q_proj"], **lora))
    assert f"{LAYER}.self_attn.q_proj" in str(error.value)  # the module, and (in the message) the fix


def test_an_adapted_embedding_under_the_auto_plan_is_refused_naming_its_qualified_class():
    if not llama_plan_splits_the_embedding():  # transformers 5.17: the embedding stays whole, so its adapter too
        assert not [fqn for fqn in tp_styles(meta_lora(["q_proj", "embed_tokens"])) if "embed_tokens" in fqn]
        return
    with pytest.raises(AdapterLayoutError, match=r"is a peft\.tuners\.lora\.layer\.Embedding wrapping a torch\.nn"):
        tp_styles(meta_lora(["q_proj", "embed_tokens"]))


def test_errors_name_a_modules_qualified_class():
    """A style on a module it cannot shard names both classes qualified (peft's wrapper is also called `Linear`)."""
    module = meta_lora(["q_proj"])
    bad = parse_tp_plan({f"{LAYER}.self_attn": "colwise"})
    with pytest.raises(ValueError, match=r"cannot shard .*self_attn' \(transformers\.models\.llama\.modeling_llama\."):
        resolve_tp_plan(module, adapter_tp_plan(module, bad), 2)
    with pytest.raises(ValueError, match=r"it supports torch\.nn\.modules\.linear\.Linear and torch\.nn\.modules\."):
        resolve_tp_plan(module, adapter_tp_plan(module, bad), 2)


def test_pipeline_stages_split_a_peft_model_between_its_blocks_as_the_base_model():
    from tests.workers.hf_models import LlamaModule

    strategy = lightning_dpar.FullyShardStrategy(pipeline_parallel_size=2)
    dims = strategy.resolve_dims(4, 4, 1)
    with torch.device("meta"):
        base = LlamaModule(build_seed=None)
    peft_split = strategy.module_plan(meta_lora(), dims, rank=0).pipeline
    base_split = strategy.module_plan(base, dims, rank=0).pipeline
    moved = [[unit.replace("net.", "net.base_model.model.", 1) for unit in stage] for stage in base_split.stages]
    assert [list(stage) for stage in peft_split.stages] == moved


def test_optimizer_state_is_estimated_for_trainable_parameters_only():
    """Failed before: an optimizer over all parameters (as peft scripts build it) was counted with state for the
    frozen base too, though torch's optimizers make none for a parameter without a gradient."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    estimate = estimate_memory(model, [torch.optim.Adam(model.parameters())])
    trainable, frozen = 8 * 4 + 4, 4 * 8 + 8
    assert (estimate.parameters, estimate.frozen) == (4 * (trainable + frozen), 4 * frozen)
    assert estimate.gradients == 4 * trainable
    assert estimate.optimizer == 2 * 4 * trainable


def test_plan_dry_run_shows_trainable_and_frozen_parameter_bytes():
    module = meta_lora(["q_proj", "v_proj"])
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    report = plan(
        lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), module, world_size=4
    )
    m = report.memory
    assert 0 < m.parameters - m.frozen < m.frozen  # this rank's shards: a little trainable, mostly frozen
    assert m.gradients == m.parameters - m.frozen  # gradients only for the trainable ones
    assert m.optimizer == m.gradients  # SGD with momentum: one state per trainable element
    assert trainable * 20 < total
    text = report.render()
    assert "frozen" in text and "no gradient or optimizer state" in text
    assert "net.base_model.model.model.layers.*.self_attn.q_proj.lora_B.default  TP ColwiseParallel" in text
