"""Forward-only passes through the stages, with errors relayed so that no rank waits forever.

In a forward-only pass (the shape probe before a new batch shape's schedule is built, and every evaluation step) the
stages run one after the other, each sending its boundary output, with the output specs its units recorded, to the
next stage's rank. A stage that raises sends the error on in place of its activation, and the last stage's rank
sends the first error to every pipeline rank: each rank raises it, instead of waiting in a receive for an activation
that will never come. Inside a schedule step there is no such exchange: an error raised there on one stage (e.g.
from data only that step has) leaves the other stages waiting until the process group's `timeout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_dpar.pipeline.stage import PipelinedModel
from lightning_dpar.pipeline.values import tensor_specs

__all__ = ["ForwardRelay", "PipelineStageError"]


class PipelineStageError(RuntimeError):
    """Raised on every pipeline rank when a stage failed in a forward-only pass; names the stage and its error."""


@dataclass(frozen=True)
class _Failed:
    """Sent to the next stage in place of an activation: a stage before it failed."""

    message: str


class ForwardRelay:
    """Point-to-point traffic between this rank's stages and the other pipeline ranks' (`group`)."""

    def __init__(self, model: PipelinedModel, group: dist.ProcessGroup, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device

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
                    model.adopt_received_specs(stage, spec, table)
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
        failure, value = self.from_last_stage((failure, value))
        if failure is not None:
            if own_error is not None:
                raise own_error
            raise PipelineStageError(f"{failure.message} (raised on every pipeline rank so none waits for it)")
        return value

    def from_last_stage(self, value: Any) -> Any:
        """The last stage's rank's `value` (an object: sent pickled), on every pipeline rank."""
        payload = [value]
        dist.broadcast_object_list(
            payload, src=self._global_rank(self.model.num_stages - 1), group=self.group, device=self._object_device()
        )
        return payload[0]
