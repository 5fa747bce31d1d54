"""Fault tolerance when a heal is cut short, then the full restart (workers: `tests/workers/fault_tolerance.py`; split
from `test_fault_tolerance.py`, whose kill settings it reuses): two replica groups of two gloo ranks, one `torchrun`
per group, a torchft lighthouse in this process.

- The source group killed in the middle of a heal (a test hook pauses its transfer): the healing group stops whole,
  never trains on part of the state, and never hangs.
- Every group relaunched with the same `ckpt_path`, started seconds apart: the run resumes and continues exactly.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.launched.test_fault_tolerance import KILL_ENV
from tests.support.fault_tolerance import (
    GROUP_SIZE,
    GROUPS,
    TIMEOUT,
    Job,
    max_diff,
    rank0,
    reference_from_log,
    step_log,
    wait_for_a_save_alone,
)
from tests.support.models import RegressionData

pytest.importorskip("torchft.coordination")  # skips cleanly without the `ft` extra

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- a heal cut short, then a full restart
CUT_KILL_AT, CUT_STEPS, CUT_SAMPLES, CUT_EVERY = 12, 300, 4800, 10
CUT_ENV = {**KILL_ENV, "DPAR_FT_STEPS": str(CUT_STEPS), "DPAR_FT_SAMPLES": str(CUT_SAMPLES)}
CUT_ENV["DPAR_FT_CKPT_EVERY"] = str(CUT_EVERY)
#: How long the healing group may take to stop after its source is killed: its HTTP fetch fails at once (the
#: source's sockets close), and every other wait is bounded by `timeout` (`DPAR_FT_TIMEOUT`, 20 s).
CUT_STOP_BOUND = 20 + 30


def _wait_for(paths: list[Path], procs: list, job: Job, deadline: float) -> None:
    while not all(p.exists() for p in paths):
        assert all(proc.poll() is None for proc in procs), [job.tail(n) for n in ("source", "victim", "healer")]
        assert time.time() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cut_heal_run(tmp_path_factory) -> dict:
    """Group 1 is SIGKILLed after batch 12 and relaunched; it heals from group 0, whose rank 1 pauses before handing
    torchft its state (the test hook), while group 0's rank 0 serves: group 1's rank 0 has applied the new state
    when group 0 is SIGKILLed, its rank 1 has received nothing. Then every group is relaunched with the same
    `ckpt_path` (the last checkpoint group 0 wrote alone), group 1 first and group 0 five seconds later."""
    out = tmp_path_factory.mktemp("ft_cut_heal")
    (out / "ckpt").mkdir()
    job = Job(out)
    result: dict = {"out": out}
    try:
        deadline = time.time() + TIMEOUT
        source = job.launch("ft", GROUP_SIZE, "source", REPLICA_GROUP_ID="0", DPAR_FT_HEAL_PAUSE_RANK="1", **CUT_ENV)
        victim = job.launch(
            "ft", GROUP_SIZE, "victim", REPLICA_GROUP_ID="1", DPAR_FT_MARK_AT=str(CUT_KILL_AT), DPAR_FT_MARK_GROUP="1",
            **CUT_ENV,
        )  # fmt: skip
        _wait_for([out / "mark"], [source, victim], job, deadline)
        job.kill_group(1, victim)
        wait_for_a_save_alone(job, 0, CUT_KILL_AT + 1, {"source": source}, deadline)  # the restart's checkpoint
        # the victim may have healed too, at its start, if it joined after group 0's first step (a loaded machine)
        before = set(out.glob("healed_g1_*"))
        healer = job.launch("ft", GROUP_SIZE, "healer", REPLICA_GROUP_ID="1", **CUT_ENV)
        _wait_for([out / "heal_paused"], [source, healer], job, deadline)
        while not set(out.glob("healed_g1_r0_*")) - before:  # the healer's rank 0 applies what group 0's rank 0 served
            assert healer.poll() is None, job.tail("healer")
            assert time.time() < deadline, "the healer's rank 0 never healed"
            time.sleep(0.05)
        result["healed_g1"] = sorted(p.name for p in set(out.glob("healed_g1_*")) - before)  # the healer's ranks
        result["source_killed_at"] = job.kill_group(0, source)
        try:
            healer.wait(timeout=CUT_STOP_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the healing group did not stop within {CUT_STOP_BOUND} s:\n{job.tail('healer')}")
        result["healer_stopped_s"] = time.time() - result["source_killed_at"]
        result["healer_rc"] = healer.returncode
        result["healer_log"] = (out / "log_healer").read_text()
    finally:
        job.close()
    steps = step_log(out)
    written = sorted(int(p.name.split("step=")[1].split(".")[0]) for p in (out / "ckpt").glob("*.ckpt"))
    resume_at = written[-1]
    assert resume_at > CUT_KILL_AT + 1 and len(steps[resume_at - 1]) == 1  # written while group 1 was down
    restart = out / "restart"
    restart.mkdir()
    job = Job(restart)
    ckpt = out / "ckpt" / f"epoch=0-step={resume_at}.ckpt"
    env = {**CUT_ENV, "DPAR_FT_STEPS": str(resume_at + 10), "DPAR_FT_RESUME": str(ckpt), "DPAR_FT_PAUSE": "0"}
    env.pop("DPAR_FT_CKPT_EVERY")
    try:
        deadline = time.time() + TIMEOUT
        procs = [job.launch("ft", GROUP_SIZE, "g1", REPLICA_GROUP_ID="1", **env)]
        time.sleep(5)
        procs.insert(0, job.launch("ft", GROUP_SIZE, "g0", REPLICA_GROUP_ID="0", **env))
        for g, proc in enumerate(procs):
            job.wait(proc, f"g{g}", deadline)
    finally:
        job.close()
    result.update(steps=steps, resume_at=resume_at, restart=restart)
    return result


def test_a_heal_cut_short_stops_the_whole_healing_group(cut_heal_run):
    """The source died with the heal half done (rank 0 healed, rank 1 not): every rank of the healing group stopped
    with the error naming the failed heal, within the bound, and none of them trained a batch."""
    run = cut_heal_run
    assert [name.split("_")[2] for name in run["healed_g1"]] == ["r0"], run["healed_g1"]
    log = run["healer_log"]
    assert run["healer_rc"] != 0, log[-3000:]
    assert run["healer_stopped_s"] < CUT_STOP_BOUND, run["healer_stopped_s"]
    failures = [line for line in log.splitlines() if "HealFailedError: Replica group 1 failed to heal" in line]
    assert len(failures) >= GROUP_SIZE, log[-6000:]  # every rank raised it
    assert all("ranks [0] received the state, ranks [1] failed" in line for line in failures), failures
    logged = [entry for entries in run["steps"].values() for entry in entries]
    healer_steps = [e for e in logged if e["group"] == 1 and e["batch_idx"] > CUT_KILL_AT]
    assert healer_steps == [], healer_steps  # no step after the kill was logged by group 1
    assert not list(run["out"].glob("ft_g1_*.pt"))  # neither did a rank of it finish a fit
    print(f"healing group stopped {run['healer_stopped_s']:.1f} s after its source was killed")


def test_full_restart_with_the_groups_started_apart_resumes_exactly(cut_heal_run):
    """Both groups relaunched with the same `ckpt_path`, group 1 five seconds before group 0: the first quorum waited
    for both, neither healed from the other over the checkpoint, and both equal the reference of the logged steps up
    to the checkpoint, then both groups at every step."""
    run = cut_heal_run
    resume_at, restart = run["resume_at"], run["restart"]
    expected = {b: entries for b, entries in run["steps"].items() if b < resume_at}
    for b in range(resume_at, resume_at + 10):
        expected[b] = [{"group": g, "groups": list(range(GROUPS))} for g in range(GROUPS)]
    want = reference_from_log(expected, RegressionData(n=CUT_SAMPLES), schedule_until=resume_at + 9)
    records_ = [rank0(restart, f"ft_g{g}") for g in range(GROUPS)]
    for g, record in enumerate(records_):
        assert [(h["batch_idx"], h["groups"]) for h in record["history"]] == [
            (b, (0, 1)) for b in range(resume_at, resume_at + 10)
        ]
        assert all(h["batch_idx"] is None for h in record["heals"]), record["heals"]  # at most the initial sync
        diff = max_diff(record["params"], want)
        print(f"restart from step {resume_at}: group {g} max abs diff {diff}")
        assert diff < 1e-5
    assert all(torch.equal(records_[0]["params"][k], records_[1]["params"][k]) for k in want)
