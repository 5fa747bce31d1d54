"""Fault tolerance across torchft replica groups (workers: `tests/workers/fault_tolerance.py`), on 4 gloo processes:
two replica groups of two ranks (FSDP inside each group), one `torchrun` per group, a torchft lighthouse in this
process.

- Without failures the parameters equal plain HSDP 2 x 2 and one process on the same global batches.
- With one group SIGKILLed mid-training (the group that writes checkpoints): the other keeps stepping alone, writes
  the checkpoints, the killed group is relaunched, heals from the live one and rejoins; afterwards both groups hold
  bitwise identical weights, equal to the documented reference: one process training, at each committed batch, the
  shards of the groups in that step's quorum (read from the per-step logs every group's rank 0 appends as it goes).
- A full-job restart from a checkpoint the survivor wrote while the other group was down resumes exactly.

The measurements (steps the survivor took alone, time from kill to rejoin, bytes copied while healing, steps lost
against a restart from the last checkpoint) are printed and written to the test's `measurements.json`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from tests.conftest import ROOT, subprocess_env
from tests.support.models import Net, RegressionData, global_batches, make_optimizer, reference_train
from tests.workers.fault_tolerance import SCHEDULE

coordination = pytest.importorskip("torchft.coordination")

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "workers" / "fault_tolerance.py"
GROUPS, GROUP_SIZE, BATCH = 2, 2, 4
TIMEOUT = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Job:
    """Torchrun launches (each in a session of its own) and the lighthouse; everything is killed on `close`."""

    def __init__(self, out: Path, min_replicas: int) -> None:
        self.out = out
        self.lighthouse = coordination.LighthouseServer(
            bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=2000
        )
        self.procs: list[subprocess.Popen] = []

    def launch(self, mode: str, nproc: int, name: str, **env: str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(_free_port()), str(WORKER), mode, str(self.out),
        ]  # fmt: skip
        full_env = {**subprocess_env(), "TORCHFT_LIGHTHOUSE": self.lighthouse.address(), **env}
        full_env["NUM_REPLICA_GROUPS"] = str(GROUPS)
        log = open(self.out / f"log_{name}", "w")
        proc = subprocess.Popen(
            cmd, env=full_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, name: str, deadline: float) -> None:
        try:
            proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch {name} did not finish in time:\n{self.tail(name)}")
        assert proc.returncode == 0, f"launch {name} failed ({proc.returncode}):\n{self.tail(name)}"

    def tail(self, name: str) -> str:
        lines = (self.out / f"log_{name}").read_text().splitlines()
        return "\n".join(line for line in lines if "[INFO]" not in line)[-6000:]

    def kill_group(self, group: int, proc: subprocess.Popen) -> float:
        """SIGKILL every worker of `group` (torchrun starts them in sessions of their own) and its torchrun."""
        pids = [int(f.name.split("_")[2]) for f in self.out.glob(f"pid_{group}_*")]
        assert len(pids) == GROUP_SIZE, pids
        killed_at = time.time()
        for pid in pids:
            _kill(pid, os.kill)
        _kill(proc.pid, os.killpg)
        proc.wait(timeout=30)
        for f in self.out.glob(f"pid_{group}_*"):
            f.unlink()
        return killed_at

    def close(self) -> None:
        for f in self.out.glob("pid_*"):
            _kill(int(f.name.split("_")[2]), os.kill)
        for proc in self.procs:
            _kill(proc.pid, os.killpg)
        self.lighthouse.shutdown()


def _kill(pid: int, kill) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _records(out: Path, prefix: str) -> dict[str, dict]:
    return {f.name: torch.load(f, weights_only=False) for f in sorted(out.glob(f"{prefix}_r*_*.pt"))}


def _rank0(out: Path, prefix: str) -> dict:
    (record,) = [r for name, r in _records(out, prefix).items() if name.startswith(f"{prefix}_r0_")]
    return record


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


# ---------------------------------------------------------------------- parity without failures
@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ft_parity")
    job = _Job(out, min_replicas=GROUPS)  # the first quorum waits for both groups
    try:
        deadline = time.time() + TIMEOUT
        env = {"DPAR_FT_STEPS": "6", "DPAR_FT_OPTIMIZER": "adam"}
        groups = [job.launch("ft", GROUP_SIZE, f"g{g}", REPLICA_GROUP_ID=str(g), **env) for g in range(GROUPS)]
        for g, proc in enumerate(groups):
            job.wait(proc, f"g{g}", deadline)
        job.wait(job.launch("hsdp", GROUPS * GROUP_SIZE, "hsdp", **env), "hsdp", deadline)
    finally:
        job.close()
    return out


def test_parity_with_hsdp_and_one_process(parity_runs):
    want = reference_train("adam", global_batches(RegressionData(), GROUPS * GROUP_SIZE, BATCH, 6))
    hsdp = _rank0(parity_runs, "hsdp_g-1")["params"]
    diffs = {}
    for g in range(GROUPS):
        record = _rank0(parity_runs, f"ft_g{g}")
        assert [(h["batch_idx"], h["participants"], h["committed"]) for h in record["history"]] == [
            (b, GROUPS, True) for b in range(6)
        ]
        diffs[g] = (_max_diff(record["params"], want), _max_diff(record["params"], hsdp))
    print(f"max abs diff (group: vs one process, vs HSDP 2x2): {diffs}; HSDP vs one process {_max_diff(hsdp, want)}")
    assert all(one < 1e-5 and vs_hsdp < 1e-5 for one, vs_hsdp in diffs.values()), diffs
    assert _max_diff(hsdp, want) < 1e-5


# ---------------------------------------------------------------------- a killed group
KILLED, SURVIVOR = 0, 1  # group 0 writes the checkpoints while both are up: killing it shows the survivor takes over
KILL_AT, STEPS, SAMPLES, EVERY = 25, 150, 2400, 10
KILL_ENV = {
    "DPAR_FT_STEPS": str(STEPS),
    "DPAR_FT_OPTIMIZER": "sgd_momentum",  # momentum buffers: optimizer state the heal must copy
    "DPAR_FT_SAMPLES": str(SAMPLES),
    "DPAR_FT_PAUSE": "0.3",
    "DPAR_FT_TIMEOUT": "20",
    "DPAR_FT_CKPT_EVERY": str(EVERY),
    "DPAR_FT_SCHEDULER": "1",  # StepLR stepped every batch: scheduler state the heal must copy
}


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("ft_kill")
    (out / "ckpt").mkdir()
    job = _Job(out, min_replicas=1)
    try:
        deadline = time.time() + TIMEOUT
        survivor = job.launch("ft", GROUP_SIZE, "survivor", REPLICA_GROUP_ID=str(SURVIVOR), **KILL_ENV)
        victim = job.launch(
            "ft", GROUP_SIZE, "victim", REPLICA_GROUP_ID=str(KILLED), DPAR_FT_MARK_AT=str(KILL_AT),
            DPAR_FT_MARK_GROUP=str(KILLED), **KILL_ENV,
        )  # fmt: skip
        while not (out / "mark").exists():
            assert survivor.poll() is None and victim.poll() is None, job.tail("victim") + job.tail("survivor")
            assert time.time() < deadline, "the victim never reached the kill point"
            time.sleep(0.05)
        killed_at = job.kill_group(KILLED, victim)
        relaunched = job.launch("ft", GROUP_SIZE, "relaunched", REPLICA_GROUP_ID=str(KILLED), **KILL_ENV)
        job.wait(survivor, "survivor", deadline)
        job.wait(relaunched, "relaunched", deadline)
    finally:
        job.close()
    return out, killed_at


def _rejoined(history: list[dict], killed_at: float) -> dict:
    """The survivor's first committed step with every group again, after it stepped alone."""
    alone = next(h for h in history if h["wall_time"] > killed_at and h["committed"] and h["participants"] == 1)
    return next(
        h for h in history if h["batch_idx"] > alone["batch_idx"] and h["committed"] and h["participants"] == GROUPS
    )


def _step_log(out: Path) -> dict[int, list[dict]]:
    """Every committed step any group's rank 0 logged (the killed launch's too: a line per step, flushed), by batch."""
    steps: dict[int, list[dict]] = {}
    for path in out.glob("steps_g*_*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["committed"]:
                steps.setdefault(entry["batch_idx"], []).append(entry)
    return steps


def _reference_from_log(
    steps: dict[int, list[dict]], data: RegressionData, group_size: int = GROUP_SIZE, schedule_until: int | None = None
) -> dict[str, torch.Tensor]:
    """The documented definition: at each committed batch `b`, one process trains on the shards of batch `b` of
    exactly the groups that committed it (group `g`'s shard: data-parallel ranks `g * 2` and `g * 2 + 1` of a
    4-rank sampler, with groups of 2). With `schedule_until`, the worker's StepLR steps after every batch up to that
    one, committed or not (Lightning steps it per batch)."""
    ranks = GROUPS * group_size
    per_rank = [list(DistributedSampler(data, num_replicas=ranks, rank=r, shuffle=True, seed=0)) for r in range(ranks)]
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer("sgd_momentum", model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **SCHEDULE) if schedule_until is not None else None
    last = schedule_until if schedule_until is not None else max(steps)
    for b in range(last + 1):
        if b in steps:
            # A step with every group in its quorum averaged every group's shard, also when a group was killed after
            # its all-reduce but before it logged the step; otherwise the groups that committed it are the quorum.
            everyone = any(e["participants"] == GROUPS for e in steps[b])
            groups = list(range(GROUPS)) if everyone else sorted({e["group"] for e in steps[b]})
            assert all(e["participants"] == len(groups) for e in steps[b]), (b, steps[b])  # no record missing
            idx = [
                i
                for g in groups
                for r in range(g * group_size, (g + 1) * group_size)
                for i in per_rank[r][b * BATCH : (b + 1) * BATCH]
            ]
            optimizer.zero_grad()
            F.mse_loss(model(data.x[idx]), data.y[idx]).backward()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def test_killed_group_survives_heals_and_matches_the_reference(killed_run):
    out, killed_at = killed_run
    survivor, relaunched = _rank0(out, f"ft_g{SURVIVOR}"), _rank0(out, f"ft_g{KILLED}")
    history = survivor["history"]
    alone = [h for h in history if h["committed"] and h["participants"] == 1 and h["wall_time"] > killed_at]
    lost = [h["batch_idx"] for h in history if not h["committed"]]
    rejoined = _rejoined(history, killed_at)
    heals = [r["heals"][-1] for r in _records(out, f"ft_g{KILLED}").values()]
    assert alone, "the survivor took no step while the other group was down"
    assert all(h["batch_idx"] == rejoined["batch_idx"] for h in heals), (heals, rejoined)
    # The healed group continues the live group's RNG stream: the same draw at every batch both logged.
    draws: dict[int, dict[int, int]] = {}
    for path in out.glob("steps_g*_*.jsonl"):
        for entry in map(json.loads, path.read_text().splitlines()):
            draws.setdefault(entry["batch_idx"], {})[entry["group"]] = entry["draw"]
    after_heal = [b for b in draws if b >= rejoined["batch_idx"] and len(draws[b]) == GROUPS]
    assert after_heal and all(len(set(draws[b].values())) == 1 for b in after_heal)
    # Afterwards every rank holds the same weights, bitwise (the full parameters gather each group's shards).
    assert all(torch.equal(survivor["params"][k], relaunched["params"][k]) for k in survivor["params"])
    steps = _step_log(out)
    diff = _max_diff(
        survivor["params"], _reference_from_log(steps, RegressionData(n=SAMPLES), schedule_until=STEPS - 1)
    )
    downtime_steps = rejoined["batch_idx"] - (KILL_AT + 1)
    measurements = {
        "max_abs_diff_vs_reference": diff,
        "survivor_steps_while_down": len(alone),
        "uncommitted_batches": lost,
        "kill_to_rejoin_s": rejoined["wall_time"] - killed_at,
        "kill_to_healed_s": max(h["wall_time"] for h in heals) - killed_at,
        "heal_bytes_per_rank": [h["bytes_received"] for h in heals],
        "killed_group_batches_missed": downtime_steps,
    }
    (out / "measurements.json").write_text(json.dumps(measurements, indent=1))
    print(json.dumps(measurements, indent=1))
    assert diff < 1e-5, measurements


@pytest.fixture(scope="module")
def restart_baseline(tmp_path_factory) -> tuple[Path, float]:
    """Today's recovery on the same schedule: plain HSDP 2 x 2 in one launch, a checkpoint every 10 steps, every
    process killed after batch 25, the job relaunched from the last checkpoint (step 20)."""
    out = tmp_path_factory.mktemp("ft_restart_baseline")
    job = _Job(out, min_replicas=1)  # unused by HSDP; `_Job` kills what is left
    env = {**KILL_ENV, "DPAR_FT_MARK_AT": str(KILL_AT), "DPAR_FT_PAUSE": "0"}
    try:
        deadline = time.time() + TIMEOUT
        first = job.launch("hsdp", GROUPS * GROUP_SIZE, "first", **env)
        while not (out / "mark").exists():
            assert first.poll() is None, job.tail("first")
            assert time.time() < deadline, "the baseline never reached the kill point"
            time.sleep(0.05)
        killed_at = time.time()
        for f in out.glob("pid_*"):
            _kill(int(f.name.split("_")[2]), os.kill)
            f.unlink()
        _kill(first.pid, os.killpg)
        first.wait(timeout=30)
        resume = out / "ckpt" / f"epoch=0-step={(KILL_AT // EVERY) * EVERY}.ckpt"
        env.pop("DPAR_FT_CKPT_EVERY")
        job.wait(
            job.launch("hsdp", GROUPS * GROUP_SIZE, "resumed", DPAR_FT_RESUME=str(resume), **env), "resumed", deadline
        )
    finally:
        job.close()
    return out, killed_at


def test_steps_lost_against_a_restart_from_checkpoint(killed_run, restart_baseline):
    """The measured comparison on one schedule (kill after batch 25, checkpoints every 10 steps): under fault
    tolerance no committed step is lost and only the killed group's shards are missing while it is down; a restart
    loses the steps since the last checkpoint on every rank and stops every rank until the job is back."""
    out, killed_at = killed_run
    base_out, base_killed_at = restart_baseline
    resumed = _rank0(base_out, "hsdp_g-1")
    last_ckpt = (KILL_AT // EVERY) * EVERY
    assert resumed["batches"][0] == last_ckpt
    redone = KILL_AT + 1 - last_ckpt
    steps = sorted(resumed["batch_times"])
    step_time = (steps[-1] - steps[redone]) / (len(steps) - 1 - redone)
    idle_s = resumed["batch_times"][0] - base_killed_at
    history = _rank0(out, f"ft_g{SURVIVOR}")["history"]
    ft_lost = [h["batch_idx"] for h in history if not h["committed"]]
    rejoined = _rejoined(history, killed_at)
    comparison = {
        "restart_steps_redone_all_ranks": redone,
        "restart_kill_to_first_step_s": idle_s,
        "restart_idle_in_steps": idle_s / step_time,
        "restart_step_time_s": step_time,
        "ft_uncommitted_steps": len(ft_lost),
        "ft_killed_group_down_batches": rejoined["batch_idx"] - (KILL_AT + 1),
        "ft_kill_to_rejoin_s": rejoined["wall_time"] - killed_at,
    }
    (out / "comparison.json").write_text(json.dumps(comparison, indent=1))
    print(json.dumps(comparison, indent=1))
    assert len(ft_lost) <= 1 < redone


def test_checkpoints_written_by_the_quorum(killed_run):
    """Every checkpoint step was written once (by the first group of the quorum), the ones while group 0 was down
    by group 1."""
    out, _ = killed_run
    written = sorted(int(p.name.split("step=")[1].split(".")[0]) for p in (out / "ckpt").glob("*.ckpt"))
    assert written == list(range(EVERY, STEPS + 1, EVERY)), written
    writers = {}
    for path in out.glob("saves_g*_*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            writers.setdefault(entry["step"], set()).add(entry["group"])
    assert all(len(groups) == 1 for groups in writers.values()), writers
    steps = _step_log(out)
    down = [s for s in written if s > KILL_AT + 1 and len(steps.get(s - 1, [])) == 1]  # after the kill
    assert down and all(writers[s] == {SURVIVOR} for s in down), (down, writers)


def test_full_job_restart_resumes_exactly(killed_run, tmp_path):
    """Both groups relaunched from a checkpoint the survivor wrote while the other group was down, to 20 more
    steps: equal to the reference of the logged steps up to the checkpoint, then both groups for every step."""
    out, _ = killed_run
    steps = _step_log(out)
    down = [s for s in range(EVERY, STEPS + 1, EVERY) if s > KILL_AT + 1 and len(steps.get(s - 1, [])) == 1]
    resume_at = down[0]
    ckpt = out / "ckpt" / f"epoch=0-step={resume_at}.ckpt"
    restart = tmp_path / "restart"
    restart.mkdir()
    job = _Job(restart, min_replicas=GROUPS)
    env = {**KILL_ENV, "DPAR_FT_STEPS": str(resume_at + 20), "DPAR_FT_RESUME": str(ckpt), "DPAR_FT_PAUSE": "0"}
    env.pop("DPAR_FT_CKPT_EVERY")
    try:
        deadline = time.time() + TIMEOUT
        procs = [job.launch("ft", GROUP_SIZE, f"g{g}", REPLICA_GROUP_ID=str(g), **env) for g in range(GROUPS)]
        for g, proc in enumerate(procs):
            job.wait(proc, f"g{g}", deadline)
    finally:
        job.close()
    expected = {b: entries for b, entries in steps.items() if b < resume_at}
    for b in range(resume_at, resume_at + 20):
        expected[b] = [{"group": g, "participants": GROUPS} for g in range(GROUPS)]
    want = _reference_from_log(expected, RegressionData(n=SAMPLES), schedule_until=resume_at + 19)
    for g in range(GROUPS):
        record = _rank0(restart, f"ft_g{g}")
        assert [h["batch_idx"] for h in record["history"]] == list(range(resume_at, resume_at + 20))
        diff = _max_diff(record["params"], want)
        print(f"restart from step {resume_at}: group {g} max abs diff {diff}")
        assert diff < 1e-5


# ---------------------------------------------------------------------- Ray Train
RAY_STEPS, RAY_KILL_AT, RAY_SAMPLES = 120, 15, 1000


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> Path:
    """`TorchTrainer` with Ray's `TorchftConfig`: 2 replica groups of one worker; group 1's worker SIGKILLs itself
    after batch 15 (once), and Ray restarts that group only."""
    ray = pytest.importorskip("ray")
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig  # not exported by `ray.train.torch` in 2.60

    from tests.workers.fault_tolerance import ray_job

    out = tmp_path_factory.mktemp("ft_ray")
    saved = dict(os.environ)
    os.environ.update(subprocess_env())  # the workers inherit it through the raylet started here
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    os.environ.clear()
    os.environ.update(saved)
    try:
        config = {
            "out": str(out), "steps": RAY_STEPS, "kill_at": RAY_KILL_AT, "kill_group": 1, "pause": 0.3,
            "samples": RAY_SAMPLES, "optimizer": "sgd_momentum",
        }  # fmt: skip
        lighthouse = {"min_replicas": 1, "join_timeout_ms": 2000, "heartbeat_timeout_ms": 2000}
        TorchTrainer(
            ray_job,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=GROUPS, use_gpu=False),
            torch_config=TorchftConfig(lighthouse_kwargs=lighthouse, backend="gloo"),
            run_config=RunConfig(storage_path=str(out / "storage"), failure_config=FailureConfig(max_failures=1)),
        ).fit()
    finally:
        ray.shutdown()
    return out


def test_ray_restarts_the_killed_group_only_and_it_heals(ray_run):
    out = ray_run
    killed_at = float((out / "mark").read_text())
    survivors, relaunched = _records(out, "ray_g0"), _records(out, "ray_g1")
    assert len(survivors) == 1 and len(relaunched) == 1, (list(survivors), list(relaunched))
    survivor, healed = next(iter(survivors.values())), next(iter(relaunched.values()))
    # Group 0 never stopped: one process trained every batch from the one it joined at (the first quorum can form
    # before the other worker has started) to the end.
    first = survivor["batches"][0]
    assert first < RAY_KILL_AT and survivor["batches"] == list(range(first, RAY_STEPS)), survivor["batches"]
    assert len(list(out.glob("pid_0_*"))) == 1 and len(list(out.glob("pid_1_*"))) == 2
    alone = [h for h in survivor["history"] if h["committed"] and h["participants"] == 1 and h["wall_time"] > killed_at]
    (heal,) = healed["heals"]
    assert alone and heal["batch_idx"] > RAY_KILL_AT + 1, (len(alone), heal)
    assert all(torch.equal(survivor["params"][k], healed["params"][k]) for k in survivor["params"])
    diff = _max_diff(survivor["params"], _reference_from_log(_step_log(out), RegressionData(n=RAY_SAMPLES), 1))
    print(
        f"Ray: {len(alone)} steps alone, healed at batch {heal['batch_idx']} {heal['wall_time'] - killed_at:.1f} s"
        f" after the kill, {heal['bytes_received']} bytes, max abs diff to the reference {diff}"
    )
    assert diff < 1e-5
