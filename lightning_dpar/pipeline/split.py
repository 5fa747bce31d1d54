"""Where a model splits into pipeline stages, as data: which modules run on which stage, and which stages each
pipeline rank holds.

A *unit* is a module that moves to one stage as a whole: each repeated block (a child of an `nn.ModuleList`), and
every other module holding parameters that contains no block (the embedding, the final norm, the head). Modules
without parameters (rotary embeddings, dropout, activation functions) are not units: every stage runs them. Units
are listed in the order they are registered, which is the order most decoders run them; a model registering them in
another order (LitGPT registers `lm_head` before `transformer`) says in which order its forward calls them
(`call_order`).

A stage is a run of consecutive units. `"auto"` spreads the blocks evenly over the stages (the stages in the middle
take the remainder, since the first and last also carry the embedding and the head); explicit split points name the
first unit of every stage after the first. Units keep their names: a stage's state dict holds exactly the unsplit
model's keys for its parameters, so checkpoints move between pipelined and unpipelined runs.

Everything here is pure (no process group): a bad split fails on every rank before any collective, and in the `plan`
dry run, with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Union

from torch import nn

from lightning_dpar.helpers import class_name, has_parameters, is_under, show_names

__all__ = [
    "PipelineSplit",
    "SplitSpec",
    "StagePlacement",
    "check_placement",
    "parse_split",
    "pipeline_units",
    "resolve_split",
    "stage_ranks",
]

#: `"auto"`, or the names of the units that start stages 1, 2, ... (one fewer than the number of stages).
SplitSpec = Union[Literal["auto"], Sequence[str]]
#: `"loop"`: stage s on pipeline rank s % p (GPipe, 1F1B, interleaved schedules). `"v"`: rank r holds stages r and
#: 2p - 1 - r (the V-shaped zero-bubble schedules), so the first and last stage sit on the same rank.
StagePlacement = Literal["loop", "v"]


def pipeline_units(root: nn.Module, blocks: Sequence[str], call_order: Sequence[str] = ()) -> list[str]:
    """The units of `root` in the order its forward calls them, given its repeated blocks (FQNs): registration
    order, or, with `call_order` (names of modules in the order the forward calls them), the units under each named
    module in turn, each group in registration order."""
    if not blocks:
        raise ValueError(
            f"Pipeline parallelism splits a model between its repeated blocks, but {class_name(root)} has none"
            " (no `nn.ModuleList` of modules with parameters). Put the transformer layers in an `nn.ModuleList`, or"
            " name the blocks with `shard_modules`."
        )
    block_set = set(blocks)
    units: list[str] = []

    def contains_block(fqn: str) -> bool:
        return any(block.startswith(f"{fqn}.") for block in blocks)

    def visit(prefix: str, module: nn.Module) -> None:
        direct = [name for name, _ in module.named_parameters(recurse=False)]
        if direct:
            owner = prefix.rstrip(".") or class_name(root)
            raise ValueError(
                f"Module {owner!r} holds parameters of its own ({direct}) and also contains pipeline blocks, so its"
                " parameters belong to no single stage. Move them into a submodule (for example an `nn.Embedding`"
                " or a small `nn.Module` holding the `nn.Parameter`)."
            )
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if fqn in block_set:
                units.append(fqn)
            elif not has_parameters(child):
                continue
            elif contains_block(fqn):
                visit(f"{fqn}.", child)
            else:
                units.append(fqn)

    visit("", root)
    return _in_call_order(root, units, call_order) if call_order else units


def _in_call_order(root: nn.Module, units: list[str], call_order: Sequence[str]) -> list[str]:
    names = {fqn for fqn, _ in root.named_modules()}
    unknown = [name for name in call_order if name not in names]
    if unknown:
        raise ValueError(
            f"`pipeline_call_order` names {unknown}, which are not modules of {class_name(root)}; name modules"
            f" holding units, in the order the forward calls them (units: {show_names(units)})."
        )
    ordered = [unit for name in call_order for unit in units if is_under(unit, [name])]
    missing = [unit for unit in units if unit not in ordered]
    if missing or len(set(ordered)) != len(ordered):
        problem = f"leaves out {show_names(missing)}" if missing else "names a unit twice (nested names)"
        raise ValueError(
            f"`pipeline_call_order={list(call_order)}` {problem}: list modules that together hold every unit once,"
            " e.g. the LightningModule's top-level children in the order the forward calls them."
        )
    return ordered


@dataclass(frozen=True)
class PipelineSplit:
    """The stages (each a list of unit FQNs, in order) and the pipeline rank holding each stage."""

    stages: tuple[tuple[str, ...], ...]
    stage_to_rank: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_of_rank(self, pipeline_rank: int) -> list[int]:
        """The stage indices held by one pipeline rank, in execution order."""
        return [stage for stage, rank in enumerate(self.stage_to_rank) if rank == pipeline_rank]

    def units_of_rank(self, pipeline_rank: int) -> list[str]:
        return [unit for stage in self.stages_of_rank(pipeline_rank) for unit in self.stages[stage]]


def check_placement(placement: StagePlacement, stages_per_rank: int, schedule: str = "A V-shaped schedule") -> None:
    """Raise unless `stages_per_rank` fits the placement: a V holds exactly 2 stages per rank."""
    if placement == "v" and stages_per_rank != 2:
        raise ValueError(
            f"{schedule} places exactly 2 stages per rank in a V; got `pipeline_stages_per_rank={stages_per_rank}`."
            " Set it to 2."
        )


def parse_split(spec: object) -> SplitSpec:
    """A valid `pipeline_split`: `"auto"`, or the split points as a tuple of module names."""
    if isinstance(spec, str) and spec == "auto":
        return spec
    if isinstance(spec, str) or not isinstance(spec, Sequence) or not all(isinstance(point, str) for point in spec):
        detail = "" if isinstance(spec, str) else " (the first unit of each stage after the first)"
        raise ValueError(f"`pipeline_split={spec!r}` is invalid: use 'auto' or a list of module names{detail}.")
    return tuple(spec)


def stage_ranks(num_ranks: int, stages_per_rank: int, placement: StagePlacement) -> tuple[int, ...]:
    """The pipeline rank of each stage."""
    check_placement(placement, stages_per_rank)
    if placement == "v":
        return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
    return tuple(stage % num_ranks for stage in range(num_ranks * stages_per_rank))


def _even_sizes(count: int, parts: int) -> list[int]:
    """`count` items over `parts` stages as evenly as possible; the remainder goes to the middle stages first."""
    sizes = [count // parts] * parts
    middle_first = sorted(range(parts), key=lambda stage: (stage in (0, parts - 1), abs(2 * stage - (parts - 1))))
    for stage in middle_first[: count % parts]:
        sizes[stage] += 1
    return sizes


def resolve_split(
    root: nn.Module,
    blocks: Sequence[str],
    spec: SplitSpec,
    num_ranks: int,
    stages_per_rank: int,
    placement: StagePlacement,
    call_order: Sequence[str] = (),
) -> PipelineSplit:
    """Split `root`'s units into `num_ranks * stages_per_rank` stages, checking every stage gets at least one unit."""
    units = pipeline_units(root, blocks, call_order)
    num_stages = num_ranks * stages_per_rank
    spec = parse_split(spec)
    if spec == "auto":
        stages = _auto_stages(units, list(blocks), num_stages, class_name(root))
    else:
        stages = _explicit_stages(root, units, list(spec), num_stages)
    split = PipelineSplit(tuple(tuple(stage) for stage in stages), stage_ranks(num_ranks, stages_per_rank, placement))
    _check_no_parameter_shared_across_stages(root, split)
    return split


def _check_no_parameter_shared_across_stages(root: nn.Module, split: PipelineSplit) -> None:
    """A parameter used by units on two stages (tied input and output embeddings) would get two gradients that no
    one adds up: refuse it. Within a stage each unit is an FSDP unit of its own, and one parameter cannot belong to
    two: refuse a parameter shared by two units too (a block reused by several layers)."""
    seen: dict[int, tuple[str, str, int]] = {}
    for stage, units in enumerate(split.stages):
        for unit in units:
            for name, param in root.get_submodule(unit).named_parameters(remove_duplicate=False):
                first_name, first_unit, first_stage = seen.setdefault(id(param), (f"{unit}.{name}", unit, stage))
                if first_stage != stage:
                    raise ValueError(
                        f"Parameter {first_name!r} (pipeline stage {first_stage}) is the same tensor as"
                        f" {unit}.{name!r} (stage {stage}): pipeline stages cannot share a parameter. Untie them (for"
                        " transformers models `tie_word_embeddings=False`), or train without"
                        " `pipeline_parallel_size`, where the unit enclosing both holds it."
                    )
                if first_unit != unit:
                    raise ValueError(
                        f"Parameter {first_name!r} is the same tensor as {unit}.{name!r}: units {first_unit!r} and"
                        f" {unit!r} of pipeline stage {stage} share it, but each unit of a stage is an FSDP unit of"
                        " its own and a parameter can belong to one only. Pipeline without the sharing (give each"
                        " layer its own copy), or train without `pipeline_parallel_size`, where the unit enclosing"
                        " both holds it."
                    )


def _auto_stages(units: list[str], blocks: list[str], num_stages: int, model: str) -> list[list[str]]:
    block_units = [unit for unit in units if unit in set(blocks)]
    if len(block_units) < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but {model} has {len(block_units)}"
            f" ({show_names(block_units)}), so a stage would be empty. Lower `pipeline_parallel_size` x"
            " `pipeline_stages_per_rank`, or give `pipeline_split` explicitly."
        )
    first, last = units.index(block_units[0]), units.index(block_units[-1])
    before, after = units[:first], units[last + 1 :]
    between = units[first : last + 1]  # the blocks, plus any other unit registered among them
    stages: list[list[str]] = []
    start = 0
    for size in _even_sizes(len(block_units), num_stages):
        # Each stage takes `size` blocks (and the non-block units that sit between them).
        taken, end = 0, start
        while taken < size:
            taken += between[end] in set(block_units)
            end += 1
        stages.append(between[start:end])
        start = end
    stages[-1].extend(between[start:])
    stages[0][:0] = before
    stages[-1].extend(after)
    return stages


def _explicit_stages(root: nn.Module, units: list[str], split_points: list[str], num_stages: int) -> list[list[str]]:
    names = {fqn for fqn, _ in root.named_modules()}
    positions = []
    for point in split_points:
        if point not in units:
            what = "is a module but not a unit" if point in names else "names no module"
            raise ValueError(
                f"Pipeline split point {point!r} {what} of {class_name(root)}. A split point is the name of the"
                f" unit that starts a stage: one of {show_names(units, limit=12)}."
            )
        positions.append(units.index(point))
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"`pipeline_split` names {len(split_points)} split points, but {num_stages} stages need"
            f" {num_stages - 1} (the first unit of every stage after the first). Units: {show_names(units)}."
        )
    bounds = [0, *positions, len(units)]
    for stage, (start, end) in enumerate(pairwise(bounds)):
        if end <= start:
            raise ValueError(
                f"Pipeline split points {split_points} leave stage {stage} empty: each split point must come after"
                " the previous one in the model's unit order."
            )
    return [units[start:end] for start, end in pairwise(bounds)]
