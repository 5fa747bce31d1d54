"""The command line's parsing, in this process (`lightning_dpar.cli`): `python -m lightning_dpar fit` on the bundled
example, every example config, the LightningCLI parsing rules and the `python -m lightning_dpar` dispatch. The real
training runs, which launch ranks, are in `tests/launched/test_cli.py` (workers in `tests/workers/cli.py`)."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_dpar
from lightning_dpar.__main__ import main
from lightning_dpar.cli import cli_main, strategy_class_path
from lightning_dpar.examples import GPT, StdlibBytes
from tests.conftest import ROOT

CONFIGS = ROOT / "examples" / "configs"


def parse(*args: str):
    """Build (not run) the CLI's Trainer, model and datamodule, as `python -m lightning_dpar fit ARGS` would."""
    return cli_main(list(args), run=False)


pytestmark = pytest.mark.usefixtures("no_pytest_argv")


def test_defaults_are_the_example_on_4_cpu_ranks_with_tp2_fsdp2():
    cli = parse()
    strategy = cli.trainer.strategy
    assert type(strategy) is lightning_dpar.FSDPTensorParallelStrategy
    assert strategy.resolve_dims(4, 4, 1).describe() == "world=4 = replicate 1 x shard 2 x tensor_parallel 2"
    # The default strategy also fits other device counts: FSDP takes the ranks TP leaves.
    assert strategy.resolve_dims(32, 8, 4).describe() == "world=32 = replicate 1 x shard 16 x tensor_parallel 2"
    assert cli.trainer.num_devices == 4 and cli.trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    assert isinstance(cli.model, GPT) and isinstance(cli.datamodule, StdlibBytes)
    assert cli.model.tp_plan["model.blocks.*.attn.proj"] == "rowwise"
    checkpoint = next(c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint))
    assert checkpoint.dirpath.endswith("checkpoints/gpt") and checkpoint.save_last == "link"


@pytest.mark.parametrize(
    ("args", "tensor_parallel"),
    [
        (["--trainer.devices=1"], 1),  # issue 31: a one-GPU user's first command failed in setup
        (["--trainer.devices=3"], 1),
        (["--trainer.devices=2"], 2),
        (["--trainer.devices=3", "--trainer.num_nodes=2"], 2),
        (["--trainer.devices=auto"], 1),  # one CPU device
    ],
)
def test_the_default_strategy_fits_the_device_count(args, tensor_parallel, caplog):
    with caplog.at_level("INFO"):
        strategy = parse(*args).trainer.strategy
    assert type(strategy) is lightning_dpar.FSDPTensorParallelStrategy
    assert strategy.resolve_dims(2, 2, 1).tensor_parallel == tensor_parallel
    assert ("FSDP alone" in caplog.text) is (tensor_parallel == 1)


def test_the_world_size_is_counted_as_lightning_counts_devices(monkeypatch):
    from jsonargparse import Namespace

    from lightning_dpar.cli import configured_world_size

    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)

    def world(**trainer):
        return configured_world_size(Namespace(trainer=Namespace(**trainer)))

    assert world(accelerator="gpu", devices=[0, 1, 2]) == 3
    assert world(accelerator="gpu", devices="0,1,") == 2
    assert world(accelerator="cuda", devices=-1, num_nodes=2) == 16
    assert world(accelerator="auto", devices="auto") == 8
    assert world(accelerator="cpu", devices="auto") == 1
    assert world(accelerator="gpu", devices="4", num_nodes=3) == 12
    assert world(accelerator="tpu", devices="auto") is None  # left to Lightning


def test_the_main_job_trains_on_one_device(tmp_path, monkeypatch, gloo_world):
    """`python -m lightning_dpar fit --trainer.devices=1`, in this process (on `gloo_world`'s group, which the
    strategy adopts and the fixture tears down): two steps of the example."""
    monkeypatch.chdir(tmp_path)
    cli = cli_main(
        ["fit", "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
         "--trainer.callbacks=[]", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
         "--trainer.enable_progress_bar=false"]
    )  # fmt: skip
    assert cli.trainer.global_step == 2 and cli.trainer.strategy.dims.tensor_parallel == 1


def test_main_job_progress_bar_reads_epoch_0_and_the_integer_version(tmp_path):
    """With `rich`, Lightning's bar read `Epoch 0/-2` (`max_epochs - 1` of a `max_steps` run) and `v_num: 0.000`.
    The CLI's bar (checked through a real single-process fit, as the main job draws it) reads `Epoch 0`, `v_num: 0`."""
    pytest.importorskip("rich")
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dpar.progress import DparRichProgressBar
    from tests.support.models import ParityModule, RegressionData, loader

    assert type(parse().trainer.progress_bar_callback) is DparRichProgressBar
    assert (
        type(parse("--trainer.callbacks=TQDMProgressBar").trainer.progress_bar_callback).__name__ == "TQDMProgressBar"
    )

    class Shown(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            bar = trainer.progress_bar_callback
            self.title = bar.progress.tasks[bar.train_progress_bar_id].description.strip()
            self.metrics = bar.get_metrics(trainer, pl_module)

    shown = Shown()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=CSVLogger(tmp_path),
        callbacks=[DparRichProgressBar(), shown],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(ParityModule(), loader(RegressionData(), 4))
    assert shown.title == "Epoch 0" and shown.metrics["v_num"] == "0"


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("dpar_2d", lightning_dpar.FSDPTensorParallelStrategy),
        ("dpar_fsdp_offload", lightning_dpar.FullyShardStrategy),
        ("dpar_replicate", lightning_dpar.ReplicateStrategy),
        # The LightningCLI trap: a class name without init args is parsed as a string.
        ("FSDPTensorParallelStrategy", lightning_dpar.FSDPTensorParallelStrategy),
        ("lightning_dpar.ReplicateStrategy", lightning_dpar.ReplicateStrategy),
        ("FullyShardStrategy", lightning_dpar.FullyShardStrategy),
    ],
)
def test_strategy_by_registered_name_or_class_name(arg, expected):
    assert type(parse(f"--trainer.strategy={arg}").trainer.strategy) is expected


def test_registered_names_keep_their_registered_arguments():
    strategy = parse("--trainer.strategy=dpar_fsdp_offload").trainer.strategy
    assert strategy._cpu_offload is True


def test_class_name_then_init_args_on_the_command_line():
    strategy = parse(
        "--trainer.strategy=FSDPTensorParallelStrategy", "--trainer.strategy.tensor_parallel_size=4"
    ).trainer.strategy
    assert strategy.resolve_dims(4, 4, 1).tensor_parallel == 4


def test_class_name_resolution_leaves_registered_and_unknown_names_alone():
    assert strategy_class_path("dpar_2d") is None
    assert strategy_class_path("ddp") is None
    assert strategy_class_path("NoSuchStrategy") is None
    assert strategy_class_path("DDPStrategy") == "lightning.pytorch.strategies.ddp.DDPStrategy"


EXPECTED_CONFIGS = {
    "replicate": (lightning_dpar.ReplicateStrategy, (4, 1, 1)),
    "fsdp": (lightning_dpar.FullyShardStrategy, (1, 4, 1)),
    "fsdp_offload": (lightning_dpar.FullyShardStrategy, (1, 4, 1)),
    "hsdp": (lightning_dpar.FullyShardStrategy, (2, 2, 1)),
    "2d": (lightning_dpar.FSDPTensorParallelStrategy, (1, 2, 2)),
    "2d_tp_plan": (lightning_dpar.FSDPTensorParallelStrategy, (1, 2, 2)),
    "2d_compile": (lightning_dpar.FSDPTensorParallelStrategy, (1, 2, 2)),
    "3d": (lightning_dpar.FSDPTensorParallelStrategy, (1, 1, 2)),  # and pipeline 2
    "moe": (lightning_dpar.FullyShardStrategy, (1, 4, 1)),  # shard 4 = expert_shard 2 x expert 2
}


def test_every_config_file_is_covered():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED_CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_config_parses_to_its_strategy_without_inheriting_the_default_arguments(name):
    strategy_type, dims = EXPECTED_CONFIGS[name]
    strategy = parse("--config", str(CONFIGS / f"{name}.yaml")).trainer.strategy
    assert type(strategy) is strategy_type
    resolved = strategy.resolve_dims(4, 4, 1)
    assert (resolved.replicate, resolved.shard, resolved.tensor_parallel) == dims


def test_tp_plan_written_in_yaml_gives_style_objects():
    cli = parse("--config", str(CONFIGS / "2d_tp_plan.yaml"))
    strategy = cli.trainer.strategy
    dims = strategy.resolve_dims(world_size=4, devices_per_node=4, num_nodes=1)
    styles = {fqn: type(style) for fqn, style in strategy.module_plan(cli.model, dims).tensor_parallel.items()}
    assert {fqn: style for fqn, style in styles.items() if fqn.startswith("model.blocks.0.")} == {
        "model.blocks.0.attn.q": ColwiseParallel,
        "model.blocks.0.attn.k": ColwiseParallel,
        "model.blocks.0.attn.v": ColwiseParallel,
        "model.blocks.0.attn.proj": RowwiseParallel,
        "model.blocks.0.mlp.fc": ColwiseParallel,
        "model.blocks.0.mlp.proj": RowwiseParallel,
    }


def test_bad_style_in_config_fails_at_parse_time_with_the_strategy_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_dpar.FSDPTensorParallelStrategy\n"
        "    init_args:\n      tp_plan:\n        model.blocks.*.mlp.fc: columnwise\n"
    )
    with pytest.raises(ValueError, match=r"'columnwise' is not a tensor-parallel style"):
        parse("--config", str(bad))


def test_stdlib_data_is_deterministic_and_split(tmp_path):
    (tmp_path / "b.py").write_bytes(b"b" * 300)
    (tmp_path / "a.py").write_bytes(b"a" * 300)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_bytes(b"c" * 300)
    data = StdlibBytes(block_size=9, batch_size=2, max_bytes=500, val_fraction=0.2, root=str(tmp_path))
    data.setup("fit")
    train = bytes(data.train_set.windows.flatten().tolist())
    val = bytes(data.val_set.windows.flatten().tolist())
    # Sorted file order (a before b), third-party dirs skipped, first 400 bytes train, last 100 validation.
    assert train == b"a" * 300 + b"b" * 100 and val == b"b" * 100
    assert data.train_set[0].shape == (10,) and data.train_set[0].dtype.is_floating_point is False


def test_stdlib_data_reads_the_real_standard_library():
    data = StdlibBytes(max_bytes=50_000)
    data.setup("fit")
    assert len(data.train_set) == int(50_000 * 0.95) // 129
    assert b"import" in bytes(data.train_set.windows.flatten().tolist())


def test_main_dispatch_usage_and_unknown_command(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "fit|validate|test|predict" in capsys.readouterr().out
    assert main(["train"]) == 2
    assert "Unknown command 'train'" in capsys.readouterr().err


def test_consolidate_command_is_dispatched_and_names_a_missing_path(capsys):
    assert main(["consolidate", "/nonexistent/ckpt", "out.ckpt"]) == 1
    assert "Checkpoint path '/nonexistent/ckpt' does not exist" in capsys.readouterr().err
