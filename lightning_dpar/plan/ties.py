"""Tied and shared parameters: one parameter reachable under several names (`lm_head.weight` and
`model.embed_tokens.weight` under `tie_word_embeddings`; every parameter of a module reused by several blocks).

They are found once, from the model before any parallelism (`tied_parameters`), and carried in the plan
(`ModulePlan.tied`). Each step that could give the names separate tensors keeps them one parameter:

- tensor parallelism: `parallelize_module` gives each module a new parameter of its own; `retie` makes every name
  of a group the first name's again. That is exact only where both modules' styles give the weight the same layout
  (transformers' `embedding_rowwise` and `colwise_gather_output` both shard dim 0 of the `[vocab, hidden]` weight);
  `check_tied_layouts` refuses any other combination before any collective, naming both modules and styles.
- meta-device materialisation: `nn.Module.to_empty` allocates a tensor per module; `retie` again.
- FSDP: a parameter goes to the unit enclosing all its users (`parameter_owners`), FSDP2's rule for shared
  parameters; the inner units leave it alone (`SharedOwners`).
- pipeline stages: a parameter used on two stages is refused (`lightning_dpar.pipeline.split`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "SharedOwners",
    "TiedGroup",
    "check_each_in_one_unit",
    "check_tied_layouts",
    "describe_tp_placement",
    "parameter_owners",
    "retie",
    "tied_parameters",
]

#: The names of one parameter, in `named_parameters` order (the first is where the others are tied back to).
TiedGroup = tuple[str, ...]


def tied_parameters(root: nn.Module) -> list[TiedGroup]:
    """Every parameter reachable under more than one name, as its names; pure, and cheap on a meta model."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _split(name: str) -> tuple[str, str]:
    module, _, attribute = name.rpartition(".")
    return module, attribute


def retie(root: nn.Module, groups: Iterable[TiedGroup]) -> None:
    """Make every name of each group refer to its first name's parameter again (after a step gave them separate
    tensors with equal values: `parallelize_module`, `to_empty`)."""
    for group in groups:
        first = root.get_parameter(group[0])
        for name in group[1:]:
            module_name, attribute = _split(name)
            module = root.get_submodule(module_name)
            if getattr(module, attribute) is not first:
                module.register_parameter(attribute, first)


#: Layouts of a weight under the styles whose effect is known: (style type, module type) -> the weight dim split.
_SHARDED_DIM: dict[tuple[type[ParallelStyle], type[nn.Module]], int] = {
    (ColwiseParallel, nn.Linear): 0,
    (ColwiseParallel, nn.Embedding): 1,
    (RowwiseParallel, nn.Linear): 1,
    (RowwiseParallel, nn.Embedding): 0,
}
WHOLE = "whole on every rank"


def _style_over(name: str, styles: Mapping[str, ParallelStyle]) -> tuple[str, ParallelStyle] | None:
    """The planned module (and its style) that holds parameter `name`: its own module or an ancestor."""
    module_name, _ = _split(name)
    candidates = [fqn for fqn in styles if module_name == fqn or module_name.startswith(f"{fqn}.")]
    return (max(candidates, key=len), styles[max(candidates, key=len)]) if candidates else None


def describe_tp_placement(root: nn.Module, name: str, styles: Mapping[str, ParallelStyle]) -> str | None:
    """What tensor parallelism makes of parameter `name`: `"Shard(0)"`, `"Replicate()"` (a DTensor, as
    `SequenceParallel` gives), `WHOLE` (untouched), or `None` when the style's effect on it is unknown (a custom
    style, or a parameter other than a Linear's or Embedding's weight)."""
    found = _style_over(name, styles)
    if found is None:
        return WHOLE
    fqn, style = found
    module_name, attribute = _split(name)
    if type(style) is SequenceParallel:
        return "Replicate()"
    module = root.get_submodule(module_name)
    dim = next(
        (
            d
            for (style_type, module_type), d in _SHARDED_DIM.items()
            if type(style) is style_type and isinstance(module, module_type)
        ),
        None,
    )
    if dim is None or attribute != "weight" or fqn != module_name:
        return None
    return f"Shard({dim})"


def check_tied_layouts(root: nn.Module, groups: Sequence[TiedGroup], styles: Mapping[str, ParallelStyle]) -> None:
    """Refuse tied names that tensor parallelism would lay out differently: one tensor cannot serve both. Pure, so it
    fails on every rank before any collective, and in the `plan` dry run, with the same message."""
    for group in groups:
        layouts = {name: describe_tp_placement(root, name, styles) for name in group}
        if len(set(layouts.values())) == 1 and None not in layouts.values():
            continue
        described = "; ".join(
            f"{name!r} is {layout or 'laid out in a way lightning_dpar cannot tell'} ({_describe_style(name, styles)})"
            for name, layout in layouts.items()
        )
        raise ValueError(
            f"Tied parameters {list(group)} are one tensor, but the tp_plan lays them out differently: {described}."
            " Give both modules styles that shard the same weight dim (for tied input and output embeddings:"
            " 'embedding_rowwise' on the embedding and 'colwise_gather_output' on the head, which both shard the"
            " vocabulary dim), leave both out of the tp_plan, or untie them (`tie_word_embeddings=False` for"
            " transformers models)."
        )


def _describe_style(name: str, styles: Mapping[str, ParallelStyle]) -> str:
    found = _style_over(name, styles)
    if found is None:
        return "not in the tp_plan"
    fqn, style = found
    return f"module {fqn!r} gets {type(style).__name__}"


def _encloses(unit: str, name: str) -> bool:
    return unit == "" or name.startswith(f"{unit}.")


def parameter_owners(groups: Sequence[TiedGroup], units: Sequence[str]) -> dict[str, str]:
    """For each tied parameter (keyed by its first name), the unit that holds it: the innermost of `units` (FQNs;
    `""` is the LightningModule) that encloses every name it is used under, as FSDP2 requires of a parameter shared
    by several units. Parameters whose names all sit in one unit are not listed: that unit holds them anyway."""
    owners = {}
    for group in groups:
        enclosing = [unit for unit in units if all(_encloses(unit, name) for name in group)]
        innermost = max(enclosing, key=lambda unit: (unit.count(".") + 1) if unit else 0, default="")
        # The unit each name would go to by default: the innermost unit enclosing that name alone.
        default = {
            max((u for u in units if _encloses(u, name)), key=lambda u: (u.count(".") + 1) if u else 0, default="")
            for name in group
        }
        if default != {innermost}:
            owners[group[0]] = innermost
    return owners


def check_each_in_one_unit(groups: Sequence[TiedGroup], units: Sequence[str], strategy: str) -> None:
    """DDP wraps each top-level child of the LightningModule on its own, and two DDP reducers cannot share one
    parameter: refuse a parameter used by two of them (before any collective)."""
    for group in groups:
        holders = sorted({unit for name in group for unit in units if _encloses(unit, name)})
        if len(holders) > 1:
            raise ValueError(
                f"Parameters {list(group)} are one tensor used by the top-level modules {holders}, which {strategy}"
                " wraps in separate DDP units that cannot share a parameter. Put the modules that share it inside"
                " one module (a child of the LightningModule that calls both), or use strategy='dpar_fsdp', whose"
                " unit on the LightningModule holds such parameters."
            )


class SharedOwners:
    """Which FSDP unit holds each parameter shared by several units: the innermost unit enclosing all its users
    (`parameter_owners`), and the `ignored_params` that make every other unit leave it alone.

    Parameters are looked up by name when each unit is applied: `fully_shard` replaces a module's parameters with
    new (sharded) ones. Without shared parameters every unit gets only the user's `ignored_params`: the usual
    bottom-up application already gives each parameter to the innermost unit holding it."""

    def __init__(
        self, root: nn.Module, tied: Sequence[TiedGroup], units: Sequence[str], user_ignored: set[nn.Parameter]
    ) -> None:
        self.root, self.units, self.user_ignored = root, list(units), user_ignored
        self.hoisted: dict[str, list[str]] = {}  # unit -> the first names of the shared parameters it holds
        for first_name, unit in parameter_owners(tied, units).items():
            self.hoisted.setdefault(unit, []).append(first_name)

    def hoisting_units(self) -> list[str]:
        """The units holding shared parameters of units below them, outermost first."""
        return sorted(self.hoisted, key=lambda fqn: -1 if fqn == "" else fqn.count("."))

    def _held_by(self, fqn: str) -> set[nn.Parameter]:
        return {self.root.get_parameter(name) for name in self.hoisted.get(fqn, ())}

    def ignored(self, fqn: str) -> set[nn.Parameter]:
        """What unit `fqn` must not take: the user's ignored parameters and the shared ones another unit holds; a
        unit applied before the units below it also leaves their parameters to them."""
        others = {
            self.root.get_parameter(name) for unit, names in self.hoisted.items() if unit != fqn for name in names
        }
        ignored = self.user_ignored | others
        if fqn in self.hoisted:
            below = [u for u in self.units if u and (not fqn or u.startswith(f"{fqn}."))]
            ignored |= {p for u in below for p in self.root.get_submodule(u).parameters()} - self._held_by(fqn)
        return ignored

    def ignored_kwargs(self, fqn: str) -> dict[str, Any]:
        ignored = self.ignored(fqn)
        return {"ignored_params": ignored} if ignored else {}
