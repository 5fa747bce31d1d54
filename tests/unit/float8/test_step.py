"""float8's step (`lightning_dpar.float8.step`): its slice of the plan (which Linears are converted: the default
skips, skip patterns, LoRA adapters, sizes that float8 matmuls cannot take, tensor-parallel shards), every refusal's
message, the conversion itself (torchao's `Float8Linear` on exactly the planned modules, keys unchanged), and the
planning walk with `PlanOptions.float8`. In-process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_dpar.float8 import step
from lightning_dpar.float8.config import resolve_float8
from lightning_dpar.parallel import parallelize
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import PlanOptions

torchao_float8 = pytest.importorskip("torchao.float8")

ONE = ParallelDims(1, 1, 1, 1)
FSDP2 = ParallelDims(2, 1, 2, 1)
TP2 = ParallelDims(2, 1, 1, 2)


def emulated(recipe: str = "rowwise", skip=None):
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return resolve_float8(config, skip, "FullyShardStrategy")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Tiny(nn.Module):
    """Two blocks of 32 -> 64 -> 32, a Linear of width 20 (not a multiple of 16) and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.odd = nn.Linear(32, 20)
        self.head = nn.Linear(20, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.odd(x))


BLOCK_LINEARS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]


def test_by_default_every_linear_but_the_output_layer_and_odd_sizes_is_converted():
    part = step.plan_float8(Tiny(), FSDP2, emulated(), "S")
    assert part.modules == BLOCK_LINEARS
    assert part.config.emulate
    assert step.plan_float8(Tiny(), FSDP2, None, "S") == step.Float8Plan()


def test_skip_patterns_replace_the_default_and_keep_whatever_they_match_in_high_precision():
    square = Tiny()
    square.odd, square.head = nn.Linear(32, 32), nn.Linear(32, 48)
    part = step.plan_float8(square, FSDP2, emulated(skip=["blocks.1.*"]), "S")
    assert part.modules == ["blocks.0.fc1", "blocks.0.fc2", "odd", "head"]
    part = step.plan_float8(square, FSDP2, emulated(skip=["blocks.0", "*head"]), "S")  # a module and all inside
    assert part.modules == ["blocks.1.fc1", "blocks.1.fc2", "odd"]
    assert step.plan_float8(square, FSDP2, emulated(skip=[]), "S").modules == [*BLOCK_LINEARS, "odd", "head"]


def test_under_tensor_parallelism_each_shard_must_be_a_multiple_of_16_too():
    model = Tiny()
    model.blocks[1].fc1 = nn.Linear(32, 16)  # its shards of 8 columns cannot be float8 matmuls
    model.blocks[1].fc2 = nn.Linear(16, 32)
    assert step.plan_float8(model, TP2, emulated(), "S").modules == ["blocks.0.fc1", "blocks.0.fc2"]
    assert step.plan_float8(model, FSDP2, emulated(), "S").modules == BLOCK_LINEARS


def test_lora_adapters_stay_in_high_precision_and_their_base_is_converted():
    model = Tiny()
    lora = nn.Module()
    lora.base_layer = nn.Linear(32, 64)
    lora.lora_A = nn.ModuleDict({"default": nn.Linear(32, 16, bias=False)})
    lora.lora_B = nn.ModuleDict({"default": nn.Linear(16, 64, bias=False)})
    model.blocks[0].fc1 = lora
    part = step.plan_float8(model, FSDP2, emulated(), "S")
    assert part.modules == ["blocks.0.fc1.base_layer", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]


def _refusal(model: nn.Module, dims: ParallelDims, options, **facts) -> str:
    with pytest.raises(ValueError) as raised:
        step.plan_float8(model, dims, options, "FSDPTensorParallelStrategy", **facts)
    message = str(raised.value)
    assert "`FSDPTensorParallelStrategy(float8=" in message
    return message


def test_the_tensorwise_recipe_under_tensor_parallelism_is_refused_by_name():
    message = _refusal(Tiny(), TP2, resolve_float8("tensorwise", None, "S"))
    assert "float8='tensorwise')` with" in message
    shown = "float8=Float8LinearConfig(<tensorwise recipe>, emulate=True))` with"
    assert shown in _refusal(Tiny(), TP2, emulated("tensorwise"))
    assert "`tensor_parallel_size=2`" in message
    assert "not exact against one process" in message and "float8='rowwise'" in message
    assert step.plan_float8(Tiny(), FSDP2, resolve_float8("tensorwise", None, "S"), "S").modules == BLOCK_LINEARS
    assert step.plan_float8(Tiny(), TP2, emulated("rowwise_with_gw_hp"), "S").modules == BLOCK_LINEARS


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        (ParallelDims(4, 1, 2, 1, pipeline=2), "`pipeline_parallel_size=2` is not supported"),
        (ParallelDims(2, 1, 2, 1, context=2), "`context_parallel_size=2` is not supported"),
    ],
)
def test_pipeline_and_context_parallelism_are_refused_by_name(dims, expected):
    message = _refusal(Tiny(), dims, emulated())
    assert expected in message and "drop `float8=`" in message


def test_a_model_parallelised_by_its_own_configure_model_is_refused():
    message = _refusal(Tiny(), FSDP2, emulated(), adopted=True)
    assert "parallelised by its own `configure_model`" in message and "convert_to_float8_training" in message


def test_a_model_converted_already_is_refused_naming_its_float8_modules():
    model = Tiny()
    torchao_float8.convert_to_float8_training(model.blocks[0], config=emulated().config)
    message = _refusal(model, FSDP2, emulated())
    assert "['blocks.0.fc1', 'blocks.0.fc2'] are torchao `Float8Linear` modules already" in message
    assert "Remove your own `convert_to_float8_training` call" in message


def test_a_linear_inside_an_experts_module_is_refused_with_the_skip_that_keeps_it():
    message = _refusal(Tiny(), FSDP2, emulated(), experts=["blocks.1"])
    assert "would convert ['blocks.1.fc1', 'blocks.1.fc2'], inside the experts modules ['blocks.1']" in message
    assert "float8_skip=['blocks.1.*']" in message
    skipped = emulated(skip=["blocks.1.*", "head"])
    assert step.plan_float8(Tiny(), FSDP2, skipped, "S", experts=["blocks.1"]).modules == BLOCK_LINEARS[:2]


def test_a_skip_pattern_matching_nothing_is_refused():
    message = _refusal(Tiny(), FSDP2, emulated(skip=["block.*"]))
    assert "`float8_skip` pattern 'block.*' matches no module" in message and "'blocks.0'" in message


def test_the_conversion_swaps_exactly_the_planned_modules_and_keeps_every_key():
    model = Tiny()
    keys = list(model.state_dict())
    part = step.plan_float8(model, ONE, emulated(), "S")
    step.apply_float8(model, part, torch.device("cpu"))
    assert step.converted_modules(model) == BLOCK_LINEARS
    assert type(model.head) is nn.Linear and type(model.odd) is nn.Linear
    assert list(model.state_dict()) == keys
    model(torch.randn(4, 32)).sum().backward()  # emulated float8 on the CPU
    assert model.blocks[0].fc1.weight.grad is not None and model.blocks[0].fc1.weight.dtype == torch.float32
    step.apply_float8(model, step.Float8Plan(), torch.device("cpu"))  # nothing planned: nothing to do
    assert step.converted_modules(Tiny()) == []


def test_the_planning_walk_carries_the_slice_and_its_config():
    options = PlanOptions("FullyShardStrategy", shards=True, float8=emulated())
    plan = parallelize.plan_modules(Tiny(), FSDP2, options)
    assert plan.float8 == BLOCK_LINEARS and plan.float8_config.emulate
    plain = parallelize.plan_modules(Tiny(), FSDP2, PlanOptions("FullyShardStrategy", shards=True))
    assert plain.float8 == [] and plain.float8_config is None


def test_the_step_reads_what_it_declares_and_converts_its_slice(gloo_world):
    """`STEP`, the binding the list of steps walks: the real options, facts and plan satisfy what it declares it
    reads; its slice is the convertible Linear modules with torchao's config, and applying it converts them."""
    from lightning_dpar.parallel.facts import model_facts
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.steps.contract import Applying, Planning

    options = PlanOptions("FullyShardStrategy", shards=True, float8=emulated())
    facts = model_facts(Tiny(), ONE, options)
    assert isinstance(options, step.PlanOptionsRead) and isinstance(facts, step.ModelFactsRead)
    part = step.STEP.plan(Planning(Tiny(), ONE, options, facts))
    assert part["float8"] == BLOCK_LINEARS and part["float8_config"].emulate
    plan = ModulePlan({}, [], [], **part)
    assert isinstance(plan, step.ModulePlanRead)
    model = Tiny()
    step.STEP.apply(model, plan, Applying(ONE.build_meshes(torch.device("cpu"), device_type="cpu")))
    assert step.converted_modules(model) == BLOCK_LINEARS
