"""Plan parsing, module selection and mesh arithmetic: pure logic, tested in one process without collectives."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import lightning_dpar
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import (
    NamedStyle,
    fqn_matches,
    parse_tp_plan,
    repeated_blocks,
    resolve_activation_checkpointing,
    resolve_tp_plan,
    select_modules,
)
from tests.support.models import Net


class WildcardModel(nn.Module):
    """Module names as in the wildcard tests of torch's `test/distributed/tensor/parallel/test_parallelize_api.py`."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2, self.net3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.layers = nn.ModuleList(nn.ModuleDict({"net1": nn.Linear(4, 4), "net2": nn.Linear(4, 4)}) for _ in range(2))


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("net*", ["net1", "net2", "net3"]),
        ("net?", ["net1", "net2", "net3"]),
        ("net[1-2]", ["net1", "net2"]),
        ("layers.*.net[1]", ["layers.0.net1", "layers.1.net1"]),
        ("layers.1.net2", ["layers.1.net2"]),
    ],
)
def test_wildcard_patterns_match_like_parallelize_module(pattern, expected):
    plan = resolve_tp_plan(WildcardModel(), {pattern: ColwiseParallel()})
    assert list(plan) == expected


def test_fqn_matching_is_per_segment():
    assert fqn_matches("layers.*.net1", "layers.0.net1")
    assert not fqn_matches("layers.*", "layers.0.net1")  # '*' does not cross dots
    assert not fqn_matches("net1", "layers.0.net1")


def test_style_names_and_objects():
    plan = parse_tp_plan({"a": "colwise", "b": "ROWWISE", "c": "sequence_parallel", "d": RowwiseParallel()})
    styles = [s.build(nn.Linear(2, 2)) if isinstance(s, NamedStyle) else s for s in plan.values()]
    assert [type(s) for s in styles] == [ColwiseParallel, RowwiseParallel, SequenceParallel, RowwiseParallel]


def test_unknown_style_is_refused_at_strategy_construction():
    with pytest.raises(ValueError, match=r"tp_plan\['net1'\] = 'columnwise' is not a tensor-parallel style.*'colwise'"):
        lightning_dpar.FSDPTensorParallelStrategy(tp_plan={"net1": "columnwise"})


def test_two_patterns_on_one_module_is_an_error():
    with pytest.raises(ValueError, match=r"'net1' is matched by both tp_plan patterns 'net1' and 'net\*'"):
        resolve_tp_plan(WildcardModel(), {"net1": ColwiseParallel(), "net*": RowwiseParallel()})


def test_select_modules_by_class_name_type_and_glob():
    model = Net(depth=3)
    assert select_modules(model, ["Block"], "shard_modules") == ["layers.0", "layers.1", "layers.2"]
    assert select_modules(model, [nn.Linear], "x")[:2] == ["inp", "layers.0.fc1"]
    assert select_modules(model, ["layers.[02]"], "x") == ["layers.0", "layers.2"]
    with pytest.raises(ValueError, match=r"`shard_modules` entry 'Blok' matches no module.*'Block'"):
        select_modules(model, ["Blok"], "shard_modules")


def test_default_units_are_the_repeated_blocks():
    assert repeated_blocks(Net(depth=2)) == ["layers.0", "layers.1"]
    assert resolve_activation_checkpointing(Net(), True, []) == ["layers.0", "layers.1"]
    assert resolve_activation_checkpointing(Net(), ["layers.1"], ["layers.0", "layers.1"]) == ["layers.1"]
    assert resolve_activation_checkpointing(Net(), False, ["layers.0"]) == []


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"world_size": 8, "devices_per_node": 4, "tensor_parallel_size": "auto"}, (1, 2, 4)),
        ({"world_size": 8, "devices_per_node": 4, "tensor_parallel_size": 2}, (1, 4, 2)),
        ({"world_size": 16, "devices_per_node": 8, "replicate_size": "auto", "num_nodes": 2}, (2, 8, 1)),
        ({"world_size": 8, "devices_per_node": 8, "tensor_parallel_size": 2, "replicate_size": 2}, (2, 2, 2)),
    ],
)
def test_parallel_dims_resolve(kwargs, expected):
    dims = ParallelDims.resolve(**kwargs)
    assert (dims.replicate, dims.shard, dims.tensor_parallel) == expected
    assert dims.replicate * dims.shard * dims.tensor_parallel == kwargs["world_size"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "`tensor_parallel_size=3` does not divide the world size 8"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, "Set `data_parallel_size=4` or 'auto'"),
        ({"replicate_size": 3}, "`replicate_size=3` must divide the data-parallel size 8"),
        ({"tensor_parallel_size": 0}, "`tensor_parallel_size=0` is invalid"),
    ],
)
def test_parallel_dims_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ParallelDims.resolve(world_size=8, devices_per_node=8, **kwargs)


def test_strategy_names_are_registered_lower_case():
    from lightning.pytorch.strategies import StrategyRegistry

    names = {"dpar_replicate", "dpar_fsdp", "dpar_fsdp_offload", "dpar_hsdp", "dpar_2d"}
    assert names <= set(StrategyRegistry.available_strategies())
    assert all(name == name.lower() for name in names)
    assert StrategyRegistry["dpar_fsdp_offload"]["init_params"] == {"cpu_offload": True}
    assert StrategyRegistry["dpar_hsdp"]["init_params"] == {"replicate_size": "auto"}


# ("16-mixed" on CPU is turned into bf16-mixed by Lightning itself before the strategy sees it.)
@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_fails_when_the_trainer_is_built(precision):
    with pytest.raises(ValueError, match=f"`precision='{precision}'` .*is not supported.*'bf16-mixed'"):
        L.Trainer(accelerator="cpu", devices=2, strategy="dpar_fsdp", precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_supported_precision_maps_to_the_package_plugin(precision):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="dpar_2d", precision=precision)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_dpar.DparPrecision) and plugin.precision == precision
    policy = plugin.mixed_precision_policy(root_unit=True)
    assert policy.param_dtype == (torch.bfloat16 if precision == "bf16-mixed" else None)
    assert policy.reduce_dtype == (torch.float32 if precision == "bf16-mixed" else None)


def test_parameters_on_the_lightning_module_itself_get_a_unit_on_it():
    from lightning_dpar.estimates import ROOT, plan

    class Direct(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def reset_parameters(self) -> None:  # what initialises `scale` when built on the meta device
            nn.init.ones_(self.scale)

        def training_step(self, batch, batch_idx):
            return (self.body(batch) * self.scale).sum()

    with torch.device("meta"):
        module = Direct()
    report = plan(lightning_dpar.FullyShardStrategy(), module, world_size=2)
    assert report.modules[ROOT] == ["FSDP unit (its own parameters; step methods gather them)"]
    assert report.modules["body"] == ["FSDP unit"]
