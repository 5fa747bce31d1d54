"""Which optimizers train exactly on which parameter layouts; the check that refuses the others before training.

An optimizer whose update of each element depends only on that element (its value, gradient and state, plus
hyperparameters and the step count) computes the same update on a shard as on the whole tensor: SGD, Adam, AdamW,
RMSprop, Adagrad and the other elementwise `torch.optim` classes, in their foreach and fused forms, train exactly
under every layout, and nothing is added to their step. Others look at whole tensors: Muon orthogonalises each
weight matrix, Adafactor factors its second moment over rows and columns and scales by the parameter's RMS, LAMB and
LARS scale by whole-tensor norms; on a rank that holds a shard, each sees a different matrix. LBFGS goes further and
couples every parameter of the model. Which property a layout needs:

- `dpar_replicate` without tensor parallelism: every rank holds every parameter whole, as under DDP: any optimizer.
- FSDP, HSDP (a shard group of 2 or more), tensor parallelism (also `dpar_replicate` with `tensor_parallel_size > 1`):
  parameters are split across ranks: elementwise optimizers only, and `torch.optim.Muon`, whose step the strategy
  computes on whole matrices (`lightning_dpar.distributed_muon`).
- Pipeline parallelism: each stage's ranks hold only their stage's parameters: optimizers that treat each tensor on
  its own (elementwise or per-tensor, e.g. Adafactor), not whole-model ones (LBFGS); with FSDP or TP inside the
  stages, the rule above as well.

An optimizer class the package does not know is probed before training (`probe_update_kind`): a fresh instance of
the same class with the same hyperparameters steps a small float64 matrix whole, then each piece of it on its own
(as each rank would), split by rows and by columns, and then two tensors together and apart. The probe draws no
random numbers from the global generators and uses no collectives, so every rank reaches the same verdict. What it
proves is limited to what it tried: a few steps, on one shape, one dtype and the optimizer's current
hyperparameters. An update that becomes non-elementwise only later (after a warm-up, above a threshold), only on
other shapes or dtypes, or only for other hyperparameters passes it. `declare_update_kind` states the kind of a
class instead, for such optimizers or for classes the probe cannot build.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_dpar.mesh import ParallelDims

__all__ = [
    "OptimizerLayoutError",
    "ParameterLayout",
    "UpdateKind",
    "check_optimizers",
    "classify",
    "declare_update_kind",
    "exactness_summary",
    "probe_update_kind",
    "refusal",
]


class UpdateKind(Enum):
    """How much of the model one parameter element's update depends on."""

    #: Only that element (and scalars: hyperparameters, step count): exact on any shard.
    ELEMENTWISE = "elementwise"
    #: The whole tensor it belongs to (norms, matrix products): exact only where each tensor is whole on a rank.
    PER_TENSOR = "per-tensor"
    #: Every parameter the optimizer holds: exact only where one rank holds every parameter whole.
    WHOLE_MODEL = "whole-model"


#: `torch.optim` classes whose updates are elementwise, in every form (for-loop, foreach, fused). Exact classes only:
#: a subclass may override `step`, so it is probed.
ELEMENTWISE_CLASSES: frozenset[type[Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.SparseAdam,
    }
)

#: Known optimizers whose updates are not elementwise: (kind, why).
NON_ELEMENTWISE_CLASSES: dict[type[Optimizer], tuple[UpdateKind, str]] = {
    torch.optim.Muon: (UpdateKind.PER_TENSOR, "it orthogonalises each whole weight matrix (Newton-Schulz)"),
    torch.optim.Adafactor: (
        UpdateKind.PER_TENSOR,
        "it factors its second moment over each matrix's whole rows and columns and scales by the parameter's RMS",
    ),
    torch.optim.LBFGS: (UpdateKind.WHOLE_MODEL, "its quasi-Newton step uses dot products over every parameter"),
}

#: Classes whose kind the user declared (`declare_update_kind`); checked before the tables above.
_DECLARED: dict[type[Optimizer], UpdateKind] = {}


def declare_update_kind(optimizer_class: type[Optimizer], kind: UpdateKind | str) -> None:
    """State how an optimizer class's update depends on its parameters, instead of probing it.

    For an optimizer the probe cannot build or step, or one whose update changes kind beyond what a few small steps
    show. A wrong declaration trains silently differently from DDP: declare `"elementwise"` only for an update
    that reads nothing but each element's own value, gradient and state.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(f"`declare_update_kind` takes a torch.optim.Optimizer subclass, got {optimizer_class!r}.")
    _DECLARED[optimizer_class] = UpdateKind(kind)


@dataclass(frozen=True)
class Classification:
    """An optimizer's update kind, how it was found ("known", "declared", "probe"), and why."""

    kind: UpdateKind
    source: str
    reason: str


@dataclass(frozen=True)
class ParameterLayout:
    """How a layout splits parameters: across ranks (`split_by`, e.g. FSDP shards), and across pipeline stages."""

    split_by: tuple[str, ...]
    pipelined: bool

    @classmethod
    def of(cls, dims: ParallelDims) -> ParameterLayout:
        """From the mesh sizes alone, so every rank decides alike (a rank's own parameters could differ)."""
        split_by = []
        if dims.shard > 1:
            split_by.append(f"FSDP shards over {dims.shard} ranks")
        if dims.tensor_parallel > 1:
            split_by.append(f"tensor parallelism over {dims.tensor_parallel} ranks")
        return cls(tuple(split_by), dims.pipeline > 1)

    def allows(self, kind: UpdateKind) -> bool:
        if kind is UpdateKind.ELEMENTWISE:
            return True
        if kind is UpdateKind.PER_TENSOR:
            return not self.split_by
        return not self.split_by and not self.pipelined

    def describe(self) -> str:
        parts = [*self.split_by, *(["pipeline stages"] if self.pipelined else [])]
        return " and ".join(parts) if parts else "whole parameters on every rank"


class OptimizerLayoutError(ValueError):
    """An optimizer whose update would differ from DDP's under this layout; raised before training."""


def classify(optimizer: Optimizer) -> Classification:
    """The update kind of `optimizer`: declared, known, or found by `probe_update_kind`."""
    cls = type(optimizer)
    if cls in _DECLARED:
        return Classification(_DECLARED[cls], "declared", "declared with `declare_update_kind`")
    if cls in ELEMENTWISE_CLASSES:
        return Classification(UpdateKind.ELEMENTWISE, "known", "its update is elementwise")
    if cls in NON_ELEMENTWISE_CLASSES:
        kind, why = NON_ELEMENTWISE_CLASSES[cls]
        return Classification(kind, "known", why)
    return probe_update_kind(optimizer)


def check_optimizers(
    optimizers: Sequence[Optimizer],
    layout: ParameterLayout,
    strategy: str,
    supported_on_split: Callable[[Optimizer], bool] = lambda _: False,
) -> None:
    """Raise `OptimizerLayoutError` for the first optimizer that would not train exactly as under DDP on `layout`.

    Elementwise `torch.optim` classes return at once (known by class, no probe). `supported_on_split(optimizer)` says
    whether the strategy computes a per-tensor optimizer's step on whole tensors itself (distributed Muon).
    """
    for optimizer in optimizers:
        message = refusal(optimizer, layout, strategy, supported_on_split)
        if message is not None:
            raise OptimizerLayoutError(message)


def refusal(
    optimizer: Optimizer,
    layout: ParameterLayout,
    strategy: str,
    supported_on_split: Callable[[Optimizer], bool] = lambda _: False,
) -> str | None:
    """Why `optimizer` cannot train exactly under `layout`, or None when it can."""
    if type(optimizer) in ELEMENTWISE_CLASSES and type(optimizer) not in _DECLARED:
        return None  # the fast path: nothing else to look at
    found = classify(optimizer)
    if layout.allows(found.kind):
        return None
    if found.kind is UpdateKind.PER_TENSOR and not layout.pipelined and supported_on_split(optimizer):
        return None
    return _refusal(optimizer, found, layout, strategy)


def _refusal(optimizer: Optimizer, found: Classification, layout: ParameterLayout, strategy: str) -> str:
    name = type(optimizer).__name__
    how = {
        "known": f"{name}'s update is {found.kind.value}: {found.reason}",
        "declared": f"{name} was declared {found.kind.value} with `lightning_dpar.declare_update_kind`",
        "probe": f"{name}'s update is not elementwise: {found.reason}",
    }[found.source]
    if found.kind is UpdateKind.WHOLE_MODEL:
        where = "one process holding every parameter whole"
        instead = "strategy='dpar_replicate' (without tensor parallelism)"
    else:
        where = "each rank holding whole tensors"
        instead = "strategy='dpar_replicate' (whole parameters on every rank, as DDP)"
        if layout.pipelined and not layout.split_by:
            instead = "one pipeline stage, or strategy='dpar_replicate'"
    message = (
        f"{name} cannot train exactly under {strategy} with {layout.describe()}. {how}, so on a rank that holds only"
        f" part of the model it would compute a different update than under DDP, silently. It needs {where}."
        f" Use {instead}, or an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...)"
    )
    if found.kind is UpdateKind.PER_TENSOR and not layout.pipelined and type(optimizer) is not torch.optim.Muon:
        message += ", or torch.optim.Muon (the strategy computes its update on whole matrices)"
    message += "."
    if type(optimizer) is torch.optim.Muon:
        message += (
            " The strategy computes Muon's update on whole matrices under FSDP, HSDP and tensor parallelism, but not"
            " with `cpu_offload=True` or pipeline parallelism."
        )
    if found.source == "probe":
        message += (
            " If the probe is wrong about it (its update reads only each element's own value, gradient and state),"
            f" declare it with `lightning_dpar.declare_update_kind({name}, 'elementwise')`."
        )
    return message


# ---------------------------------------------------------------------------------------------------- the probe
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
    seen: list[dict[str, Any]] = []
    kind = UpdateKind.ELEMENTWISE
    reasons: list[str] = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        if any(_same(hyper, other) for other in seen):
            continue
        seen.append(hyper)
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
    probe = _fresh_instance(optimizer, hyper, params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            probe.step()
    return [p.detach() for p in params]


def _fresh_instance(optimizer: Optimizer, hyper: dict[str, Any], params: list[Tensor]) -> Optimizer:
    """A new instance of `optimizer`'s class with the hyperparameters `hyper`, holding `params` and no state."""
    cls = type(optimizer)
    hyper = copy.deepcopy(hyper)  # e.g. a tensor learning rate, which a step may update in place
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hyper.items() if takes_any or k in accepted}
    # Constructors validate and default their arguments; the group then carries every hyperparameter as is.
    return cls([{"params": params, **hyper}], **kwargs)


# ---------------------------------------------------------------------------------------------------- reporting
def exactness_summary(
    optimizers: Sequence[Optimizer],
    layout: ParameterLayout,
    strategy: str,
    supported_on_split: Callable[[Optimizer], bool] = lambda _: False,
) -> list[str]:
    """One line per optimizer for the `plan` dry run: exact under this layout and why, or refused and why."""
    lines = []
    for optimizer in optimizers:
        name = type(optimizer).__name__
        found = classify(optimizer)
        if refusal(optimizer, layout, strategy, supported_on_split) is not None:
            lines.append(f"{name}: refused under this layout, its update is {found.kind.value} ({found.reason})")
        elif found.kind is not UpdateKind.ELEMENTWISE and layout.split_by:
            lines.append(f"{name}: exact, each whole matrix's update computed by one rank and sent to the others")
        else:
            lines.append(f"{name}: exact ({found.kind.value} update)")
    return lines
