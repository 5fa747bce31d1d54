"""The one command to run when a GPU is lent: `python -m benchmarks.gpu_check` (one H100/H200, ~5 minutes).

1. the GPU tests, `pytest -m gpu tests/launched/test_gpu.py` (NCCL, world size 1, parity and bf16), counted;
2. the benchmark: the package's GPT (preset `gpu`, ~1.1 B parameters) and a transformers `LlamaForCausalLM` of
   ~1.1 B (preset `gpu-llama`), bf16-mixed, AdamW, batch 4 x 2048, each eager and compiled, `FullyShardStrategy`
   (`compile=True` when compiled) against the hand-written FSDP2 loop (`benchmarks.variants.run_plain`: `fully_shard`
   per block and the root, bf16/fp32 `MixedPrecisionPolicy`, each block compiled when compiled). `--repeats`
   interleaved repetitions, each a fresh process (`benchmarks.worker`) running all 16 variants in an order rotated
   per repetition; between variants compiled code, cycles and the CUDA cache are freed before the peak is reset
   (`benchmarks.clock`), and each peak is reported over what was still allocated then (the last column);
3. `<out>/gpu_check_<device>.md` (tables, versions, ratios against the hand loop, the GPU tests' summary) and
   `.json` (raw measurements).

`--smoke` runs the same path on any machine in seconds (tiny GPT and Llama, one repetition, `aot_eager` compilation
unless `--compile-options` says otherwise): CI runs it on the CPU (`tests/launched/test_benchmarks.py`), where the
GPU tests run to their skip. `--budget-s` stops starting repetitions when the next would end past it (the table
says so), so one lent machine's minutes always end with a table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.report import check_markdown, summarize
from benchmarks.run import ROOT, _rounded, launch_worker

MODELS = {"gpu": ("gpu", "gpu-llama"), "smoke": ("gpu-smoke", "gpu-llama-smoke")}
VARIANTS = (
    "plain_fsdp",
    "plain_fsdp_compiled",
    "dpar_fsdp",
    "dpar_fsdp_compiled",
    # selective activation checkpointing (`activation_checkpointing="selective"`) against the same policy by hand
    "plain_fsdp_selective",
    "plain_fsdp_selective_compiled",
    "dpar_fsdp_selective",
    "dpar_fsdp_selective_compiled",
    # float8 (`float8=`, torchao) against the same conversion by hand; compiled only on a GPU (`_float8_devices`)
    *(
        f"{driver}_fsdp_float8_{recipe}{compiled}"
        for recipe in ("tensorwise", "rowwise")
        for compiled in ("", "_compiled")
        for driver in ("plain", "dpar")
    ),
)
GPU_TESTS = "tests/launched/test_gpu.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny models, one repetition: the code path in seconds")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where available")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 3; smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 3; smoke 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repetition (default 8; smoke 2)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no repetition ending later (default 330; smoke: none)",
    )
    parser.add_argument("--presets", nargs="+", default=None, help="models (default: gpu gpu-llama, or their smoke)")
    parser.add_argument("--compile-options", default=None, help="torch.compile options, JSON (smoke: aot_eager)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmark only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.presets = args.presets or list(MODELS["smoke" if args.smoke else "gpu"])
    args.budget_s = args.budget_s if args.budget_s is not None else (float("inf") if args.smoke else 330.0)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 8)
    if args.compile_options is None:
        args.compile_options = '{"backend": "aot_eager"}' if args.smoke else "{}"
    json.loads(args.compile_options)  # fail now, not in the worker
    # What `benchmarks.run.launch_worker` reads.
    args.only, args.profile = list(VARIANTS), False
    return args


def run_gpu_tests() -> dict[str, Any]:
    """`pytest -m gpu` on the GPU tests alone (collecting every test would import the CLI's jsonargparse, which a
    GPU image may lack): counts, time and the failed tests' names and first message lines."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-m", "gpu", GPU_TESTS, "-q", "-p", "no:cacheprovider"]
        started = time.time()
        result: dict[str, Any] = {"command": " ".join(["python", *command[1:]])}
        try:  # 25 tests took 28 s on an H200; a hang (NCCL) must not take the benchmark's minutes
            proc = subprocess.run(
                [*command, f"--junitxml={xml_path}"], cwd=ROOT, capture_output=True, text=True, timeout=240
            )
        except subprocess.TimeoutExpired as error:
            output = _text(error.stdout) + _text(error.stderr)
            return result | {
                "returncode": None,
                "wall_s": time.time() - started,
                "error": "timed out " + output[-1500:],
            }
        result |= {"returncode": proc.returncode, "wall_s": time.time() - started}
        if not xml_path.exists():
            return result | {"error": (proc.stdout + proc.stderr)[-2000:]}
        return result | junit_counts(xml_path)


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def junit_counts(xml_path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML report, and each failed or erroring test as `name: first message line`."""
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    failed = []
    for suite in ET.parse(xml_path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            problem = case.find("failure") if case.find("failure") is not None else case.find("error")
            if problem is not None:
                message = (problem.get("message") or "").splitlines()[:1]
                failed.append(f"{case.get('name')}: {message[0][:300] if message else ''}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts | {"passed": passed, "failed": failed}


def merge(launches: list[list[dict]]) -> list[dict]:
    """One raw report per model from several launches (one repetition each): runs appended in order."""
    merged = [json.loads(json.dumps(report)) for report in launches[0]]
    for reports in launches[1:]:
        for into, report in zip(merged, reports, strict=True):
            for name, variant in report["variants"].items():
                into["variants"].setdefault(name, {**variant, "runs": []})["runs"] += variant["runs"]
            for name, errors in report.get("errors", {}).items():
                into.setdefault("errors", {}).setdefault(name, []).extend(errors)
            into["repeats"] += report["repeats"]
            into["wall_s"] += report["wall_s"]
    return merged


def run_benchmark(args: argparse.Namespace, deadline: float) -> tuple[list[dict], list[str]]:
    """All models' variants, one fresh process per repetition (its variant order rotated by the repetition's index),
    each started only if it would end within the budget (taking as long as the last)."""
    extra = ["--compile-options", args.compile_options, "--keep-going"]
    launches: list[list[dict]] = []
    notes: list[str] = []
    one = argparse.Namespace(**{**vars(args), "repeats": 1})
    last = 0.0
    for rep in range(args.repeats):
        if launches and time.time() + last > deadline:
            notes.append(
                f"Stopped after {len(launches)} of {args.repeats} repetitions: the next would pass --budget-s."
            )
            break
        started = time.time()
        # A hung launch gets the budget's rest and two minutes more: the minutes left then still give a table.
        timeout = None if deadline == float("inf") else max(deadline - started, 0) + 120
        try:
            launches.append(launch_worker(one, 1, args.presets, [*extra, "--repeat-offset", str(rep)], timeout))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            notes.append(f"Repetition {rep} failed ({error}); see the command's output.")
        last = time.time() - started
    return (merge(launches) if launches else []), notes


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def gpu_tests_line(tests: dict[str, Any] | None) -> str:
    if tests is None:
        return "GPU tests: not run (`--skip-tests`)."
    if "error" in tests:
        return f"GPU tests: `{tests['command']}` did not report (exit {tests['returncode']}): {tests['error'][-300:]}"
    line = (
        f"GPU tests (`{tests['command']}`): {tests['passed']} passed, {tests['failures']} failed,"
        f" {tests['errors']} errors, {tests['skipped']} skipped in {tests['wall_s']:.0f} s."
    )
    return "\n".join([line, *(f"- failed: `{name}`" for name in tests["failed"])])


def write(args, command: str, tests, reports: list[dict], notes: list[str], wall_s: float) -> Path:
    first = reports[0] if reports else {"device_name": "unknown device", "device": args.device, "python": "?"}
    summaries = [summarize(report) for report in reports]
    versions = (
        f"torch {first.get('torch')}, Lightning {first.get('lightning')}, transformers {first.get('transformers')}"
    )
    lines = [
        f"### GPU check on {first['device_name']} ({first['device']})",
        "",
        f"Command: `{command}` ({wall_s:.0f} s in all). {versions}, Python {first['python']}; compile options"
        f" {json.dumps(first.get('compile_options', {}))}.",
        "",
        gpu_tests_line(tests),
        "",
        *[f"{note}\n" for note in notes],
    ]
    for report, summary in zip(reports, summaries, strict=True):
        lines.append(check_markdown(report, summary))
        for name, errors in report.get("errors", {}).items():
            lines += [f"- `{name}` failed {errors.count(e)} of {report['repeats']} times: {e}" for e in set(errors)]
    stem = ("gpu_check_smoke_" if args.smoke else "gpu_check_") + device_slug(first["device_name"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines).rstrip() + "\n")
    models = [{"raw": report, "summary": summary} for report, summary in zip(reports, summaries, strict=True)]
    result = {"command": command, "wall_s": wall_s, "tests": tests, "notes": notes, "models": models}
    (args.out / f"{stem}.json").write_text(json.dumps(_rounded(result), separators=(",", ":")))
    return args.out / f"{stem}.md"


def main(argv: list[str] | None = None) -> None:
    started = time.time()
    args = parse_args(argv)
    command = "python -m benchmarks.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    tests = None if args.skip_tests else run_gpu_tests()
    if tests is not None:
        print(gpu_tests_line(tests), flush=True)
    reports, notes = run_benchmark(args, started + args.budget_s)
    path = write(args, command.strip(), tests, reports, notes, time.time() - started)
    print(path.read_text())
    print(f"Written: {path} and {path.with_suffix('.json')}")
    if not reports:  # the GPU tests' failures and failed variants are in the table; no table at all is an error
        raise SystemExit("No repetition of the benchmark completed: " + " ".join(notes))


if __name__ == "__main__":
    main()
