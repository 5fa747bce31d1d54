"""Every benchmarked variant and how one repetition of it is measured.

All variants train the preset's model (`benchmarks.model`: MLP blocks, the example GPT or a transformers Llama),
built on the device it trains on, with the same data, per-rank batch, optimizer and mesh, and are timed by the same
`StepClock` of `benchmarks.clock` (wall time between the ends of consecutive steps, data loading included), so the
only difference left is the training driver: a plain loop, Lightning's strategies, or this package's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.clock import ClockCallback, RecordFunctionProfiler, StepClock
from benchmarks.model import (
    BenchModule,
    HandParallelModule,
    Preset,
    Size,
    SyntheticTokens,
    block_class,
    block_tp_plan,
    blocks,
    build_net,
    loss_fn,
    tp_plan,
)
from benchmarks.model import make_optimizer as make_bench_optimizer

#: Tensor-parallel size of the 2D runs (1 at odd world sizes, e.g. the single-GPU preset: FSDP on a 2D mesh).
TENSOR_PARALLEL_SIZE = 2


@dataclass
class Context:
    """What every variant of one run shares: preset, device, data, meshes and repetition settings."""

    preset: Preset
    device: torch.device
    warmup: int
    steps: int
    data: SyntheticTokens
    mesh_2d: DeviceMesh
    checkpoint_root: str
    #: Record the timed steps with `torch.profiler` (ops, and Lightning's hooks as ranges); see `benchmarks.profile`.
    profile: bool = False
    #: `torch.compile` options of the compiled variants, hand loop and package alike (`{}`: the default, Inductor).
    compile_options: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> Size:
        return self.preset.size

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh_2d["tensor_parallel"].size()

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


@dataclass
class Measurement:
    """One repetition of one variant on this rank."""

    step_times: list[float]
    #: This process's CPU time per step: unlike wall time, barely affected by other processes on a busy machine.
    cpu_times: list[float]
    peak_memory_bytes: int
    state_bytes: dict[str, int]
    checkpoint: dict[str, float] = field(default_factory=dict)
    #: Bytes still allocated when the variant started (`StepClock.memory_at_reset`): ~0 unless a variant leaked.
    memory_at_reset_bytes: int = 0
    #: With `Context.profile`: per profiled event, `[name, calls, self CPU us, total CPU us]` over the timed steps.
    profile: list[list] = field(default_factory=list)
    #: With `Context.profile`: per Python function, `[name, calls]` over the timed steps (`StepClock.python_calls`).
    python_calls: list[list] = field(default_factory=list)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters and optimizer state (local shards only)."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    optim = sum(
        _local(t).numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return {"params": params, "optimizer": optim}


# ------------------------------------------------------------------------------------------ plain PyTorch loops


def _compile_blocks(net: nn.Module, options: dict[str, Any]) -> None:
    for block in blocks(net):
        block.compile(**options)


def _mixed_precision(ctx: Context, root: bool) -> MixedPrecisionPolicy:
    """As the package maps `bf16-mixed` onto FSDP2: bf16 compute, fp32 gradient reduction, fp32 root outputs."""
    if ctx.preset.precision != "bf16-mixed":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
    )


def _forward_context(family: str, ctx: Context) -> Any:
    """DDP has no mixed-precision policy: `bf16-mixed` is autocast there (as in the package and Lightning)."""
    if family == "replicate" and ctx.preset.precision == "bf16-mixed":
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    return nullcontext()


def _checkpoint_by_hand(block: nn.Module) -> None:
    """Selective activation checkpointing written by hand, as a user would: the block's forward through
    `torch.utils.checkpoint.checkpoint` (non-reentrant) with the selective policy's contexts (torchtitan's op-level
    policy, `lightning_dpar.activation_checkpointing.policy`: the same policy, applied without the package)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from lightning_dpar.activation_checkpointing.policy import selective_policy

    forward = block.forward

    def context_fn() -> Any:  # made outside the compiled forward: dynamo refuses a context_fn made inside it
        return create_selective_checkpoint_contexts(selective_policy())

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    block.forward = checkpointed  # type: ignore[method-assign]


def float8_config(recipe: str, device: torch.device) -> Any:
    """torchao's config of `recipe`, emulated on a CPU (float8 matmuls need a GPU of compute capability 8.9 or
    newer): what the package is given as `float8=` and the hand loop converts with."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if device.type == "cpu" else config


def _float8_by_hand(net: nn.Module, recipe: str, device: torch.device) -> None:
    """float8 written by hand, as a user would: torchao's `convert_to_float8_training` on the Linears the package's
    float8 step converts (`convertible_linears`: all but the output layer, of sizes float8 matmuls take)."""
    from torchao.float8 import convert_to_float8_training

    from lightning_dpar.float8.step import convertible_linears

    wanted = set(convertible_linears(net, None))
    convert_to_float8_training(net, module_filter_fn=lambda _, fqn: fqn in wanted, config=float8_config(recipe, device))


def _plain_model(
    family: str, compiled: bool, ctx: Context, checkpointing: str = "", float8: str = ""
) -> tuple[nn.Module, int, int]:
    """The network parallelised by hand exactly as the package does it (each block selectively checkpointed
    first with `checkpointing="selective"`; its Linears converted by torchao first with `float8=<recipe>`); returns
    (model, dp size, dp rank)."""
    with ctx.device:  # built where it trains (a 1 B model's CPU init would take longer than its steps)
        net = build_net(ctx.size)
    if checkpointing == "selective":
        for block in blocks(net):
            _checkpoint_by_hand(block)
    if float8:
        _float8_by_hand(net, float8, ctx.device)
    if family == "replicate":
        if compiled:
            _compile_blocks(net, ctx.compile_options)
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(net, device_ids=device_ids), ctx.world, dist.get_rank()
    if family == "fsdp":
        mesh = None
    else:
        tp_mesh, mesh = ctx.mesh_2d["tensor_parallel"], ctx.mesh_2d["data_parallel"]
        if tp_mesh.size() > 1:
            for block in blocks(net):
                parallelize_module(block, tp_mesh, block_tp_plan(ctx.size))
    if compiled:
        _compile_blocks(net, ctx.compile_options)
    for block in blocks(net):
        fully_shard(block, mesh=mesh, mp_policy=_mixed_precision(ctx, root=False))
    fully_shard(net, mesh=mesh, mp_policy=_mixed_precision(ctx, root=True))
    if mesh is None:
        return net, ctx.world, dist.get_rank()
    return net, mesh.size(), mesh.get_local_rank()


def _clock(ctx: Context) -> StepClock:
    return StepClock(ctx.device, (ctx.warmup, ctx.total_steps) if ctx.profile else None)


def run_plain(family: str, compiled: bool, ctx: Context, checkpointing: str = "", float8: str = "") -> Measurement:
    clock = _clock(ctx)
    model, dp, dp_rank = _plain_model(family, compiled, ctx, checkpointing, float8)
    optimizer = make_bench_optimizer(model.parameters())
    forward_context = _forward_context(family, ctx)
    sampler = DistributedSampler(ctx.data, num_replicas=dp, rank=dp_rank, shuffle=False)
    loader = DataLoader(ctx.data, batch_size=ctx.size.batch, sampler=sampler)
    for step, batch in enumerate(loader):
        if step == 0:
            clock.start()
        batch = [t.to(ctx.device, non_blocking=True) for t in batch]
        with forward_context:
            loss = loss_fn(model, batch)
        clock.sample_memory()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        clock.tick()
        if step + 1 == ctx.total_steps:
            break
    return Measurement(
        clock.times,
        clock.cpu_times,
        clock.peak_memory(),
        state_bytes(model, optimizer),
        profile=clock.profile,
        python_calls=clock.python_calls,
        memory_at_reset_bytes=clock.memory_at_reset,
    )


# ------------------------------------------------------------------------------------------ Lightning-driven


def run_lightning(
    make_strategy: Callable[[Context], Any],
    module_cls: type,
    ctx: Context,
    checkpoint: str,
    gradient_clip_val: float | None = None,
) -> Measurement:
    """`checkpoint`: "" (none), "trainer" (save/load through the strategy) or "async" (also `async_save`)."""
    clock = _clock(ctx)
    trainer = L.Trainer(
        accelerator="gpu" if ctx.device.type == "cuda" else "cpu",
        devices=ctx.world,
        strategy=make_strategy(ctx),
        precision=ctx.preset.precision,
        max_steps=ctx.total_steps,
        callbacks=[ClockCallback(clock)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        profiler=RecordFunctionProfiler() if ctx.profile else None,
        gradient_clip_val=gradient_clip_val,
    )
    with ctx.device:  # as the plain loops build theirs
        module = module_cls(ctx.size)
    trainer.fit(module, DataLoader(ctx.data, batch_size=ctx.size.batch, shuffle=False))
    optimizer = trainer.optimizers[0]
    measurement = Measurement(
        clock.times,
        clock.cpu_times,
        clock.peak_memory(),
        state_bytes(module, optimizer),
        profile=clock.profile,
        python_calls=clock.python_calls,
        memory_at_reset_bytes=clock.memory_at_reset,
    )
    if checkpoint and ctx.preset.checkpoints:
        measurement.checkpoint = _time_checkpoints(trainer, ctx.checkpoint_root, with_async=checkpoint == "async")
    return measurement


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _time_checkpoints(trainer: L.Trainer, checkpoint_root: str, with_async: bool) -> dict[str, float]:
    """Save and load through the strategy; with `with_async`, also two `async_save` saves of the same state.

    Async "blocked" is the time until `save_checkpoint` returns on the slowest rank (training waits for it); "total"
    also waits for the background write to be complete under its final name. The first async save also creates
    the writer's thread and process group; "steady" is the next one, as every later save in a run.
    """
    root = [tempfile.mkdtemp(dir=checkpoint_root)]
    dist.broadcast_object_list(root)
    path = os.path.join(root[0], "sync.ckpt")
    _timed(lambda: trainer.save_checkpoint(path))  # the first save of a run also sets up what later saves reuse
    times = {
        "save_s": _timed(lambda: trainer.save_checkpoint(path)),  # steady, like the async "steady" save below
        "load_s": _timed(lambda: trainer.strategy.load_checkpoint(path)),
    }
    if with_async:
        trainer.strategy.async_save = True
        for attempt in ("first", "steady"):
            dist.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(os.path.join(root[0], f"async_{attempt}.ckpt"))
            blocked = torch.tensor(time.perf_counter() - start)
            trainer.strategy.wait_for_checkpoint()
            total = time.perf_counter() - start
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
            suffix = "_first" if attempt == "first" else ""
            times[f"async_blocked{suffix}_s"] = blocked.item()
            times[f"async_total{suffix}_s"] = total
        trainer.strategy.async_save = False
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    return times


def _dpar(
    name: str, compiled: bool, on_nonfinite: str = "raise", checkpointing: str = "", float8: str = ""
) -> Callable[[Context], Any]:
    def make(ctx: Context) -> Any:
        import lightning_dpar

        kwargs: dict[str, Any] = {
            "compile": (ctx.compile_options or True) if compiled else False,
            "on_nonfinite": on_nonfinite,
        }
        if checkpointing:
            kwargs["activation_checkpointing"] = checkpointing
        if float8:
            kwargs["float8"] = float8_config(float8, ctx.device)

        if name == "2d":
            return lightning_dpar.FSDPTensorParallelStrategy(
                tensor_parallel_size=ctx.tensor_parallel_size, tp_plan=tp_plan(ctx.size), **kwargs
            )
        cls = {"replicate": lightning_dpar.ReplicateStrategy, "fsdp": lightning_dpar.FullyShardStrategy}[name]
        return cls(**kwargs)

    return make


def _lightning_peer(family: str) -> Callable[[Context], Any]:
    def make(ctx: Context) -> Any:
        from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

        if family == "replicate":
            return DDPStrategy()
        if family == "fsdp":
            return FSDPStrategy(auto_wrap_policy={block_class(ctx.size)})
        tp = ctx.tensor_parallel_size
        return ModelParallelStrategy(data_parallel_size=ctx.world // tp, tensor_parallel_size=tp)

    return make


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # replicate | fsdp | 2d: which plain loop it is compared with
    driver: str  # plain | lightning | dpar
    compiled: bool
    run: Callable[[Context], Measurement]
    #: Device types the variant can run on (Lightning's `FSDPStrategy` refuses the CPU).
    devices: tuple[str, ...] = ("cpu", "cuda")
    #: Activation checkpointing of the blocks (`"selective"`), in the package and the hand loop it is compared with;
    #: `""`: none.
    checkpointing: str = ""
    #: torchao's float8 recipe (`"tensorwise"`, `"rowwise"`) of the Linears the float8 step converts, in the package
    #: (`float8=`) and in the hand loop it is compared with (the same conversion by hand); `""`: none.
    float8: str = ""

    def named(self, base: str) -> Variant:
        """This variant named `base` with its setting and compilation as suffixes (`dpar_fsdp_float8_rowwise`)."""
        suffix = (f"_{self.setting}" if self.setting else "") + ("_compiled" if self.compiled else "")
        return replace(self, name=base + suffix)

    @property
    def setting(self) -> str:
        """What the variant adds to its family's loop, as its name's suffix: `selective`, `float8_rowwise`, ..."""
        return "_".join(part for part in (self.checkpointing, self.float8 and f"float8_{self.float8}") if part)


def _float8_devices(float8: str, compiled: bool) -> tuple[str, ...]:
    """Where a variant runs: compiled float8 needs inductor's float8 kernels, which need a GPU; emulated float8
    runs eagerly on a CPU too."""
    return ("cuda",) if float8 and compiled else ("cpu", "cuda")


def all_variants() -> list[Variant]:
    variants = []
    for family, plain_name, peer_name in (
        ("replicate", "plain_ddp", "lightning_ddp"),
        ("fsdp", "plain_fsdp", "lightning_fsdp"),
        ("2d", "plain_2d", "lightning_model_parallel"),
    ):
        # FSDP also with selective activation checkpointing and with float8 (tensorwise, rowwise), each against the
        # same policy or conversion applied by hand; (checkpointing, float8) per setting
        settings = [("", "")]
        if family == "fsdp":
            settings += [("selective", ""), ("", "tensorwise"), ("", "rowwise")]
        for checkpointing, float8 in settings:
            for compiled in (False, True):
                variants.append(
                    Variant(
                        "",
                        family,
                        "plain",
                        compiled,
                        lambda ctx, f=family, c=compiled, a=checkpointing, e=float8: run_plain(f, c, ctx, a, e),
                        devices=_float8_devices(float8, compiled),
                        checkpointing=checkpointing,
                        float8=float8,
                    ).named(plain_name)
                )
        module_cls = HandParallelModule if family == "2d" else BenchModule
        variants.append(
            Variant(
                peer_name,
                family,
                "lightning",
                False,
                lambda ctx, f=family, m=module_cls: run_lightning(_lightning_peer(f), m, ctx, "trainer"),
                devices=("cuda",) if family == "fsdp" else ("cpu", "cuda"),
            )
        )
        for checkpointing, float8 in settings:
            for compiled in (False, True):
                timed_checkpoint = "" if compiled or checkpointing or float8 else "async"
                variants.append(
                    Variant(
                        "",
                        family,
                        "dpar",
                        compiled,
                        lambda ctx, f=family, c=compiled, a=checkpointing, e=float8, t=timed_checkpoint: run_lightning(
                            _dpar(f, c, checkpointing=a, float8=e), BenchModule, ctx, t
                        ),
                        devices=_float8_devices(float8, compiled),
                        checkpointing=checkpointing,
                        float8=float8,
                    ).named(f"dpar_{family}")
                )
        # The non-finite guard's cost (`on_nonfinite`), with and without gradient-norm clipping: `_unguarded` is
        # `on_nonfinite="off"`, `_clip` clips at norm 1.0.
        guard_runs = (("_unguarded", "off", None), ("_clip", "raise", 1.0), ("_clip_unguarded", "off", 1.0))
        for suffix, mode, clip in guard_runs:
            variants.append(
                Variant(
                    f"dpar_{family}{suffix}",
                    family,
                    "dpar",
                    False,
                    lambda ctx, f=family, m=mode, c=clip: run_lightning(_dpar(f, False, m), BenchModule, ctx, "", c),
                )
            )
    return variants


def build_context(
    preset: Preset,
    device: torch.device,
    warmup: int,
    steps: int,
    checkpoint_root: str,
    profile: bool = False,
    compile_options: dict[str, Any] | None = None,
) -> Context:
    world = dist.get_world_size()
    if world % TENSOR_PARALLEL_SIZE and world > 1:
        raise ValueError(f"--world-size {world} must be 1 or a multiple of the 2D runs' tensor-parallel size 2.")
    tp = min(TENSOR_PARALLEL_SIZE, world)
    mesh_2d = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    data = SyntheticTokens(preset.size, n=world * preset.size.batch * (warmup + steps))
    return Context(preset, device, warmup, steps, data, mesh_2d, checkpoint_root, profile, dict(compile_options or {}))


def preset_variants(preset: Preset, device_type: str, only: list[str] | None = None) -> list[Variant]:
    """The variants a preset runs on this device type, optionally narrowed to `only` (names)."""
    return [
        v
        for v in all_variants()
        if device_type in v.devices
        and v.family in preset.families
        and v.driver in preset.drivers
        and (not only or v.name in only)
    ]
