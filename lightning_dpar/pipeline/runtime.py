"""Running Lightning's steps through the pipeline: a training step is one schedule step over microbatches, an
evaluation step is one forward pass through the stages; logged values and the loss are the last stage's, on every
rank.

Training. The first step with a new batch shape runs one forward pass of the first microbatch through all stages
without gradients (RNG state and logged metrics' states restored, logs discarded) to learn what crosses each
boundary, and to find errors while every rank can still hear of them (`forward_relay`); torch's `PipelineStage`s and
the schedule are then built with those shapes and reused for every batch of that shape. Each microbatch's loss is
scaled by `1 / (microbatches x accumulate_grad_batches)` before its backward, so gradients equal the unpipelined
run's and gradient accumulation works as usual. Lightning zeroes gradients between `training_step` and `backward`
(on the first batch of an accumulation window), so the step's gradients are set aside when the schedule ends and
added in the strategy's `backward` (`add_step_gradients`), where Lightning expects them to appear.

Evaluation runs forward-only through `forward_relay`. What the steps log is relayed by `log_relay`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.forward_relay import ForwardRelay
from lightning_dpar.pipeline.log_relay import LogRelay, to_cpu, to_device
from lightning_dpar.pipeline.schedule import build_schedule
from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.pipeline.values import tensor_specs

__all__ = ["PipelineRuntime"]


def _tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, found.append)
    return found


def _batch_key(value: Any) -> tuple:
    """The shapes and dtypes of a batch's tensors: what decides the shapes crossing each stage boundary."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors_in(value))


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
        self.relay = ForwardRelay(model, group, device)
        self.logs = LogRelay(module, device)
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
        self.model.use_step(self.module.training_step)
        if self.model.select_shapes(key) or key not in self._schedules:
            first = self._split_batch(batch)[0]
            with torch.no_grad(), torch.random.fork_rng(devices=self._rng_devices()), self.logs.discarding():
                self.relay.forward_only({"batch": first, "step_args": step_args}, finish=self._check_step_output)
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
        microbatch_ids = torch.arange(self.num_microbatches, device=self.device)
        params = self._parameters
        earlier = [p.grad for p in params]
        for param in params:
            param.grad = None
        with self.logs.recording() as recorder:
            schedule.step(batch=batch, step_args=step_args, target=microbatch_ids, return_outputs=False)
        self._step_gradients = [(p, p.grad) for p in params]
        for param, grad in zip(params, earlier):
            param.grad = grad
        loss = torch.stack(self._microbatch_losses).mean().cpu() if self._microbatch_losses else None
        loss, logged = self.relay.from_last_stage((loss, self.logs.portable(recorder)))
        self.logs.replay(logged)
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
        self.model.use_step(getattr(self.module, step_name))
        self.model.select_shapes((step_name, _batch_key(batch)))
        with self.logs.recording() as recorder:
            output, logged = self.relay.forward_only(
                {"batch": batch, "step_args": step_args},
                finish=lambda output: (to_cpu(output), self.logs.portable(recorder)),
            )
        self._reshard()
        self.logs.replay(logged)
        return to_device(output, self.device)
