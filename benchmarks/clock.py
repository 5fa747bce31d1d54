"""How every benchmark variant is timed and its memory measured: `StepClock` (plain loops call it, Lightning runs
through `ClockCallback`), `release_memory`, which frees what a finished variant left before the next starts, and
`RecordFunctionProfiler`, which marks Lightning's hooks in a `torch.profiler` trace. In the profiled window `cProfile`
also counts Python function calls: unlike time, a count does not depend on the load of the machine."""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import re
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.profilers import Profiler

REPOSITORY = str(Path(__file__).resolve().parents[1])


def release_memory(device: torch.device) -> None:
    """Free what the last variant left: compiled code first (dynamo's caches hold the compiled modules and their
    parameters), then reference cycles (a Trainer and its module), then the CUDA caching allocator's free blocks,
    so the next variant starts from the same empty device: at GPU sizes two models' state does not fit at once."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def live_memory_bytes(device: torch.device) -> int:
    """Bytes allocated now: CUDA's allocator count, or on the CPU the storages of all live tensors (found by the
    garbage collector, each storage once), so a variant that leaks into the next shows on both."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    storages = {}
    for obj in gc.get_objects():
        # Plain tensors and parameters only: a compiler's fake and functional tensors hold no storage of their own.
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu" and obj.layout == torch.strided:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class StepClock:
    """Step times and peak memory, measured identically for plain loops and Lightning (via `ClockCallback`)."""

    def __init__(self, device: torch.device, profile_window: tuple[int, int] | None = None) -> None:
        self.device = device
        #: `(after, until)`: run `torch.profiler` from the end of step `after` (the warm-up) to the end of `until`.
        self.profile_window = profile_window
        self._profiler: torch.profiler.profile | None = None
        self._python: cProfile.Profile | None = None
        self.profile: list[list] = []
        #: With a profile window: `[function, calls]` over the profiled steps, every Python function called there.
        self.python_calls: list[list] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.peak_rss = 0
        self._last: float | None = None
        # The previous variant's tensors must be gone before the peak is reset, or its leftovers count as this
        # variant's peak; what is still allocated then (should be ~0: the data pool) is reported beside it.
        release_memory(device)
        #: Bytes still held when this variant started: CUDA's allocated memory, or on the CPU the live tensors'.
        self.memory_at_reset = live_memory_bytes(device)
        #: CPU: memory is reported as growth over the RSS before the variant built anything.
        self.baseline_rss = current_rss_bytes()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    def tick(self) -> None:
        self._sync()
        now, now_cpu = time.perf_counter(), time.process_time()
        assert self._last is not None
        self.times.append(now - self._last)
        self.cpu_times.append(now_cpu - self._last_cpu)
        self._last, self._last_cpu = now, now_cpu
        self.sample_memory()
        if self.profile_window is None:
            return
        if len(self.times) == self.profile_window[0]:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()
            self._python = cProfile.Profile()
            self._python.enable()
            self._last, self._last_cpu = time.perf_counter(), time.process_time()  # start-up not counted
        elif len(self.times) == self.profile_window[1] and self._profiler is not None:
            self._stop_profiler()

    def _stop_profiler(self) -> None:
        assert self._profiler is not None and self._python is not None
        self._python.disable()
        self.python_calls = python_call_counts(self._python)
        self._python = None
        self._profiler.__exit__(None, None, None)
        self.profile = [
            [e.key, e.count, e.self_cpu_time_total, e.cpu_time_total] for e in self._profiler.key_averages()
        ]
        self._profiler = None

    def sample_memory(self) -> None:
        """CPU has no allocator statistics: sample the RSS (after forward, when activations are alive, and at the
        end of each step, when gradients and optimizer state are)."""
        if self.device.type != "cuda":
            self.peak_rss = max(self.peak_rss, current_rss_bytes())

    def peak_memory(self) -> int:
        """Peak over what was allocated at the reset (CUDA), or peak RSS growth (CPU): this variant's own bytes."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device)) - self.memory_at_reset
        return max(self.peak_rss - self.baseline_rss, 0)


class ClockCallback(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.clock.start()

    def on_before_backward(self, trainer, pl_module, loss):
        self.clock.sample_memory()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.tick()


def python_call_counts(profile: cProfile.Profile) -> list[list]:
    """`[function, calls]` for every function `profile` saw, named `file:function` (the path from `site-packages/`
    or the repository on, built-ins by name without their address), summed over functions of the same name."""
    counts: dict[str, int] = {}
    for (path, _, function), (_, calls, *_) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        where = path.split("site-packages/")[-1].removeprefix(f"{REPOSITORY}/")
        name = re.sub(r" at 0x[0-9a-f]+", "", f"{where}:{function}" if where != "~" else function)
        counts[name] = counts.get(name, 0) + calls
    return [[name, calls] for name, calls in counts.items()]


def current_rss_bytes() -> int:
    """Resident set size now (Linux `/proc/self/statm`); 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class RecordFunctionProfiler(Profiler):
    """Lightning profiler that only marks each hook and loop phase as a `torch.profiler` range, so a profile of the
    timed steps shows, next to the ops, the CPU time of every hook by its Lightning name."""

    def __init__(self) -> None:
        super().__init__()
        self._open: dict[str, list[Any]] = {}

    def start(self, action_name: str) -> None:
        handle = torch.profiler.record_function(action_name)
        handle.__enter__()
        self._open.setdefault(action_name, []).append(handle)

    def stop(self, action_name: str) -> None:
        self._open[action_name].pop().__exit__(None, None, None)

    def summary(self) -> str:
        return ""
