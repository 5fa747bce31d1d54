"""The non-finite step guard: a NaN or Inf in any rank's gradients or loss stops (`"raise"`) or skips (`"skip"`) the
optimizer step on every rank before it reaches the weights. See docs/nonfinite.md.

What is checked, once per optimizer step (the last micro-batch of an accumulation window), on every rank:

- the loss of every micro-batch of the step (`note_loss`, from the strategy's `backward`; a device flag, no sync);
- the gradients the optimizer is about to apply, after they were reduced (DDP's all-reduce, FSDP's reduce-scatter,
  the fault-tolerant average across replica groups) and before clipping: this rank's local shard of each.

How the ranks agree, in two phases:

1. A cheap suspicion: per-tensor norms of the local gradient shards (one fused `foreach` kernel per device and
   dtype), a flag when their sum is not finite, and the loss flag; shared by one all-reduce of a few floats over
   the world (every pipeline stage, every replica and shard). With gradient-norm clipping the clipper already
   computes those norms and reduces them: the flags ride along its reductions (`optim.clipping`), so no collective
   is added where those reductions reach every rank (sharded layouts), and one where they do not (DDP, HSDP's
   replicas). Without clipping: one all-reduce per optimizer step.
2. Only when a rank is suspected: every rank scans its gradient shards exactly and the findings are gathered (rank,
   loss, the names of the first parameters holding NaN or Inf). A norm that overflowed float32 on large but finite
   gradients (a sum of squares above 3.4e38) is suspected in phase 1 and cleared here: no false alarm.

What happens then is the same on every rank: `"raise"` raises `NonFiniteError` (naming the global step, loss or
gradients, the parameters and ranks) before the optimizer step; `"skip"` discards the gradients and skips the step
(no weight, optimizer state or optimizer step count moves; Lightning's global step and the learning-rate
schedulers still advance, as with an fp16 `GradScaler` skip) and counts it (`SKIPPED_METRIC`); more than
`max_consecutive_skips` skips in a row raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "MODES",
    "SKIPPED_METRIC",
    "NonFiniteError",
    "NonFiniteGuard",
    "OnNonFinite",
    "StepFlags",
    "check_mode",
    "suspect_flag",
]

OnNonFinite = Literal["raise", "skip", "off"]
MODES: tuple[str, ...] = ("raise", "skip", "off")
#: Skipped steps in a row after which `"skip"` raises: a run whose every step is non-finite is broken, not unlucky.
MAX_CONSECUTIVE_SKIPS = 10
#: The metric counting skipped steps (logged every optimizer step under `"skip"`, in `trainer.callback_metrics`).
SKIPPED_METRIC = "nonfinite/skipped_steps"
#: Parameters named per rank in the error (the first ones, in the optimizer's order).
NAMED_PER_RANK = 3
#: The position of the gradients' flag in the flags vector (then the loss's).
_GRADIENTS = 0


def check_mode(value: object) -> OnNonFinite:
    """`value` if it is one of `MODES`, else a `ValueError` naming it, the valid ones and the fix."""
    if value not in MODES:
        raise ValueError(
            f"`on_nonfinite={value!r}` is invalid: use 'raise' (the default: every rank stops before a non-finite"
            " step reaches the weights), 'skip' (the step is skipped on every rank and counted) or 'off' (no check)."
        )
    return value  # type: ignore[return-value]


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients were NaN or Inf on some rank; raised on every rank before the optimizer step."""


class SkippedStep(Exception):
    """Raised inside the optimizer's closure to leave `optimizer.step` before it updates anything."""


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def suspect_flag(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """1.0 (float32 on `device`) when the sum of the per-tensor squared norms of `grads` (local tensors) is not
    finite: a NaN or Inf among them, or finite values whose squares overflow float32 (`NonFiniteGuard` tells those
    apart). One fused norm per device and dtype; no host sync."""
    flag = torch.zeros((), device=device, dtype=torch.float32)
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for tensors in by_kind.values():
        total = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).sum()
        flag = torch.maximum(flag, (~torch.isfinite(total)).to(device=device, dtype=torch.float32))
    return flag


@dataclass
class StepFlags:
    """One optimizer step's flags `[gradients suspected, loss non-finite]` (float32, on the rank's device): this
    rank's until `agreed`, then every rank's (nonzero where any rank's was). `optim.clipping` folds them into its
    norm reductions and sets `agreed` when those reached every rank."""

    values: Tensor
    agreed: bool = False

    def suspect(self, flag: Tensor) -> None:
        """Add a gradient suspicion (a nonnegative scalar) of this rank before any reduction."""
        self.values[_GRADIENTS] = torch.maximum(self.values[_GRADIENTS], flag.to(self.values.device))


@dataclass(frozen=True)
class _Finding:
    rank: int
    loss: bool
    parameters: tuple[str, ...]
    bad_parameters: int


@dataclass
class _Step:
    """The step being checked: its flags and what the error needs."""

    flags: StepFlags
    parameters: list[Tensor]
    names: Callable[[], dict[int, str]]
    global_step: int
    #: Whether gradient-norm clipping will agree on the flags (`optim.clipping`); else the closure does.
    deferred: bool
    decided: bool = False


class NonFiniteGuard:
    """The per-step check of one strategy (see the module docstring); `mode` is `"raise"` or `"skip"`."""

    def __init__(self, mode: OnNonFinite = "raise", max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS) -> None:
        if check_mode(mode) == "off":
            raise ValueError("`NonFiniteGuard` checks steps; with `on_nonfinite='off'` make none.")
        if max_consecutive_skips < 1:
            raise ValueError(f"`max_consecutive_skips={max_consecutive_skips}` must be >= 1.")
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        #: Steps skipped since the guard was made, and in a row up to the last step.
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._loss_flag: Tensor | None = None
        #: The step being checked, between its closure and its end; `optim.clipping` folds into `pending.flags`.
        self.pending: _Step | None = None
        #: Whether the last optimizer step was skipped (a fault-tolerant replica group then votes not to commit).
        self.last_skipped = False

    # ------------------------------------------------------------------ per micro-batch
    @torch.no_grad()
    def note_loss(self, loss: Tensor) -> None:
        """Remember whether a micro-batch's loss is finite (a device flag: no host sync)."""
        bad = (~torch.isfinite(loss.detach())).any().to(torch.float32)
        self._loss_flag = bad if self._loss_flag is None else torch.maximum(self._loss_flag, bad)

    # ------------------------------------------------------------------ per optimizer step
    def optimizer_step(
        self,
        step: Callable[[Callable[[], Any]], Any],
        closure: Callable[[], Any],
        parameters: Callable[[], list[Tensor]],
        names: Callable[[], dict[int, str]],
        global_step: int,
        device: torch.device,
        deferred: bool,
    ) -> Any:
        """Run `step(checked_closure)` (the optimizer step given its closure): the closure (forward, backward, the
        gradients reduced) then the check; the ranks agree here, or in gradient-norm clipping when `deferred`. A
        skipped step returns None; a non-finite one under `"raise"` raises `NonFiniteError` on every rank."""

        def checked_closure() -> Any:
            result = closure()
            params = [p for p in parameters() if p.grad is not None]
            loss = self._loss_flag if self._loss_flag is not None else torch.zeros((), device=device)
            flags = StepFlags(torch.stack([torch.zeros((), device=device), loss.to(device)]))
            self.pending = _Step(flags, params, names, global_step, deferred)
            if not deferred:
                flags.suspect(suspect_flag([_local(p.grad) for p in params], device))  # type: ignore[arg-type]
                self.decide()
            return result

        self.last_skipped = False
        try:
            output = step(checked_closure)
            if self.pending is not None and not self.pending.decided:  # clipping did not run: still agree
                self.decide()
            self.consecutive_skips = 0
            return output
        except SkippedStep:
            self.last_skipped = True
            return None
        finally:
            self.pending = None
            self._loss_flag = None

    def decide(self) -> None:
        """Agree on the pending step's flags (unless clipping did), and raise `NonFiniteError` or `SkippedStep` on
        every rank when some rank's loss or gradients hold NaN or Inf. Called before the gradients are clipped."""
        step = self.pending
        assert step is not None, "`decide` runs inside a checked optimizer step"
        step.decided = True
        flags = step.flags
        if not flags.agreed and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags.values, op=dist.ReduceOp.MAX)
            flags.agreed = True
        if not bool(flags.values.any()):
            return
        findings = self._gather_findings(step)
        if not findings:  # a norm that overflowed on large finite gradients
            return
        if self.mode == "skip" and self.consecutive_skips < self.max_consecutive_skips:
            for param in step.parameters:
                param.grad = None
            self.skipped_steps += 1
            self.consecutive_skips += 1
            raise SkippedStep
        raise NonFiniteError(self._message(step, findings))

    def _gather_findings(self, step: _Step) -> list[_Finding]:
        """Every rank's exact scan (a collective, run only when a rank is suspected): the ranks with a non-finite
        loss or gradient, in rank order."""
        loss = self._loss_flag is not None and bool(self._loss_flag)
        bad = [p for p in step.parameters if not bool(torch.isfinite(_local(p.grad)).all())]  # type: ignore[arg-type]
        names = step.names() if bad else {}
        named = tuple(names.get(id(p), f"<unnamed parameter {i}>") for i, p in enumerate(bad[:NAMED_PER_RANK]))
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mine = _Finding(rank, loss, named, len(bad)) if loss or bad else None
        if not (dist.is_available() and dist.is_initialized()):
            return [mine] if mine is not None else []
        everyone: list[_Finding | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return [f for f in everyone if f is not None]

    def _message(self, step: _Step, findings: list[_Finding]) -> str:
        loss_ranks = [f.rank for f in findings if f.loss]
        grad_findings = [f for f in findings if f.bad_parameters]
        parts = []
        if loss_ranks:
            parts.append(f"the loss on ranks {loss_ranks}")
        if grad_findings:
            where = "; ".join(
                f"rank {f.rank}: {', '.join(f.parameters)}"
                + (f" and {f.bad_parameters - len(f.parameters)} more" if f.bad_parameters > len(f.parameters) else "")
                for f in grad_findings
            )
            parts.append(f"the gradients of {where}")
        what = " and ".join(parts)
        if self.mode == "skip":
            cause = (
                f"{self.consecutive_skips} steps in a row were skipped before it (`on_nonfinite='skip'` stops after"
                f" {self.max_consecutive_skips})"
            )
        else:
            cause = "`on_nonfinite='raise'`"
        return (
            f"Non-finite values (NaN or Inf) at global step {step.global_step}: {what}. Every rank stops before the"
            f" optimizer step ({cause}): no weight, optimizer state or scheduler moved. Look at the batch of that"
            " step, the learning rate and the loss scale; `on_nonfinite='skip'` skips such steps instead."
        )


def parameter_names(modules: Iterable[torch.nn.Module]) -> dict[int, str]:
    """`id(parameter) -> fully qualified name` over `modules` (the names the error reports)."""
    return {id(p): name for module in modules for name, p in module.named_parameters()}
