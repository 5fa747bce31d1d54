"""Lightning's own launchers: the script re-launch ("popen"), an interactive session (forked ranks), and ranks
started by SLURM's `srun` (simulated: one process per task with the variables srun sets)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.conftest import WORKERS, run_script, subprocess_env, torchrun_args


@pytest.mark.slow
@pytest.mark.parametrize("interactive", [False, True], ids=["script_relaunch", "interactive_fork"])
def test_launch_without_torchrun(tmp_path, interactive):
    out = tmp_path / "result.json"
    args = ["-i"] if interactive else []
    proc = run_script([*args, str(WORKERS / "launch_script.py"), str(out)], tmp_path, stdin="" if interactive else None)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["interactive"] is interactive
    # Lightning's script launcher and ours for notebooks, each resolving `ckpt_path="last"` first.
    assert result["launcher"] == ("InteractiveLauncher" if interactive else "ScriptLauncher")
    # Interactive: the parent process's module holds the full trained weights the ranks sent back.
    assert result["max_abs_diff"] < 1e-5
    if not interactive:  # forked ranks leave through `os._exit`, without the interpreter's shutdown
        _assert_ended_what_the_strategy_started(out, world=2, user_group=False)


def _assert_ended_what_the_strategy_started(out, world: int, user_group: bool) -> None:
    """Every rank exited with the strategy's checkpoint thread ended, its own process groups destroyed (a group the
    user created still alive for the user to end), and the save still in flight at exit complete."""
    for rank in range(world):
        state = json.loads(out.with_name(f"{out.name}.exit{rank}").read_text())
        assert state["process_group_alive"] is user_group, (rank, state)
        assert "dpar-checkpoint" not in state["threads"], (rank, state)
    assert (out.parent / "after_fit.ckpt" / "meta.pt").exists()


@pytest.mark.slow
def test_torchrun_with_the_users_process_group(tmp_path):
    """torchrun started the ranks and the script its own process group: the strategy uses it and leaves it alone."""
    out = tmp_path / "result.json"
    proc = run_script(torchrun_args(2, WORKERS / "launch_script.py", str(out), "1", "user_group"), tmp_path)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["environment"] == "TorchElasticEnvironment" and result["launcher"] == "InPlaceLauncher"
    assert result["max_abs_diff"] < 1e-5
    _assert_ended_what_the_strategy_started(out, world=2, user_group=True)


def _free_port() -> int:
    """A port nothing listens on now (a fixed or pid-derived one can collide with another test's store)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("num_nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_slurm_tasks(tmp_path, num_nodes):
    """Every rank is its own SLURM task: the strategy must take the ranks from SLURM and not re-launch; with two
    nodes, `dpar_hsdp` replicates across them and shards within each."""
    out = tmp_path / "result.json"
    world = 2
    tasks_per_node = world // num_nodes
    slurm = {
        "SLURM_NTASKS": str(world),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NNODES": str(num_nodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    procs, logs = [], [tmp_path / f"rank{rank}.log" for rank in range(world)]
    try:
        for rank in range(world):
            task = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % tasks_per_node)}
            task["SLURM_NODEID"] = str(rank // tasks_per_node)
            with open(logs[rank], "w") as log:  # files, not pipes: a full pipe would stall a rank mid-collective
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKERS / "launch_script.py"), str(out), str(num_nodes)],
                        env={**subprocess_env(), **slurm, **task},
                        cwd=tmp_path,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            proc.kill()  # no-op for those that exited; a hung rank must not outlive the test
    assert all(proc.returncode == 0 for proc in procs) and out.exists(), "\n".join(
        f"rank {rank} (exit {proc.returncode}): {log.read_text()[-3000:]}"
        for rank, (proc, log) in enumerate(zip(procs, logs))
    )
    result = json.loads(out.read_text())
    assert result["environment"] == "SLURMEnvironment"
    assert result["launcher"] == "InPlaceLauncher"  # srun created the processes; nothing is re-launched
    assert result["mesh"]["replicate"] == num_nodes and result["mesh"]["shard"] == world // num_nodes
    assert result["max_abs_diff"] < 1e-5
    _assert_ended_what_the_strategy_started(out, world=world, user_group=False)
