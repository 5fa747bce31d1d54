"""The benchmark suite: its arithmetic on known numbers, and one tiny end-to-end run so the command keeps working."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.model import PRESETS, Size, parameter_count
from benchmarks.overhead import overhead_markdown, per_step_events
from benchmarks.report import markdown, summarize
from tests.conftest import ROOT, run_script


def _rank(step_ms: float, state_mib: float, checkpoint: dict | None = None) -> dict:
    return {
        "step_times": [1.0] + [step_ms / 1e3] * 4,  # the first (warm-up) step is slow and must be ignored
        "cpu_times": [1.0] + [step_ms / 2e3] * 4,
        "peak_memory_bytes": 100 * 1024**2,
        "state_bytes": {"params": int(state_mib * 1024**2 / 3), "optimizer": int(state_mib * 1024**2 * 2 / 3)},
        "checkpoint": checkpoint or {},
    }


def _variant(family: str, driver: str, compiled: bool, step_ms: float, state_mib: float, checkpoint=None) -> dict:
    run = [_rank(step_ms, state_mib, checkpoint) for _ in range(2)]
    return {"family": family, "driver": driver, "compiled": compiled, "runs": [run, run]}


RAW = {
    "world_size": 2,
    "device": "cpu",
    "device_name": "test CPU",
    "cpu_count": 2,
    "torch": "x",
    "lightning": "y",
    "size": {"dim": 8, "hidden": 16, "depth": 2, "seq": 4, "batch": 8},
    "warmup": 1,
    "steps": 4,
    "repeats": 2,
    "variants": {
        "plain_ddp": _variant("replicate", "plain", False, 100.0, 24.0),
        "lightning_ddp": _variant("replicate", "lightning", False, 110.0, 24.0, {"save_s": 1.0, "load_s": 1.0}),
        "dpar_replicate": _variant(
            "replicate",
            "dpar",
            False,
            102.0,
            24.0,
            {
                "save_s": 1.0,
                "load_s": 1.0,
                "async_blocked_first_s": 0.3,
                "async_blocked_s": 0.1,
                "async_total_s": 1.2,
            },
        ),
        "plain_fsdp": _variant("fsdp", "plain", False, 200.0, 12.0),
        "dpar_fsdp": _variant("fsdp", "dpar", False, 210.0, 12.5),
    },
}


def test_summary_ratios_and_targets():
    summary = summarize(RAW)
    replicate = summary["dpar_replicate"]
    assert replicate["step_time_ms"] == pytest.approx(102.0)  # warm-up step excluded
    assert replicate["samples_per_s"] == pytest.approx(8 * 2 / 0.102)
    assert replicate["overhead_vs_plain"] == pytest.approx(0.02) and replicate["meets_overhead_target"]
    assert replicate["throughput_vs_lightning_peer"] == pytest.approx(110 / 102) and replicate["meets_peer_parity"]
    assert replicate["cpu_time_ms"] == pytest.approx(51.0) and replicate["cpu_overhead_vs_plain"] == pytest.approx(0.02)
    assert replicate["checkpoint"]["async_blocked_over_sync"] == pytest.approx(0.1) and replicate["meets_async_target"]
    fsdp = summary["dpar_fsdp"]
    assert fsdp["overhead_vs_plain"] == pytest.approx(0.05) and not fsdp["meets_overhead_target"]
    assert fsdp["state_vs_replicate"] == pytest.approx(12.5 / 24, rel=1e-3)
    assert fsdp["meets_sharding_target"]  # within 10% of 1/2
    table = markdown(RAW, summary)
    assert "| dpar_fsdp | 210.0 |" in table and "+5.0%) ❌" in table


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


def test_presets_sizes_and_flops():
    gpu = PRESETS["gpu"]
    assert 0.9e9 < parameter_count(gpu.size) < 1.3e9  # "~1B-parameter decoder"
    assert gpu.precision == "bf16-mixed" and gpu.world_sizes == (1,)
    assert set(gpu.families) == {"fsdp", "2d"} and "plain" in gpu.drivers and "dpar" in gpu.drivers
    # fp32 parameters, gradients and two AdamW moments: 16 bytes per parameter, well inside 60 GB with activations.
    assert parameter_count(gpu.size) * 16 < 20e9
    large = PRESETS["cpu-large"].size
    assert (large.kind, large.depth, large.dim) == ("gpt", 8, 512)
    tiny = Size(dim=8, hidden=0, depth=2, seq=4, batch=1, kind="gpt", heads=2, vocab=16)
    matmul_params = parameter_count(tiny) - (16 + 4) * 8  # embedding lookups are not matmuls
    assert tiny.flops_per_token() == 6 * matmul_params + 12 * 2 * 8 * 4
    mlp = PRESETS["cpu"].size
    assert mlp.flops_per_token() == 6 * parameter_count(mlp)


def test_mfu_and_compile_speedup_on_known_numbers():
    raw = {
        **RAW,
        "world_size": 1,
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "precision": "bf16-mixed",
        "flops_per_token": 1e9,
        "tensor_parallel_size": 1,
        "variants": {
            "plain_fsdp": _variant("fsdp", "plain", False, 100.0, 12.0),
            "plain_fsdp_compiled": _variant("fsdp", "plain", True, 80.0, 12.0),
            "dpar_fsdp_compiled": _variant("fsdp", "dpar", True, 82.0, 12.0),
        },
    }
    summary = summarize(raw)
    tokens_per_s = 8 * 4 / 0.082  # batch x seq x data-parallel ranks / step
    assert summary["dpar_fsdp_compiled"]["tokens_per_s"] == pytest.approx(tokens_per_s)
    assert summary["dpar_fsdp_compiled"]["mfu"] == pytest.approx(1e9 * tokens_per_s / 989.4e12)
    assert summary["plain_fsdp_compiled"]["speedup_vs_eager"] == pytest.approx(100 / 80 - 1)
    assert summary["dpar_fsdp_compiled"]["overhead_vs_plain"] == pytest.approx(82 / 80 - 1)
    table = markdown(raw, summary)
    assert "| plain_fsdp_compiled | 80.0 |" in table and "+25.0%" in table
    assert "async save" not in table  # no checkpoint timings, no checkpoint table
    assert summarize({**raw, "device": "cpu"})["dpar_fsdp_compiled"]["mfu"] is None  # no peak FLOPs on CPU


def test_overhead_tables_per_step():
    def run(events):
        rank = {**_rank(50.0, 1.0), "profile": events}
        return [rank, rank]

    raw = {
        **RAW,
        "preset": "cpu",
        "steps": 4,
        "repeats": 2,
        "variants": {
            "plain_2d": {"runs": [run([["aten::mm", 8, 400.0, 400.0]])] * 2},
            "dpar_2d": {
                "runs": [run([["aten::mm", 8, 400.0, 400.0], ["[Strategy]X.training_step", 4, 80.0, 2000.0]])] * 2
            },
        },
    }
    events = per_step_events(raw)
    assert events["plain_2d"]["aten::mm"] == pytest.approx((2.0, 0.1, 0.1))  # 16 calls, 800 us over 8 steps
    assert events["dpar_2d"]["[Strategy]X.training_step"] == pytest.approx((1.0, 0.02, 0.5))
    table = overhead_markdown(raw)
    assert "| `[Strategy]X.training_step` |  | 1: 0.02 / 0.50 |" in table  # a hook only dpar_2d has
    assert "| `aten::mm` | 2: 0.10 / 0.10 | 2: 0.10 / 0.10 |" in table
    differing = table.split("Ops called a different number")[1].split("Ops with the largest")[0]
    assert "aten::mm" not in differing  # same calls in both: not listed as extra work
    assert "| dpar_2d | 50.0 | 25.0 | 0.1 | 0.1 |" in table


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


def _pipeline_rank(step_s: float, schedule_s: float, compute_s: float) -> dict:
    """One rank's run of the pipeline benchmark: a slow warm-up step, then three identical timed steps."""
    return {
        "step_times": [1.0] + [step_s] * 3,
        "cpu_times": [1.0] + [step_s / 2] * 3,
        "peak_memory_bytes": 0,
        "state_bytes": {"params": 0, "optimizer": 0},
        "schedule": [[0.9, 0.1, 0.5]] + [[schedule_s, compute_s, 0.002]] * 3,
    }


def test_pipeline_summary_bubble_and_ratio_on_known_numbers():
    from benchmarks.pipeline import markdown, summarize, theoretical_bubble

    def case(driver: str, ranks: list[dict]) -> dict:
        return {"driver": driver, "schedule": "1F1B", "microbatches": 4, "runs": [ranks, ranks]}

    raw = {
        "world_size": 2,
        "pipeline_size": 2,
        "device": "cpu",
        "device_name": "test CPU",
        "cpu_count": 2,
        "load_average_before": [1.0, 1.0, 1.0],
        "load_average_after": [2.0, 1.0, 1.0],
        "torch": "x",
        "lightning": "y",
        "size": {"dim": 8, "hidden": 16, "depth": 2, "seq": 4, "batch": 8},
        "size_description": "test model",
        "warmup": 1,
        "steps": 3,
        "repeats": 2,
        "wall_s": 3.0,
        "cases": {
            "plain_1f1b_m4": case("plain", [_pipeline_rank(0.100, 0.080, 0.060)] * 2),
            "dpar_1f1b_m4": case("dpar", [_pipeline_rank(0.110, 0.090, 0.060), _pipeline_rank(0.110, 0.090, 0.045)]),
        },
    }
    summary = summarize(raw)
    plain, dpar = summary["plain_1f1b_m4"], summary["dpar_1f1b_m4"]
    assert plain["step_time_ms"] == pytest.approx(100.0)  # the warm-up step is left out
    assert plain["bubble"] == pytest.approx(0.4) and plain["schedule_bubble"] == pytest.approx(0.25)
    assert dpar["schedule_bubble_per_rank"] == pytest.approx([1 / 3, 0.5])
    assert dpar["schedule_bubble"] == pytest.approx(5 / 12)
    assert dpar["bubble_per_rank"] == pytest.approx([1 - 60 / 110, 1 - 45 / 110])
    assert dpar["step_time_vs_plain"] == pytest.approx(1.1) and dpar["cpu_time_ms"] == pytest.approx(55.0)
    assert dpar["theoretical_bubble"] == theoretical_bubble(2, 4) == pytest.approx(0.2)
    table = markdown(raw, summary)
    assert "| 1F1B | 4 | 100.0 | 110.0 | 1.100 | 1.100 | 0.400 / 0.523 | 0.250 / 0.417 | 0.200 |" in table
    assert dpar["reduce_time_ms"] == pytest.approx(2.0)
    row = "| dpar_1f1b_m4 | 110.0 | 110.0, 110.0 | 55.0 | 90.0 | 52.5 | 13.1 | 2.0 | 0.455, 0.591 | 0.333, 0.500 |"
    assert row in table


def test_pipeline_timer_restores_torch_classes():
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from benchmarks.pipeline import ScheduleTimer

    before = (PipelineStage.forward_one_chunk, PipelineStage.perform_reduce_grad, ScheduleGPipe.step)
    with ScheduleTimer(torch.device("cpu")).instrument(ScheduleGPipe):
        assert PipelineStage.forward_one_chunk is not before[0] and ScheduleGPipe.step is not before[2]
        assert PipelineStage.perform_reduce_grad is not before[1]
    assert (PipelineStage.forward_one_chunk, PipelineStage.perform_reduce_grad, ScheduleGPipe.step) == before
    assert "step" not in vars(ScheduleGPipe) and "forward_one_chunk" not in vars(PipelineStage)  # inherited again


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
