"""Hardware profiles as data: what the layout search's cost model knows about the machine.

A profile is a frozen dataclass that round-trips through JSON (`save_profile` / `load_profile`), so a measured
profile (`python -m lightning_dpar calibrate --out profile.json`) and the presets are used the same way. It holds:

- `devices_per_node` and `device_memory` (bytes one rank may use);
- `matmul_flops`: the sustained (not peak) matmul throughput of one device, FLOP/s (bf16 on a GPU);
- `float8_matmul_flops`: the same for float8 matmuls (torchao's `Float8Linear`), `None` on a device without them
  (an A100, a CPU): the search then refuses `float8=`;
- two links, `intra_node` and `inter_node`, each a latency (seconds per message step) and a bandwidth (bytes/s one
  rank sends and receives at, over that link);
- `collectives`: measured `(latency, bandwidth)` by collective and group size, which override the links for groups
  of that size within a node (what `calibrate` writes);
- `fsdp_overlap`: the fraction of FSDP's all-gather / reduce-scatter time hidden behind compute (prefetching);
- `runtime_memory`: bytes a rank holds beyond the model's tensors (CUDA context, communication library, allocator,
  the framework's own objects), and `step_overhead`: seconds per step beyond compute and communication (the training
  loop, hooks, the optimizer's launch): both measured by `calibrate` on a near-empty model, estimated in presets.

The presets are estimates, not measurements: `cpu-gloo` is a small shared CPU machine through gloo, and `h100-node`
is 8 x H100 SXM per node (NVLink 4 within, 400 Gb/s InfiniBand per GPU across, ~400 TFLOP/s sustained bf16 matmul,
i.e. ~40% of the dense peak). The H100 preset is not yet checked against a measured step (see docs/auto-layout.md).
`h200-node`, `b200-node` and `a100-node` are the same estimate for those GPUs, from NVIDIA's datasheets: each
sustained rate is 40% of the datasheet's dense (not sparse) peak, bf16 and float8 alike:

| preset | dense bf16 peak | dense float8 peak | memory | NVLink per direction (achieved) |
| --- | ---: | ---: | ---: | ---: |
| `a100-node` (A100 SXM 80 GB) | 312 TFLOP/s | none | 80 GB | 300 GB/s (130) |
| `h100-node` (H100 SXM) | 989 TFLOP/s | 1,979 TFLOP/s | 80 GB | 450 GB/s (200) |
| `h200-node` (H200 SXM) | 989 TFLOP/s | 1,979 TFLOP/s | 141 GB | 450 GB/s (200) |
| `b200-node` (HGX B200) | 2,250 TFLOP/s | 4,500 TFLOP/s | 180 GB | 900 GB/s (400) |

So float8 matmuls run at twice the bf16 rate in the model. That is the matmul alone: torchao measures +25%
(tensorwise) and +10% (rowwise) end-to-end on H100 for Llama 3 8B, the casts, scales and unconverted work included
(see docs/auto-layout.md, "float8").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lightning_dpar.float8.cost import check_recipe

__all__ = [
    "PRESETS",
    "HardwareProfile",
    "Link",
    "check_float8",
    "get_profile",
    "load_profile",
    "save_profile",
]

GIB = 1024**3


@dataclass(frozen=True)
class Link:
    """A link between two ranks: time for n bytes over one message step is `latency + n / bandwidth`."""

    latency: float  # seconds per message step
    bandwidth: float  # bytes per second, per rank, each direction

    def seconds(self, nbytes: float, steps: int = 1) -> float:
        """Time to move `nbytes` per rank in `steps` message steps (the latency is paid once per step)."""
        return steps * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of machine; see the module docstring for each field's meaning."""

    name: str
    devices_per_node: int
    device_memory: int  # bytes
    matmul_flops: float  # sustained FLOP/s per device
    intra_node: Link
    inter_node: Link
    fsdp_overlap: float = 0.0
    runtime_memory: int = 0
    step_overhead: float = 0.0
    #: `{collective: {group size (as a string, JSON keys): Link}}`, measured; used within a node.
    collectives: dict[str, dict[str, Link]] = field(default_factory=dict)
    description: str = ""
    float8_matmul_flops: float | None = None  # sustained float8 FLOP/s per device; None: no float8 matmuls

    def link(self, crosses_nodes: bool) -> Link:
        return self.inter_node if crosses_nodes else self.intra_node

    def collective_link(self, collective: str, group_size: int, crosses_nodes: bool) -> Link:
        """The link a collective over `group_size` ranks runs at: the measured one for that collective and size
        within a node when the profile has it (the nearest smaller measured size otherwise), else the plain link."""
        measured = self.collectives.get(collective, {})
        if not crosses_nodes and measured:
            sizes = sorted(int(size) for size in measured)
            fitting = [size for size in sizes if size <= group_size] or sizes[:1]
            return measured[str(fitting[-1])]
        return self.link(crosses_nodes)

    def with_memory(self, device_memory: int) -> HardwareProfile:
        """The same machine with `device_memory` bytes per rank (a user's budget, or the search for a size that
        fits)."""
        return replace(self, device_memory=int(device_memory))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        data = dict(data)
        data["intra_node"] = Link(**data["intra_node"])
        data["inter_node"] = Link(**data["inter_node"])
        data["collectives"] = {
            name: {str(size): Link(**link) for size, link in sizes.items()}
            for name, sizes in data.get("collectives", {}).items()
        }
        return cls(**data)


PRESETS: dict[str, HardwareProfile] = {
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo",
        devices_per_node=4,
        device_memory=4 * GIB,
        matmul_flops=2.0e10,  # a few shared cores, fp32
        intra_node=Link(latency=5e-5, bandwidth=1.0e9),  # gloo over loopback TCP
        inter_node=Link(latency=1e-4, bandwidth=1.25e9),  # 10 Gb/s Ethernet
        fsdp_overlap=0.0,  # the ranks share the cores: communication competes with compute
        runtime_memory=32 * 1024**2,
        step_overhead=0.01,
        description="estimate for a small CPU machine running gloo; calibrate for numbers of this machine",
    ),
    "a100-node": HardwareProfile(
        name="a100-node",
        devices_per_node=8,
        device_memory=80 * GIB,
        matmul_flops=1.25e14,  # ~40% of the 312 TFLOP/s bf16 dense peak, sustained
        intra_node=Link(latency=5e-6, bandwidth=1.3e11),  # NVLink 3: 300 GB/s per direction, ~130 achieved
        inter_node=Link(latency=1e-5, bandwidth=2.25e10),  # 200 Gb/s InfiniBand per GPU, ~90% achieved
        fsdp_overlap=0.8,
        runtime_memory=2 * GIB,
        step_overhead=0.005,
        description="8 x A100 SXM 80 GB per node (no float8 matmuls), NVLink within, 200 Gb/s per GPU across;"
        " estimate, not yet checked",
    ),
    "h100-node": HardwareProfile(
        name="h100-node",
        devices_per_node=8,
        device_memory=80 * GIB,
        matmul_flops=4.0e14,  # ~40% of the bf16 dense peak, sustained
        intra_node=Link(latency=5e-6, bandwidth=2.0e11),  # NVLink 4: ~200 GB/s achieved per direction
        inter_node=Link(latency=1e-5, bandwidth=4.5e10),  # 400 Gb/s InfiniBand per GPU, ~90% achieved
        fsdp_overlap=0.8,
        runtime_memory=2 * GIB,  # CUDA context, NCCL buffers, allocator fragmentation
        step_overhead=0.005,
        float8_matmul_flops=7.9e14,  # ~40% of the 1,979 TFLOP/s float8 dense peak, as for bf16
        description="8 x H100 SXM per node, NVLink within, 400 Gb/s per GPU across; estimate, not yet checked",
    ),
    "h200-node": HardwareProfile(
        name="h200-node",
        devices_per_node=8,
        device_memory=141 * 10**9,  # 141 GB of HBM3e
        matmul_flops=4.0e14,  # the H100's compute: ~40% of the 989 TFLOP/s bf16 dense peak
        intra_node=Link(latency=5e-6, bandwidth=2.0e11),
        inter_node=Link(latency=1e-5, bandwidth=4.5e10),
        fsdp_overlap=0.8,
        runtime_memory=2 * GIB,
        step_overhead=0.005,
        float8_matmul_flops=7.9e14,  # ~40% of the 1,979 TFLOP/s float8 dense peak
        description="8 x H200 SXM (141 GB) per node, NVLink within, 400 Gb/s per GPU across; estimate, not yet checked",
    ),
    "b200-node": HardwareProfile(
        name="b200-node",
        devices_per_node=8,
        device_memory=180 * 10**9,  # 180 GB of HBM3e per GPU (HGX B200)
        matmul_flops=9.0e14,  # ~40% of the 2,250 TFLOP/s bf16 dense peak
        intra_node=Link(latency=5e-6, bandwidth=4.0e11),  # NVLink 5: 900 GB/s per direction, ~400 achieved
        inter_node=Link(latency=1e-5, bandwidth=4.5e10),  # 400 Gb/s per GPU, ~90% achieved
        fsdp_overlap=0.8,
        runtime_memory=2 * GIB,
        step_overhead=0.005,
        float8_matmul_flops=1.8e15,  # ~40% of the 4,500 TFLOP/s float8 dense peak
        description="8 x B200 (HGX B200) per node, NVLink 5 within, 400 Gb/s per GPU across; estimate, not yet checked",
    ),
}


def check_float8(float8: str | None, profile: HardwareProfile) -> None:
    """Refuse, naming the fix, a `float8=` that is not one of torchao's recipes, or one on a profile whose device has
    no float8 matmuls (`float8_matmul_flops` is `None`: an A100, a CPU, a calibrated profile), naming the presets
    that have them (`lightning_dpar.float8.cost.check_recipe`)."""
    check_recipe(float8, profile, PRESETS)


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile from a JSON file written by `save_profile` (or `calibrate`)."""
    return HardwareProfile.from_json(json.loads(Path(path).read_text()))


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=2, sort_keys=True) + "\n")


def get_profile(spec: str | HardwareProfile) -> HardwareProfile:
    """A preset by name, or a JSON file's profile by path; anything else fails naming what is valid."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if isinstance(spec, str) and spec.endswith(".json"):
        if not Path(spec).is_file():
            raise ValueError(
                f"`profile={spec!r}`: no such file. Write one with `python -m lightning_dpar calibrate --out {spec}`,"
                f" or use a preset: {sorted(PRESETS)}."
            )
        try:
            return load_profile(spec)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"`profile={spec!r}` is not a hardware profile ({err}); rewrite it with calibrate."
            ) from err
    raise ValueError(
        f"`profile={spec!r}` is not a known hardware profile. Use a preset {sorted(PRESETS)} or the path of a JSON"
        " profile written by `python -m lightning_dpar calibrate --out FILE.json`."
    )
