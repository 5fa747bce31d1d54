"""The probe of `lightning_dpar.optim.exactness` on plain tensors: how much of the model an optimizer's update reads.

A fresh instance of the optimizer's class, with the same hyperparameters, steps a small float64 matrix whole, then
each piece of it on its own (as each rank would), split by rows and by columns, and then two tensors together and
apart. The probe draws no random numbers from the global generators and uses no collectives, so every rank reaches
the same verdict. An update found not elementwise here may still be exact on shards, where it receives DTensors:
`lightning_dpar.optim.shard_probe` decides that on the parameters' own placements.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["Classification", "UpdateKind", "fresh_instance", "group_hyperparameters", "probe_update_kind"]


class UpdateKind(Enum):
    """How much of the model one parameter element's update depends on."""

    #: Only that element (and scalars: hyperparameters, step count): exact on any shard.
    ELEMENTWISE = "elementwise"
    #: The whole tensor it belongs to (norms, matrix products): exact only where each tensor is whole on a rank.
    PER_TENSOR = "per-tensor"
    #: Every parameter the optimizer holds: exact only where one rank holds every parameter whole.
    WHOLE_MODEL = "whole-model"


@dataclass(frozen=True)
class Classification:
    """An optimizer's update kind, how it was found ("known", "declared", "probe",
    "shards"), and why."""

    kind: UpdateKind
    source: str
    reason: str


#: Steps the probe takes; more than one, so that state (momentum, second moments) takes part.
PROBE_STEPS = 3
#: The probe's matrix: rows and columns both split unevenly, as FSDP (rows, padded) and TP (rows or columns) do.
PROBE_SHAPE = (6, 5)
#: Where the probe cuts rows and columns.
ROW_CUT, COLUMN_CUT = 4, 2
#: Relative to the largest update: float64 elementwise arithmetic agrees far below it, a whole-tensor norm or matrix
#: product taken on a piece differs far above it.
PROBE_RTOL = 1e-9


def probe_update_kind(optimizer: Optimizer) -> Classification:
    """Find the update kind of `optimizer`'s class by stepping fresh instances of it on small CPU tensors.

    For each distinct set of hyperparameters among its param groups, a new instance (same class, same
    hyperparameters, no state) steps a float64 matrix whole, and, in other instances, each of its pieces alone (cut
    by rows, then by columns), `PROBE_STEPS` times with the same gradients; then two matrices in one instance and
    in one each. Pieces that end unlike the whole: not elementwise; two tensors that end unlike apart: whole-model.
    The real optimizer, its parameters and the global random generators are left untouched.
    """
    name = type(optimizer).__name__
    kind = UpdateKind.ELEMENTWISE
    reasons: list[str] = []
    for hyper in group_hyperparameters(optimizer):
        try:
            found, reason = _probe_group(optimizer, hyper)
        except Exception as error:  # anything the class raises: not provable, so not assumed elementwise
            return Classification(
                UpdateKind.WHOLE_MODEL,
                "probe",
                f"the check before training could not step a copy of {name} on a small float64 CPU matrix"
                f" ({type(error).__name__}: {error}), so nothing shows that it is",
            )
        if found is not UpdateKind.ELEMENTWISE:
            reasons.append(reason)
            if found is UpdateKind.WHOLE_MODEL or kind is UpdateKind.ELEMENTWISE:
                kind = found
    if kind is UpdateKind.ELEMENTWISE:
        return Classification(kind, "probe", "a copy stepped on pieces of a matrix matched it stepped whole")
    return Classification(kind, "probe", "; ".join(reasons))


def group_hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The distinct hyperparameters of `optimizer`'s param groups, in group order."""
    seen: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        if not any(_same(hyper, other) for other in seen):
            seen.append(hyper)
    return seen


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, Tensor) or isinstance(y, Tensor):
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _probe_group(optimizer: Optimizer, hyper: dict[str, Any]) -> tuple[UpdateKind, str]:
    generator = torch.Generator().manual_seed(0)
    shape = PROBE_SHAPE
    cpu = {"dtype": torch.float64, "device": "cpu"}  # also inside the dry run's `torch.device("meta")`
    start = torch.randn(shape, generator=generator, **cpu)
    # Rows and columns of different scales, so that statistics of a piece differ from the whole's.
    scale = torch.logspace(-1, 1, shape[0], **cpu)[:, None] * torch.linspace(0.5, 2, shape[1], **cpu)
    grads = [torch.randn(shape, generator=generator, **cpu) * scale for _ in range(PROBE_STEPS)]
    whole = _run(optimizer, hyper, [start], [[g] for g in grads])[0]
    size = (whole - start).abs().max().item()
    tolerance = PROBE_RTOL * size + 1e-300
    for cut, dim, what in ((ROW_CUT, 0, "rows"), (COLUMN_CUT, 1, "columns")):
        pieces = [
            _run(optimizer, hyper, [piece], [[g.split([cut, shape[dim] - cut], dim)[i]] for g in grads])[0]
            for i, piece in enumerate(start.split([cut, shape[dim] - cut], dim))
        ]
        difference = (torch.cat(pieces, dim) - whole).abs().max().item()
        if difference > tolerance:
            # Per-tensor or whole-model? Two tensors in one instance against one instance each.
            other = start.flip(0) * 0.5
            together = _run(optimizer, hyper, [start, other], [[g, g.flip(1)] for g in grads])
            apart = _run(optimizer, hyper, [other], [[g.flip(1)] for g in grads])[0]
            coupled = (together[0] - whole).abs().max().item() > tolerance or (
                (together[1] - apart).abs().max().item() > tolerance
            )
            reason = (
                f"a copy stepped on a {shape[0]}x{shape[1]} matrix cut into {what} moved the pieces up to"
                f" {difference:.3g} away from the whole matrix's update (whose largest entry is {size:.3g})"
            )
            if coupled:
                return UpdateKind.WHOLE_MODEL, reason + ", and two tensors stepped together unlike apart"
            return UpdateKind.PER_TENSOR, reason
    return UpdateKind.ELEMENTWISE, ""


def _run(optimizer: Optimizer, hyper: dict[str, Any], starts: list[Tensor], grads: list[list[Tensor]]) -> list[Tensor]:
    """Step a fresh instance of `optimizer`'s class on copies of `starts`; return the parameters after the steps."""
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    probe = fresh_instance(optimizer, hyper, params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            probe.step()
    return [p.detach() for p in params]


def fresh_instance(optimizer: Optimizer, hyper: dict[str, Any], params: list[Tensor]) -> Optimizer:
    """A new instance of `optimizer`'s class with the hyperparameters `hyper`, holding `params` and no state."""
    cls = type(optimizer)
    hyper = copy.deepcopy(hyper)  # e.g. a tensor learning rate, which a step may update in place
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hyper.items() if takes_any or k in accepted}
    # Constructors validate and default their arguments; the group then carries every hyperparameter as is.
    return cls([{"params": params, **hyper}], **kwargs)
