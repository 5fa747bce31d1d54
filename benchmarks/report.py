"""Turn the workers' raw measurements into summary numbers (JSON) and markdown tables, with the targets checked:
step-time overhead over the plain loop <= 3%, at least parity with each Lightning peer, async save blocking <= 1/5
of the sync save, and FSDP per-rank parameter+optimizer memory ~1/N of replicate's. `check_markdown` is the
`benchmarks.gpu_check` table: step time and peak memory against the hand-written loop (1% and 3%)."""

from __future__ import annotations

import statistics
from typing import Any

OVERHEAD_TARGET = 0.03
ASYNC_BLOCK_TARGET = 0.2
#: Per-rank FSDP state within this factor of the ideal 1/N (padding of uneven shards, replicated biases under TP).
SHARDING_SLACK = 1.10
MIB = 1024**2


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-variant medians and ratios for one world size."""
    world, warmup = raw["world_size"], raw["warmup"]
    size = raw["size"]
    out: dict[str, Any] = {}
    for name, variant in raw["variants"].items():
        rank0_runs = [run[0] for run in variant["runs"]]
        measured = [t for run in rank0_runs for t in run["step_times"][warmup:]]
        rep_medians = [statistics.median(run["step_times"][warmup:]) for run in rank0_runs]
        cpu_measured = [t for run in rank0_runs for t in run["cpu_times"][warmup:]]
        dp = world // raw.get("tensor_parallel_size", 2) if variant["family"] == "2d" else world
        step = statistics.median(measured)
        checkpoint_keys = sorted({k for run in rank0_runs for k in run["checkpoint"]})
        out[name] = {
            **{k: variant[k] for k in ("family", "driver", "compiled")},
            "checkpointing": variant.get("checkpointing", ""),
            "setting": variant.get("setting", variant.get("checkpointing", "")),
            "step_time_ms": step * 1e3,
            "rep_median_ms": [m * 1e3 for m in rep_medians],
            "cpu_time_ms": statistics.median(cpu_measured) * 1e3,
            "samples_per_s": size["batch"] * dp / step,
            "tokens_per_s": size["batch"] * size["seq"] * dp / step,
            "mfu": _mfu(raw, size["batch"] * size["seq"] * dp / step),
            "peak_memory_mib_per_rank": [
                max(run[r]["peak_memory_bytes"] for run in variant["runs"]) / MIB for r in range(world)
            ],
            # What was still allocated when each repetition started (~0 unless an earlier variant leaked).
            "memory_at_reset_mib": max(run.get("memory_at_reset_bytes", 0) for run in rank0_runs) / MIB,
            "state_mib_per_rank": [
                (variant["runs"][0][r]["state_bytes"]["params"] + variant["runs"][0][r]["state_bytes"]["optimizer"])
                / MIB
                for r in range(world)
            ],
            "checkpoint": {k: statistics.median(run["checkpoint"][k] for run in rank0_runs) for k in checkpoint_keys},
        }
    for name, s in out.items():
        plain = _plain_name(s["family"], s["compiled"], s["setting"])
        if plain in out and s["driver"] != "plain":
            s["throughput_vs_plain"] = out[plain]["step_time_ms"] / s["step_time_ms"]
            s["overhead_vs_plain"] = s["step_time_ms"] / out[plain]["step_time_ms"] - 1
            s["meets_overhead_target"] = s["overhead_vs_plain"] <= OVERHEAD_TARGET
            s["cpu_overhead_vs_plain"] = s["cpu_time_ms"] / out[plain]["cpu_time_ms"] - 1
            plain_peak = max(out[plain]["peak_memory_mib_per_rank"])
            if plain_peak > 0:
                s["memory_vs_plain"] = max(s["peak_memory_mib_per_rank"]) / plain_peak
        if s["compiled"]:
            eager = out.get(_eager_name(name))
            if eager is not None:
                s["speedup_vs_eager"] = eager["step_time_ms"] / s["step_time_ms"] - 1
        peer = _peer_name(s["family"])
        if s["driver"] == "dpar" and not s["compiled"] and peer in out:
            s["throughput_vs_lightning_peer"] = out[peer]["step_time_ms"] / s["step_time_ms"]
            s["meets_peer_parity"] = s["throughput_vs_lightning_peer"] >= 1 - OVERHEAD_TARGET
            s["cpu_vs_lightning_peer"] = s["cpu_time_ms"] / out[peer]["cpu_time_ms"] - 1
        ckpt = s["checkpoint"]
        if "async_blocked_s" in ckpt:
            ckpt["async_blocked_over_sync"] = ckpt["async_blocked_s"] / ckpt["save_s"]
            s["meets_async_target"] = ckpt["async_blocked_over_sync"] <= ASYNC_BLOCK_TARGET
    replicate = out.get("dpar_replicate")
    for s in out.values():
        if replicate and s["family"] in ("fsdp", "2d"):
            ratio = max(s["state_mib_per_rank"]) / max(replicate["state_mib_per_rank"])
            s["state_vs_replicate"] = ratio
            s["meets_sharding_target"] = ratio <= SHARDING_SLACK / world
    return out


def _mfu(raw: dict[str, Any], tokens_per_s: float) -> float | None:
    """Model FLOPs utilisation: model FLOP/s over the peak of all ranks' devices, where both are known."""
    if raw["device"] != "cuda":
        return None
    peak = peak_flops(raw.get("device_name") or "", raw.get("precision", "32-true"))
    flops_per_token = raw.get("flops_per_token")
    if not peak or not flops_per_token:
        return None
    return flops_per_token * tokens_per_s / (peak * raw["world_size"])


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one GPU for the compute dtype of `precision` (the `PerformanceMonitor` table)."""
    from lightning_dpar.performance_monitor import PEAK_FLOPS

    dtype = "bf16" if "bf16" in precision else "tf32"  # the benchmark enables TF32 matmuls for fp32
    return next((table[dtype] for fragment, table in PEAK_FLOPS.items() if fragment in device_name), None)


def _eager_name(compiled_name: str) -> str:
    return compiled_name.removesuffix("_compiled")


def _plain_name(family: str, compiled: bool, setting: str = "") -> str:
    """The hand loop a variant is compared with: the same family, compilation and setting (activation
    checkpointing, float8: `Variant.setting`)."""
    base = {"replicate": "plain_ddp", "fsdp": "plain_fsdp", "2d": "plain_2d"}[family]
    return base + (f"_{setting}" if setting else "") + ("_compiled" if compiled else "")


def _peer_name(family: str) -> str:
    return {"replicate": "lightning_ddp", "fsdp": "lightning_fsdp", "2d": "lightning_model_parallel"}[family]


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✅" if ok else " ❌")


def markdown(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    world = raw["world_size"]
    size = raw["size"]
    description = raw.get("size_description") or (
        f"{size['depth']} residual MLP blocks, dim {size['dim']}, hidden {size['hidden']}"
    )
    preset = raw.get("preset", raw["device"])
    lines = [
        f"### Preset `{preset}`, {world} ranks ({raw['device']}, {raw['device_name'] or 'unknown CPU'},"
        f" {raw['cpu_count']} cores)",
        "",
        f"Model: {description}; batch {size['batch']} x {size['seq']} tokens per data-parallel rank; AdamW;"
        f" precision {raw.get('precision', '32-true')}. 2D runs: tensor-parallel size"
        f" {raw.get('tensor_parallel_size', 2)}. Medians of {raw['steps']} steps after {raw['warmup']} warm-up steps,"
        f" {raw['repeats']} interleaved repetitions (range: the repetitions' medians). torch {raw['torch']}, lightning"
        f" {raw['lightning']}.",
        "",
        "| variant | step (ms) | range (ms) | tokens/s | MFU | vs plain loop | vs Lightning peer | compiled vs eager"
        " | CPU/step (ms) | CPU vs plain | CPU vs peer"
        f" | {'peak CUDA memory' if raw['device'] == 'cuda' else 'RSS growth'}/rank (MiB) | params+optim/rank (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        cpu_plain = f"{s['cpu_overhead_vs_plain']:+.1%}" if "cpu_overhead_vs_plain" in s else ""
        cpu_peer = f"{s['cpu_vs_lightning_peer']:+.1%}" if "cpu_vs_lightning_peer" in s else ""
        vs_plain = (
            f"{s['throughput_vs_plain']:.3f} ({s['overhead_vs_plain']:+.1%}){_mark(s['meets_overhead_target'])}"
            if "throughput_vs_plain" in s
            else "baseline"
            if s["driver"] == "plain"
            else ""
        )
        vs_peer = (
            f"{s['throughput_vs_lightning_peer']:.3f}{_mark(s['meets_peer_parity'])}"
            if "throughput_vs_lightning_peer" in s
            else ""
        )
        state = f"{max(s['state_mib_per_rank']):.1f}"
        if "state_vs_replicate" in s:
            state += f" ({s['state_vs_replicate']:.2f}x repl.){_mark(s['meets_sharding_target'])}"
        lo, hi = min(s["rep_median_ms"]), max(s["rep_median_ms"])
        mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else ""
        vs_eager = f"{s['speedup_vs_eager']:+.1%}" if "speedup_vs_eager" in s else ""
        lines.append(
            f"| {name} | {s['step_time_ms']:.1f} | {lo:.1f}-{hi:.1f} | {s['tokens_per_s']:,.0f} | {mfu} | {vs_plain}"
            f" | {vs_peer} | {vs_eager} | {s['cpu_time_ms']:.1f} | {cpu_plain} | {cpu_peer}"
            f" | {max(s['peak_memory_mib_per_rank']):.0f} | {state} |"
        )
    if not any(s["checkpoint"] for s in summary.values()):
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "| variant | save (s) | load (s) | async save: blocked, first (s) | blocked, steady (s)"
        " | async total (s) | steady blocked / save |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        c = s["checkpoint"]
        if not c:
            continue
        cells = [f"{c['save_s']:.3f}", f"{c['load_s']:.3f}"]
        if "async_blocked_s" in c:
            cells += [
                f"{c['async_blocked_first_s']:.3f}",
                f"{c['async_blocked_s']:.3f}",
                f"{c['async_total_s']:.3f}",
                f"{c['async_blocked_over_sync']:.2f}{_mark(s['meets_async_target'])}",
            ]
        else:
            cells += ["", "", "", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: `benchmarks.gpu_check`'s targets against the hand-written loop (issue 31): step time within 1%, peak memory
#: within 3%.
CHECK_TIME_TARGET = 0.01
CHECK_MEMORY_TARGET = 0.03


def check_markdown(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    """One model's `benchmarks.gpu_check` table: the package against the hand-written loop, eager and compiled."""
    size = raw["size"]
    memory = "peak CUDA memory" if raw["device"] == "cuda" else "RSS growth"
    lines = [
        f"#### {raw.get('size_description', raw['preset'])}",
        "",
        f"Preset `{raw['preset']}`; batch {size['batch']} x {size['seq']} tokens; AdamW; {raw['precision']};"
        f" medians of {raw['steps']} steps after {raw['warmup']} warm-up steps, over {raw['repeats']} interleaved"
        f" repetitions (range: the repetitions' medians).",
        "",
        f"| variant | step (ms) | range (ms) | tokens/s | MFU | step vs hand loop | compiled vs eager | {memory} (MiB)"
        " | memory vs hand loop | held at reset (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        lo, hi = min(s["rep_median_ms"]), max(s["rep_median_ms"])
        mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else ""
        step_ratio = memory_ratio = "hand loop" if s["driver"] == "plain" else ""
        if "overhead_vs_plain" in s:
            ok = s["overhead_vs_plain"] <= CHECK_TIME_TARGET
            step_ratio = f"{1 + s['overhead_vs_plain']:.3f} ({s['overhead_vs_plain']:+.1%}){_mark(ok)}"
        if "memory_vs_plain" in s:
            ok = s["memory_vs_plain"] - 1 <= CHECK_MEMORY_TARGET
            memory_ratio = f"{s['memory_vs_plain']:.3f} ({s['memory_vs_plain'] - 1:+.1%}){_mark(ok)}"
        vs_eager = f"{s['speedup_vs_eager']:+.1%}" if "speedup_vs_eager" in s else ""
        lines.append(
            f"| {name} | {s['step_time_ms']:.1f} | {lo:.1f}-{hi:.1f} | {s['tokens_per_s']:,.0f} | {mfu}"
            f" | {step_ratio} | {vs_eager} | {max(s['peak_memory_mib_per_rank']):,.0f} | {memory_ratio}"
            f" | {s['memory_at_reset_mib']:,.1f} |"
        )
    return "\n".join(lines) + "\n"
