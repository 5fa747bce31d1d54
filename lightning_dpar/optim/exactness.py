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
  parameters are split across ranks, as DTensors: elementwise optimizers; `torch.optim.Muon`, whose step the
  strategy computes on whole matrices (`lightning_dpar.optim.distributed_muon`); and optimizers whose whole-tensor
  statistics are DTensor operations (a LARS written with `p.norm()`), which DTensor computes over the whole tensor.
- Pipeline parallelism: each stage's ranks hold only their stage's parameters: optimizers that treat each tensor on
  its own (elementwise or per-tensor, e.g. Adafactor), not whole-model ones (LBFGS); with FSDP or TP inside the
  stages, the rule above as well.

An optimizer class the package does not know is probed before training (`probe_update_kind`,
`lightning_dpar.optim.update_probe`): a fresh instance of the same class with the same hyperparameters steps a small
float64 matrix whole, then each piece of it on its own, without collectives. Elementwise: accepted at once. Not
elementwise, on split parameters: the strategy steps it again on small DTensors placed as its parameters, on their mesh
(`lightning_dpar.optim.shard_probe`), and accepts it when they end as the whole matrices do. What the probes prove is
limited to what they tried: a few steps, on small shapes, float64 and the optimizer's current hyperparameters. An update
that changes only later (after a warm-up, above a threshold), on other shapes or dtypes, or for other hyperparameters
passes them. `declare_update_kind` states the kind of a class instead, for such optimizers or for classes the probe
cannot build."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from lightning_dpar.optim.update_probe import Classification, UpdateKind, probe_update_kind
from lightning_dpar.parallel_dims import ParallelDims

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
class ParameterLayout:
    """How a layout splits parameters: across ranks (`split_by`, e.g. FSDP shards), and across pipeline stages; and
    whether every rank holds every parameter as a plain tensor (`plain_tensors`: no sharding wrapper, tensor or
    pipeline parallelism), which callbacks that re-register parameters need (`conformance.callback_checks`)."""

    split_by: tuple[str, ...]
    pipelined: bool
    plain_tensors: bool = False

    @classmethod
    def of(cls, dims: ParallelDims, wrapper_shards: bool = True) -> ParameterLayout:
        """From the mesh sizes alone, so every rank decides alike (a rank's own parameters could differ);
        `wrapper_shards`: the data-parallel wrapper is FSDP (its parameters are DTensors even on one rank)."""
        split_by = []
        if dims.shard > 1:
            split_by.append(f"FSDP shards over {dims.shard} ranks")
        if dims.tensor_parallel > 1:
            split_by.append(f"tensor parallelism over {dims.tensor_parallel} ranks")
        plain = not wrapper_shards and dims.tensor_parallel == 1 and dims.pipeline == 1
        return cls(tuple(split_by), dims.pipeline > 1, plain)

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


#: `probe_on_shards(optimizer)`: whether the optimizer steps DTensors placed as its parameters exactly as whole
#: tensors, and why not (`lightning_dpar.optim.shard_probe`); None where no real process group exists (the dry run).
ShardProbe = Callable[[Optimizer], tuple[bool, str]]


def check_optimizers(
    optimizers: Sequence[Optimizer],
    layout: ParameterLayout,
    strategy: str,
    supported_on_split: Callable[[Optimizer], bool] = lambda _: False,
    probe_on_shards: ShardProbe | None = None,
) -> None:
    """Raise `OptimizerLayoutError` for the first optimizer that would not train exactly as under DDP on `layout`.

    Elementwise `torch.optim` classes return at once (known by class, no probe). `supported_on_split(optimizer)` says
    whether the strategy computes a per-tensor optimizer's step on whole tensors itself (distributed Muon). An
    unknown optimizer that the plain probe finds not elementwise is, on split parameters, stepped on DTensors placed
    as them (`probe_on_shards`, collectives: every rank must call this alike).
    """
    for optimizer in optimizers:
        message = refusal(optimizer, layout, strategy, supported_on_split, probe_on_shards)
        if message is not None:
            raise OptimizerLayoutError(message)


def refusal(
    optimizer: Optimizer,
    layout: ParameterLayout,
    strategy: str,
    supported_on_split: Callable[[Optimizer], bool] = lambda _: False,
    probe_on_shards: ShardProbe | None = None,
) -> str | None:
    """Why `optimizer` cannot train exactly under `layout`, or None when it can."""
    if type(optimizer) in ELEMENTWISE_CLASSES and type(optimizer) not in _DECLARED:
        return None  # the fast path: nothing else to look at
    found = classify(optimizer)
    if layout.allows(found.kind):
        return None
    if found.kind is UpdateKind.PER_TENSOR and not layout.pipelined and supported_on_split(optimizer):
        return None
    if probe_on_shards is not None and decided_on_shards(found, layout):
        exact, why = probe_on_shards(optimizer)
        if exact:  # DTensor computes its whole-tensor statistics over the whole tensor
            return None
        found = Classification(found.kind, "shards", f"{found.reason}; {why}")
    return _refusal(optimizer, found, layout, strategy)


def decided_on_shards(found: Classification, layout: ParameterLayout) -> bool:
    """Whether a probed optimizer is stepped on DTensors placed as its parameters before it is refused: where
    parameters are split, and unless it couples tensors of different pipeline stages (which no DTensor spans)."""
    return (
        found.source == "probe"
        and bool(layout.split_by)
        and not (layout.pipelined and found.kind is UpdateKind.WHOLE_MODEL)
    )


def _refusal(optimizer: Optimizer, found: Classification, layout: ParameterLayout, strategy: str) -> str:
    name = type(optimizer).__name__
    how = {
        "known": f"{name}'s update is {found.kind.value}: {found.reason}",
        "declared": f"{name} was declared {found.kind.value} with `lightning_dpar.declare_update_kind`",
        "probe": f"{name}'s update is not elementwise: {found.reason}",
        "shards": f"{name}'s update is not elementwise, nor exact on DTensors: {found.reason}",
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
    if "could not step" in found.reason:  # nothing shows what it reads: the user may state it
        message += (
            " If its update reads only each element's own value, gradient and state, declare it with"
            f" `lightning_dpar.declare_update_kind({name}, 'elementwise')`."
        )
    elif found.source == "shards":
        message += (
            " Its update reads the shards as plain tensors somewhere (e.g. `to_local()`, or statistics of local"
            " values): compute whole-tensor statistics on the DTensor parameters and gradients instead (`p.norm()`,"
            " sums and products of DTensors are taken over the whole tensor), and the check accepts it."
        )
    return message


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
        if refusal(optimizer, layout, strategy, supported_on_split) is None:
            if found.kind is not UpdateKind.ELEMENTWISE and layout.split_by:
                lines.append(f"{name}: exact, each whole matrix's update computed by one rank and sent to the others")
            else:
                lines.append(f"{name}: exact ({found.kind.value} update)")
        elif decided_on_shards(found, layout):  # the dry run's fake process group cannot step DTensors
            lines.append(
                f"{name}: decided when training starts, its update is not elementwise ({found.reason}): it is"
                " stepped on DTensors placed as its parameters and refused unless they end as whole tensors do"
            )
        else:
            lines.append(f"{name}: refused under this layout, its update is {found.kind.value} ({found.reason})")
    return lines
