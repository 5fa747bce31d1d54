"""One benchmark run on N ranks (started by `benchmarks.run` under torchrun): every variant, `--repeats` times,
interleaved (the variant order rotates each repetition, so drift on a shared machine hits all variants alike).
Rank 0 writes the raw measurements as JSON: one report, or a list of one per preset when `--preset` names several
(`benchmarks.gpu_check`: all models' variants rotate together; `--repeat-offset` continues the rotation of earlier
processes, `--keep-going` reports a variant that raises and runs the rest)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict

import torch
import torch.distributed as dist

from benchmarks.clock import release_memory


def init_rank(device_type: str) -> torch.device:
    """This rank's device and process group (NCCL on CUDA with TF32 matmuls, gloo on CPU), seeded like the runs."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    return device


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", required=True, nargs="+", help="several: their variants interleaved in one run")
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--repeat-offset", type=int, default=0, help="index of the first repetition (its rotation)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", action="store_true", help="record the timed steps with torch.profiler")
    parser.add_argument("--compile-options", default="{}", help="torch.compile options of compiled variants (JSON)")
    parser.add_argument(
        "--keep-going", action="store_true", help="one rank only: a variant that raises is reported, the rest run"
    )
    args = parser.parse_args()

    from benchmarks.model import PRESETS
    from benchmarks.variants import build_context, preset_variants

    device = init_rank(args.device)
    compile_options = json.loads(args.compile_options)
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root)  # one checkpoint directory shared by all ranks (one machine)
        contexts = {
            name: build_context(PRESETS[name], device, args.warmup, args.steps, root[0], args.profile, compile_options)
            for name in args.preset
        }
        # Every (preset, variant) of this run, in one rotation: two models' variants interleave as one model's do.
        entries = [(name, v) for name in args.preset for v in preset_variants(PRESETS[name], args.device, args.only)]
        raw: dict[tuple[str, str], list] = {(name, v.name): [] for name, v in entries}
        errors: dict[tuple[str, str], list[str]] = {}
        keep_going = args.keep_going and dist.get_world_size() == 1  # with more ranks, a failure desyncs them
        started = time.time()
        for rep in range(args.repeat_offset, args.repeat_offset + args.repeats):
            shift = rep % len(entries)
            for name, variant in entries[shift:] + entries[:shift]:
                try:
                    measurement = variant.run(contexts[name])
                except Exception as error:
                    if not keep_going:
                        raise
                    traceback.print_exc()
                    errors.setdefault((name, variant.name), []).append(f"{type(error).__name__}: {error}"[:500])
                    del error
                    release_memory(device)
                    continue
                release_memory(device)
                per_rank: list = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, asdict(measurement))
                raw[name, variant.name].append(per_rank)
                if dist.get_rank() == 0:
                    measured = measurement.step_times[args.warmup :]
                    label = f"{name}/{variant.name}" if len(args.preset) > 1 else variant.name
                    print(
                        f"[rep {rep}] {label:<36} median step {statistics.median(measured) * 1e3:8.1f} ms"
                        f"  peak {measurement.peak_memory_bytes / 2**20:,.0f} MiB",
                        flush=True,
                    )
        dist.barrier()
    if dist.get_rank() == 0:
        reports = [
            report(args, name, contexts[name], [v for n, v in entries if n == name], raw, device, time.time() - started)
            | {"errors": {v: e for (n, v), e in errors.items() if n == name}}
            for name in args.preset
        ]
        with open(args.out, "w") as f:
            json.dump(reports if len(args.preset) > 1 else reports[0], f)
    dist.destroy_process_group()


def report(args, name, ctx, variants, raw, device, wall_s) -> dict:
    """One preset's raw measurements and what they were measured on (the JSON `benchmarks.report` summarizes)."""
    import lightning.pytorch as pl

    preset = ctx.preset
    return {
        "world_size": dist.get_world_size(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if args.device == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "transformers": transformers_version(),
        "python": sys.version.split()[0],
        "preset": name,
        "precision": preset.precision,
        "size": preset.size.as_dict(),
        "size_description": preset.size.describe(),
        "flops_per_token": preset.size.flops_per_token(),
        "tensor_parallel_size": ctx.tensor_parallel_size,
        "compile_options": ctx.compile_options,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "wall_s": wall_s,
        "variants": {
            v.name: {
                "family": v.family,
                "driver": v.driver,
                "compiled": v.compiled,
                "checkpointing": v.checkpointing,
                "setting": v.setting,
                "runs": raw[name, v.name],
            }
            for v in variants
            if raw[name, v.name]  # with --keep-going, a variant that failed every repetition has no runs
        },
    }


if __name__ == "__main__":
    main()
