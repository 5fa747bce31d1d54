"""What the fault-tolerance launched tests share (`tests/launched/test_fault_tolerance.py`): the launches of replica
groups with a torchft lighthouse (`Job`), the records the workers (`tests/workers/fault_tolerance.py`) write, and the
documented reference a run with a failure must equal (`reference_from_log`)."""

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

from lightning_dpar.fault_tolerance.config import LighthouseUnreachableError, check_lighthouse_reachable
from tests.conftest import ROOT, subprocess_env
from tests.support.models import Net, RegressionData, make_optimizer

#: The learning-rate schedule of the workers' `DPAR_FT_SCHEDULER=1` runs: StepLR, stepped every batch.
SCHEDULE = {"step_size": 10, "gamma": 0.7}

WORKER = ROOT / "tests" / "workers" / "fault_tolerance.py"
GROUPS, GROUP_SIZE, BATCH = 2, 2, 4
TIMEOUT = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docs_commands() -> dict[str, list[str]]:
    """The launch commands of docs/fault_tolerance.md's "Launch" section, as argument lists: `lighthouse` (the
    `torchft_lighthouse` line), `env` (the exported variables) and `group` (the `torchrun` flags of the one-machine
    group launch). The tests run exactly these, with their own ports, so the docs cannot drift from what is tested."""
    text = (ROOT / "docs" / "fault_tolerance.md").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    (lighthouse,) = [line.split() for line in lines if line.startswith("torchft_lighthouse ")]
    (env,) = [line.split()[1:] for line in lines if line.startswith("export TORCHFT_LIGHTHOUSE=http://localhost")]
    group = next(line.split() for line in lines if line.startswith("REPLICA_GROUP_ID=0 torchrun "))
    assert group[-2:] == ["train.py", "&"], group
    return {"lighthouse": lighthouse, "env": env, "group": group[2:-2]}


def _with_port(args: list[str], old: str, new: int) -> list[str]:
    replaced = [arg.replace(old, str(new)) for arg in args]
    assert replaced != args, (args, old)
    return replaced


class Job:
    """The docs' lighthouse and torchrun launches (each in a session of its own); everything is killed on `close`."""

    def __init__(self, out: Path) -> None:
        self.out = out
        commands = docs_commands()
        port = free_port()
        bin_dir = Path(sys.executable).parent
        lighthouse = _with_port(commands["lighthouse"], "29510", port)
        self.lighthouse = subprocess.Popen(
            [str(bin_dir / lighthouse[0]), *lighthouse[1:]],
            stdout=open(out / "log_lighthouse", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.env = dict(item.split("=", 1) for item in _with_port(commands["env"], "29510", port))
        self.group_args = commands["group"]
        self.procs: list[subprocess.Popen] = []
        deadline = time.time() + 30
        while True:
            try:
                check_lighthouse_reachable(self.env["TORCHFT_LIGHTHOUSE"], timeout=2)
                break
            except LighthouseUnreachableError:
                assert time.time() < deadline and self.lighthouse.poll() is None, (out / "log_lighthouse").read_text()
                time.sleep(0.2)

    def launch(self, mode: str, nproc: int, name: str, **env: str) -> subprocess.Popen:
        """One launch: a replica group (`mode` "ft*") with the docs' `torchrun` flags and variables, or the plain
        HSDP reference on `nproc` ranks."""
        if mode.startswith("ft"):
            flags = _with_port(self.group_args, "29600", free_port())
            assert flags[flags.index("--nproc-per-node") + 1] == str(nproc), (flags, nproc)
        else:
            flags = ["--nproc-per-node", str(nproc), "--master-port", str(free_port())]
        cmd = [str(Path(sys.executable).parent / "torchrun"), *flags, str(WORKER), mode, str(self.out)]
        full_env = {**subprocess_env(), **self.env, **env}
        assert full_env["NUM_REPLICA_GROUPS"] == str(GROUPS)
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
            kill_quietly(pid, os.kill)
        kill_quietly(proc.pid, os.killpg)
        proc.wait(timeout=30)
        for f in self.out.glob(f"pid_{group}_*"):
            f.unlink()
        return killed_at

    def close(self) -> None:
        for f in self.out.glob("pid_*"):
            kill_quietly(int(f.name.split("_")[2]), os.kill)
        for proc in self.procs:
            kill_quietly(proc.pid, os.killpg)
        kill_quietly(self.lighthouse.pid, os.killpg)
        self.lighthouse.wait(timeout=30)


def kill_quietly(pid: int, kill) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def records(out: Path, prefix: str) -> dict[str, dict]:
    return {f.name: torch.load(f, weights_only=False) for f in sorted(out.glob(f"{prefix}_r*_*.pt"))}


def rank0(out: Path, prefix: str) -> dict:
    (record,) = [r for name, r in records(out, prefix).items() if name.startswith(f"{prefix}_r0_")]
    return record


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def wait_for_a_save_alone(
    job: Job, group: int, after_step: int, procs: dict[str, subprocess.Popen], deadline: float
) -> None:
    """Block until `group`, left alone by a kill, has logged a checkpoint of a step after `after_step` (its
    `saves_g*` log, written as it saves), so that the tests see it step and save alone before the killed group is
    relaunched. Without the wait a fast machine relaunches the killed group before the lighthouse drops it, the next
    quorum holds both groups again and nothing is ever done alone. `procs`: the launches that must stay up, by name."""
    while True:
        logs = [f.read_text() for f in job.out.glob(f"saves_g{group}_*.jsonl")]
        saved = [json.loads(line)["step"] for text in logs for line in text.split("\n")[:-1]]  # whole lines only
        if any(step > after_step for step in saved):
            return
        for name, proc in procs.items():
            assert proc.poll() is None, f"launch {name} stopped:\n{job.tail(name)}"
        assert time.time() < deadline, f"group {group} saved no checkpoint after step {after_step} alone: {saved}"
        time.sleep(0.05)


def rejoin_step(history: list[dict], killed_at: float) -> dict:
    """The survivor's first committed step with every group again, after it stepped alone."""
    alone = next(h for h in history if h["wall_time"] > killed_at and h["committed"] and h["participants"] == 1)
    return next(
        h for h in history if h["batch_idx"] > alone["batch_idx"] and h["committed"] and h["participants"] == GROUPS
    )


def step_log(out: Path) -> dict[int, list[dict]]:
    """Every committed step any group's rank 0 logged (the killed launch's too: a line per step, flushed), by batch."""
    steps: dict[int, list[dict]] = {}
    for path in out.glob("steps_g*_*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["committed"]:
                steps.setdefault(entry["batch_idx"], []).append(entry)
    return steps


def reference_from_log(
    steps: dict[int, list[dict]], data: RegressionData, group_size: int = GROUP_SIZE, schedule_until: int | None = None
) -> dict[str, torch.Tensor]:
    """The documented definition: at each committed batch `b`, one process trains on the shards of batch `b` of
    exactly the groups in its quorum, as `history` records them (group `g`'s shard: data-parallel ranks `g * 2` and
    `g * 2 + 1` of a 4-rank sampler, with groups of 2). With `schedule_until`, the worker's StepLR steps after every
    batch up to that one, committed or not (Lightning steps it per batch)."""
    ranks = GROUPS * group_size
    per_rank = [list(DistributedSampler(data, num_replicas=ranks, rank=r, shuffle=True, seed=0)) for r in range(ranks)]
    torch.manual_seed(0)
    model = Net()
    optimizer = make_optimizer("sgd_momentum", model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, **SCHEDULE) if schedule_until is not None else None
    last = schedule_until if schedule_until is not None else max(steps)
    for b in range(last + 1):
        if b in steps:
            # The groups of the step's quorum, as every group that committed it recorded them (also a group killed
            # after its all-reduce but before it logged the step: its shard was averaged in).
            (groups,) = {tuple(e["groups"]) for e in steps[b]}
            assert {e["group"] for e in steps[b]} <= set(groups), (b, steps[b])
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
