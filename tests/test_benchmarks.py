"""The benchmark suite: its arithmetic on known numbers, and one tiny end-to-end run so the command keeps working."""

from __future__ import annotations

import json

import pytest

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
