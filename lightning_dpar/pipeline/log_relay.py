"""Logging under pipeline parallelism: `self.log` inside a step runs on the last stage, once per microbatch. Those
calls are recorded (`LogRecorder`), reduced over the step's microbatches, sent to every pipeline rank and logged there
(`LogRelay.replay`), so every rank (rank 0 writes the loggers) logs the true values, reduced over data-parallel peers
as usual. A logged torchmetrics `Metric` is updated on the last stage; its states are sent along (`MetricState`) and
adopted by the same metric on the other stages, so its value (computed and synced over data-parallel peers when
Lightning asks) is the same on every rank.

Recording replaces `module.log` on the LightningModule instance while the stages run (`LogRelay.recording`):
Lightning has no hook through which a strategy could receive `self.log` calls made inside a step before they reach
the trainer's results, and these calls must not reach them (the other ranks would not log them). The replacement is
confined to that context manager, which removes it again; nothing else in the package assigns `module.log`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics import Metric

from lightning_dpar._private_api import adopt_metric_state, metric_step_value

__all__ = ["REDUCTIONS", "LogRecorder", "LogRelay", "MetricState", "to_cpu", "to_device"]

#: A step's logged calls, one per name: (name, value, the first call's `self.log` options).
Logged = list[tuple[str, Any, dict[str, Any]]]

#: How a value logged once per microbatch becomes the step's value (Lightning's `reduce_fx` names).
REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": torch.mean,
    "avg": torch.mean,
    "sum": torch.sum,
    "max": torch.max,
    "min": torch.min,
}


class LogRecorder:
    """Collects `LightningModule.log` calls made while stages run, to log them once per step on every rank."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("Under pipeline parallelism, pass `LightningModule.log` options by keyword.")
        if isinstance(value, torch.Tensor):
            value = value.detach().float().cpu()
        elif not isinstance(value, (int, float, Metric)):
            raise TypeError(
                f"Under pipeline parallelism `self.log({name!r}, ...)` takes a number, a tensor or a torchmetrics"
                f" `Metric`; got {type(value).__name__}."
            )
        self.calls.append((name, value, kwargs))

    def reduced(self) -> Logged:
        """One entry per logged name (first-call order): the calls' values combined by the call's `reduce_fx`
        (mean by default; sum, max, min or a callable otherwise; a metric: itself, it accumulates its own updates),
        with the first call's options."""
        values: dict[str, list[Any]] = {}
        options: dict[str, dict[str, Any]] = {}
        for name, value, kwargs in self.calls:
            values.setdefault(name, []).append(value)
            options.setdefault(name, kwargs)
        out = []
        for name, logged in values.items():
            if isinstance(logged[-1], Metric):
                out.append((name, logged[-1], options[name]))
                continue
            stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in logged])
            reduce_fx = options[name].get("reduce_fx", "mean")
            combine = REDUCTIONS.get(reduce_fx, reduce_fx) if isinstance(reduce_fx, str) else reduce_fx
            if not callable(combine):
                raise ValueError(f"`self.log({name!r}, ..., reduce_fx={reduce_fx!r})`: use one of {list(REDUCTIONS)}.")
            out.append((name, combine(stacked), options[name]))
        return out


@dataclass(frozen=True)
class MetricState:
    """A logged metric as it travels from the last stage: where it sits in the LightningModule, and its states."""

    fqn: str
    states: dict[str, Any]
    update_count: int
    step_value: Any = None


class LogRelay:
    """Records what one LightningModule logs while its stages run, and logs it on this rank once the last stage's
    record has been sent to every pipeline rank."""

    def __init__(self, module: LightningModule, device: torch.device) -> None:
        self.module, self.device = module, device

    @contextmanager
    def recording(self) -> Iterator[LogRecorder]:
        """Route `module.log` (and `log_dict`, which calls it) to a new recorder while the stages run."""
        recorder = LogRecorder()
        self.module.log = recorder.log  # type: ignore[method-assign]
        try:
            yield recorder
        finally:
            del self.module.log

    @contextmanager
    def discarding(self) -> Iterator[None]:
        """What the steps run inside this context log is discarded, and the metrics they update are put back as
        they were (for the shape probe, which runs a step that training does not count)."""
        metrics = [m for m in self.module.modules() if isinstance(m, Metric)]
        saved = [
            (m, apply_to_collection(m.metric_state, torch.Tensor, torch.clone), m.update_count, metric_step_value(m))
            for m in metrics
        ]
        try:
            with self.recording():
                yield
        finally:
            for metric, states, update_count, step_value in saved:
                adopt_metric_state(metric, states, update_count, step_value)

    def portable(self, recorder: LogRecorder) -> Logged:
        """The recorder's reduced values as they can be sent: a metric becomes its name in the module and its
        states."""
        logged = recorder.reduced()
        if not any(isinstance(value, Metric) for _, value, _ in logged):
            return logged
        names = {id(module): fqn for fqn, module in self.module.named_modules()}
        portable = []
        for name, value, options in logged:
            if isinstance(value, Metric):
                if id(value) not in names:
                    raise TypeError(
                        f"`self.log({name!r}, metric)`: under pipeline parallelism a logged metric must be an"
                        " attribute of the LightningModule (its copies on the other stages are found by name)."
                    )
                value = MetricState(
                    names[id(value)],
                    to_cpu(value.metric_state),
                    value.update_count,
                    to_cpu(metric_step_value(value)),
                )
            portable.append((name, value, options))
        return portable

    def replay(self, logged: Logged) -> None:
        """Log on this rank what the last stage recorded (its metrics' states adopted by this rank's metrics)."""
        for name, value, options in logged:
            if isinstance(value, MetricState):
                metric = self.module.get_submodule(value.fqn)
                adopt_metric_state(
                    metric,
                    to_device(value.states, self.device),
                    value.update_count,
                    to_device(value.step_value, self.device),
                )
                LightningModule.log(self.module, name, metric, **options)
            else:
                LightningModule.log(self.module, name, value.to(self.device), **options)


def to_cpu(value: Any) -> Any:
    """`value` with every tensor detached and on the CPU (to be sent as an object)."""
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().cpu())


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor on `device`."""
    return apply_to_collection(value, torch.Tensor, lambda t: t.to(device))
