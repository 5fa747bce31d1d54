"""What each of the package's per-step hooks costs: `python -m benchmarks.step_hooks`.

One process on a one-rank gloo group trains the benchmark's `cpu` preset model (4 residual MLP blocks) under each
strategy, with every function the package runs on each training step wrapped in a timer, and writes
`<out>/step_hooks_cpu.md`: per strategy the step's CPU time and, per hook, its calls and CPU microseconds per step.
CPU time of this thread (`time.thread_time`), not wall time, so the other processes of a shared machine do not
count; with one rank no collective waits for another, so what is left is the work each hook does. A hook that a
run does not need (buffer broadcast without buffers, a key/value cache switch without a transformers model) shows
as called and costing nothing, or not called at all.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.model import PRESETS, BenchModule, SyntheticTokens
from benchmarks.run import ROOT

#: `(module, class or None, function)`: everything the package runs per training step besides Lightning's own loop,
#: the model and the optimizer.
HOOKS: list[tuple[str, str | None, str]] = [
    ("lightning_dpar.strategies.step_hooks", "StepHooks", "_release_last_gradients"),
    ("lightning_dpar.strategies.step_hooks", "StepHooks", "_step_forward"),
    ("lightning_dpar.conformance.buffers", "BufferSync", "before_forward"),
    ("lightning_dpar.conformance.buffers", "BufferSync", "after_forward"),
    ("lightning_dpar.parallel.fsdp_units", None, "_outputs_without_detached_views"),
    ("lightning_dpar.parallel.data_parallel", None, "reshard"),
    ("lightning_dpar.conformance.unit_guard", "UnitCallGuard", "_mark_called"),
    ("lightning_dpar.conformance.unit_guard", "UnitCallGuard", "_check_called"),
    ("lightning_dpar.conformance.unit_guard", "UnitCallGuard", "reset"),
    ("lightning_dpar.checkpoint.data_position", "ResumableDistributedSampler", "__iter__"),
    ("lightning_dpar.strategies.collectives", "Collectives", "data_parallel_group"),
    # Lightning's own zeroing, for comparison: the gradients `_release_last_gradients` freed leave it nothing to do.
    ("lightning.pytorch.core.module", "LightningModule", "optimizer_zero_grad"),
]
#: The package's hooks, summed in the table's total (not Lightning's, listed for comparison).
OURS = {f"{c}.{a}" if c else f"{m.rsplit('.', 1)[-1]}.{a}" for m, c, a in HOOKS if m.startswith("lightning_dpar")}
STRATEGIES = {
    "dpar_fsdp": lambda lightning_dpar: lightning_dpar.FullyShardStrategy(),
    "dpar_replicate": lambda lightning_dpar: lightning_dpar.ReplicateStrategy(),
    "dpar_2d": lambda lightning_dpar: lightning_dpar.FSDPTensorParallelStrategy(tensor_parallel_size=1),
}


class Timers:
    """CPU time and calls per hook name, summed per step while `active`; `steps` holds each finished step's."""

    def __init__(self) -> None:
        self.current: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.steps: list[dict[str, list[float]]] = []
        self.active = False

    def add(self, name: str, seconds: float) -> None:
        if self.active:
            entry = self.current[name]
            entry[0] += 1
            entry[1] += seconds

    def end_step(self) -> None:
        if self.active:
            self.steps.append(dict(self.current))
        self.current = defaultdict(lambda: [0, 0.0])

    def per_step(self) -> dict[str, tuple[float, float]]:
        """`{hook: (calls, median CPU microseconds)}` per step: the median resists the collector's and the
        machine's occasional pauses, which a mean would spread over every hook."""
        names = {name for step in self.steps for name in step}
        return {
            name: (
                statistics.mean(step.get(name, [0, 0.0])[0] for step in self.steps),
                statistics.median(step.get(name, [0, 0.0])[1] for step in self.steps) * 1e6,
            )
            for name in names
        }

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name, time.thread_time() - start)

        return timed

    def wrap_context(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """A context manager's own time: entering and leaving it, not the body it wraps."""

        @contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            start = time.thread_time()
            context = function(*args, **kwargs)
            value = context.__enter__()
            entered = time.thread_time() - start
            try:
                yield value
            finally:
                start = time.thread_time()
                context.__exit__(None, None, None)
                self.add(name, entered + time.thread_time() - start)

        return timed


@contextmanager
def hooks_timed(timers: Timers) -> Iterator[None]:
    """Every `HOOKS` entry replaced by a timed wrapper while the context is open."""
    saved = []
    for module_name, class_name, attr in HOOKS:
        owner = importlib.import_module(module_name)
        if class_name is not None:
            owner = getattr(owner, class_name)
        original = owner.__dict__[attr] if class_name is not None else getattr(owner, attr)
        name = f"{class_name}.{attr}" if class_name else f"{module_name.rsplit('.', 1)[-1]}.{attr}"
        if isinstance(original, property):
            replacement: Any = property(timers.wrap(name, original.fget))
        elif attr == "_step_forward":
            replacement = timers.wrap_context(name, original)
        else:
            replacement = timers.wrap(name, original)
        saved.append((owner, attr, original))
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def measure(strategy_name: str, steps: int, warmup: int) -> dict[str, Any]:
    """Train `steps` steps under `strategy_name`; the hooks' and whole steps' CPU time after `warmup` steps."""
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_dpar

    size = PRESETS["cpu"].size
    timers = Timers()
    step_seconds: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            timers.active = batch_idx >= warmup
            self.start = time.thread_time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if timers.active:
                step_seconds.append(time.thread_time() - self.start)
            timers.end_step()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=STRATEGIES[strategy_name](lightning_dpar),
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer()],
    )
    data = DataLoader(SyntheticTokens(size, size.batch * (warmup + steps)), batch_size=size.batch)
    with hooks_timed(timers):
        trainer.fit(BenchModule(size), data)
    return {
        "step_us": statistics.median(step_seconds) * 1e6,
        "hooks": timers.per_step(),
    }


def markdown(results: dict[str, dict[str, Any]], steps: int) -> str:
    names = list(results)
    hooks = sorted({hook for result in results.values() for hook in result["hooks"]})
    lines = [
        f"### The package's per-step hooks, {steps} timed steps, one gloo rank (preset `cpu`)",
        "",
        "CPU time of the training thread (`time.thread_time`); `calls: microseconds` per step (the median over"
        " steps). A hook not listed for a strategy did not run there. `LightningModule.optimizer_zero_grad` is"
        " Lightning's, not the package's: `_release_last_gradients` does its work earlier (before the forward).",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| whole step (median, us) | " + " | ".join(f"{results[n]['step_us']:,.0f}" for n in names) + " |",
    ]
    for hook in hooks:
        cells = []
        for name in names:
            calls, micros = results[name]["hooks"].get(hook, (0.0, 0.0))
            cells.append(f"{calls:g}: {micros:,.1f}" if calls else "")
        lines.append(f"| `{hook}` | " + " | ".join(cells) + " |")
    totals = [sum(us for hook, (_, us) in results[n]["hooks"].items() if hook in OURS) for n in names]
    lines.append("| the package's hooks (us) | " + " | ".join(f"{t:,.1f}" for t in totals) + " |")
    share = [f"{t / results[n]['step_us']:.2%}" for t, n in zip(totals, names)]
    lines.append("| share of the step | " + " | ".join(share) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = {name: measure(name, args.steps, args.warmup) for name in args.only}
    finally:
        dist.destroy_process_group()
    table = markdown(results, args.steps)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_hooks_cpu.md").write_text(table)


if __name__ == "__main__":
    main()
