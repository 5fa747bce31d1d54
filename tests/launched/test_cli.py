"""The command line: `python -m lightning_dpar fit` on the bundled example, every example config, and the
LightningCLI parsing rules (parsing tests run in this process; only real training runs launch ranks)."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_dpar
from lightning_dpar.__main__ import main
from lightning_dpar.cli import cli_main, strategy_class_path
from lightning_dpar.examples import GPT, StdlibBytes
from tests.conftest import ROOT, run_script, run_workers

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


# ---------------------------------------------------------------- real training runs


@pytest.fixture(scope="module")
def configs_run(tmp_path_factory):
    return run_workers(4, "example_configs", tmp_path_factory.mktemp("configs"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_example_config_trains_and_saves_a_sharded_checkpoint(configs_run, name):
    result = configs_run[f"config_{name}"]
    strategy_type, dims = EXPECTED_CONFIGS[name]
    assert result["strategy"] == strategy_type.__name__ and tuple(result["dims"]) == dims
    assert result["global_step"] == 4 and math.isfinite(result["train_loss"])
    assert result["checkpoint_files"] == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"]


@pytest.mark.slow
def test_example_configs_shard_as_configured(configs_run):
    assert configs_run["config_replicate"]["q_placement"] is None  # full parameters on every rank
    assert configs_run["config_fsdp"]["q_placement"] == ["S(0)"]
    assert configs_run["config_hsdp"]["q_placement"] == ["R", "S(0)"]
    # 2D: attention projections sharded over both dims (FSDP on top of TP), LayerNorm over FSDP only.
    q_2d = configs_run["config_2d"]["q_placement"]
    assert len(q_2d) == 2 and q_2d[1] == "S(0)"
    assert configs_run["config_2d"]["ln_placement"] == ["S(0)"]


@pytest.mark.slow
def test_example_configs_agree_where_the_math_is_the_same(configs_run):
    """Same global batches (data-parallel size 4) and fp32: replicate, HSDP and offloaded FSDP train identically;
    the model's own tp_plan and the same plan written in YAML give the same 2D run."""
    losses = [configs_run[f"config_{n}"]["train_loss"] for n in ("replicate", "hsdp", "fsdp_offload")]
    assert max(losses) - min(losses) < 1e-4
    assert abs(configs_run["config_2d"]["train_loss"] - configs_run["config_2d_tp_plan"]["train_loss"]) < 1e-6
    # fsdp.yaml trains in bf16-mixed on the same batches: bf16 compute shows in the loss, within bf16 precision,
    # while the sharded master weights stay fp32.
    fsdp = configs_run["config_fsdp"]
    assert fsdp["precision"] == "bf16-mixed" and fsdp["param_dtypes"] == ["torch.float32"]
    assert 1e-5 < abs(fsdp["train_loss"] - configs_run["config_replicate"]["train_loss"]) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("result", ["config_3d", "strategy_dpar_3d"])
def test_the_example_gpt_trains_with_pipeline_2_x_tensor_parallel_2(configs_run, result):
    """`examples/configs/3d.yaml` (4 microbatches) and `--trainer.strategy=dpar_3d` (the README's command)."""
    run = configs_run[result]
    assert run["pipeline"] == 2 and run["dims"] == [1, 1, 2]
    assert run["global_step"] == 4 and math.isfinite(run["train_loss"]) and math.isfinite(run["val_loss"])
    # Rank 0 holds the first stage: the embeddings and block 0 (TP-sharded), not block 1, the final norm or the head.
    assert {name.split(".")[1] for name in run["local_shapes"]} == {"tok_emb", "pos_emb", "blocks"}
    assert {name.split(".")[2] for name in run["local_shapes"] if ".blocks." in name} == {"0"}
    assert len(run["q_placement"]) == 2 and run["q_placement"][1] == "S(0)"  # FSDP (1 rank) x TP
    assert run["checkpoint_files"] == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["2d", "2d_tp_plan", "hsdp", "fsdp", "replicate", "3d"])
def test_plan_dry_run_predicts_the_real_runs_local_shapes(configs_run, name):
    """`plan` (one process, meta device, fake process group) gives rank 0 the shards the 4-rank run gave it."""
    from lightning_dpar.dry_run import plan
    from tests.workers.cli import TINY

    cli = cli_main(["--config", str(CONFIGS / f"{name}.yaml"), *TINY], run=False, model_on_meta=True)
    report = plan(cli.trainer.strategy, cli.model, world_size=4)
    assert {r.name: list(r.local_shape) for r in report.params} == configs_run[f"config_{name}"]["local_shapes"]


MAIN_JOB_OVERRIDES = [
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--data.max_bytes=100000",
]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """`python -m lightning_dpar fit` (Lightning re-launches `-m lightning_dpar` per rank), `validate` on its
    checkpoint, then a resume. Logs: version_0 fit, version_1 validate, version_2 resumed fit."""
    workdir = tmp_path_factory.mktemp("main_job")
    first = run_script(["-m", "lightning_dpar", "fit", "--trainer.max_steps=6", *MAIN_JOB_OVERRIDES], workdir)
    validated = run_script(["-m", "lightning_dpar", "validate", "--ckpt_path", "last", *MAIN_JOB_OVERRIDES], workdir)
    resumed = run_script(
        ["-m", "lightning_dpar", "fit", "--trainer.max_steps=9", "--ckpt_path", "last", *MAIN_JOB_OVERRIDES], workdir
    )
    return workdir, first, validated, resumed


def _metrics(workdir: Path, version: int) -> list[dict[str, str]]:
    with open(workdir / "lightning_logs" / "gpt" / f"version_{version}" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _logged_steps(workdir: Path, version: int) -> list[int]:
    return sorted({int(row["step"]) for row in _metrics(workdir, version)})


@pytest.mark.slow
def test_main_job_trains_with_a_progress_bar_and_saves_a_sharded_checkpoint(main_job):
    workdir, first, _, _ = main_job
    assert first.returncode == 0, first.stderr[-4000:]
    # Lightning draws tqdm's bar, or rich's when `rich` is installed (the `[hf]` extra brings it, via typer).
    assert re.search(r"Epoch 0(: 100%|\s+\S+ 6/6)", first.stdout) and "`max_steps=6` reached" in first.stderr
    assert "Epoch 0/-2" not in first.stdout and "v_num: 0.000" not in first.stdout  # rich's bar read both
    assert "PerformanceMonitor summary" in first.stdout and "tokens/s (global)" in first.stdout
    last = workdir / "checkpoints" / "gpt" / "last.ckpt"
    assert last.is_symlink() and (last / "meta.pt").is_file()
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert _logged_steps(workdir, 0)[0] == 0


@pytest.mark.slow
def test_validate_on_the_checkpoint_reproduces_the_trained_models_val_loss(main_job):
    workdir, _, validated, _ = main_job
    assert validated.returncode == 0, validated.stderr[-4000:]
    trained = [float(row["val_loss"]) for row in _metrics(workdir, 0) if row["val_loss"]][-1]  # after step 6
    (restored,) = [float(row["val_loss"]) for row in _metrics(workdir, 1) if row["val_loss"]]
    assert restored == pytest.approx(trained, abs=1e-6)


@pytest.mark.slow
def test_main_job_resumes_from_last(main_job):
    workdir, _, _, resumed = main_job
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert _logged_steps(workdir, 2)[0] >= 6  # continues after step 6 instead of starting over at 0
    # 3 more optimizer steps (global step 6 -> 9), and the newest checkpoint replaced the old one (top-1).
    assert sorted(p.name for p in (workdir / "checkpoints" / "gpt").iterdir()) == ["epoch=0-step=9.ckpt", "last.ckpt"]


@pytest.mark.slow
def test_readme_resume_command_continues_exactly(configs_run):
    """`python -m lightning_dpar fit --trainer.max_steps=3`, then the README's `fit --ckpt_path last
    --trainer.max_steps=5`: every rank trains on the uninterrupted run's batches from step 3 on and ends with its
    weights (the checkpoint `fit` writes at its end used to resume in the next epoch, with other batches)."""
    result = configs_run["readme_resume"]
    assert result["resumed"] == result["expected"]
    assert [len(rank) for rank in result["resumed"]] == [2, 2, 2, 2]
    assert result["same_keys"] and result["weights_max_diff"] == 0.0
