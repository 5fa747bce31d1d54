"""The layout search: every candidate layout priced by the cost model, those that cannot run rejected with the reason,
the rest ranked by step time per sample among those that fit the device memory.

`search` is a pure function of the model's facts, the world, the hardware profile and a `probe` that returns the
dry run's per-rank memory for a layout (or raises the planner's error: heads not divisible by the TP size, too few
layers for the stages, ...). The probe is called once per distinct mesh, schedule and microbatches
(`Layout.probe_key`), in the fixed candidate order, and ranking breaks ties by `Layout.sort_key`: the same model
and world always give the same choice. `what_would_fit` answers the question a search with no fitting layout
leaves: how much memory, or how many devices, would do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lightning_dpar.activation_checkpointing.step import Checkpointing
from lightning_dpar.helpers import format_bytes
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.candidates import Layout, Rejected, enumerate_layouts
from lightning_dpar.layout_search.cost import Estimate, MeshMemory, estimate
from lightning_dpar.layout_search.model_facts import ModelFacts
from lightning_dpar.layout_search.profiles import GIB, HardwareProfile, check_float8

__all__ = ["MeshProbe", "SearchResult", "Suggestion", "search", "what_would_fit"]

#: The dry run's memory for a layout (every activation checkpointing setting); raises `ValueError` / `TypeError`
#: with the planner's message.
MeshProbe = Callable[[Layout], MeshMemory]


@dataclass(frozen=True)
class SearchResult:
    """`ranked`: the layouts that fit, fastest per sample first; `too_big`: those that do not fit, least memory
    first; `rejected`: those that cannot run, with the reason."""

    world_size: int
    num_nodes: int
    profile: HardwareProfile
    facts: ModelFacts
    ranked: list[Estimate]
    too_big: list[Estimate]
    rejected: list[Rejected]
    #: When nothing fits and it was asked for (`what_would_fit`): how much memory, or how many devices, would do.
    suggestion: Suggestion | None = None
    #: The per-rank batch of each data-parallel size, when it is not `facts.batch_size` at every size.
    batch: BatchRule | None = None
    #: Whether loss parallel was allowed (the layouts with tensor parallelism, without pipeline or context
    #: parallelism, have it).
    loss_parallel: bool = False
    #: The float8 recipe every layout was priced with, or None.
    float8: str | None = None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def over_by(self, candidate: Estimate) -> int:
        """Bytes by which `candidate` exceeds the device memory."""
        return candidate.memory.total - self.profile.device_memory


def search(
    facts: ModelFacts,
    world_size: int,
    num_nodes: int,
    profile: HardwareProfile,
    probe: MeshProbe,
    activation_checkpointing: Checkpointing | None = None,
    batch: BatchRule | None = None,
    loss_parallel: bool = False,
    float8: str | None = None,
) -> SearchResult:
    """Price every layout of `world_size` ranks on `num_nodes` nodes (see the module docstring).

    `activation_checkpointing`: `None` considers every setting; `False`, `"selective"` or `True` (full) only that
    one. `batch`: the per-rank
    batch of each data-parallel size (default: `facts.batch_size` at every size); each layout is priced at its own.
    `loss_parallel`: give loss parallel to the layouts that can run it (`enumerate_layouts`); `float8`: price every
    layout with that float8 recipe, refused on a profile without float8 matmuls.
    """
    check_float8(float8, profile)
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"`world_size={world_size}` on `num_nodes={num_nodes}`: the world size must be a positive multiple of the"
            " number of nodes."
        )
    devices_per_node = world_size // num_nodes
    profile = replace(profile, devices_per_node=devices_per_node)
    rule = batch if batch is not None else BatchRule(per_rank=facts.batch_size)
    layouts, rejected = enumerate_layouts(
        world_size,
        devices_per_node,
        num_nodes,
        facts.layers,
        rule,
        moe=bool(facts.experts),
        seq_len=facts.seq_len,
        loss_parallel=loss_parallel,
        float8=float8,
    )
    if activation_checkpointing is not None:
        layouts = [layout for layout in layouts if layout.activation_checkpointing == activation_checkpointing]
    probed: dict[tuple[Any, ...], MeshMemory | str] = {}
    estimates: list[Estimate] = []
    for layout in layouts:
        if layout.probe_key not in probed:
            try:
                probed[layout.probe_key] = probe(layout)
            except (ValueError, TypeError) as err:
                probed[layout.probe_key] = str(err)
                if not any(r.what == layout.mesh() and r.reason == str(err) for r in rejected):
                    rejected.append(Rejected(layout.mesh(), str(err)))
        mesh = probed[layout.probe_key]
        if isinstance(mesh, MeshMemory):
            per_rank = rule.at(layout.dims.data_parallel)
            assert isinstance(per_rank, int), "enumerate_layouts refuses the sizes without a batch"
            estimates.append(estimate(layout, replace(facts, batch_size=per_rank), mesh, profile))
    fits = [e for e in estimates if e.memory.total <= profile.device_memory]
    too_big = [e for e in estimates if e.memory.total > profile.device_memory]
    fits.sort(key=lambda e: (e.seconds_per_sample, e.layout.sort_key))
    too_big.sort(key=lambda e: (e.memory.total, e.layout.sort_key))
    return SearchResult(
        world_size,
        num_nodes,
        profile,
        facts,
        fits,
        too_big,
        rejected,
        batch=batch,
        loss_parallel=loss_parallel,
        float8=float8,
    )


@dataclass(frozen=True)
class Suggestion:
    """What would fit when nothing does: the smallest device memory on this world (and its layout), and the
    smallest device count tried that fits the given memory (and its layout), if any."""

    memory_needed: int | None
    memory_layout: Estimate | None
    devices_needed: int | None
    devices_layout: Estimate | None
    #: Set when no device count can fit: the profile's runtime memory alone is at least the device memory.
    runtime_exceeds: tuple[int, int] | None = None

    def describe(self) -> str:
        lines = []
        if self.memory_layout is not None and self.memory_needed is not None:
            layout = self.memory_layout.layout.describe()
            lines.append(f"with {self.memory_needed / GIB:.2f} GiB per device it would fit: {layout}")
        if self.devices_layout is not None:
            lines.append(f"on {self.devices_needed} devices it would fit: {self.devices_layout.layout.describe()}")
        elif self.runtime_exceeds is not None:
            runtime, device = (format_bytes(n) for n in self.runtime_exceeds)
            lines.append(
                f"no device count fits {device} per device: the profile's runtime memory alone (CUDA context,"
                f" communication buffers) takes {runtime}"
            )
        elif self.devices_needed is None:
            lines.append("no device count tried (up to 32 x this world) fits the device memory")
        return "; ".join(lines)


def what_would_fit(
    result: SearchResult,
    probe_for_world: Callable[[int, int], MeshProbe],
    max_factor: int = 32,
) -> Suggestion:
    """The smallest memory per device that would fit on `result`'s world, and the smallest multiple of its world
    (x2, x4, ... up to `max_factor`, whole nodes kept) whose best layout fits; `probe_for_world(world, nodes)` gives
    the dry-run probe of another world. When the profile's runtime memory alone does not fit, no world can, and
    none is tried."""
    candidates = result.ranked + result.too_big
    smallest = min(candidates, key=lambda e: (e.memory.total, e.layout.sort_key), default=None)
    memory_needed = smallest.memory.total if smallest else None
    profile = result.profile
    if profile.runtime_memory >= profile.device_memory:
        return Suggestion(memory_needed, smallest, None, None, (profile.runtime_memory, profile.device_memory))
    devices = devices_layout = None
    factor = 2
    while factor <= max_factor:
        world, nodes = result.world_size * factor, result.num_nodes * factor if result.num_nodes > 1 else 1
        if nodes == 1 and world > result.profile.devices_per_node:
            nodes = world // result.profile.devices_per_node if world % result.profile.devices_per_node == 0 else 1
        bigger = search(
            result.facts,
            world,
            nodes,
            result.profile,
            probe_for_world(world, nodes),
            batch=result.batch,
            loss_parallel=result.loss_parallel,
            float8=result.float8,
        )
        if bigger.best is not None:
            devices, devices_layout = world, bigger.best
            break
        factor *= 2
    return Suggestion(memory_needed, smallest, devices, devices_layout)
