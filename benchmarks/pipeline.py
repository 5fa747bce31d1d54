"""Pipeline-parallel benchmark: this package's strategy against a hand-written `torch.distributed.pipelining` loop.

    python -m benchmarks.pipeline --world-size 2 --out benchmarks/results

For each world size, one torchrun launch trains, per schedule (GPipe, 1F1B) and microbatch count (4, 8):
- `dpar_<schedule>_m<M>`: `FullyShardStrategy(pipeline_parallel_size=2, pipeline_schedule=..., pipeline_microbatches=M)`
  through a real Trainer on `benchmarks.model.BenchModule` (its own `training_step` runs once per microbatch);
- `plain_<schedule>_m<M>`: the same `Net`, split by hand where `"auto"` splits it (the first half of the blocks on
  stage 0; the second half and the output layer on stage 1), each block, the output layer and the stage module
  `fully_shard`-ed over the data-parallel ranks as the strategy does (a mesh of one rank at world size 2), driven by
  `PipelineStage` and the same torch schedule class, with the same data, per-rank batch and AdamW.
The pipeline is 2 stages deep; the remaining factor of the world size is FSDP (world size 4: PP 2 x FSDP 2).

What is measured, per rank and step (warm-up steps dropped):
- step time: wall time between the ends of consecutive steps (`benchmarks.variants.StepClock`: data loading, the
  schedule and the optimizer step), the number compared between the two drivers;
- schedule time: wall time inside the torch schedule's `step`;
- compute time: time inside this rank's `PipelineStage.forward_one_chunk` and `backward_one_chunk` calls (the
  stage module's forward and backward of one microbatch, FSDP's parameter all-gathers included). Not in it: the
  waits for activations and gradients from the neighbouring stage (the schedule waits on them in between), the last
  stage's loss function (`loss_fn`; the strategy computes the loss inside the stage's forward instead, where it is
  counted), and FSDP's gradient reduce-scatter and gradient scaling after the last backward
  (`PipelineStage.perform_reduce_grad`; over one rank at world size 2), timed apart as "gradient reduction". Both
  drivers are timed by the same wrappers (`ScheduleTimer`), put on torch's classes for the run; perf_counter on
  CPU, CUDA events on GPU;
- CPU time: this process's CPU time per step, which other processes on a busy machine barely change;
- bubble of the step = 1 - compute time / step time, summed over the timed steps, averaged over ranks: every
  moment of the step a rank is not computing its stage counts, wherever it waits (inside the schedule, or in a
  collective after it), and so does the work outside the pipeline (optimizer step, data loading, the driver's own
  code), which makes it an upper bound of the pipeline's bubble;
- bubble in the schedule = 1 - compute time / schedule time: only what idles inside the schedule's `step`. It
  misses waits that fall outside it: a rank that finishes its part of the pipeline early waits for the others
  either at the start of the next step's schedule (the plain loop: the last stage waits there for the first
  stage's last backward and optimizer step) or in a collective outside the schedule (the strategy sends the loss
  from the last stage to every rank after each schedule step), and only the first counts here.
The theoretical bubble of GPipe and 1F1B with p stages and m microbatches is (p - 1) / (m + p - 1); it assumes
every stage takes the same time per microbatch and sends in no time. Measured bubbles above it are the cost of
communication, of the schedule's own Python, of waiting for a core on a shared machine, and of the stages'
imbalance (stage 1 also holds the output layer and the loss).

`--device cuda` runs the same with NCCL, one GPU per rank (`--size gpu`, a ~1 B-parameter MLP, by default).
Writes `<out>/pipeline_<size>.json` (raw measurements and summaries) and `<out>/pipeline_<size>.md` (tables).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.model import BenchModule, Preset, Size, build_net, make_optimizer
from benchmarks.run import _rounded as rounded
from benchmarks.variants import Context, Measurement, StepClock, build_context, run_lightning, state_bytes
from benchmarks.worker import cpu_name, release_memory

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_SIZE = 2
SCHEDULES: dict[str, type] = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
#: Model and per-data-parallel-rank batch. `cpu`: 8.7 M parameters; about 30 / 48 ms of forward and backward per
#: microbatch per stage at 8 / 4 microbatches (one core each, on a quiet 2-core machine), so compute dominates gloo's
#: point-to-point sends of 128 / 256 KiB activations. `tiny`: the test's size (seconds). `gpu`: 8 blocks of dim
#: 4096 (~1.1 B parameters, fp32 with TF32 matmuls; ~9 GB of parameters, gradients and AdamW state per stage).
SIZES: dict[str, Size] = {
    "cpu": Size(dim=512, hidden=2048, depth=4, seq=32, batch=16),
    "tiny": Size(dim=32, hidden=64, depth=4, seq=4, batch=8),
    "gpu": Size(dim=4096, hidden=16384, depth=8, seq=1024, batch=16),
}
DEFAULT_SIZE = {"cpu": "cpu", "cuda": "gpu"}


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's idle share of a step with equal stages and free communication: (p-1) / (m+p-1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class Case:
    driver: str  # plain | dpar
    schedule: str  # a key of SCHEDULES
    microbatches: int

    @property
    def name(self) -> str:
        return f"{self.driver}_{self.schedule.lower()}_m{self.microbatches}"


def cases(schedules: list[str], microbatches: list[int]) -> list[Case]:
    return [Case(driver, s, m) for s in schedules for m in microbatches for driver in ("plain", "dpar")]


# ------------------------------------------------------------------------------------------ timing


class ScheduleTimer:
    """Per call of a schedule's `step`: its wall time, the time spent in the stages' forward and backward, and in the
    gradient reduction after the last backward (`perform_reduce_grad`: FSDP's reduce-scatter, gradient scaling).

    `instrument` wraps `PipelineStage`'s chunk methods and the schedule class's `step` for the duration of one run,
    so torch's schedules, whoever built them (the plain loop or the strategy), are timed by the same code.
    """

    COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    REDUCE_METHOD = "perform_reduce_grad"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: `(schedule seconds, compute seconds, gradient reduction seconds)` per `step` call.
        self.steps: list[tuple[float, float, float]] = []
        self._intervals: dict[str, list[tuple[Any, Any]]] = {"compute": [], "reduce": []}

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start: Any, end: Any) -> float:
        if self.device.type == "cuda":
            return start.elapsed_time(end) / 1e3
        return end - start

    def _timed_stage_method(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(stage: Any, *args: Any, **kwargs: Any) -> Any:
            start = self._mark()
            try:
                return method(stage, *args, **kwargs)
            finally:
                self._intervals[kind].append((start, self._mark()))

        return timed

    def _timed_step(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            self._intervals = {"compute": [], "reduce": []}
            start = self._mark()
            result = method(schedule, *args, **kwargs)
            end = self._mark()
            if self.device.type == "cuda":
                end.synchronize()
            compute, reduce = (sum(self._seconds(a, b) for a, b in self._intervals[k]) for k in ("compute", "reduce"))
            self.steps.append((self._seconds(start, end), compute, reduce))
            return result

        return timed

    @contextmanager
    def instrument(self, schedule_class: type) -> Iterator[ScheduleTimer]:
        with ExitStack() as stack:
            for name in (*self.COMPUTE_METHODS, self.REDUCE_METHOD):
                kind = "reduce" if name == self.REDUCE_METHOD else "compute"
                timed = self._timed_stage_method(getattr(PipelineStage, name), kind)
                stack.enter_context(_replaced(PipelineStage, name, timed))
            stack.enter_context(_replaced(schedule_class, "step", self._timed_step(schedule_class.step)))
            yield self


@contextmanager
def _replaced(cls: type, name: str, value: Any) -> Iterator[None]:
    """Set `cls.<name>` to `value`, then restore it (or the inherited one) on exit."""
    own = vars(cls).get(name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


# ------------------------------------------------------------------------------------------ the two drivers


class LastStage(nn.Module):
    """Stage 1 of the hand split: the second half of the blocks, then the output layer."""

    def __init__(self, layers: list[nn.Module], out: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def hand_split(net: nn.Module, stage: int) -> nn.Module:
    """This rank's stage of `benchmarks.model.Net`, split where the strategy's `"auto"` split puts it."""
    half = (len(net.layers) + 1) // 2
    if stage == 0:
        return nn.Sequential(*net.layers[:half])
    return LastStage(list(net.layers[half:]), net.out)


def run_plain(case: Case, ctx: Context, mesh: DeviceMesh) -> Measurement:
    """The plain loop: hand-split stage, `fully_shard` as the strategy applies it, torch's `PipelineStage` and
    schedule, AdamW."""
    clock = StepClock(ctx.device)
    pp_rank, dp_mesh = mesh["pipeline"].get_local_rank(), mesh["data_parallel"]
    stage_module = hand_split(build_net(ctx.size), pp_rank).to(ctx.device)
    units = [*stage_module] if pp_rank == 0 else [*stage_module.layers, stage_module.out]
    for unit in units:
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)
    stage = PipelineStage(stage_module, pp_rank, PIPELINE_SIZE, ctx.device, group=mesh.get_group("pipeline"))
    schedule = SCHEDULES[case.schedule](stage, case.microbatches, loss_fn=F.mse_loss)
    optimizer = make_optimizer(stage_module.parameters())
    # Shuffled with seed 0, as the sampler Lightning puts on a training DataLoader, so both drivers see the same
    # batches (their losses then agree bit for bit at the `tiny` size, GPipe and 1F1B, over 4 steps).
    sampler = DistributedSampler(
        ctx.data, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(), shuffle=True, seed=0
    )
    last = pp_rank == PIPELINE_SIZE - 1
    for step, (x, y) in enumerate(DataLoader(ctx.data, batch_size=ctx.size.batch, sampler=sampler)):
        if step == 0:
            clock.start()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        if last:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(x, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad()
        clock.tick()
        if step + 1 == ctx.total_steps:
            break
    return Measurement(clock.times, clock.cpu_times, clock.peak_memory(), state_bytes(stage_module, optimizer))


def run_dpar(case: Case, ctx: Context) -> Measurement:
    """This package's strategy through a real Trainer, the LightningModule unchanged."""

    def strategy(_: Context) -> Any:
        import lightning_dpar

        return lightning_dpar.FullyShardStrategy(
            pipeline_parallel_size=PIPELINE_SIZE,
            pipeline_schedule=case.schedule,
            pipeline_microbatches=case.microbatches,
        )

    return run_lightning(strategy, BenchModule, ctx, checkpoint="")


# ------------------------------------------------------------------------------------------ worker (one per rank)


def worker(args: argparse.Namespace) -> None:
    from benchmarks.worker import init_rank

    device = init_rank(args.device)
    import lightning.pytorch as pl

    world = dist.get_world_size()
    if world % PIPELINE_SIZE:
        raise ValueError(f"--world-size {world} must be a multiple of the pipeline size {PIPELINE_SIZE}.")
    size = SIZES[args.size]
    bad = [m for m in args.microbatches if size.batch % m]
    if bad:
        raise ValueError(f"--microbatches {bad} must divide the {args.size!r} size's batch of {size.batch}.")
    preset = Preset(size, "32-true", (world,), families=(), drivers=(), checkpoints=False)
    ctx = build_context(preset, device, args.warmup, args.steps, checkpoint_root="")
    mesh = init_device_mesh(
        device.type, (PIPELINE_SIZE, world // PIPELINE_SIZE), mesh_dim_names=("pipeline", "data_parallel")
    )
    runs = cases(args.schedules, args.microbatches)
    raw: dict[str, list] = {case.name: [] for case in runs}
    load_before = os.getloadavg()
    started = time.time()
    for rep in range(args.repeats):
        shift = rep % len(runs)
        for case in runs[shift:] + runs[:shift]:  # rotated, so drift on a shared machine hits every case alike
            timer = ScheduleTimer(device)
            with timer.instrument(SCHEDULES[case.schedule]):
                measurement = run_plain(case, ctx, mesh) if case.driver == "plain" else run_dpar(case, ctx)
            release_memory(device)
            if len(timer.steps) != ctx.total_steps:
                raise RuntimeError(f"{case.name}: {len(timer.steps)} schedule steps timed, {ctx.total_steps} run.")
            per_rank: list = [None] * world
            dist.all_gather_object(per_rank, {**asdict(measurement), "schedule": timer.steps})
            raw[case.name].append(per_rank)
            if dist.get_rank() == 0:
                step_ms = statistics.median(measurement.step_times[args.warmup :]) * 1e3
                print(f"[rep {rep}] {case.name:<16} median step {step_ms:8.1f} ms", flush=True)
    if dist.get_rank() == 0:
        report = {
            "world_size": world,
            "pipeline_size": PIPELINE_SIZE,
            "device": args.device,
            "device_name": torch.cuda.get_device_name(device) if args.device == "cuda" else cpu_name(),
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "size_name": args.size,
            "size": size.as_dict(),
            "size_description": size.describe(),
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "wall_s": time.time() - started,
            "cases": {case.name: {**asdict(case), "runs": raw[case.name]} for case in runs},
        }
        Path(args.raw).write_text(json.dumps(report))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ summary and report


def _bubbles(run: list[dict[str, Any]], warmup: int) -> tuple[list[float], list[float]]:
    """Per rank of one repetition: the idle share of the step and of the schedule's `step` (timed steps summed)."""
    of_step, of_schedule = [], []
    for rank in run:
        timed = rank["schedule"][warmup:]
        compute = sum(c for _, c, _ in timed)
        of_step.append(1 - compute / sum(rank["step_times"][warmup:]))
        of_schedule.append(1 - compute / sum(s for s, _, _ in timed))
    return of_step, of_schedule


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per case: medians over repetitions of the step, schedule and compute times (each the mean over ranks of the
    rank's median step) and of the bubble fractions (each the mean over ranks)."""
    warmup, world = raw["warmup"], raw["world_size"]

    def mean_of_medians(run: list[dict[str, Any]], values: Callable[[dict[str, Any]], list[float]]) -> float:
        return statistics.mean(statistics.median(values(rank)[warmup:]) for rank in run) * 1e3

    out: dict[str, Any] = {}
    for name, case in raw["cases"].items():
        runs = case["runs"]  # one entry per repetition: a list over ranks
        bubbles = [_bubbles(run, warmup) for run in runs]
        out[name] = {
            "driver": case["driver"],
            "schedule": case["schedule"],
            "microbatches": case["microbatches"],
            "step_time_ms": statistics.median(mean_of_medians(run, lambda r: r["step_times"]) for run in runs),
            "rep_step_time_ms": [mean_of_medians(run, lambda r: r["step_times"]) for run in runs],
            "cpu_time_ms": statistics.median(mean_of_medians(run, lambda r: r["cpu_times"]) for run in runs),
            "schedule_time_ms": statistics.median(
                mean_of_medians(run, lambda r: [s for s, _, _ in r["schedule"]]) for run in runs
            ),
            "compute_time_ms": statistics.median(
                mean_of_medians(run, lambda r: [c for _, c, _ in r["schedule"]]) for run in runs
            ),
            "reduce_time_ms": statistics.median(
                mean_of_medians(run, lambda r: [g for _, _, g in r["schedule"]]) for run in runs
            ),
            "bubble": statistics.median(statistics.mean(step) for step, _ in bubbles),
            "bubble_per_rank": [statistics.median(step[r] for step, _ in bubbles) for r in range(world)],
            "schedule_bubble": statistics.median(statistics.mean(schedule) for _, schedule in bubbles),
            "schedule_bubble_per_rank": [statistics.median(sched[r] for _, sched in bubbles) for r in range(world)],
            "theoretical_bubble": theoretical_bubble(raw["pipeline_size"], case["microbatches"]),
        }
    for s in out.values():
        plain = out.get(Case("plain", s["schedule"], s["microbatches"]).name)
        if s["driver"] == "dpar" and plain is not None:
            s["step_time_vs_plain"] = s["step_time_ms"] / plain["step_time_ms"]
            s["cpu_time_vs_plain"] = s["cpu_time_ms"] / plain["cpu_time_ms"]
    return out


def markdown(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    dp = raw["world_size"] // raw["pipeline_size"]
    before, after = raw["load_average_before"], raw["load_average_after"]
    lines = [
        f"### {raw['world_size']} ranks: pipeline {raw['pipeline_size']} x FSDP {dp} on {raw['device']}",
        "",
        f"{raw['size_description']}, sequence {raw['size']['seq']}, batch {raw['size']['batch']} per data-parallel"
        f" rank, fp32, AdamW. {raw['device_name']} ({raw['cpu_count']} cores), torch {raw['torch']}, Lightning"
        f" {raw['lightning']}. {raw['warmup']} warm-up + {raw['steps']} timed steps per run, {raw['repeats']}"
        f" interleaved repetitions, medians. Load average (1/5/15 min) {_load(before)} at the start,"
        f" {_load(after)} at the end; {raw['wall_s']:.0f} s.",
        "",
        "| schedule | microbatches | plain step (ms) | dpar step (ms) | dpar / plain | CPU time dpar / plain"
        " | bubble of the step: plain / dpar | bubble in the schedule: plain / dpar | theoretical (p-1)/(m+p-1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    details = [
        "",
        "| variant | step (ms) | per repetition (ms) | CPU time (ms) | schedule (ms) | compute (ms)"
        " | compute per microbatch (ms) | gradient reduction (ms) | bubble of the step, per rank"
        " | bubble in the schedule, per rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        details.append(
            f"| {name} | {s['step_time_ms']:.1f} | {_joined(s['rep_step_time_ms'], 1)} | {s['cpu_time_ms']:.1f}"
            f" | {s['schedule_time_ms']:.1f} | {s['compute_time_ms']:.1f}"
            f" | {s['compute_time_ms'] / s['microbatches']:.1f} | {s['reduce_time_ms']:.1f}"
            f" | {_joined(s['bubble_per_rank'], 3)}"
            f" | {_joined(s['schedule_bubble_per_rank'], 3)} |"
        )
        if "step_time_vs_plain" not in s:
            continue
        plain = summary[Case("plain", s["schedule"], s["microbatches"]).name]
        lines.append(
            f"| {s['schedule']} | {s['microbatches']} | {plain['step_time_ms']:.1f} | {s['step_time_ms']:.1f}"
            f" | {s['step_time_vs_plain']:.3f} | {s['cpu_time_vs_plain']:.3f}"
            f" | {plain['bubble']:.3f} / {s['bubble']:.3f}"
            f" | {plain['schedule_bubble']:.3f} / {s['schedule_bubble']:.3f} | {s['theoretical_bubble']:.3f} |"
        )
    return "\n".join(lines + details) + "\n"


def _joined(values: list[float], decimals: int) -> str:
    return ", ".join(f"{v:.{decimals}f}" for v in values)


def _load(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


# ------------------------------------------------------------------------------------------ launcher


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, nargs="+", default=[2], help="ranks per run (multiples of 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 'cpu' on CPU, 'gpu' on CUDA")
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["GPipe", "1F1B"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's timing")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of every case")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or DEFAULT_SIZE[args.device]
    return args


def run_world(args: argparse.Namespace, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        cmd += ["-m", "benchmarks.pipeline", "--worker", f"--raw={raw_path}", f"--device={args.device}"]
        cmd += [f"--size={args.size}", f"--warmup={args.warmup}", f"--steps={args.steps}"]
        cmd += [f"--repeats={args.repeats}", "--schedules", *args.schedules]
        cmd += ["--microbatches", *map(str, args.microbatches)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")  # one core per rank, as torchrun sets it by default
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        return json.loads(raw_path.read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for world in args.world_size:
        raw = run_world(args, world)
        results.append({"raw": raw, "summary": summarize(raw)})
    command = "python -m benchmarks.pipeline " + " ".join(sys.argv[1:] if argv is None else argv)
    raw_and_summaries = rounded({"command": command, "results": results})  # 4 significant digits, as benchmarks.run
    (args.out / f"pipeline_{args.size}.json").write_text(json.dumps(raw_and_summaries, separators=(",", ":")))
    tables = "\n".join(markdown(r["raw"], r["summary"]) for r in results)
    (args.out / f"pipeline_{args.size}.md").write_text(f"Command: `{command}`\n\n{DEFINITIONS}\n{tables}")
    print(tables)


DEFINITIONS = """\
Step: wall time between the ends of consecutive training steps (data, schedule, optimizer). Compute: time inside
this rank's `PipelineStage.forward_one_chunk` / `backward_one_chunk` (one microbatch's stage forward or backward;
FSDP's gradient reduce-scatter after the last backward is not in it: "gradient reduction", in the second table).
Schedule: time inside the torch schedule's
`step`. Bubble of the step: 1 - compute / step (an upper bound: it also counts the optimizer step and the driver's
own work). Bubble in the schedule: 1 - compute / schedule (waits outside the schedule's `step`, such as the
strategy's loss broadcast after it, are not in it). Both over the timed steps, mean over ranks (per rank in the
second table). CPU time: the process's CPU time per step (less affected by other processes than wall time).
Theoretical: (p-1)/(m+p-1) for p stages and m microbatches. `plain`: hand-split model,
`torch.distributed.pipelining.PipelineStage` and the same schedule class; `dpar`: `FullyShardStrategy` with
`pipeline_parallel_size=2` through the Trainer. See `benchmarks/pipeline.py`.
"""


if __name__ == "__main__":
    main()
