"""What gradient-norm clipping costs per step: `python -m benchmarks.clipping_cost --preset cpu-large`.

One process (a one-rank gloo group), the preset's model with a gradient on every parameter, three layouts of the
same gradients: plain tensors, and DTensors as the 2D strategy leaves them (blocks' matrices sharded on two mesh
dims, everything else on one), on meshes of size 1 so only the per-step Python and kernel work is timed, not the
all-reduces. Times `torch.nn.utils.clip_grad_norm_` (plain tensors only: it cannot mix meshes) and the package's
clipping as `DparPrecision` runs it (`GradientClipper`, grouping cached) and without the cache, in ms per call
(median of `--calls`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from benchmarks.model import PRESETS, blocks, build_net


def _timed(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _with_grads(net: nn.Module) -> list[nn.Parameter]:
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    return params


def _as_2d_dtensors(net: nn.Module) -> list[nn.Parameter]:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tensor_parallel"))
    in_blocks = {id(p) for block in blocks(net) for p in block.parameters() if p.dim() == 2}
    params = []
    for p in net.parameters():
        placements = (Shard(0), Shard(0)) if id(p) in in_blocks else (Shard(0), Replicate())
        d = nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        d.grad = distribute_tensor(torch.randn_like(p) * 1e-2, mesh, placements)
        params.append(d)
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-large")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from lightning_dpar.optim.clipping import GradientClipper, clip_grad_norm_

    net = build_net(PRESETS[args.preset].size)
    plain, dtensors = _with_grads(net), _as_2d_dtensors(net)
    clipper_plain, clipper_dtensor = GradientClipper(), GradientClipper()
    rows = [
        ("torch.nn.utils.clip_grad_norm_, plain tensors", lambda: torch.nn.utils.clip_grad_norm_(plain, 1.0)),
        ("GradientClipper, plain tensors", lambda: clipper_plain.clip_grad_norm_(plain, 1.0)),
        ("GradientClipper, 2D DTensors", lambda: clipper_dtensor.clip_grad_norm_(dtensors, 1.0)),
        ("clipping.clip_grad_norm_ (one-off, no cache), 2D DTensors", lambda: clip_grad_norm_(dtensors, 1.0)),
    ]
    print(f"{args.preset}: {len(plain)} parameters")
    print("| clipping | ms per call |\n|---|---:|")
    for label, fn in rows:
        print(f"| {label} | {_timed(fn, args.calls):.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
