"""The benchmark suite's arithmetic (`benchmarks/`) on known numbers, in process: summaries, ratios and targets,
presets, MFU, overhead tables, the pipeline summary and timer, the GPU check's merge, table and test counts. The tiny
end-to-end runs that keep the commands working are in `tests/launched/test_benchmarks.py`."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check import device_slug, gpu_tests_line, junit_counts, merge
from benchmarks.model import PRESETS, Size, parameter_count
from benchmarks.overhead import overhead_markdown, per_step_events, python_calls_per_step
from benchmarks.report import check_markdown, markdown, summarize


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
    assert "Python function calls" not in table  # no counts recorded: no table


def test_python_calls_per_step_and_the_functions_that_differ():
    def run(calls):
        rank = {**_rank(50.0, 1.0), "profile": [], "python_calls": calls}
        return [rank, rank]

    same, extra = ["torch/nn/modules/module.py:_call_impl", 40], ["lightning_dpar/conformance/buffers.py:x", 8]
    raw = {
        **RAW,
        "preset": "cpu",
        "steps": 4,
        "repeats": 2,
        "variants": {"plain_2d": {"runs": [run([same])] * 2}, "dpar_2d": {"runs": [run([same, extra])] * 2}},
    }
    calls = python_calls_per_step(raw)
    assert calls["dpar_2d"] == {same[0]: 10.0, extra[0]: 2.0}  # 80 calls over 8 steps; rank 0 only
    table = overhead_markdown(raw)
    assert "| plain_2d | 10 | 1.000 |" in table and "| dpar_2d | 12 | 1.200 |" in table
    differing = table.split("Functions whose calls per step differ most")[1].splitlines()
    assert differing[4] == f"| `{extra[0]}` | 0 | 2 |"  # the largest difference first


def test_the_clock_counts_python_calls_in_its_profile_window():
    import torch

    from benchmarks.clock import StepClock

    def work(n: int) -> None:
        for _ in range(n):
            abs(-1)

    clock = StepClock(torch.device("cpu"), profile_window=(1, 3))
    clock.start()
    for step in range(4):
        work(5 if step in (1, 2) else 50)  # the steps after the first tick and up to the third are profiled
        clock.tick()
    counted = dict(clock.python_calls)
    assert counted["tests/unit/test_benchmarks.py:work"] == 2
    assert counted["<built-in method builtins.abs>"] == 10


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


def test_llama_preset_is_the_issue_s_1b_llama():
    pytest.importorskip("transformers")
    llama = PRESETS["gpu-llama"].size
    assert (llama.dim, llama.depth, llama.heads, llama.kv_heads, llama.vocab) == (2048, 16, 16, 8, 32000)
    assert (llama.batch, llama.seq) == (4, 2048) and PRESETS["gpu-llama"].precision == "bf16-mixed"
    assert 1.0e9 < parameter_count(llama) < 1.2e9
    tiny = PRESETS["gpu-llama-smoke"].size
    matmul_params = parameter_count(tiny) - tiny.vocab * tiny.dim  # rotary: no position table
    assert tiny.flops_per_token() == 6 * matmul_params + 12 * tiny.depth * tiny.dim * tiny.seq


def _check_raw(plain_peak: int, dpar_peak: int, dpar_ms: float) -> dict:
    def variant(driver, compiled, ms, peak):
        v = _variant("fsdp", driver, compiled, ms, 12.0)
        run = [{**v["runs"][0][0], "peak_memory_bytes": peak * 1024**2, "memory_at_reset_bytes": 1024**2}]
        return {**v, "runs": [run]}

    return {
        **RAW,
        "world_size": 1,
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "precision": "bf16-mixed",
        "preset": "gpu",
        "repeats": 1,
        "wall_s": 10.0,
        "size_description": "GPT decoder",
        "variants": {
            "plain_fsdp": variant("plain", False, 100.0, plain_peak),
            "dpar_fsdp": variant("dpar", False, dpar_ms, dpar_peak),
        },
    }


def test_gpu_check_merges_repetitions_and_tables_ratios_against_the_hand_loop():
    first, second = _check_raw(1000, 1020, 100.5), _check_raw(1000, 1100, 103.0)
    second["errors"] = {"dpar_fsdp": ["RuntimeError: boom"]}
    (merged,) = merge([[first], [second]])
    assert merged["repeats"] == 2 and len(merged["variants"]["dpar_fsdp"]["runs"]) == 2
    assert merged["errors"] == {"dpar_fsdp": ["RuntimeError: boom"]} and "errors" not in first  # inputs untouched
    summary = summarize(merged)
    dpar = summary["dpar_fsdp"]
    assert dpar["memory_vs_plain"] == pytest.approx(1.1)  # the highest peak of the repetitions
    assert dpar["memory_at_reset_mib"] == pytest.approx(1.0)
    assert dpar["rep_median_ms"] == pytest.approx([100.5, 103.0])
    table = check_markdown(merged, summary)
    assert "| plain_fsdp | 100.0 | 100.0-100.0 |" in table and "hand loop" in table
    assert "1.018 (+1.8%) ❌" in table and "1.100 (+10.0%) ❌" in table  # targets: 1% time, 3% memory
    within = summarize(_check_raw(1000, 1020, 100.5))["dpar_fsdp"]
    assert within["memory_vs_plain"] == pytest.approx(1.02)
    assert "1.005 (+0.5%) ✅" in check_markdown(_check_raw(1000, 1020, 100.5), {"dpar_fsdp": within})
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_gpu_check_counts_the_gpu_tests(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase name="test_a"/><testcase name="test_b"><failure message="assert 1 &lt; 0&#10;more"/></testcase>'
        '<testcase name="test_c"><error message="RuntimeError: nccl"/></testcase>'
        '<testcase name="test_d"><skipped/></testcase></testsuite></testsuites>'
    )
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failures"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["failed"] == ["test_b: assert 1 < 0", "test_c: RuntimeError: nccl"]
    line = gpu_tests_line({"command": "pytest -m gpu", "wall_s": 28.0, **counts})
    assert "1 passed, 1 failed, 1 errors, 1 skipped in 28 s" in line and "- failed: `test_b: assert 1 < 0`" in line


def test_gpu_check_repetitions_rotate_stop_at_the_budget_and_survive_a_failed_launch(monkeypatch):
    import subprocess

    from benchmarks import gpu_check

    calls = []

    def fake_launch(args, world, presets, extra, timeout):
        offset = int(extra[extra.index("--repeat-offset") + 1])
        calls.append((args.repeats, presets, offset, timeout))
        if offset == 1:
            raise subprocess.CalledProcessError(1, "torchrun")
        return [_check_raw(1000, 1000, 100.0)]

    monkeypatch.setattr(gpu_check, "launch_worker", fake_launch)
    args = gpu_check.parse_args(["--smoke", "--repeats", "3", "--device", "cpu"])
    (merged,), notes = gpu_check.run_benchmark(args, float("inf"))
    assert [c[2] for c in calls] == [0, 1, 2] and {c[0] for c in calls} == {1}  # one repetition per process
    assert calls[0][1] == ["gpu-smoke", "gpu-llama-smoke"] and calls[0][3] is None
    assert merged["repeats"] == 2 and len(notes) == 1 and notes[0].startswith("Repetition 1 failed")
    calls.clear()
    (merged,), notes = gpu_check.run_benchmark(args, 0.0)  # a deadline long past: the first repetition only
    assert (
        len(calls) == 1
        and merged["repeats"] == 1
        and notes == ["Stopped after 1 of 3 repetitions: the next would pass --budget-s."]
    )


def test_one_setup_pass_computes_each_fact_of_the_plan_once(gloo_world):
    """`python -m benchmarks.setup_pass`: the plan, its top-level units, the tied parameters and the meshes each once
    per pass (before issue 33: the plan twice, the top-level units five times), through folders in layers."""
    from benchmarks.setup_pass import modules_touched

    touched, facts = modules_touched("dpar_fsdp")
    assert facts["parallelize.plan_modules"] == 1
    assert facts["structure.data_parallel_roots"] == 1
    assert facts["ties.tied_parameters"] == 1
    assert facts["parallel_dims.build"] == 1
    assert "lightning_dpar.parallel.parallelize" in touched and "lightning_dpar.estimates.dry_run" not in touched
