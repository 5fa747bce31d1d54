"""`python -m lightning_dpar calibrate --out profile.json [--world-sizes 2,4] [--base cpu-gloo] [--backend gloo]`:
measure this machine into a hardware profile the layout search reads (`plan --auto --profile profile.json`,
`AutoParallelStrategy(profile="profile.json")`).

For each group size, one `torchrun` launch of that many ranks (this module with `--worker`) measures, on every rank
at once (so ranks that share cores are measured sharing them):

- matmul throughput: square fp32 matmuls (bf16 on CUDA) of a few sizes, FLOP/s sustained over repeats, the median
  rank's at the largest size kept (at the largest group size measured: the ranks compete as in training);
- each collective the cost model prices (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `send_recv`)
  at a small and a large buffer, fitted to the model's own form `time = steps x latency + bytes / bandwidth` with the
  cost model's ring steps and bytes per rank (`layout.cost`): two sizes, two unknowns.

- the runtime: a near-empty model (one 64 x 64 linear layer) trained for a few steps through a Trainer and
  `FullyShardStrategy` over the group: its peak memory growth (CPU: RSS high-water mark over the RSS before; CUDA:
  the device memory in use beyond PyTorch's tensors) is `runtime_memory`, its median step time `step_overhead`.

The profile keeps the base preset's other fields (device memory, the link across nodes, FSDP overlap); a CPU run
sets the device memory to this machine's RAM over the largest group size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_dpar.helpers import process_memory
from lightning_dpar.layout_search.profiles import HardwareProfile, Link, get_profile, save_profile

__all__ = ["fit_link", "main", "ring_volume"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SMALL, LARGE = 4 * 1024, 8 * 1024 * 1024  # bytes of the whole buffer


def ring_volume(collective: str, n: int, nbytes: float) -> tuple[int, float]:
    """(message steps, bytes each rank sends) of one collective over `n` ranks of an `nbytes` buffer, as the cost
    model counts them."""
    if collective == "send_recv":
        return 1, nbytes
    factor = 2 if collective == "all_reduce" else 1
    return factor * (n - 1), factor * nbytes * (n - 1) / n


def fit_link(collective: str, n: int, small: tuple[float, float], large: tuple[float, float]) -> Link:
    """The `Link` whose `seconds` gives both measurements `(buffer bytes, seconds)`; a latency below zero (noise)
    is clamped to zero, and the bandwidth then taken from the large buffer alone."""
    (s_bytes, s_time), (l_bytes, l_time) = small, large
    s_steps, s_volume = ring_volume(collective, n, s_bytes)
    _, l_volume = ring_volume(collective, n, l_bytes)
    if l_time > s_time and l_volume > s_volume:
        bandwidth = (l_volume - s_volume) / (l_time - s_time)
        latency = (s_time - s_volume / bandwidth) / s_steps
        if latency >= 0:
            return Link(latency, bandwidth)
    return Link(0.0, l_volume / l_time)


def _timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def _collective(name: str, nbytes: int, device: torch.device) -> Callable[[], object]:
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.float32
    elements = max(nbytes // 4 // n * n, n)
    whole = torch.ones(elements, dtype=dtype, device=device)
    part = torch.ones(elements // n, dtype=dtype, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, part)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, whole)
    if name == "all_to_all":
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole)
    peer = rank ^ 1  # pairs (0, 1), (2, 3): each rank sends to and receives from its partner

    def send_recv() -> None:
        if peer >= n:
            return
        ops = [dist.P2POp(dist.isend, whole, peer), dist.P2POp(dist.irecv, part.new_empty(elements), peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return send_recv


def _worker(out: Path) -> None:
    """One rank of a calibration launch: matmul throughput and each collective's timings, to `out` (rank 0)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    n = dist.get_world_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    matmul = {}
    for size in (256, 512, 1024) if device.type == "cpu" else (4096, 8192):
        a = torch.randn(size, size, dtype=dtype, device=device)
        seconds = _timed(lambda a=a: a @ a, 5, sync)
        matmul[size] = 2 * size**3 / seconds
    timings: dict[str, list[tuple[int, float]]] = {}
    for name in COLLECTIVES:
        if name == "send_recv" and n % 2:
            continue
        try:
            timings[name] = [(size, _timed(_collective(name, size, device), 10, sync)) for size in (SMALL, LARGE)]
        except (RuntimeError, NotImplementedError) as err:  # e.g. a collective this backend lacks
            timings[name] = []
            print(f"calibrate: {name} on {n} ranks skipped: {err}", file=sys.stderr)
    runtime = _runtime(device, n)
    gathered: list[object] = [None] * n
    dist.all_gather_object(gathered, {"matmul": matmul, "timings": timings, **runtime})
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"world_size": n, "ranks": gathered, "device": device.type}))
    dist.destroy_process_group()


def _runtime(device: torch.device, world_size: int) -> dict[str, float]:
    """Peak memory growth and median step time of a near-empty model trained through a Trainer on this group."""
    import ctypes
    import gc

    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_dpar.strategies.fully_shard import FullyShardStrategy

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            self.ends.append(time.perf_counter())

    gc.collect()
    if device.type == "cpu":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts from here
    baseline = process_memory("VmRSS")
    clock = Clock()
    trainer = L.Trainer(
        accelerator=device.type,
        devices=world_size,
        strategy=FullyShardStrategy(),
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(Tiny(), DataLoader([torch.randn(64) for _ in range(8 * 8 * world_size)], batch_size=8))
    if device.type == "cpu":
        memory = process_memory("VmHWM") - baseline
    else:
        free, total = torch.cuda.mem_get_info(device)
        memory = total - free - torch.cuda.memory_allocated(device)
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][2:]
    return {"runtime_memory": float(memory), "step_overhead": statistics.median(steps)}


def _launch(world_size: int, directory: Path) -> dict:
    out = directory / f"calibrate_{world_size}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        "lightning_dpar.layout_search.calibrate",
        "--worker",
        str(out),
    ]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def profile_from(measured: list[dict], base: HardwareProfile, name: str) -> HardwareProfile:
    """The profile the launches' measurements make: collectives by group size, the matmul throughput of the largest
    group's median rank (ranks compete for the cores as in training), `intra_node` the largest group's all-reduce."""
    collectives: dict[str, dict[str, Link]] = {}
    for launch in measured:
        n = launch["world_size"]
        for collective in COLLECTIVES:
            per_rank = [rank["timings"].get(collective) for rank in launch["ranks"]]
            if not all(per_rank):
                continue
            small = (per_rank[0][0][0], max(r[0][1] for r in per_rank))  # the slowest rank sets the pace
            large = (per_rank[0][1][0], max(r[1][1] for r in per_rank))
            collectives.setdefault(collective, {})[str(n)] = fit_link(collective, n, small, large)
    largest = max(measured, key=lambda launch: launch["world_size"])
    size = max(int(s) for s in largest["ranks"][0]["matmul"])
    flops = statistics.median(rank["matmul"][str(size)] for rank in largest["ranks"])
    intra = collectives.get("all_reduce", {}).get(str(largest["world_size"]), base.intra_node)
    runtime = {
        name: statistics.median(rank[name] for rank in largest["ranks"] if name in rank)
        for name in ("runtime_memory", "step_overhead")
        if all(name in rank for rank in largest["ranks"])
    }
    memory = base.device_memory
    if largest["device"] == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // largest["world_size"]
    return replace(
        base,
        name=name,
        devices_per_node=largest["world_size"],
        device_memory=memory,
        matmul_flops=flops,
        intra_node=intra,
        collectives=collectives,
        runtime_memory=int(runtime.get("runtime_memory", base.runtime_memory)),
        step_overhead=runtime.get("step_overhead", base.step_overhead),
        description=f"calibrated on {socket.gethostname()} ({largest['device']}, group sizes"
        f" {sorted(launch['world_size'] for launch in measured)}) from the {base.name} preset",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpar calibrate",
        description="Measure matmul throughput and each collective's latency and bandwidth by group size on this"
        " machine (one torchrun launch per group size) and write a hardware profile for `plan --auto --profile`.",
    )
    parser.add_argument("--out", help="the profile's JSON file")
    parser.add_argument("--world-sizes", default="2,4", help="group sizes to measure, comma-separated (default 2,4)")
    parser.add_argument("--base", default="cpu-gloo", help="preset whose other fields the profile keeps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(Path(args.worker))
        return 0
    if not args.out:
        parser.error("--out FILE.json is required")
    try:
        sizes = sorted({int(size) for size in args.world_sizes.split(",")})
        if not sizes or min(sizes) < 2:
            raise ValueError
    except ValueError:
        print(
            f"`--world-sizes={args.world_sizes}` is invalid: give group sizes of 2 or more, e.g. 2,4.", file=sys.stderr
        )
        return 2
    base = get_profile(args.base)
    with tempfile.TemporaryDirectory(prefix="dpar-calibrate-") as directory:
        measured = [_launch(size, Path(directory)) for size in sizes]
    profile = profile_from(measured, base, f"calibrated-{socket.gethostname()}")
    save_profile(profile, args.out)
    print(json.dumps(profile.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
