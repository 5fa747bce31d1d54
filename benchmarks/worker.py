"""One benchmark run on N ranks (started by `benchmarks.run` under torchrun): every variant, `--repeats` times,
interleaved (the variant order rotates each repetition, so drift on a shared machine hits all variants alike).
Rank 0 writes the raw measurements as JSON."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist


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


def release_memory(device: torch.device) -> None:
    """Free what the last variant left (reference cycles of the Trainer, compiled code holding its modules), so the
    next one starts from the same empty device: at GPU sizes two models' state does not fit at once."""
    gc.collect()
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", action="store_true", help="record the timed steps with torch.profiler")
    args = parser.parse_args()

    from benchmarks.model import PRESETS
    from benchmarks.variants import build_context, preset_variants

    device = init_rank(args.device)
    import lightning.pytorch as pl

    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root)  # one checkpoint directory shared by all ranks (one machine)
        ctx = build_context(preset, device, args.warmup, args.steps, root[0], profile=args.profile)
        variants = preset_variants(preset, args.device, args.only)
        raw: dict[str, list] = {v.name: [] for v in variants}
        started = time.time()
        for rep in range(args.repeats):
            shift = rep % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                measurement = variant.run(ctx)
                release_memory(device)
                per_rank: list = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, asdict(measurement))
                raw[variant.name].append(per_rank)
                if dist.get_rank() == 0:
                    measured = measurement.step_times[args.warmup :]
                    print(
                        f"[rep {rep}] {variant.name:<28} median step {statistics.median(measured) * 1e3:8.1f} ms",
                        flush=True,
                    )
        dist.barrier()
    if dist.get_rank() == 0:
        report = {
            "world_size": dist.get_world_size(),
            "device": args.device,
            "device_name": torch.cuda.get_device_name(device) if args.device == "cuda" else cpu_name(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "python": sys.version.split()[0],
            "preset": args.preset,
            "precision": preset.precision,
            "size": preset.size.as_dict(),
            "size_description": preset.size.describe(),
            "flops_per_token": preset.size.flops_per_token(),
            "tensor_parallel_size": ctx.tensor_parallel_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "wall_s": time.time() - started,
            "variants": {
                v.name: {"family": v.family, "driver": v.driver, "compiled": v.compiled, "runs": raw[v.name]}
                for v in variants
            },
        }
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
