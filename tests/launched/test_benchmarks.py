"""The benchmark suite: one tiny end-to-end run of each command (launched as scripts, some on 2 gloo ranks) so the
commands keep working. Its arithmetic on known numbers is tested in process in `tests/unit/test_benchmarks.py`."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import ROOT, run_script


@pytest.mark.slow
def test_benchmark_command_end_to_end(tmp_path):
    args = ["-m", "benchmarks.run", "--world-size", "2", "--warmup", "1", "--steps", "2", "--repeats", "1"]
    args += ["--only", "plain_ddp", "dpar_replicate", "--out", str(tmp_path)]
    proc = run_script(args, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "benchmark_cpu.json").read_text())["results"][0]
    assert set(result["summary"]) == {"plain_ddp", "dpar_replicate"}
    assert result["summary"]["dpar_replicate"]["checkpoint"]["async_blocked_s"] > 0
    assert "| dpar_replicate |" in (tmp_path / "benchmark_cpu.md").read_text()


@pytest.mark.slow
def test_gpu_command_code_path_on_cpu(tmp_path):
    """`--preset gpu` on a GPU runs this exact path (world size 1, bf16-mixed, FSDP2 + compile vs the package) at
    the `gpu-smoke` size; on CPU there is no MFU (no peak FLOPs), on CUDA the same table has it."""
    args = ["-m", "benchmarks.run", "--device", "cpu", "--preset", "gpu-smoke", "--warmup", "1", "--steps", "2"]
    args += ["--repeats", "1", "--out", str(tmp_path)]
    args += ["--only", "plain_fsdp", "plain_fsdp_compiled", "dpar_fsdp", "dpar_fsdp_compiled", "dpar_2d"]
    proc = run_script(args, ROOT, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "benchmark_gpu-smoke.json").read_text())["results"][0]
    assert result["raw"]["world_size"] == 1 and result["raw"]["precision"] == "bf16-mixed"
    summary = result["summary"]
    assert set(summary) == {"plain_fsdp", "plain_fsdp_compiled", "dpar_fsdp", "dpar_fsdp_compiled", "dpar_2d"}
    assert "speedup_vs_eager" in summary["dpar_fsdp_compiled"] and summary["dpar_fsdp"]["tokens_per_s"] > 0
    assert "| dpar_2d |" in (tmp_path / "benchmark_gpu-smoke.md").read_text()


@pytest.mark.slow
def test_overhead_command_profiles_ops_and_lightning_hooks(tmp_path):
    args = ["-m", "benchmarks.overhead", "--preset", "gpu-smoke", "--world-size", "1", "--warmup", "1"]
    args += ["--steps", "2", "--repeats", "1", "--only", "plain_fsdp", "dpar_fsdp", "--out", str(tmp_path)]
    proc = run_script(args, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "overhead_gpu-smoke.md").read_text()
    assert "| plain_fsdp |" in table and "| dpar_fsdp |" in table
    assert "`[Strategy]FullyShardStrategy.training_step`" in table  # Lightning's hooks, by Lightning's names
    # The ops are profiled for every variant. (The table lists the events whose time differs most between the
    # variants, which on a shared machine need not include the matmuls both run alike.)
    raw = json.loads((tmp_path / "overhead_gpu-smoke.json").read_text())
    for name, variant in raw["variants"].items():
        events = {event[0] for event in variant["runs"][0][0]["profile"]}
        assert events & {"aten::mm", "aten::addmm"}, (name, sorted(events)[:20])
        python = dict(variant["runs"][0][0]["python_calls"])  # and the Python calls, counted
        assert python.get("torch/nn/modules/module.py:_call_impl", 0) > 0, (name, sorted(python)[:20])
    assert "Python function calls per step on rank 0" in table


@pytest.mark.slow
def test_pipeline_benchmark_end_to_end(tmp_path):
    """Both drivers, GPipe and 1F1B, on 2 gloo ranks at the `tiny` size: every row present, numbers sane. Slow: a
    2-rank launch (9 to 19 s on the 2 shared cores, 36 s at a load average of 20), not an in-process test; the
    fast lane covers the package in-process."""
    args = ["-m", "benchmarks.pipeline", "--world-size", "2", "--size", "tiny", "--microbatches", "4"]
    args += ["--warmup", "1", "--steps", "2", "--repeats", "1", "--out", str(tmp_path)]
    proc = run_script(args, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads((tmp_path / "pipeline_tiny.json").read_text())["results"]
    summary = result["summary"]
    assert set(summary) == {"plain_gpipe_m4", "dpar_gpipe_m4", "plain_1f1b_m4", "dpar_1f1b_m4"}
    for name, s in summary.items():
        assert math.isfinite(s["step_time_ms"]) and s["step_time_ms"] > 0, name
        assert 0 < s["compute_time_ms"] < s["schedule_time_ms"] <= s["step_time_ms"], name
        assert 0 < s["reduce_time_ms"] < s["schedule_time_ms"], name
        assert all(0 <= b <= 1 for b in s["bubble_per_rank"] + s["schedule_bubble_per_rank"]), name
        assert s["bubble"] >= s["schedule_bubble"], name  # the step holds the schedule
        assert s["theoretical_bubble"] == pytest.approx(0.2)
    assert math.isfinite(summary["dpar_1f1b_m4"]["step_time_vs_plain"])
    table = (tmp_path / "pipeline_tiny.md").read_text()
    assert "| GPipe | 4 |" in table and "| 1F1B | 4 |" in table and "| dpar_gpipe_m4 |" in table


@pytest.mark.slow
def test_gpu_check_smoke_end_to_end(tmp_path):
    """`python -m benchmarks.gpu_check --smoke`: the lent GPU's one command at smoke size (GPT and transformers Llama,
    hand loop against the package, eager and compiled; the GPU tests run to their skip on the CPU), two repetitions
    in two processes, merged: every variant of both models has numbers in the table and the JSON. Slow: three
    launches (the GPU tests and two repetitions), ~1 min on an idle 2-core machine."""
    from benchmarks.gpu_check import VARIANTS
    from benchmarks.variants import all_variants

    on_cpu = {v.name for v in all_variants() if "cpu" in v.devices} & set(VARIANTS)  # compiled float8 needs a GPU
    assert {"dpar_fsdp_float8_rowwise_compiled", "dpar_fsdp_float8_tensorwise_compiled"} & on_cpu == set()

    proc = run_script(["-m", "benchmarks.gpu_check", "--smoke", "--repeats", "2", "--out", str(tmp_path)], ROOT, 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (md,) = tmp_path.glob("gpu_check_smoke_*.md")
    result = json.loads(md.with_suffix(".json").read_text())
    assert result["tests"]["tests"] == 25 and not result["tests"]["failed"], result["tests"]
    assert [m["raw"]["preset"] for m in result["models"]] == ["gpu-smoke", "gpu-llama-smoke"]
    table = md.read_text()
    assert "transformers" in table and ("25 skipped" in table or "25 passed" in table)
    for model in result["models"]:
        assert model["raw"]["repeats"] == 2 and not model["raw"]["errors"], model["raw"].get("errors")
        assert set(model["summary"]) == on_cpu
        for name, s in model["summary"].items():
            assert len(s["rep_median_ms"]) == 2 and s["step_time_ms"] > 0 and s["tokens_per_s"] > 0, name
            row = next(line for line in table.splitlines() if line.startswith(f"| {name} | "))
            assert math.isfinite(float(row.split("|")[2])), row
        for name in ("dpar_fsdp", "dpar_fsdp_compiled"):
            assert "overhead_vs_plain" in model["summary"][name] and f"| {name} | " in table
        # selective activation checkpointing, compared with the same policy applied by hand, eager and compiled
        for name in ("dpar_fsdp_selective", "dpar_fsdp_selective_compiled"):
            assert model["summary"][name]["checkpointing"] == "selective"
            assert "overhead_vs_plain" in model["summary"][name] and f"| {name} | " in table
        assert "speedup_vs_eager" in model["summary"]["dpar_fsdp_selective_compiled"]
        # float8 (emulated on the CPU), compared with the same torchao conversion by hand
        for recipe in ("tensorwise", "rowwise"):
            name = f"dpar_fsdp_float8_{recipe}"
            assert model["summary"][name]["setting"] == f"float8_{recipe}"
            assert "overhead_vs_plain" in model["summary"][name] and f"| {name} | " in table
