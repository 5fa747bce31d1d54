"""Run the benchmark suite: `python -m benchmarks.run --world-size 2 4 --out benchmarks/results`.

For each world size, one torchrun launch trains every variant (plain PyTorch loops, Lightning's strategies, this
package's strategies eager and compiled) with the same model, data and mesh, then this process writes
`<out>/benchmark_<preset>.json` (raw measurements and summaries) and `<out>/benchmark_<preset>.md` (tables).
`--device cuda` runs the suite with NCCL, one GPU per rank; `--device cuda --preset gpu` (the default preset on CUDA)
trains a ~1 B-parameter decoder in bf16-mixed on one GPU and reports tokens/s, MFU and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.model import DEFAULT_PRESET, PRESETS
from benchmarks.report import markdown, summarize

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world-size", type=int, nargs="+", default=None, help="ranks per run (1 or even; default: the preset's)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model size, precision and variants (default: 'cpu' on CPU, 'gpu' on CUDA); see benchmarks/model.py",
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of each repetition's timing")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repetition")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions of every variant")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--profile", action="store_true", help="record the timed steps with torch.profiler")
    args = parser.parse_args(argv)
    args.preset = args.preset or DEFAULT_PRESET[args.device]
    preset = PRESETS[args.preset]
    args.world_size = args.world_size or list(preset.world_sizes)
    for name in ("warmup", "steps", "repeats"):  # unset: the preset's measurement
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    return args


def run_world(args: argparse.Namespace, world: int) -> dict:
    return launch_worker(args, world, [args.preset])


def launch_worker(
    args: argparse.Namespace,
    world: int,
    presets: list[str],
    extra: Sequence[str] = (),
    timeout: float | None = None,
) -> Any:
    """One torchrun launch of `benchmarks.worker` on `world` ranks: the raw report of one preset, or a list (one per
    preset, their variants interleaved) for several; `extra` are further worker arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "benchmarks.worker",
            f"--device={args.device}",
            "--preset",
            *presets,
            f"--warmup={args.warmup}",
            f"--steps={args.steps}",
            f"--repeats={args.repeats}",
            f"--out={raw_path}",
            *extra,
        ]
        if args.only:
            cmd += ["--only", *args.only]
        if args.profile:
            cmd.append("--profile")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")  # one core per rank, as torchrun sets it by default
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=timeout)
        return json.loads(raw_path.read_text())


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits (timings are noisier than that), so the raw results stay small."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for world in args.world_size:
        raw = run_world(args, world)
        results.append({"raw": raw, "summary": summarize(raw)})
    command = "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / f"benchmark_{args.preset}.json").write_text(
        json.dumps(_rounded({"command": command, "results": results}), separators=(",", ":"))
    )
    tables = "\n".join(markdown(r["raw"], r["summary"]) for r in results)
    (args.out / f"benchmark_{args.preset}.md").write_text(f"Command: `{command}`\n\n{tables}")
    print(tables)


if __name__ == "__main__":
    main()
