"""The user-script lane: a training script whose `LightningModule` is defined in the script itself (`__main__`),
copied alone to a temporary directory and run there as users run it, with nothing of the repository importable but
the installed package (`tests/user_scripts/gpt_train.py` says what each case does).

Every way the package pickles, spawns, forks or re-imports the user's code is run here: `dpar_auto`'s search (a
forked child, on 2 and 4 ranks, after another Trainer in the same process, in a Ray worker), Lightning's script
re-launch (`python script.py`), torchrun, `start_method="spawn"`, the script's own LightningCLI, `plan` and
`plan --auto` on `--model.class_path script.Class`, a sharded save and `fit(ckpt_path=...)`, `consolidate`,
`load_from_checkpoint` in another script importing the class, pipeline stages, context and expert parallelism, and a
torchft replica group. The fast, in-process part of this lane is `tests/unit/layout_search/test_isolated.py`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, subprocess_env, torchrun_args

SCRIPT = ROOT / "tests" / "user_scripts" / "gpt_train.py"
ATOL = 1e-5
#: What the 2-rank script run trains, in one Lightning re-launch of the script.
CASES2 = "auto auto_budget auto_split auto_refused names pipeline context_parallel experts checkpoint".split()


def user_env(**extra: str) -> dict[str, str]:
    """The tests' environment (one thread per process, the warning policy) without the repository on the path."""
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    return {**env, **extra}


def run_user(args: list[str], cwd: Path, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=user_env(**env), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def case(out: Path, name: str) -> dict:
    """A case's record, or a failure of the calling test alone with the case's traceback."""
    path = out / f"{name}.json"
    if not path.exists():
        pytest.fail(f"case {name!r} left no record in {out}", pytrace=False)
    result = json.loads(path.read_text())
    if "error" in result:
        pytest.fail(f"case {name!r} raised:\n{result['error']}", pytrace=False)
    return result


def user_directory(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A fresh directory holding the script alone, with an `out` directory for its records."""
    directory = tmp_path_factory.mktemp(name)
    shutil.copy(SCRIPT, directory / "gpt_train.py")
    (directory / "out").mkdir()
    return directory


@pytest.fixture(scope="module")
def script2(tmp_path_factory) -> Path:
    """`python gpt_train.py out CASES2...`: Lightning re-runs the script for rank 1."""
    directory = user_directory(tmp_path_factory, "script2")
    run_user(["gpt_train.py", "out", *CASES2], directory)
    return directory


@pytest.fixture(scope="module")
def torchrun4(tmp_path_factory) -> Path:
    directory = user_directory(tmp_path_factory, "torchrun4")
    cases = ("auto", "auto_budget", "auto_split")
    run_user(torchrun_args(4, Path("gpt_train.py"), "out", *cases), directory, SCRIPT_DEVICES="4")
    return directory / "out"


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["script2", "torchrun4"])
@pytest.mark.parametrize("name", ["auto", "auto_budget", "auto_split"])
def test_dpar_auto_trains_a_script_module_as_the_same_layout_by_hand(launch, name, request):
    fixture = request.getfixturevalue(launch)
    result = case(fixture / "out" if launch == "script2" else fixture, name)
    assert result["steps"] == 3
    assert result["auto_vs_hand"] < ATOL
    assert result["auto_vs_one_process"] < ATOL
    assert result["peak"] <= result["device_memory"] and len(result["runners_up"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["script2", "torchrun4"])
def test_memory_budgets_change_the_choice(launch, request):
    fixture = request.getfixturevalue(launch)
    out = fixture / "out" if launch == "script2" else fixture
    budget, split = case(out, "auto_budget"), case(out, "auto_split")
    assert budget["chosen"] != budget["first"] and budget["peak"] < budget["first_peak"]
    assert "pp" in split["chosen"] or "tp1" not in split["chosen"], split["chosen"]


@pytest.mark.slow
def test_an_impossible_budget_is_refused_with_its_own_message(script2):
    refusal = case(script2 / "out", "auto_refused")["refusal"]
    assert refusal is not None and refusal.startswith("No layout of 2 ranks fits 0.00 GiB per device")
    assert "Add devices, raise `device_memory`, or lower the batch size." in refusal


@pytest.mark.slow
def test_every_strategy_name_trains_a_script_module_at_parity(script2):
    results = case(script2 / "out", "names")
    assert set(results) == {"dpar_replicate", "dpar_fsdp", "dpar_fsdp_offload", "dpar_hsdp", "dpar_2d", "dpar_cp"}
    for name, result in results.items():
        assert result["steps"] == 3 and result["vs_one_process"] < ATOL, (name, result)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipeline", "context_parallel", "experts"])
def test_features_train_a_script_module_at_parity(script2, name):
    result = case(script2 / "out", name)
    assert result["steps"] == 3 and result["vs_one_process"] < ATOL


@pytest.mark.slow
def test_a_script_modules_checkpoint_resumes_and_loads(script2):
    result = case(script2 / "out", "checkpoint")
    assert result["resumed_steps"] == 4 and result["resumed_vs_whole"] == 0.0
    assert result["loaded_type"] == "ScriptGPT" and result["loaded_vs_saved"] == 0.0


@pytest.mark.slow
def test_consolidate_then_load_from_checkpoint_in_another_script(script2):
    """`consolidate` the script run's sharded checkpoint (2 steps), then an inference script that imports the class
    from the training script loads it: the weights of two steps trained in one process."""
    run_user(["-m", "lightning_dpar", "consolidate", "out/sharded.ckpt", "out/one.ckpt"], script2)
    check = (
        "from gpt_train import ScriptGPT, difference, one_process\n"
        "model = ScriptGPT.load_from_checkpoint('out/one.ckpt', map_location='cpu')\n"
        "print('DIFF', difference(model.state_dict(), one_process(2, steps=2)))\n"
    )
    done = run_user(["-c", check], script2)
    assert float(done.stdout.split("DIFF")[-1]) < ATOL


@pytest.mark.slow
def test_plan_and_plan_auto_on_a_class_from_the_script(script2):
    """The dry run imports the class by `--model.class_path gpt_train.ScriptGPT` (the script's guard keeps it from
    training); `plan --auto` on the batch the script trains (its length read off the model, as `dpar_auto` reads
    it) makes the choice `dpar_auto` made in it."""
    plan = run_user(
        ["-m", "lightning_dpar", "plan", "--model.class_path", "gpt_train.ScriptGPT", "--world-size", "2"], script2
    )
    # the script's model (vocabulary 64, width 32, 4 blocks), not the example GPT the default config names
    assert "Parameters on rank 0 (54,080 in total)" in plan.stdout, plan.stdout[-2000:]
    auto = run_user(
        ["-m", "lightning_dpar", "plan", "--auto", "--model.class_path", "gpt_train.ScriptGPT", "--world-size", "2",
         "--batch-size", "4", "--trainer.precision", "32-true"],
        script2,
    )  # fmt: skip
    chosen = case(script2 / "out", "auto")["chosen"]
    assert f"Chosen layout for 2 ranks (profile cpu-gloo): {chosen}:" in auto.stdout, auto.stdout[-3000:]


@pytest.mark.slow
def test_the_scripts_own_lightning_cli_under_dpar_auto(tmp_path_factory):
    directory = user_directory(tmp_path_factory, "cli")
    done = run_user(
        ["gpt_train.py", "fit", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=dpar_auto",
         "--trainer.max_steps=3", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={directory / 'out'}"],
        directory,
    )  # fmt: skip
    assert "Chosen layout for 2 ranks" in done.stdout + done.stderr
    assert list((directory / "out").rglob("*.ckpt")), "the CLI run saved no checkpoint"


@pytest.mark.slow
def test_spawned_ranks_train_a_script_module(tmp_path_factory):
    """`start_method="spawn"` pickles the strategy and the module to fresh interpreters, which find the class by
    re-importing the script as `__mp_main__`; the trained weights come back to the script's process."""
    directory = user_directory(tmp_path_factory, "spawn")
    run_user(["gpt_train.py", "out", "spawn"], directory)
    assert case(directory / "out", "spawn")["vs_one_process"] < ATOL


@pytest.mark.slow
def test_ray_train_sends_the_script_module_to_its_workers(tmp_path_factory):
    pytest.importorskip("ray")
    directory = user_directory(tmp_path_factory, "ray")
    run_user(["gpt_train.py", "ray", "out"], directory)
    assert case(directory / "out", "ray")["vs_one_process"] < ATOL


@pytest.mark.slow
def test_a_torchft_replica_group_trains_a_script_module(tmp_path_factory):
    """The fault-tolerance docs' launch, for one replica group: a lighthouse, then torchrun with its address."""
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    directory = user_directory(tmp_path_factory, "ft")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    try:
        env = {"TORCHFT_LIGHTHOUSE": lighthouse.address(), "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "1"}
        run_user(torchrun_args(2, Path("gpt_train.py"), "out", "ft"), directory, **env)
    finally:
        lighthouse.shutdown()
    result = case(directory / "out", "ft")
    assert result["steps"] == 3 and result["vs_one_process"] < ATOL


def test_the_script_imports_nothing_of_the_repository_but_the_package():
    """What makes the lane a user's: the script needs no `tests` module, so it runs copied alone."""
    imports = [line for line in SCRIPT.read_text().splitlines() if line.startswith(("import ", "from "))]
    roots = {line.split()[1].split(".")[0] for line in imports}
    assert roots - sys.stdlib_module_names <= {"lightning", "torch", "lightning_dpar"}
