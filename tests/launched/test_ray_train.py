"""The strategies under Ray Train (`lightning_dpar.ray`, `docs/ray.md`): Ray's Lightning recipe with the one change,
parity with one process on 2 and 4 Ray workers, the sharded checkpoint Ray keeps and resuming from it inside Ray,
under torchrun and in one process (`consolidate`), and a worker killed for real (workers in
`tests/workers/ray_train.py`). The device/rank check every launcher gets is tested in process in
`tests/unit/launch/test_devices.py`, `prepare_trainer`'s refusals in `tests/unit/test_ray.py`.

One local Ray cluster serves the module; each Ray run trains several strategies on one worker group (starting
workers and importing Lightning dominate the cost). Without `ray` installed the Ray tests skip.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_workers, subprocess_env
from tests.launched.test_parity import ATOL
from tests.support.models import RegressionData, global_batches, reference_train
from tests.workers.checkpoint_common import inputs_env
from tests.workers.common import BATCH
from tests.workers.ray_train import REPORT_EVERY

STEPS = 4
KILL_STEPS, KILL_AT = 6, 5  # rank 1 is killed at the start of step 5; step 4's checkpoint is the latest reported
WORLD2 = ["dpar_replicate", "dpar_fsdp", "dpar_hsdp", "dpar_2d"]
WORLD4 = ["dpar_fsdp", "dpar_hsdp", "dpar_2d", "dpar_3d"]


# ---------------------------------------------------------------------- Ray runs
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # The workers inherit this environment (through the raylet Ray starts here): the repository on the path, one
    # thread per process, and the tests' warning policy.
    saved = dict(os.environ)
    os.environ.update(subprocess_env())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    os.environ.clear()
    os.environ.update(saved)
    yield ray
    ray.shutdown()


def _fit(job, workers: int, config: dict, storage: Path, name: str, max_failures: int = 0, use_gpu: bool = False):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        job,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(
            storage_path=str(storage), name=name, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def world2(ray_cluster, tmp_path_factory):
    from tests.workers.ray_train import strategies_job

    out = tmp_path_factory.mktemp("ray2")
    config = {"out": str(out), "strategies": WORLD2, "steps": STEPS, "recipe_errors": True}
    return out, _fit(strategies_job, 2, config, out / "storage", "world2")


@pytest.fixture(scope="module")
def world4(ray_cluster, tmp_path_factory):
    from tests.workers.ray_train import strategies_job

    out = tmp_path_factory.mktemp("ray4")
    config = {"out": str(out), "strategies": WORLD4, "steps": STEPS}
    return out, _fit(strategies_job, 4, config, out / "storage", "world4")


def _reference(dp: int, steps: int) -> dict[str, torch.Tensor]:
    return reference_train("sgd", global_batches(RegressionData(), dp, BATCH, steps))


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((torch.as_tensor(got[k]) - want[k]).abs().max().item() for k in want)


@pytest.mark.slow
def test_rays_recipe_refuses_or_breaks_without_the_change(world2):
    """What Ray's recipe gives without `lightning_dpar.ray.prepare_trainer`: Ray's refuses the strategy, and none at
    all now fails on every worker, before any collective, saying what to change (it was an `IndexError`)."""
    errors = json.loads((world2[0] / "recipe_errors.json").read_text())
    assert (
        "should be one of ['RayDDPStrategy', 'RayFSDPStrategy', 'RayDeepSpeedStrategy']"
        in errors["ray_prepare_trainer"]
    )
    assert errors["no_prepare_trainer"].startswith("ValueError: RayLightningEnvironment runs 2 rank(s)")
    assert "lightning_dpar.ray.prepare_trainer(trainer)" in errors["no_prepare_trainer"]
    assert errors["rays_callback"].startswith("TypeError: Ray's `RayTrainReportCallback` has each worker save")


@pytest.mark.slow
@pytest.mark.parametrize("workers, strategy", [(2, s) for s in WORLD2] + [(4, s) for s in WORLD4])
def test_parity_on_ray_workers(world2, world4, workers, strategy):
    out, _ = world2 if workers == 2 else world4
    saved = torch.load(out / f"{strategy}.pt")
    assert saved["backend"] == "gloo"
    assert _max_diff(saved["params"], _reference(saved["dp"], STEPS)) < ATOL


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_ray_keeps_the_sharded_checkpoint_each_worker_wrote(world2):
    """Every report is a checkpoint Ray keeps: the sharded directory itself (no copy), one shard file per worker."""
    out, result = world2
    kept = sorted(Path(c.path).name for c, _ in result.best_checkpoints)
    steps = range(REPORT_EVERY, STEPS + 1, REPORT_EVERY)
    assert kept == sorted(f"{s}-epoch=0-step={n}" for s in WORLD2 for n in steps)
    last = Path(result.checkpoint.path)
    assert last == out / "storage" / "world2" / f"{WORLD2[-1]}-epoch=0-step={STEPS}"
    assert sorted(p.name for p in last.iterdir() if p.name.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (last / "meta.pt").is_file() and (last / ".metadata").is_file()
    print(f"Ray keeps {_dir_bytes(last)} bytes for {last.name}")


@pytest.fixture(scope="module")
def resumed_outside(world2, tmp_path_factory):
    """torchrun, same layout (`dpar_fsdp` on 2 ranks), resuming from the step-2 checkpoint Ray kept."""
    out, _ = world2
    kept = out / "storage" / "world2" / f"dpar_fsdp-epoch=0-step={REPORT_EVERY}"
    return run_workers(
        2, "ray_resume", tmp_path_factory.mktemp("ray_resume"), extra_env=inputs_env(ray_fsdp_step2=kept)
    )


@pytest.mark.slow
def test_resume_from_rays_checkpoint_under_torchrun(resumed_outside):
    seen = resumed_outside["ray_resume_outside"]
    assert seen["first"] == {"global_step": REPORT_EVERY, "batch_idx": REPORT_EVERY}  # the exact next batch
    assert _max_diff(seen["params"], _reference(2, STEPS)) < ATOL


@pytest.mark.slow
def test_ray_keeps_what_torchrun_saves(world2, resumed_outside):
    """Ray's step-4 checkpoint of `dpar_fsdp` is the sharded checkpoint torchrun saves at step 4: the same files,
    shards of the same sizes; only `meta.pt` (Lightning's pickled loop and callback state) may differ."""
    out, _ = world2
    kept = out / "storage" / "world2" / f"dpar_fsdp-epoch=0-step={STEPS}"
    saved = Path(resumed_outside["ray_resume_outside"]["saved"])
    assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in saved.iterdir())
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        assert (kept / shard).stat().st_size == (saved / shard).stat().st_size
    print(f"Ray keeps {_dir_bytes(kept)} bytes; torchrun's sharded checkpoint has {_dir_bytes(saved)} bytes")


@pytest.mark.slow
def test_consolidate_rays_checkpoint_in_one_process(world2, tmp_path):
    from lightning_dpar.checkpoint.consolidate import main

    out, _ = world2
    kept = out / "storage" / "world2" / f"dpar_fsdp-epoch=0-step={REPORT_EVERY}"
    assert main([str(kept), str(tmp_path / "one.ckpt")]) == 0
    checkpoint = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert checkpoint["global_step"] == REPORT_EVERY
    assert _max_diff(checkpoint["state_dict"], _reference(2, REPORT_EVERY)) < ATOL


def _kill_when_asked(out: Path, experiment: Path, stop: threading.Event) -> None:
    """Kill rank 1 (SIGKILL) once it waits at the kill point and Ray has registered step 4's checkpoint."""
    snapshot = experiment / "checkpoint_manager_snapshot.json"
    while not stop.wait(0.1):
        pid = out / "pid"
        if pid.exists() and snapshot.exists() and f"step={KILL_AT - 1}" in snapshot.read_text():
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(int(pid.read_text()), signal.SIGKILL)
            return


@pytest.fixture(scope="module")
def killed(ray_cluster, tmp_path_factory):
    from tests.workers.ray_train import kill_job

    out = tmp_path_factory.mktemp("ray_kill")
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_asked, args=(out, out / "storage" / "kill", stop), daemon=True)
    killer.start()
    try:
        config = {"out": str(out), "steps": KILL_STEPS, "kill_at": KILL_AT - 1}
        result = _fit(kill_job, 2, config, out / "storage", "kill", max_failures=1)
    finally:
        stop.set()
    return out, result


@pytest.mark.slow
def test_a_killed_worker_resumes_at_the_next_batch(killed):
    out, result = killed
    assert (out / "killed_at").exists(), "the worker was never killed"
    first, second = (json.loads((out / f"attempt-{i}.json").read_text()) for i in range(2))
    assert first == {**first, "resumed_from": None, "global_step": 0, "batch_idx": 0}
    assert second["resumed_from"].endswith(f"epoch=0-step={KILL_AT - 1}")
    assert (second["global_step"], second["batch_idx"]) == (KILL_AT - 1, KILL_AT - 1)
    assert _max_diff(torch.load(out / "kill.pt")["params"], _reference(2, KILL_STEPS)) < ATOL
    assert Path(result.checkpoint.path).name == f"epoch=0-step={KILL_STEPS}"
    killed_at = float((out / "killed_at").read_text())
    print(
        f"kill to the first step after the restart: {second['first_step_end'] - killed_at:.1f} s, of which"
        f" {second['function_start'] - killed_at:.1f} s until the new workers ran the training function"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parity_on_gpu_ray_workers(ray_cluster, tmp_path):
    """One Ray worker per GPU, NCCL: parity with one process (fp32: torch leaves TF32 matmuls off by default)."""
    from tests.workers.ray_train import strategies_job

    workers = torch.cuda.device_count()
    names = ["dpar_replicate", "dpar_fsdp"] + (["dpar_hsdp", "dpar_2d"] if workers >= 2 else [])
    config = {"out": str(tmp_path), "strategies": names, "steps": STEPS, "accelerator": "gpu"}
    _fit(strategies_job, workers, config, tmp_path / "storage", "gpu", use_gpu=True)
    for name in names:
        saved = torch.load(tmp_path / f"{name}.pt")
        assert saved["backend"] == "nccl"
        assert _max_diff(saved["params"], _reference(saved["dp"], STEPS)) < ATOL, name
