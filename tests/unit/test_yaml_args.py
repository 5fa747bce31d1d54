"""Every strategy argument can be written in a LightningCLI YAML: strings, numbers, lists, dicts and `class_path`
objects parse to the typed values the strategy uses (one process; no process group is needed to build a Trainer)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_dpar
from lightning_dpar.plan import NamedStyle

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


def build_strategy(tmp_path, strategy_config) -> lightning_dpar.DparStrategy:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 1, "strategy": strategy_config}}))
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)
    return cli.trainer.strategy


def test_2d_every_argument_from_yaml(tmp_path):
    strategy = build_strategy(
        tmp_path,
        {
            "class_path": "lightning_dpar.FSDPTensorParallelStrategy",
            "init_args": {
                "tensor_parallel_size": 1,
                "data_parallel_size": "auto",
                "tp_plan": {
                    "layers.*.fc1": "colwise",
                    "layers.*.fc2": {
                        "class_path": "torch.distributed.tensor.parallel.RowwiseParallel",
                        "init_args": {"use_local_output": False},
                    },
                },
                "shard_modules": ["Block", "layers.*"],
                "activation_checkpointing": ["Block"],
                "reshard_after_forward": 2,
                "replicate_size": 1,
                "cpu_offload": True,
                "timeout": "0:10:00",
                "start_method": "fork",
            },
        },
    )
    assert isinstance(strategy, lightning_dpar.FSDPTensorParallelStrategy)
    colwise = strategy._tp_plan["layers.*.fc1"]  # a named style, built per module when the plan is resolved
    assert isinstance(colwise, NamedStyle) and isinstance(colwise.build(nn.Linear(2, 2)), ColwiseParallel)
    rowwise = strategy._tp_plan["layers.*.fc2"]
    assert isinstance(rowwise, RowwiseParallel) and rowwise.use_local_output is False
    assert strategy._shard_modules == ["Block", "layers.*"]
    assert strategy._activation_checkpointing == ["Block"]
    assert strategy._reshard_after_forward == 2
    assert strategy._cpu_offload is True
    assert strategy._timeout == timedelta(minutes=10)
    assert strategy._start_method == "fork"


def test_fsdp_arguments_from_yaml(tmp_path):
    strategy = build_strategy(
        tmp_path,
        {
            "class_path": "lightning_dpar.FullyShardStrategy",
            "init_args": {"replicate_size": "auto", "reshard_after_forward": False, "activation_checkpointing": True},
        },
    )
    assert isinstance(strategy, lightning_dpar.FullyShardStrategy)
    assert strategy._replicate_size == "auto"
    assert strategy._reshard_after_forward is False
    assert strategy._activation_checkpointing is True


@pytest.mark.parametrize("strategy_class", ["FullyShardStrategy", "FSDPTensorParallelStrategy", "ReplicateStrategy"])
def test_selective_activation_checkpointing_from_yaml(tmp_path, strategy_class):
    """`activation_checkpointing: selective` parses as the setting, not as a list of one-letter selectors."""
    strategy = build_strategy(
        tmp_path,
        {"class_path": f"lightning_dpar.{strategy_class}", "init_args": {"activation_checkpointing": "selective"}},
    )
    assert strategy._activation_checkpointing == "selective"
    assert strategy.plan_options.activation_checkpointing == "selective"


@pytest.mark.parametrize("strategy_class", ["FullyShardStrategy", "FSDPTensorParallelStrategy", "ReplicateStrategy"])
def test_loss_parallel_from_yaml(tmp_path, strategy_class):
    """`loss_parallel: true` reaches the plan options of every strategy that takes `tensor_parallel_size`."""
    init_args = {"tensor_parallel_size": 1, "loss_parallel": True}
    strategy = build_strategy(tmp_path, {"class_path": f"lightning_dpar.{strategy_class}", "init_args": init_args})
    assert strategy.plan_options.loss_parallel is True


def test_loss_parallel_must_be_a_bool():
    with pytest.raises(TypeError, match="`loss_parallel='yes'` must be True or False"):
        lightning_dpar.FSDPTensorParallelStrategy(loss_parallel="yes")


@pytest.mark.parametrize("strategy_class", ["FullyShardStrategy", "FSDPTensorParallelStrategy"])
def test_float8_from_yaml(tmp_path, strategy_class):
    """`float8: rowwise` and `float8_skip` reach the plan options as torchao's config for the recipe."""
    ao = pytest.importorskip("torchao.float8")
    init_args = {"float8": "rowwise", "float8_skip": ["model.head", "*.router"]}
    strategy = build_strategy(tmp_path, {"class_path": f"lightning_dpar.{strategy_class}", "init_args": init_args})
    options = strategy.plan_options.float8
    assert options.config == ao.Float8LinearConfig.from_recipe_name("rowwise")
    assert options.recipe == "rowwise" and options.skip == ("model.head", "*.router")


def test_float8_refuses_an_unknown_recipe_at_construction():
    with pytest.raises(ValueError, match="'fp8' is not a float8 recipe"):
        lightning_dpar.FullyShardStrategy(float8="fp8")


@pytest.mark.parametrize("hook", ["bf16_compress", "fp16_compress"])
def test_replicate_ddp_knobs_from_yaml(tmp_path, hook):
    strategy = build_strategy(
        tmp_path,
        {
            "class_path": "lightning_dpar.ReplicateStrategy",
            "init_args": {
                "bucket_cap_mb": 25,
                "gradient_as_bucket_view": True,
                "static_graph": True,
                "find_unused_parameters": False,
                "ignored_modules": ["layer", "head.*"],
                "comm_hook": hook,
            },
        },
    )
    assert isinstance(strategy, lightning_dpar.ReplicateStrategy)
    assert strategy._ddp_kwargs["bucket_cap_mb"] == 25
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True
    assert strategy._ddp_kwargs["static_graph"] is True
    assert list(strategy._ignored_modules) == ["layer", "head.*"]
    assert strategy._comm_hook_spec == hook


def test_comm_hook_callable_by_import_path(tmp_path):
    strategy = build_strategy(
        tmp_path,
        {
            "class_path": "lightning_dpar.ReplicateStrategy",
            "init_args": {"comm_hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook"},
        },
    )
    assert strategy._comm_hook is default_hooks.allreduce_hook


@pytest.mark.parametrize(
    "hook", ["torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook", default_hooks.allreduce_hook]
)
def test_ddp_comm_hook_with_tensor_parallel_is_refused_by_name(hook):
    strategy = lightning_dpar.ReplicateStrategy(tensor_parallel_size=2, comm_hook=hook)
    with pytest.raises(ValueError, match=r"\['comm_hook'\] configure DDP's bucketed reducer"):
        strategy._check_tp_compatible_options()


@pytest.mark.parametrize(
    ("name", "strategy_type"),
    [
        ("dpar_replicate", lightning_dpar.ReplicateStrategy),
        ("dpar_fsdp", lightning_dpar.FullyShardStrategy),
        ("dpar_fsdp_offload", lightning_dpar.FullyShardStrategy),
        ("dpar_hsdp", lightning_dpar.FullyShardStrategy),
        ("dpar_2d", lightning_dpar.FSDPTensorParallelStrategy),
    ],
)
def test_registered_names_from_yaml(tmp_path, name, strategy_type):
    strategy = build_strategy(tmp_path, name)
    assert type(strategy) is strategy_type
    if name == "dpar_fsdp_offload":
        assert strategy._cpu_offload is True


@pytest.mark.parametrize("hook", ["bf17_compress", "torch.no_such_module.hook", "torch.nn.no_such_hook"])
def test_unknown_comm_hook_names_the_value_and_the_choices(hook):
    with pytest.raises(ValueError, match=rf"comm_hook='{hook}'.*bf16_compress.*import path"):
        lightning_dpar.ReplicateStrategy(comm_hook=hook)
