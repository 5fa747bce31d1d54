"""Where each driver's step time goes: `python -m benchmarks.overhead --preset cpu --world-size 2`.

Runs the chosen variants (default: the 2D family, `plain_2d`, `lightning_model_parallel`, `dpar_2d`) through the
suite's own interleaved measurement with `torch.profiler` on during the timed steps, and writes
`<out>/overhead_<preset>.md`: per variant the wall and CPU time per step, then per profiled event (every op, and
every Lightning hook and loop phase, named as Lightning names them: `[Strategy]...training_step`,
`run_training_batch`, ...) its calls and CPU ms per step on rank 0: Lightning's hooks, the ops whose number of
calls differs between the variants (exact: extra work), and the ops whose time differs most. The raw profile is
kept in `<out>/overhead_<preset>.json`; `--render FILE` redoes the tables from it. The profiler itself slows every
op a little; compare the variants with each other, not with the suite's unprofiled step times. Last, cProfile's
count of Python function calls per step and variant, and the functions whose counts differ most: a count does not
depend on the load of the machine, so it tells extra work from noise where times on a shared machine cannot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.model import DEFAULT_PRESET, PRESETS
from benchmarks.run import ROOT, run_world

DEFAULT_VARIANTS = ["plain_2d", "lightning_model_parallel", "dpar_2d"]


def per_step_events(raw: dict[str, Any]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """`{variant: {event: (calls, self CPU ms, total CPU ms) per step}}`, rank 0, summed over repetitions."""
    steps = raw["steps"] * raw["repeats"]
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name, variant in raw["variants"].items():
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for run in variant["runs"]:
            for event, calls, self_us, total_us in run[0]["profile"]:
                entry = sums[event]
                entry[0] += calls
                entry[1] += self_us
                entry[2] += total_us
        out[name] = {k: (c / steps, s / steps / 1e3, t / steps / 1e3) for k, (c, s, t) in sums.items()}
    return out


#: Events that are time spent waiting for the other ranks (collectives), not work this rank does.
WAIT_EVENTS = ("_c10d_functional::wait_tensor", "c10d::", "gloo:", "nccl:")


def python_calls_per_step(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    """`{variant: {function: Python calls per step}}`, rank 0 (`StepClock.python_calls`), over the repetitions."""
    steps = raw["steps"] * raw["repeats"]
    out: dict[str, dict[str, float]] = {}
    for name, variant in raw["variants"].items():
        sums: dict[str, float] = defaultdict(float)
        for run in variant["runs"]:
            for function, calls in run[0].get("python_calls", []):
                sums[function] += calls
        out[name] = {k: v / steps for k, v in sums.items()}
    return out


def _is_hook(event: str) -> bool:
    """Lightning's hooks and loop phases as `RecordFunctionProfiler` names them."""
    return event.startswith("[") or event in ("run_training_batch", "run_training_epoch")


def overhead_markdown(raw: dict[str, Any], top: int = 40) -> str:
    names = list(raw["variants"])
    events = per_step_events(raw)
    warmup = raw["warmup"]
    lines = [
        f"### Preset `{raw['preset']}`, {raw['world_size']} ranks: time per step with torch.profiler on (rank 0)",
        "",
        'Profiled self CPU sums every event\'s own time; "without waits" leaves out time inside collectives',
        f" ({', '.join(f'`{w}`' for w in WAIT_EVENTS)}), which on a shared machine mostly measures the other rank.",
        "",
        "| variant | wall/step (ms) | CPU/step (ms) | profiled self CPU/step (ms) | without waits (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        runs = [run[0] for run in raw["variants"][name]["runs"]]
        wall = statistics.median(t for run in runs for t in run["step_times"][warmup:]) * 1e3
        cpu = statistics.median(t for run in runs for t in run["cpu_times"][warmup:]) * 1e3
        profiled = sum(self_ms for _, self_ms, _ in events[name].values())
        waits = sum(v[1] for e, v in events[name].items() if e.startswith(WAIT_EVENTS))
        lines.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {profiled:.1f} | {profiled - waits:.1f} |")
    all_events = sorted({e for per in events.values() for e in per})

    def cell(name: str, event: str) -> str:
        calls, self_ms, total_ms = events[name].get(event, (0.0, 0.0, 0.0))
        return f"{calls:g}: {self_ms:.2f} / {total_ms:.2f}" if calls else ""

    def table(title: str, rows: list[str]) -> list[str]:
        out = ["", title, "", "| event | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        return out + [f"| `{e[:90]}` | " + " | ".join(cell(n, e) for n in names) + " |" for e in rows]

    def calls_differ(event: str) -> bool:
        calls = {round(events[n].get(event, (0.0, 0.0, 0.0))[0], 2) for n in names}
        return len(calls) > 1

    def spread(event: str) -> float:
        totals = [events[n].get(event, (0.0, 0.0, 0.0))[2] for n in names]
        return max(totals) - min(totals)

    hooks = [e for e in all_events if _is_hook(e)]
    differing = [e for e in all_events if calls_differ(e) and not _is_hook(e)]
    lines += table(
        "Lightning's hooks and loop phases, `calls: self / total CPU ms` per step (total includes what runs inside).",
        sorted(hooks, key=lambda e: -max(events[n].get(e, (0, 0, 0))[2] for n in names)),
    )
    lines += table(
        "Ops called a different number of times per step (exact counts: extra or missing work, not noise).",
        sorted(differing, key=spread, reverse=True)[:top],
    )
    lines += table(
        f"Ops with the largest difference in total CPU ms per step (top {top}; timing, so noisy on a shared machine).",
        sorted((e for e in all_events if not _is_hook(e)), key=spread, reverse=True)[:top],
    )
    return "\n".join(lines + _python_calls_tables(raw, names, top)) + "\n"


def _python_calls_tables(raw: dict[str, Any], names: list[str], top: int) -> list[str]:
    """Python calls per step per variant (cProfile, counted, so not noise), and the functions whose counts differ
    most from the first variant's."""
    calls = python_calls_per_step(raw)
    if not any(calls.values()):
        return []
    base = names[0]
    lines = [
        "",
        "Python function calls per step on rank 0 (cProfile over the profiled steps: a count, independent of the"
        " machine's load).",
        "",
        "| variant | calls/step | vs " + base + " |",
        "|---|---:|---:|",
    ]
    total = {n: sum(calls[n].values()) for n in names}
    lines += [f"| {n} | {total[n]:,.0f} | {total[n] / total[base]:.3f} |" for n in names]
    functions = {f for per in calls.values() for f in per}

    def spread(function: str) -> float:
        counts = [calls[n].get(function, 0.0) for n in names]
        return max(counts) - min(counts)

    lines += ["", f"Functions whose calls per step differ most (top {top}).", ""]
    lines += ["| function | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for function in sorted(functions, key=spread, reverse=True)[:top]:
        cells = " | ".join(f"{calls[n].get(function, 0.0):g}" for n in names)
        lines.append(f"| `{function[:90]}` | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=DEFAULT_VARIANTS, help="variants to profile")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=40, help="events listed")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--render", type=Path, default=None, help="only redo the tables of a saved overhead JSON")
    args = parser.parse_args(argv)
    args.preset = args.preset or DEFAULT_PRESET[args.device]
    args.profile = True
    if args.render is not None:
        raw = json.loads(args.render.read_text())
    else:
        raw = run_world(args, args.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"overhead_{raw['preset']}.json").write_text(json.dumps(raw, separators=(",", ":")))
    table = overhead_markdown(raw, args.top)
    (args.out / f"overhead_{raw['preset']}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
