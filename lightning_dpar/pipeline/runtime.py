"""Running Lightning's steps through the pipeline: a training step is one schedule step over microbatches, an
evaluation step is one forward pass through the stages; logged values and the loss are the last stage's, on every
rank.

Training. The first step with a new batch shape runs one forward pass of the first microbatch through all stages
without gradients (RNG state and logged metrics' states restored, logs discarded) to learn what crosses each
boundary, and to find errors while every rank can still hear of them; torch's `PipelineStage`s and the schedule are
then built with those shapes and reused for every batch of that shape.

Errors. In a forward-only pass (that probe, and every evaluation step) a stage that raises sends the error on in
place of its activation, and the last stage's rank sends the first error to every pipeline rank: each rank raises
it, instead of waiting in a receive for an activation that will never come. Inside a schedule step there is no such
exchange: an error raised there on one stage (e.g. from data only that step has) leaves the other stages waiting
until the process group's `timeout`. Each microbatch's loss is
scaled by `1 / (microbatches x accumulate_grad_batches)` before its backward, so gradients equal the unpipelined
run's and gradient accumulation works as usual. Lightning zeroes gradients between `training_step` and `backward`
(on the first batch of an accumulation window), so the step's gradients are set aside when the schedule ends and
added in the strategy's `backward` (`add_step_gradients`), where Lightning expects them to appear.

Logging. `self.log` inside the step runs on the last stage, once per microbatch. Those calls are recorded, averaged
over the step's microbatches, sent to every pipeline rank and logged there, so every rank (rank 0 writes the loggers)
logs the true values, reduced over data-parallel peers as usual. A logged torchmetrics `Metric` is updated on the
last stage; its states are sent along and adopted by the same metric on the other stages, so its value (computed and
synced over data-parallel peers when Lightning asks) is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torchmetrics import Metric

from lightning_dpar._private_api import adopt_metric_state, metric_step_value
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.schedule import build_schedule
from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.pipeline.values import tensor_specs

__all__ = ["LogRecorder", "MetricState", "PipelineRuntime", "PipelineStageError"]


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

    def averaged(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """One entry per logged name (first-call order): the calls' values combined by the call's `reduce_fx`
        (mean by default; a metric: itself, it accumulates its own updates), with the first call's options."""
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


@contextmanager
def recording_logs(module: LightningModule, recorder: LogRecorder) -> Iterator[None]:
    """Route `module.log` (and `log_dict`, which calls it) to `recorder` while the stages run."""
    module.log = recorder.log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


def _tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


def _batch_key(value: Any) -> tuple:
    """The shapes and dtypes of a batch's tensors: what decides the shapes crossing each stage boundary."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors_in(value))


class PipelineStageError(RuntimeError):
    """Raised on every pipeline rank when a stage failed in a forward-only pass; names the stage and its error."""


@dataclass(frozen=True)
class _Failed:
    """Sent to the next stage in place of an activation: a stage before it failed."""

    message: str


class PipelineRuntime:
    """Drives this rank's stages for the strategy's training and evaluation steps."""

    def __init__(
        self,
        model: PipelinedModel,
        module: LightningModule,
        config: PipelineConfig,
        group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.model, self.module, self.config, self.group, self.device = model, module, config, group, device
        self.num_ranks = dist.get_world_size(group)
        self.num_microbatches = config.num_microbatches(self.num_ranks)
        self._schedules: dict[Any, Any] = {}
        self._microbatch_losses: list[torch.Tensor] = []
        self._loss_scale = 1.0
        self._step_gradients: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # Taken now, before any forward: FSDP registers unsharded parameters on its modules while they compute and
        # keeps them there between steps when not resharding after forward; these are the sharded ones the
        # optimizer holds, which gradients end on.
        self._parameters = [p for stage in model.stages.values() for p in stage.parameters()]

    # ------------------------------------------------------------------ point to point
    def _global_rank(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.model.split.stage_to_rank[stage])

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _send(self, payload: Any, values: tuple[torch.Tensor, ...], stage: int) -> None:
        dst = self._global_rank(stage)
        dist.send_object_list([payload], dst=dst, group=self.group, device=self._object_device())
        for tensor in values:
            dist.send(tensor.detach().contiguous(), dst=dst, group=self.group)

    def _recv(self, stage: int) -> tuple[Any, list[torch.Tensor]]:
        src = self._global_rank(stage)
        payload: list[Any] = [None]
        dist.recv_object_list(payload, src=src, group=self.group, device=self._object_device())
        if isinstance(payload[0], _Failed):
            return payload[0], []
        spec, _ = payload[0]
        received = []
        for leaf in tensor_specs(spec):
            buffer = torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device)
            dist.recv(buffer, src=src, group=self.group)
            received.append(buffer)
        return payload[0], received

    def forward_only(self, step_kwargs: dict[str, Any], finish: Callable[[Any], Any] = lambda output: None) -> Any:
        """One forward pass of `step_kwargs` through all stages, stage after stage (no schedule). Each stage records
        its units' output specs and sends them on with its boundary output, so every later stage can stand in for
        the units it does not hold. Returns `finish(output of the last stage's step)`, computed on the rank holding
        the last stage and sent to every pipeline rank; a stage's error is raised on every rank instead."""
        model = self.model
        carried: tuple[Any, list[torch.Tensor]] | None = None
        failure: _Failed | None = None
        own_error: BaseException | None = None
        value = None
        for stage in model.local_stages:
            received: list[torch.Tensor] = []
            if stage > 0:
                if model.split.stage_to_rank[stage - 1] == model.pipeline_rank:
                    assert carried is not None
                    payload, received = carried
                else:
                    payload, received = self._recv(stage - 1)
                if isinstance(payload, _Failed):
                    failure = payload
                elif failure is None:
                    spec, table = payload
                    model.input_specs[stage] = spec
                    model.unit_outputs.update(table)
            sent: tuple[torch.Tensor, ...] = ()
            if failure is None:
                try:
                    output = model.stages[stage](*received, **step_kwargs)  # through the stage's FSDP root
                    if model.is_last(stage):
                        value = finish(output)
                    else:
                        sent = output
                except Exception as error:
                    own_error = error
                    rank = dist.get_rank()
                    failure = _Failed(f"pipeline stage {stage} (rank {rank}) failed: {type(error).__name__}: {error}")
            if model.is_last(stage):
                break
            payload = failure if failure is not None else (model.output_specs[stage], dict(model.unit_outputs))
            if model.split.stage_to_rank[stage + 1] == model.pipeline_rank:
                carried = (payload, list(sent))
            elif isinstance(payload, _Failed):
                self._send(payload, (), stage + 1)
            else:
                self._send(payload, sent, stage + 1)
        failure, value = self._from_last_stage((failure, value))
        if failure is not None:
            if own_error is not None:
                raise own_error
            raise PipelineStageError(f"{failure.message} (raised on every pipeline rank so none waits for it)")
        return value

    # ------------------------------------------------------------------ training
    def check_batches(self, dataloader: object) -> None:
        """Refuse a training loader whose batches (the last one included) do not split into the microbatches, so
        the run fails before training instead of at the end of its first epoch."""
        batch_size = getattr(dataloader, "batch_size", None)
        sampler = getattr(dataloader, "sampler", None)
        if not isinstance(batch_size, int) or sampler is None or not hasattr(sampler, "__len__"):
            return  # a batch sampler or an iterable dataset: each batch is checked when it comes
        m = self.num_microbatches
        last = len(sampler) % batch_size
        if batch_size % m == 0 and (last % m == 0 or getattr(dataloader, "drop_last", False)):
            return
        sizes = f"batches of {batch_size}" + (f" and a last one of {last}" if last else "")
        raise ValueError(
            f"Pipeline parallelism splits each batch into `pipeline_microbatches={m}` equal microbatches, but this"
            f" rank's training loader gives {sizes} samples. Use a batch size that is a multiple of {m}, and"
            " `drop_last=True` (or a dataset size that divides) for the last batch, or change `pipeline_microbatches`."
        )

    def _split_batch(self, batch: Any) -> list[Any]:
        sizes = {t.shape[0] for t in _tensors_in(batch) if t.dim()}
        m = self.num_microbatches
        bad = sorted(size for size in sizes if size % m)
        if not sizes or bad:
            raise ValueError(
                f"Pipeline parallelism splits each batch into `pipeline_microbatches={m}` equal microbatches along"
                f" dim 0, but the batch's tensors have {sorted(sizes) or 'no'} rows. Use a batch size that is a"
                f" multiple of {m} (and `drop_last=True` for a smaller last batch), or change"
                " `pipeline_microbatches`."
            )
        _, kwarg_chunks = split_args_kwargs_into_chunks((), {"batch": batch}, m)
        return [chunk["batch"] for chunk in kwarg_chunks]

    @staticmethod
    def _check_step_output(output: Any) -> torch.Tensor:
        """The loss in `training_step`'s output, or a `TypeError` saying what it must return."""
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "Under pipeline parallelism `training_step` must return the loss (a scalar tensor, or a dict with"
                f" 'loss'); it returned {type(output).__name__}. Skipping a step by returning None is not possible:"
                " every stage has already run its part."
            )
        return loss

    def _loss(self, output: Any, microbatch_index: torch.Tensor) -> torch.Tensor:
        loss = self._check_step_output(output)
        self._microbatch_losses.append(loss.detach().reshape(()))
        return loss.reshape(()) * self._loss_scale

    def _schedule_for(self, batch: Any, step_args: tuple[Any, ...]) -> Any:
        key = _batch_key(batch)
        self.model.step = self.module.training_step
        if self.model.select_shapes(key) or key not in self._schedules:
            first = self._split_batch(batch)[0]
            with torch.no_grad(), torch.random.fork_rng(devices=self._rng_devices()), self._probing():
                self.forward_only({"batch": first, "step_args": step_args}, finish=self._check_step_output)
            self._reshard()
            self._schedules[key] = self._build_schedule()
        return self._schedules[key]

    def _reshard(self) -> None:
        """Free the parameters a forward-only pass gathered (units that do not reshard after forward keep them)."""
        for stage in self.model.stages.values():
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    @contextmanager
    def _probing(self) -> Iterator[None]:
        """What the shape probe's steps log is discarded, and the metrics they update are put back as they were."""
        metrics = [m for m in self.module.modules() if isinstance(m, Metric)]
        saved = [
            (m, apply_to_collection(m.metric_state, torch.Tensor, torch.clone), m.update_count, metric_step_value(m))
            for m in metrics
        ]
        try:
            with recording_logs(self.module, LogRecorder()):
                yield
        finally:
            for metric, states, update_count, step_value in saved:
                adopt_metric_state(metric, states, update_count, step_value)

    def _build_schedule(self) -> Any:
        model = self.model
        stages = []
        for stage in model.local_stages:
            inputs = (
                tuple(s.example(requires_grad=True) for s in tensor_specs(model.input_specs[stage])) if stage else ()
            )
            if model.is_last(stage):
                outputs: tuple[torch.Tensor, ...] = (torch.empty((), device="meta", requires_grad=True),)
            else:
                outputs = tuple(s.example(requires_grad=True) for s in tensor_specs(model.output_specs[stage]))
            stages.append(
                PipelineStage(
                    model.stages[stage],
                    stage,
                    model.num_stages,
                    self.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.group,
                )
            )
        return build_schedule(self.config.schedule, stages, self.num_microbatches, self._loss)

    def train_step(self, batch: Any, step_args: tuple[Any, ...], accumulate_grad_batches: int) -> torch.Tensor:
        """Run the schedule on `batch` (forward and backward of every microbatch; `step_args` are the step method's
        other arguments, e.g. `batch_idx`); return the step's loss, the mean over microbatches, on every rank."""
        if not self.module.automatic_optimization:
            raise RuntimeError(
                "Pipeline parallelism runs `training_step` once per microbatch inside its schedule, which also runs"
                " the backward passes, so `manual_backward` cannot be used: set `automatic_optimization = True`."
            )
        schedule = self._schedule_for(batch, step_args)
        self._loss_scale = 1.0 / (self.num_microbatches * accumulate_grad_batches)
        self._microbatch_losses = []
        recorder = LogRecorder()
        microbatch_ids = torch.arange(self.num_microbatches, device=self.device)
        params = self._parameters
        earlier = [p.grad for p in params]
        for param in params:
            param.grad = None
        with recording_logs(self.module, recorder):
            schedule.step(batch=batch, step_args=step_args, target=microbatch_ids, return_outputs=False)
        self._step_gradients = [(p, p.grad) for p in params]
        for param, grad in zip(params, earlier):
            param.grad = grad
        loss = torch.stack(self._microbatch_losses).mean().cpu() if self._microbatch_losses else None
        loss, logged = self._from_last_stage((loss, self._portable(recorder.averaged())))
        self._replay(logged)
        return loss.to(self.device)

    def add_step_gradients(self) -> None:
        """Add the last `train_step`'s gradients to the parameters' (called where Lightning runs backward)."""
        for param, grad in self._step_gradients:
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        self._step_gradients = []

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, step_name: str, batch: Any, step_args: tuple[Any, ...]) -> Any:
        """Run `step_name` (validation/test/predict) forward-only through the stages on the whole batch; return its
        output, sent from the last stage to every pipeline rank, and log what it logged on every rank."""
        self.model.step = getattr(self.module, step_name)
        self.model.select_shapes((step_name, _batch_key(batch)))
        recorder = LogRecorder()
        with recording_logs(self.module, recorder):
            output, logged = self.forward_only(
                {"batch": batch, "step_args": step_args},
                finish=lambda output: (_to_cpu(output), self._portable(recorder.averaged())),
            )
        self._reshard()
        self._replay(logged)
        return _to_device(output, self.device)

    # ------------------------------------------------------------------ results on every rank
    def _from_last_stage(self, value: Any) -> Any:
        payload = [value]
        dist.broadcast_object_list(
            payload, src=self._global_rank(self.model.num_stages - 1), group=self.group, device=self._object_device()
        )
        return payload[0]

    def _portable(self, logged: list[tuple[str, Any, dict[str, Any]]]) -> list[tuple[str, Any, dict[str, Any]]]:
        """Logged values as they can be sent: a metric becomes its name in the module and its states."""
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
                    _to_cpu(value.metric_state),
                    value.update_count,
                    _to_cpu(metric_step_value(value)),
                )
            portable.append((name, value, options))
        return portable

    def _replay(self, logged: list[tuple[str, Any, dict[str, Any]]]) -> None:
        for name, value, options in logged:
            if isinstance(value, MetricState):
                metric = self.module.get_submodule(value.fqn)
                adopt_metric_state(
                    metric,
                    _to_device(value.states, self.device),
                    value.update_count,
                    _to_device(value.step_value, self.device),
                )
                LightningModule.log(self.module, name, metric, **options)
            else:
                LightningModule.log(self.module, name, value.to(self.device), **options)


def _to_cpu(value: Any) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.detach().cpu())


def _to_device(value: Any, device: torch.device) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.to(device))
