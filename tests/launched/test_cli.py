"""The command line through real training runs on launched ranks (workers in `tests/workers/cli.py`): every example
config trains and shards as configured, the main job trains, validates and resumes. The parsing tests, which run in
this process, are in `tests/unit/test_cli.py`."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest

from lightning_dpar.cli import cli_main
from tests.conftest import run_script, run_workers
from tests.unit.test_cli import CONFIGS, EXPECTED_CONFIGS

pytestmark = pytest.mark.usefixtures("no_pytest_argv")


# ---------------------------------------------------------------- real training runs


@pytest.fixture(scope="module")
def configs_run(tmp_path_factory):
    """A launch of its own: the compiled config (`2d_compile`) fails in inductor (`device_mesh._get_submesh is not an
    OpOverload`, torch 2.13) in a process that trained several tensor-parallel layouts before it, as the shared
    launch's other groups do (`torch.compiler.reset()` does not clear it); alone, or after any one of them, it
    compiles and trains."""
    return run_workers(4, "example_configs", tmp_path_factory.mktemp("example_configs"))


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
    from lightning_dpar.estimates import plan
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
