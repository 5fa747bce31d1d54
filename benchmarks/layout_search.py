"""The layout search checked against measured runs: on 4 CPU ranks, every layout the search considers (all that run:
those that fit and those that do not fit the profile's memory) for the bundled GPT and a tiny transformers Llama,
trained for a few steps each with `FSDPTensorParallelStrategy` and the layout's sizes, compared with its predictions.

    python -m benchmarks.layout_search --profile benchmarks/results/profile_cpu.json --out benchmarks/results

What is measured, per layout (one torchrun launch per model, the layouts in the search's order):
- step time: wall time between the ends of consecutive training steps on rank 0 (ranks move in step), the median of
  the steps after `--warmup`; compared per sample (step time over the global batch), the search's objective;
- the launch first runs the first layout once, unrecorded: a process's first Trainer pays one-time costs (lazy
  initialisation, first page faults) that would otherwise count against whichever layout ran first;
- peak tensor memory (what the cost model predicts, but for the profile's `runtime_memory`): in the last step,
  which is not timed, the bytes of the tensors alive at the step's start (every tensor storage Python reaches that
  the process did not hold before the Trainer: parameter shards, gradients, optimizer state, pipeline buffers) plus
  the most bytes allocated during the step and not yet freed (the CPU allocator's "Total Allocated" under
  `torch.profiler`'s memory profiling, from the step's start); the largest rank's. The GPU counterpart is
  `torch.cuda.max_memory_allocated`. What the step frees of what it found (gradients, by `zero_grad`) was allocated
  before the profiler started and cannot be subtracted: an over-count of at most those bytes;
- peak RSS: each rank's peak RSS growth (VmHWM after `clear_refs`) over its RSS before the Trainer built the model
  (on the meta device, so only this rank's shards are allocated), freed memory returned first (`malloc_trim`), read
  before the profiled step (the profiler's own memory is not the model's); the largest rank's. Besides tensors it
  holds what the allocator keeps of freed memory, Python objects and gloo's buffers, which the profile's
  `runtime_memory` stands for.
Compared: Spearman's rank correlation of predicted and measured time per sample; the chosen layout's measured time
per sample against the measured best; memory error |predicted - measured| / measured per layout, for tensor memory
(the prediction without `runtime_memory`) and for RSS (with it).
Writes `<out>/layout_search_cpu.json` (raw) and `<out>/layout_search_cpu.md` (tables).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("gpt", "llama")
SEQ, BATCH, STEPS = 128, 8, 7  # the last step is profiled for memory, not timed


def build(model: str) -> Any:
    """The LightningModule of `model` (on the current default device)."""
    import lightning as L
    import torch

    from lightning_dpar.examples import GPT

    if model == "gpt":
        return GPT(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=128)
    from transformers import LlamaForCausalLM

    from tests.support.hf_configs import decoder_config

    class Llama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            sizes = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4)
            config = decoder_config(num_key_value_heads=4, max_position_embeddings=SEQ, **sizes)
            self.net = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.net(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Llama()


def strategy_kwargs(model: str) -> dict[str, Any]:
    return {"tp_plan": "auto"} if model == "llama" else {}


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS


def _live_storages() -> dict[int, int]:
    """Every CPU tensor storage Python can reach (parameters, gradients, optimizer state, pipeline buffers, data),
    by address: its bytes. A DTensor is reached through its local tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def _profiled_peak(trace: Path) -> int:
    """The most bytes the CPU allocator had handed out and not taken back since the profiler started. Its "Total
    Allocated" counter is process-wide and not decremented for frees while no profiler runs, so it is taken relative
    to its value before the first event of this profile."""
    events = json.loads(trace.read_text())["traceEvents"]
    memory = [e["args"] for e in sorted(events, key=lambda e: e.get("ts", 0)) if e.get("name") == "[memory]"]
    if not memory:
        return 0
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(0, *(args["Total Allocated"] - start for args in memory))


def _run_layout(model: str, kwargs: dict[str, Any], warmup: int) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader

    from lightning_dpar import FSDPTensorParallelStrategy
    from lightning_dpar.helpers import process_memory

    class Meter(L.Callback):
        """Times every step; profiles the last one's tensor memory."""

        def __init__(self, directory: str, baseline: int) -> None:
            self.baseline = baseline
            self.rss_peak = 0
            self.ends: list[float] = []
            self.trace = Path(directory) / "trace.json"
            self.profiler: Any = None
            self.before = _live_storages()  # what the process held before the Trainer: not this layout's
            self.tensor_peak = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == STEPS - 1:
                self.rss_peak = process_memory("VmHWM") - self.baseline  # the steps before, as none measured
                live = _live_storages()  # before the profiler: its own allocations are not the model's
                self.tensor_peak = sum(size for ptr, size in live.items() if ptr not in self.before)
                self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.profiler.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                self.profiler.export_chrome_trace(str(self.trace))
                self.tensor_peak += _profiled_peak(self.trace)
                self.profiler = None

    vocab = 256 if model == "gpt" else 512
    data = torch.randint(0, vocab, (BATCH * 4 * STEPS, SEQ + (1 if model == "gpt" else 0)))
    _release_memory()
    baseline = process_memory("VmRSS")
    with tempfile.TemporaryDirectory(prefix="dpar-layout-trace-") as directory:
        meter = Meter(directory, baseline)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=int(os.environ["WORLD_SIZE"]),
            strategy=FSDPTensorParallelStrategy(**{**strategy_kwargs(model), **kwargs}),
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[meter],
        )
        with trainer.init_module(empty_init=True):
            module = build(model)
        trainer.fit(module, DataLoader(list(data), batch_size=BATCH))
    timed = meter.ends[:-1]  # the profiled step is not timed
    steps = [b - a for a, b in itertools.pairwise(timed)][max(warmup - 1, 0) :]
    del trainer, module
    return {
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "peak_bytes": meter.rss_peak,
        "tensor_peak_bytes": meter.tensor_peak,
    }


def worker(args: argparse.Namespace) -> None:
    """One rank: every layout of the plan file, in order; rank 0 appends each result to the output file."""
    import torch.distributed as dist

    layouts = json.loads(Path(args.layouts).read_text())
    if layouts:  # a process's first Trainer pays one-time costs (lazy initialisation, first page faults): unrecorded
        _run_layout(args.model, layouts[0]["kwargs"], args.warmup)
    for index, entry in enumerate(layouts):
        try:
            result = _run_layout(args.model, entry["kwargs"], args.warmup)
        except Exception as err:  # a layout that fails is reported, not fatal
            result = {"error": f"{type(err).__name__}: {err}"[:500]}
        for key in ("peak_bytes", "tensor_peak_bytes"):
            peaks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, result.get(key))
            if key in result:
                result[key] = max(peaks)
        if dist.get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"index": index, **result}) + "\n")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def predictions(model: str, profile_path: str, world: int) -> tuple[list[dict[str, Any]], Any]:
    """Every layout that runs, as the search prices it: fitting ones ranked first, then those that do not fit."""
    import torch

    from lightning_dpar.layout_search.probe import search_model
    from lightning_dpar.layout_search.profiles import get_profile

    with torch.device("meta"):
        module = build(model)
    result = search_model(module, world, 1, get_profile(profile_path), BATCH, SEQ, "32-true", strategy_kwargs(model))
    rows = []
    for estimate in result.ranked + result.too_big:
        rows.append(
            {
                "layout": estimate.layout.describe(),
                "kwargs": estimate.layout.strategy_kwargs(),
                "fits": estimate in result.ranked,
                "samples": estimate.samples_per_step,
                "pred_step_s": estimate.time.total,
                "pred_compute_s": estimate.time.compute,
                "pred_comm_s": estimate.time.exposed_communication,
                "pred_bubble_s": estimate.time.bubble,
                "pred_peak_bytes": estimate.memory.total,
                "pred_runtime_bytes": estimate.memory.runtime,
            }
        )
    return rows, result


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank correlation, chosen vs measured best, memory error, over the layouts that ran."""
    ran = [r for r in rows if "step_s" in r]
    if len(ran) < 2:
        return {"layouts_run": len(ran)}
    predicted = [r["pred_step_s"] / r["samples"] for r in ran]
    measured = [r["step_s"] / r["samples"] for r in ran]
    chosen = next((r for r in ran if r["fits"]), ran[0])  # the search's best that ran
    best = min(ran, key=lambda r: r["step_s"] / r["samples"])
    rss = [_error(r["pred_peak_bytes"], r["peak_bytes"]) for r in ran if r["peak_bytes"] > 0]
    tensors = [_error(_predicted_tensors(r), r["tensor_peak_bytes"]) for r in ran if r.get("tensor_peak_bytes")]
    summary = {
        "layouts_run": len(ran),
        "layouts_failed": len(rows) - len(ran),
        "spearman_time_per_sample": spearman(predicted, measured),
        "chosen": chosen["layout"],
        "measured_best": best["layout"],
        "chosen_over_best": (chosen["step_s"] / chosen["samples"]) / (best["step_s"] / best["samples"]),
    }
    for name, errors in (("memory", tensors), ("rss", rss)):
        if errors:
            summary[f"{name}_error_median"] = statistics.median(errors)
            summary[f"{name}_error_max"] = max(errors)
            summary[f"{name}_within_25pct"] = sum(e <= 0.25 for e in errors)
    return summary


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _predicted_tensors(row: dict[str, Any]) -> int:
    """The predicted peak without the profile's runtime memory: what the tensors alone should take."""
    return row["pred_peak_bytes"] - row.get("pred_runtime_bytes", 0)


def _memory_line(summary: dict[str, Any], name: str, what: str) -> list[str]:
    if f"{name}_error_median" not in summary:
        return []
    return [
        f"- {what} error |pred - meas| / meas: median **{summary[f'{name}_error_median']:.0%}**, max"
        f" **{summary[f'{name}_error_max']:.0%}**; within 25%: {summary[f'{name}_within_25pct']} of"
        f" {summary['layouts_run']}"
    ]


def _mib(n: float | None) -> str:
    return f"{n / 2**20:.1f}" if n is not None else ""


def markdown(model: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [f"### {model}", ""]
    if "spearman_time_per_sample" in summary:
        lines += [
            f"- layouts run: {summary['layouts_run']} (failed: {summary['layouts_failed']})",
            f"- Spearman rank correlation, predicted vs measured time per sample:"
            f" **{summary['spearman_time_per_sample']:.3f}** (target >= 0.8)",
            f"- chosen: {summary['chosen']}; measured best: {summary['measured_best']}; chosen / best time per"
            f" sample: **{summary['chosen_over_best']:.2f}** (target <= 1.10)",
            *_memory_line(summary, "memory", "peak tensor memory (target: within 25%)"),
            *_memory_line(summary, "rss", "peak RSS, with the profile's runtime memory,"),
            "",
        ]
    lines += [
        "| # | layout | fits | pred step | meas step | pred ms/sample | meas ms/sample | pred tensors MiB"
        " | meas tensors MiB | pred RSS MiB | meas RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, start=1):
        pred_memory = (
            f"{_mib(_predicted_tensors(r))} | {_mib(r.get('tensor_peak_bytes'))} | {_mib(r['pred_peak_bytes'])}"
        )
        meas = (
            f"{r['step_s'] * 1e3:.0f} ms | {r['pred_step_s'] / r['samples'] * 1e3:.2f} |"
            f" {r['step_s'] / r['samples'] * 1e3:.2f} | {pred_memory} | {_mib(r['peak_bytes'])}"
            if "step_s" in r
            else f"{r.get('error', 'not run')[:80]} | | | {pred_memory} |"
        )
        lines.append(
            f"| {i} | {r['layout']} | {'yes' if r['fits'] else 'no'} | {r['pred_step_s'] * 1e3:.0f} ms | {meas} |"
        )
    return "\n".join(lines) + "\n"


def run_model(model: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, _ = predictions(model, args.profile, args.world_size)
    if args.limit:
        rows = rows[: args.limit]
    with tempfile.TemporaryDirectory(prefix="dpar-layout-bench-") as directory:
        plan, out = Path(directory) / "layouts.json", Path(directory) / "results.jsonl"
        plan.write_text(json.dumps([{"kwargs": r["kwargs"]} for r in rows]))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            "-m",
            "benchmarks.layout_search",
            "--worker",
            "--model",
            model,
            "--layouts",
            str(plan),
            "--out",
            str(out),
            "--warmup",
            str(args.warmup),
        ]
        subprocess.run(command, timeout=args.timeout)
        measured = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    for entry in measured:
        rows[entry.pop("index")].update(entry)
    return rows, summarize(rows)


def rescore(model: str, args: argparse.Namespace, measured: list[dict[str, Any]]) -> tuple[list, dict[str, Any]]:
    """The current predictions against an earlier run's measurements, matched by layout."""
    rows, _ = predictions(model, args.profile, args.world_size)
    by_layout = {row["layout"]: row for row in measured}
    kept = []
    for row in rows:
        old = by_layout.get(row["layout"])
        if old is not None:
            row.update({k: v for k, v in old.items() if not k.startswith("pred_") and k not in ("fits", "kwargs")})
            kept.append(row)
    return kept, summarize(kept)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="benchmarks/results/profile_cpu.json")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="run only the first N layouts (0: all)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument(
        "--rescore",
        help="an earlier run's raw JSON: predict again (current cost model, profile) against its measurements",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        worker(args)
        return
    raw, text = {}, ["# Layout search: predicted against measured (4 CPU ranks, gloo)", ""]
    text.append(f"Profile: `{args.profile}`; {BATCH} sequences of {SEQ} tokens per data-parallel rank; {STEPS} steps")
    text.append(
        f"per layout, the median step after {args.warmup} warm-up steps. Written by `benchmarks/layout_search.py`."
    )
    text.append("")
    earlier = json.loads(Path(args.rescore).read_text()) if args.rescore else {}
    if args.rescore:
        text[-2] += f" Measurements of `{args.rescore}`, predicted again."
    for model in args.models.split(","):
        rows, summary = rescore(model, args, earlier[model]["rows"]) if args.rescore else run_model(model, args)
        raw[model] = {"rows": rows, "summary": summary}
        text.append(markdown(model, rows, summary))
        print(text[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout_search_cpu.json").write_text(json.dumps(raw, indent=1) + "\n")
    (out / "layout_search_cpu.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
