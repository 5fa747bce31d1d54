"""`AutoParallelStrategy` chooses in `resolve_dims` (before any process group): the search's best layout, set where
`FSDPTensorParallelStrategy` reads it; and its refusals, each naming the value and what would be valid."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_dpar
from lightning_dpar.examples import GPT
from lightning_dpar.layout_search.probe import search_model
from lightning_dpar.layout_search.profiles import GIB, PRESETS
from lightning_dpar.layout_search.strategy import AutoParallelStrategy


def gpt() -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=4, n_head=4, n_embd=64, block_size=32)


def connected(strategy: AutoParallelStrategy, module: L.LightningModule) -> AutoParallelStrategy:
    strategy.connect(module)
    return strategy


def test_registered_as_dpar_auto():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["dpar_auto"]["strategy"] is lightning_dpar.AutoParallelStrategy


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_chooses_the_searchs_best_layout_and_trains_it_as_the_2d_strategy_would():
    strategy = connected(AutoParallelStrategy(batch_size=8), gpt())
    dims = strategy.resolve_dims(4, 4, 1)
    best = search_model(gpt(), 4, 1, PRESETS["cpu-gloo"], 8).best
    assert best is not None and strategy.chosen == best.layout
    assert dims == best.layout.dims
    assert strategy.plan_options.activation_checkpointing == best.layout.activation_checkpointing
    if dims.pipeline > 1:
        assert strategy.pipeline_config.schedule.name == best.layout.schedule
        assert strategy.pipeline_config.microbatches == best.layout.microbatches
    # Deterministic: another strategy on the same model and world makes the same choice.
    again = connected(AutoParallelStrategy(batch_size=8), gpt())
    assert again.resolve_dims(4, 4, 1) == dims and again.chosen == strategy.chosen


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_fixed_activation_checkpointing_is_kept():
    strategy = connected(AutoParallelStrategy(batch_size=8, activation_checkpointing=True), gpt())
    strategy.resolve_dims(2, 2, 1)
    assert strategy.chosen is not None and strategy.chosen.activation_checkpointing


def test_the_sizes_it_chooses_cannot_be_given():
    with pytest.raises(ValueError, match=r"chooses \['tensor_parallel_size'\] itself"):
        AutoParallelStrategy(tensor_parallel_size=2)


def test_an_unknown_profile_fails_when_built():
    with pytest.raises(ValueError, match=r"`profile='a100'` is not a known hardware profile.*cpu-gloo"):
        AutoParallelStrategy(profile="a100")


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_a_memory_budget_below_the_models_minimum_says_what_would_fit():
    strategy = connected(AutoParallelStrategy(batch_size=8, device_memory=0.001), gpt())
    with pytest.raises(ValueError, match=r"No layout of 2 ranks fits 0.00 GiB per device.*GiB per device it would fit"):
        strategy.resolve_dims(2, 2, 1)


def test_without_a_batch_size_or_training_data_it_asks_for_one():
    strategy = connected(AutoParallelStrategy(), gpt())
    with pytest.raises(
        ValueError, match=r"GPT.train_dataloader\(\) is not defined.*Pass `global_batch_size=`.*`batch_size=`"
    ):
        strategy.resolve_dims(2, 2, 1)


def test_batch_size_and_global_batch_size_together_are_refused_when_built():
    with pytest.raises(ValueError, match=r"`batch_size=4` and `global_batch_size=16` both fix the batch"):
        AutoParallelStrategy(batch_size=4, global_batch_size=16)


@pytest.mark.parametrize("value", [0, -8, 2.5])
def test_a_global_batch_size_that_is_not_a_positive_count_is_refused_when_built(value):
    with pytest.raises(ValueError, match=rf"`global_batch_size={value!r}` is invalid: give a positive number"):
        AutoParallelStrategy(global_batch_size=value)


class OwnLoader(L.LightningModule):
    """The common module: its `train_dataloader()` sizes each rank's share of a global batch of 8 from the sampler."""

    def __init__(self) -> None:
        super().__init__()
        self.replicas_seen: list[int] = []

    def train_dataloader(self):
        replicas = self.trainer.distributed_sampler_kwargs["num_replicas"]
        self.replicas_seen.append(replicas)
        return torch.utils.data.DataLoader(range(64), batch_size=8 // replicas)


def test_a_module_loader_is_read_at_each_data_parallel_size_before_the_mesh_exists():
    strategy = AutoParallelStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    module = OwnLoader()
    module.trainer = trainer
    strategy.connect(module)
    rule = strategy._batch_rule(4)
    assert module.replicas_seen == [1, 2, 4]
    assert rule.global_batch == 8 and [rule.at(d) for d in (1, 2, 4)] == [8, 4, 2]
    # Once read, the sampler kwargs are the mesh's again (none yet: the mesh is built in `setup_environment`).
    with pytest.raises(AssertionError, match="data-parallel mesh"):
        _ = strategy.distributed_sampler_kwargs


def test_a_global_batch_size_the_module_loader_disagrees_with_is_refused_before_the_search():
    strategy = AutoParallelStrategy(global_batch_size=6)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    module = OwnLoader()
    module.trainer = trainer
    strategy.connect(module)
    with pytest.raises(ValueError, match=r"`global_batch_size=6` cannot be trained on 4 ranks.*yields 8 per rank"):
        strategy._batch_rule(4)


@pytest.mark.parametrize(
    ("arg", "setting", "value"),
    [
        ("global_batch_size=16", "global_batch_size", 16),
        ("device_memory=2", "device_memory", 2 * GIB),
        ("loss_parallel=true", "loss_parallel", True),
    ],
)
@pytest.mark.usefixtures("no_pytest_argv")
def test_init_args_through_lightning_cli(arg, setting, value):
    """LightningCLI fills the base classes' size arguments with their defaults, which the strategy once refused as
    sizes it chooses: then no `AutoParallelStrategy` argument could be given through the CLI."""
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        OwnLoader,
        run=False,
        args=["--trainer.strategy=AutoParallelStrategy", f"--trainer.strategy.{arg}"],
        trainer_defaults={"accelerator": "cpu", "devices": 2, "logger": False},
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AutoParallelStrategy) and strategy.search_settings[setting] == value


def test_loss_parallel_is_off_unless_allowed_and_the_chosen_layouts_setting_is_trained():
    """`loss_parallel=True` allows it (the search gives it to the layouts that can run it); the chosen layout's
    setting is what the strategy plans with: on with TP, off without, whatever was allowed."""
    from lightning_dpar.layout_search.candidates import Layout
    from lightning_dpar.parallel_dims import ParallelDims

    assert AutoParallelStrategy().search_settings["loss_parallel"] is False
    strategy = AutoParallelStrategy(loss_parallel=True)
    assert strategy.search_settings["loss_parallel"] is True
    assert strategy.plan_options.loss_parallel is False  # nothing chosen yet
    strategy._apply(Layout(ParallelDims.resolve(2, 2, 2), loss_parallel=True))
    assert strategy.plan_options.loss_parallel is True
    strategy._apply(Layout(ParallelDims.resolve(2, 2, 1)))
    assert strategy.plan_options.loss_parallel is False
    with pytest.raises(TypeError, match=r"`loss_parallel='yes'` must be True or False"):
        AutoParallelStrategy(loss_parallel="yes")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"float8": "tensorwise"}, r"`float8='tensorwise'` on profile 'cpu-gloo', whose device has no float8 matmuls"),
        ({"float8": "rowwise", "profile": "a100-node"}, r"profile 'a100-node'.*'h100-node'.*float8_matmul_flops"),
        ({"float8": "fp8", "profile": "h100-node"}, r"`float8='fp8'` is not a float8 recipe.*'tensorwise'"),
    ],
)
def test_float8_on_a_profile_without_float8_matmuls_is_refused_when_built(kwargs, match):
    """Refused in `__init__`, on every rank alike, before any collective, naming the fix."""
    with pytest.raises(ValueError, match=match):
        AutoParallelStrategy(**kwargs)


@pytest.mark.slow  # several seconds (a search in a child process, or a large model traced): full suite only
def test_loss_parallel_lets_tensor_parallelism_fit_a_large_vocabulary():
    """The big-vocabulary GPT of `test_loss_parallel_layouts` at 80 MiB per rank on 2 ranks: allowed, the strategy
    chooses TP 2 with loss parallel and plans with it; not allowed, a pipeline."""
    from tests.unit.layout_search.test_loss_parallel_layouts import BATCH, SEQ, big_vocab_gpt

    budget = 80 / 1024  # GiB
    allowed = connected(
        AutoParallelStrategy(batch_size=BATCH, seq_len=SEQ, device_memory=budget, loss_parallel=True), big_vocab_gpt()
    )
    dims = allowed.resolve_dims(2, 2, 1)
    assert dims.tensor_parallel == 2 and allowed.chosen is not None and allowed.chosen.loss_parallel
    assert allowed.plan_options.loss_parallel is True
    plain = connected(AutoParallelStrategy(batch_size=BATCH, seq_len=SEQ, device_memory=budget), big_vocab_gpt())
    assert plain.resolve_dims(2, 2, 1).pipeline == 2 and plain.plan_options.loss_parallel is False
