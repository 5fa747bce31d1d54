"""`PerformanceMonitor`: training throughput, step time, peak memory and model FLOPs utilisation (MFU), logged
through any Lightning logger and summarised in a table at the end of `fit`.

Works with any strategy (the package's or Lightning's own) and any accelerator. What each number means:

- step time: wall time between the ends of consecutive training batches (data loading included, validation
  excluded); on CUDA the device is synchronised first so queued kernels are counted (Lightning's progress bar
  reads the loss every step, which synchronises anyway).
- samples/s, tokens/s: global, i.e. this rank's batch size times the number of data-parallel ranks (ranks of one
  tensor-parallel group see the same batch and are counted once), divided by the step time. Tokens are counted when
  `tokens_per_sample` is given or the batch's first tensor holds token ids (an int32/int64 tensor `[batch, seq]`).
- peak memory: per rank. CUDA: the allocator's peak (`torch.cuda.max_memory_allocated`, reset when training
  starts). CPU: the process's peak resident set size (`ru_maxrss`), which covers the whole process lifetime.
- held state: per rank, when training ends, measured on the real tensors
(`lightning_dpar.estimates.state_memory.held_state`): the
  local bytes of trainable and frozen parameters, of the gradients allocated and of the optimizers' state. Frozen
  parameters (a LoRA base model) show here with no gradient and no optimizer state.
- MFU: achieved model FLOP/s over the device's peak, when both are known. Model FLOPs per batch:
  `flops_per_sample * batch size`, else `6 * N * tokens` (N = parameter count, the standard dense-transformer
  estimate: 2 FLOPs per parameter per token forward, 4 backward; attention scores and activation recomputation are
  not counted); per rank, divided by the tensor-parallel size (ranks that share one batch's compute). Peak FLOP/s
  come from `peak_flops` or, on CUDA, the table `PEAK_FLOPS` (dense, no sparsity) for the compute dtype implied by
  the Trainer's precision. FLOPs are never measured by tracing a batch: a dispatch mode active during a compiled
  block's first call would make dynamo skip that code for the rest of the process.
- Memory of the records: the most recent `RECORDS_KEPT` batches; the summary's medians are over those.
- stragglers: at each log interval every rank's mean step time and mean own time over the interval are gathered
  (one all-gather of two floats per rank). A rank's own time runs from the end of its previous batch to its
  backward: loading its batch and its forward, before the gradient synchronisation where data-parallel ranks wait
  for the slowest (so every rank's wall step time is about the same, and the wall time alone cannot name the slow
  one). Under FSDP or tensor parallelism the forward gathers parameters too, so a rank slow in its forward delays
  the others' forwards as well; one slow in loading its batch (or in anything before its forward) still stands out.
  Logged: `perf/step_time_{min,median,max}_s` across ranks, `perf/own_time_{min,median,max}_s` and
  `perf/slowest_rank` (by own time). A rank whose own time exceeds the median by more than `straggler_fraction` over
  `straggler_intervals` intervals in a row is named, with its host, in a warning (once per such run of intervals)
  and in `stragglers`.
"""

from __future__ import annotations

import resource
import socket
import statistics
import sys
import time
from collections import deque
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dpar.estimates.state_memory import HeldState, held_state
from lightning_dpar.helpers import format_bytes

__all__ = [
    "GIB",
    "PEAK_FLOPS",
    "PerformanceMonitor",
]

#: Dense peak FLOP/s per device by marketing name fragment (first match wins, so specific names come first) and
#: compute dtype. Sources: NVIDIA H100/H200/A100 datasheets (SXM unless named). Not Lightning's
#: `get_available_flops`: its H200 entries are the with-sparsity peaks (2x dense) and it does not match the plain
#: "NVIDIA H200" device name, which would make MFU half of the truth or missing on the GPUs this project targets.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H200": {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}

GIB = 1024**3

#: Batches whose records are kept (bounded so a long run does not grow memory); the summary uses these.
RECORDS_KEPT = 10_000


class PerformanceMonitor(L.Callback):
    """Log throughput, step time, peak memory per rank and (on GPU) MFU; print a summary at the end of `fit`.

    Args:
        tokens_per_sample: tokens in one sample, when the batch does not show it (e.g. fixed-length sequences in a
            float tensor). Enables tokens/s and the `6 * N * tokens` FLOPs estimate.
        flops_per_sample: model FLOPs (forward + backward) of one sample, overriding the estimate.
        peak_flops: the device's peak FLOP/s for the compute dtype, for GPUs missing from `PEAK_FLOPS`.
        warmup_steps: first batches left out of the summary's medians (compilation, allocator warm-up).
        log_every_n_steps: how often to log; default: the Trainer's `log_every_n_steps`.
        summary: print the summary table on rank 0 when `fit` ends.
        straggler_fraction: a rank is slow when its own time exceeds the median over ranks by this fraction.
        straggler_intervals: log intervals in a row a rank must be slow before the warning names it.
    """

    def __init__(
        self,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        warmup_steps: int = 2,
        log_every_n_steps: int | None = None,
        summary: bool = True,
        straggler_fraction: float = 0.2,
        straggler_intervals: int = 3,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps={warmup_steps}` must be >= 0.")
        if straggler_fraction <= 0 or straggler_intervals < 1:
            raise ValueError(
                f"`straggler_fraction={straggler_fraction}` must be > 0 and `straggler_intervals={straggler_intervals}`"
                " >= 1."
            )
        self.straggler_fraction = straggler_fraction
        self.straggler_intervals = straggler_intervals
        #: Each straggler warned about: `{"rank", "host", "global_step", "own_time_s", "median_s"}`.
        self.stragglers: list[dict[str, Any]] = []
        #: The last log interval's spread across ranks (the `perf/step_time_*`, `perf/own_time_*` metrics).
        self.rank_spread: dict[str, float] = {}
        self._hosts: list[str] = []
        self._slow_run: tuple[int, int] | None = None  # (rank, intervals in a row)
        self._interval: list[float] = [0.0, 0.0, 0.0]  # step time, own time, batches since the last log
        self._own_start: float | None = None
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.warmup_steps = warmup_steps
        self.log_every_n_steps = log_every_n_steps
        self.summary = summary
        #: One record per recent training batch: step time (s), global samples and tokens, model FLOPs on this rank.
        self.records: deque[dict[str, float]] = deque(maxlen=RECORDS_KEPT)
        #: Peak memory (bytes) of every rank, gathered when training ends.
        self.peak_memory_per_rank: list[int] = []
        #: Parameter, gradient and optimizer-state bytes every rank holds, gathered when training ends.
        self.held_state_per_rank: list[HeldState] = []
        self._batches = 0
        self._last: float | None = None
        # Fixed for a run; computed once in `on_train_start`.
        self._data_parallel_size = 1
        self._model_parallel_size = 1
        self._parameter_count = 0
        self._peak_flops: float | None = None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.records.clear()
        self._batches = 0
        if self._is_cuda(trainer):
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        self._last = None
        self._data_parallel_size = _data_parallel_size(trainer)
        self._model_parallel_size = _model_parallel_size(pl_module)
        self._parameter_count = _parameter_count(pl_module)
        self._peak_flops = self._device_peak_flops(trainer)
        self._interval, self._slow_run, self.stragglers = [0.0, 0.0, 0.0], None, []
        self._hosts = [socket.gethostname()]
        if _distributed():
            self._hosts = [""] * dist.get_world_size()
            dist.all_gather_object(self._hosts, socket.gethostname())

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._last is None:  # first batch (or first after validation): time from here
            self._sync(trainer)
            self._last = time.perf_counter()
            self._own_start = self._last

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._own_start is not None:  # the first backward of the batch: loading and forward are done
            self._sync(trainer)
            self._interval[1] += time.perf_counter() - self._own_start
            self._own_start = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        now = time.perf_counter()
        assert self._last is not None
        step_time, self._last = now - self._last, now
        self._own_start = now
        self._interval[0] += step_time
        self._interval[2] += 1
        samples, tokens = self._batch_size(batch)
        replicas = self._data_parallel_size
        record = {
            "step_time_s": step_time,
            "samples": float(samples * replicas),
            "tokens": float(tokens * replicas) if tokens else 0.0,
            "flops": self._model_flops(samples, tokens),
        }
        self.records.append(record)
        self._batches += 1
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if self._batches % max(every, 1) == 0:
            self._log(trainer, {**self._metrics(trainer, record), **self._spread(trainer)})

    def _spread(self, trainer: L.Trainer) -> dict[str, float]:
        """Every rank's mean step time and own time over the interval (one all-gather), their spread, the slowest
        rank, and the straggler warning (see the module docstring)."""
        step_sum, own_sum, batches = self._interval
        self._interval = [0.0, 0.0, 0.0]
        mine = torch.tensor([step_sum / max(batches, 1), own_sum / max(batches, 1)], dtype=torch.float64)
        if _distributed():
            device = trainer.strategy.root_device if dist.get_backend() == "nccl" else torch.device("cpu")
            gathered = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine.to(device))
            per_rank = [t.cpu().tolist() for t in gathered]
        else:
            per_rank = [mine.tolist()]
        steps, owns = [r[0] for r in per_rank], [r[1] for r in per_rank]
        slowest = max(range(len(owns)), key=owns.__getitem__)
        median = statistics.median(owns)
        metrics = {
            "perf/step_time_min_s": min(steps),
            "perf/step_time_median_s": statistics.median(steps),
            "perf/step_time_max_s": max(steps),
            "perf/own_time_min_s": min(owns),
            "perf/own_time_median_s": median,
            "perf/own_time_max_s": owns[slowest],
            "perf/slowest_rank": float(slowest),
        }
        if len(owns) > 1 and owns[slowest] > median * (1 + self.straggler_fraction):
            run = self._slow_run[1] + 1 if self._slow_run is not None and self._slow_run[0] == slowest else 1
            self._slow_run = (slowest, run)
            if run == self.straggler_intervals:
                self._warn_straggler(trainer, slowest, owns[slowest], median)
        else:
            self._slow_run = None
        self.rank_spread = metrics
        return metrics

    def _warn_straggler(self, trainer: L.Trainer, rank: int, own: float, median: float) -> None:
        host = self._hosts[rank] if rank < len(self._hosts) else "?"
        report = {"rank": rank, "host": host, "global_step": trainer.global_step, "own_time_s": own, "median_s": median}
        self.stragglers.append(report)
        rank_zero_warn(
            f"Straggler: rank {rank} on host {host!r} took {own:.4f} s per batch before its backward (loading and"
            f" forward) over the last {self.straggler_intervals} log intervals, {own / median - 1:.0%} above the"
            f" median rank's {median:.4f} s (threshold {self.straggler_fraction:.0%}), at global step"
            f" {trainer.global_step}. Every collective waits for it: look at that host (its data loading, device"
            " clocks and temperature, other processes).",
            category=RuntimeWarning,
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = None  # validation time is not training step time
        self._own_start = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = _peak_memory_bytes(trainer)
        held = held_state(pl_module, trainer.optimizers)
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (peak, held))
            self.peak_memory_per_rank = [int(v) for v, _ in gathered]
            self.held_state_per_rank = [h for _, h in gathered]
        else:
            self.peak_memory_per_rank, self.held_state_per_rank = [peak], [held]

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here rather than in `on_train_end`: the progress bar has finished its line by now.
        if self.summary and trainer.is_global_zero and self.records:
            print(self.format_summary(trainer), flush=True)

    # ------------------------------------------------------------------ metrics
    def _measured(self) -> tuple[list[dict[str, float]], int]:
        """The kept records after warm-up (all of them when there are no more), and how many were skipped."""
        records = list(self.records)
        warmup_still_kept = max(0, self.warmup_steps - (self._batches - len(records)))
        skipped = warmup_still_kept if warmup_still_kept < len(records) else 0
        return records[skipped:], skipped

    def summary_metrics(self, trainer: L.Trainer) -> dict[str, float]:
        """Medians over the kept batches after warm-up (all batches when there are no more)."""
        measured, _ = self._measured()
        if not measured:
            return {}
        step_time = statistics.median(r["step_time_s"] for r in measured)
        record = {
            "step_time_s": step_time,
            "samples": statistics.median(r["samples"] for r in measured),
            "tokens": statistics.median(r["tokens"] for r in measured),
            "flops": statistics.median(r["flops"] for r in measured),
        }
        return self._metrics(trainer, record)

    def format_summary(self, trainer: L.Trainer) -> str:
        metrics = self.summary_metrics(trainer)
        measured, skipped = self._measured()
        rows = [("batches measured", f"{len(measured)} (after {skipped} warm-up)")]
        labels = {
            "perf/step_time_s": ("step time (median)", "{:.4f} s"),
            "perf/samples_per_s": ("samples/s (global)", "{:,.1f}"),
            "perf/tokens_per_s": ("tokens/s (global)", "{:,.0f}"),
            "perf/mfu": ("MFU", "{:.1%}"),
        }
        rows += [(label, fmt.format(metrics[key])) for key, (label, fmt) in labels.items() if key in metrics]
        memory_kind = "CUDA allocator peak" if self._is_cuda(trainer) else "peak RSS"
        for rank, peak in enumerate(self.peak_memory_per_rank):
            rows.append((f"rank {rank} {memory_kind}", f"{peak / GIB:.3f} GiB"))
        for rank, held in enumerate(self.held_state_per_rank):
            rows.append(
                (
                    f"rank {rank} held",
                    f"parameters {format_bytes(held.trainable)} trainable + {format_bytes(held.frozen)} frozen,"
                    f" gradients {format_bytes(held.gradients)}, optimizer {format_bytes(held.optimizer)}",
                )
            )
        width = max(len(label) for label, _ in rows)
        lines = [f"{label:<{width}} | {value}" for label, value in rows]
        return "\n".join(["PerformanceMonitor summary", "-" * max(len(line) for line in lines), *lines])

    def _metrics(self, trainer: L.Trainer, record: dict[str, float]) -> dict[str, float]:
        step_time = record["step_time_s"]
        metrics = {
            "perf/step_time_s": step_time,
            "perf/samples_per_s": record["samples"] / step_time,
            "perf/peak_memory_gb": _peak_memory_bytes(trainer) / GIB,
        }
        if record["tokens"]:
            metrics["perf/tokens_per_s"] = record["tokens"] / step_time
        if self._peak_flops and record["flops"]:
            metrics["perf/mfu"] = record["flops"] / step_time / self._peak_flops
        return metrics

    def _log(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ batch, FLOPs and device details
    def _batch_size(self, batch: Any) -> tuple[int, int]:
        """(samples, tokens) in this rank's batch; tokens 0 when unknown."""
        first = _first_tensor(batch)
        if first is None or first.dim() == 0:
            return 0, 0
        samples = first.shape[0]
        if self.tokens_per_sample is not None:
            return samples, samples * self.tokens_per_sample
        if first.dim() == 2 and first.dtype in (torch.int32, torch.int64):  # token ids [batch, seq]
            return samples, first.shape[0] * first.shape[1]
        return samples, 0

    def _model_flops(self, samples: int, tokens: int) -> float:
        """Model FLOPs this rank computes for its batch (0 when unknown).

        The ranks of one tensor-parallel group compute one batch together, so each does 1/TP of its FLOPs.
        """
        if self.flops_per_sample is not None:
            batch_flops = self.flops_per_sample * samples
        elif tokens:
            batch_flops = 6.0 * self._parameter_count * tokens
        else:
            return 0.0
        return batch_flops / self._model_parallel_size

    def _device_peak_flops(self, trainer: L.Trainer) -> float | None:
        if self.peak_flops is not None:
            return self.peak_flops
        if not self._is_cuda(trainer):
            return None
        name = torch.cuda.get_device_name(trainer.strategy.root_device)
        precision = str(trainer.precision)
        if "bf16" in precision or "16" in precision:
            dtype = "bf16"
        else:
            dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
        for fragment, table in PEAK_FLOPS.items():
            if fragment in name:
                return table[dtype]
        return None

    @staticmethod
    def _is_cuda(trainer: L.Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    def _sync(self, trainer: L.Trainer) -> None:
        if self._is_cuda(trainer):
            torch.cuda.synchronize(trainer.strategy.root_device)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found[0] if found else None


def _data_parallel_size(trainer: L.Trainer) -> int:
    """Ranks that see different batches (Lightning's sampler replicas), else the world size."""
    try:
        return int(trainer.strategy.distributed_sampler_kwargs["num_replicas"])
    except (AttributeError, KeyError, TypeError):
        return trainer.world_size


def _parameter_count(module: torch.nn.Module) -> int:
    """Full (unsharded) parameter count: DTensor `numel()` is the global size."""
    return sum(p.numel() for p in module.parameters())


def _model_parallel_size(module: torch.nn.Module) -> int:
    """Ranks that share one batch's compute through tensor parallelism (1 without TP)."""
    mesh = getattr(module, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1


def _peak_memory_bytes(trainer: L.Trainer) -> int:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes
