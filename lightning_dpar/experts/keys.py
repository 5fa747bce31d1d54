"""Fused mixture-of-experts weights and the per-expert tensors checkpoints store them as. Pure: names, shapes and
index arithmetic only.

transformers 5 MoE models (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...) hold each layer's experts as two fused
parameters: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. Their checkpoints, the
Hub's and what `save_pretrained` writes, store one tensor per expert and projection: `mlp.experts.3.gate_proj.weight`
[I, H], `...up_proj.weight` [I, H], `...down_proj.weight` [H, I] (Mixtral: `block_sparse_moe.experts.3.w1/w3/w2`,
renamed to `mlp.` first; `lightning_dpar.hf_weights.hf_keys`). `from_pretrained` stacks the experts on a new dim 0 and
concatenates each expert's parts on its dim 0 (gate rows, then up rows): an `ExpertMerge` describes one such rule, as
transformers' conversion mapping declares it (`MergeModulelist(dim=0)`, then `Concatenate(dim=1)`).

Loading pretrained weights (`lightning_dpar.hf_weights.pretrained`, `lightning_dpar.experts.reader`) groups the
per-expert keys into their fused parameter (`group_experts`) and reads, for the block of the fused tensor a rank holds,
only the experts and rows it covers (`pieces`); `consolidate --format hf` splits a fused parameter back (`split_fused`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_dpar.helpers import show_names

__all__ = ["ExpertMerge", "ExpertPart", "FusedExperts", "Piece", "group_experts", "pieces", "split_fused"]


def _pattern(text: str, expert: bool) -> re.Pattern[str]:
    """`text` as a regex matching at the end of a name, on a name boundary; `*` (the expert index) a group."""
    body = re.escape(text).replace(r"\*", r"(\d+)") if expert else re.escape(text)
    boundary = "" if text.startswith(".") else r"(?:^|(?<=\.))"
    return re.compile(f"{boundary}{body}$")


@dataclass(frozen=True)
class ExpertMerge:
    """One rule: the per-expert tensors `sources` (one pattern per part, `*` the expert index, e.g.
    `mlp.experts.*.gate_proj.weight` then `mlp.experts.*.up_proj.weight`) make the fused parameter `target`
    (`mlp.experts.gate_up_proj`): expert `e`'s parts, concatenated on their dim 0 in this order, are `fused[e]`."""

    sources: tuple[str, ...]
    target: str

    def match(self, name: str) -> tuple[str, int, int] | None:
        """`(fused name, expert, part)` if `name` is one of this rule's per-expert tensors."""
        for part, source in enumerate(self.sources):
            found = _pattern(source, expert=True).search(name)
            if found is not None:
                return name[: found.start()] + self.target, int(found.group(1)), part
        return None

    def expert_names(self, fused_name: str, num_experts: int) -> list[list[str]] | None:
        """The per-expert names of `fused_name`, `[expert][part]`; None if it is not this rule's target."""
        found = _pattern(self.target, expert=False).search(fused_name)
        if found is None:
            return None
        head = fused_name[: found.start()]
        return [[head + source.replace("*", str(e)) for source in self.sources] for e in range(num_experts)]


@dataclass
class FusedExperts:
    """A fused expert parameter as a checkpoint stores it: `found[(expert, part)] = (key, shape)` of each per-expert
    tensor present, named as `name` is (the names `from_pretrained` gives them)."""

    name: str
    merge: ExpertMerge
    found: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def num_parts(self) -> int:
        return len(self.merge.sources)

    @property
    def num_experts(self) -> int:
        return 1 + max(expert for expert, _ in self.found)

    @property
    def first_key(self) -> str:
        """The key of the lowest expert's first part present: the tensor whose dtype the fused one takes."""
        return self.found[min(self.found)][0]

    @property
    def part_shape(self) -> tuple[int, ...]:
        """One expert's part as stored (`[I, H]` for `gate_proj`), taken from the lowest expert's first part."""
        return self.found[min(self.found)][1]

    @property
    def shape(self) -> tuple[int, ...]:
        """The fused shape these tensors make, `(experts, parts x rows, ...)`; `check` says whether they do."""
        rows, *rest = self.part_shape or (1,)
        return (self.num_experts, self.num_parts * rows, *rest)

    def key(self, expert: int, part: int) -> str:
        """The checkpoint key of expert `expert`'s part `part` (whether the checkpoint has it or not)."""
        if (expert, part) in self.found:
            return self.found[(expert, part)][0]
        names = self.merge.expert_names(self.name, expert + 1)
        return names[expert][part] if names is not None else f"{self.name}[{expert}, part {part}]"

    def check(
        self, model_shape: Sequence[int], file_name: Callable[[str], str] = str, model_name: str | None = None
    ) -> list[str]:
        """What keeps these tensors from filling the model's fused parameter of `model_shape` exactly: each missing,
        mis-shaped or surplus per-expert tensor, named as `file_name` gives it (its name in the files) with the shape
        expected. Empty when they fit. `model_name`: the parameter's name in the model (default `name`)."""
        model_shape, shown = tuple(model_shape), repr(model_name or self.name)
        if len(model_shape) < 2 or model_shape[1] % self.num_parts:
            keys = show_names(map(file_name, self._keys()), 3, bracketed=False, count_rest=True)
            return [
                f"{shown} {model_shape} cannot be made of {self.num_parts}-part experts like the checkpoint's {keys}"
            ]
        experts, rows = model_shape[0], model_shape[1] // self.num_parts
        expected = (rows, *model_shape[2:])
        missing, wrong = [], []
        for e in range(experts):
            for p in range(self.num_parts):
                key, shape = self.found.get((e, p), (self.key(e, p), None))
                if shape is None:
                    missing.append(file_name(key))
                elif tuple(shape) != expected:
                    wrong.append(f"{file_name(key)!r} is {tuple(shape)}")
        surplus = [file_name(key) for (e, _), (key, _) in sorted(self.found.items()) if e >= experts]
        what = f"{shown} {model_shape} is {experts} experts' {' then '.join(self._part_names())} of {expected} each"
        problems = []
        if missing:
            problems.append(
                f"{what}, but the checkpoint lacks {show_names(missing, 6, bracketed=False, count_rest=True)}"
            )
        if wrong:
            problems.append(f"{what}, but the checkpoint's {', '.join(wrong[:6])}{_more(wrong, 6)}")
        if surplus:
            extra = show_names(surplus, 6, bracketed=False, count_rest=True)
            problems.append(f"{what}, but the checkpoint has {self.num_experts} experts, beyond them {extra}")
        return problems

    def _keys(self) -> list[str]:
        return [key for _, (key, _) in sorted(self.found.items())]

    def _part_names(self) -> list[str]:
        return [source.rpartition("*.")[2].removesuffix(".weight") for source in self.merge.sources]


def _more(items: Sequence[object], shown: int) -> str:
    return f" and {len(items) - shown} more" if len(items) > shown else ""


def group_experts(
    shapes: Mapping[str, tuple[int, ...]], merges: Sequence[ExpertMerge]
) -> tuple[dict[str, tuple[int, ...]], dict[str, FusedExperts], list[str]]:
    """Replace the per-expert tensors among `shapes` (`{name: shape}`) by the fused parameters they make:
    `(shapes with each group as its fused name and shape, {fused name: FusedExperts}, conflicts)`. A conflict is a
    fused name the checkpoint also holds as one tensor (both layouts at once), which no load could resolve."""
    grouped: dict[str, tuple[int, ...]] = {}
    fused: dict[str, FusedExperts] = {}
    for name, shape in shapes.items():
        hit = next(((merge, m) for merge in merges if (m := merge.match(name)) is not None), None)
        if hit is None:
            grouped[name] = tuple(shape)
            continue
        merge, (target, expert, part) = hit
        fused.setdefault(target, FusedExperts(target, merge)).found[(expert, part)] = (name, tuple(shape))
    conflicts = [
        f"the checkpoint holds {name!r} both as one tensor and as per-expert tensors"
        f" ({show_names(group._keys(), 3, bracketed=False, count_rest=True)}): remove one of the two layouts"
        for name, group in fused.items()
        if name in grouped
    ]
    for name, group in fused.items():
        grouped.setdefault(name, group.shape)
    return grouped, fused, conflicts


@dataclass(frozen=True)
class Piece:
    """One per-expert tensor's share of a block of the fused tensor: read `key[source]`, write it to
    `block[dest]`."""

    key: str
    source: tuple[slice, ...]
    dest: tuple[int | slice, ...]


def pieces(group: FusedExperts, offsets: Sequence[int], lengths: Sequence[int]) -> list[Piece]:
    """The per-expert slices that make the block `[offsets[d] : offsets[d] + lengths[d]]` of the fused tensor: only
    the experts the block spans, and of each only the rows (and columns) inside it."""
    rows = group.part_shape[0]
    (e0, r0, *rest_offsets), (ne, nr, *rest_lengths) = offsets, lengths
    rest = tuple(slice(o, o + n) for o, n in zip(rest_offsets, rest_lengths))
    found = []
    for expert in range(e0, e0 + ne):
        for part in range(group.num_parts):
            start, stop = max(r0, part * rows), min(r0 + nr, (part + 1) * rows)
            if start < stop:
                source = (slice(start - part * rows, stop - part * rows), *rest)
                dest = (expert - e0, slice(start - r0, stop - r0), *(slice(None) for _ in rest))
                found.append(Piece(group.key(expert, part), source, dest))
    return found


@dataclass(frozen=True)
class ExpertPart:
    """Expert `expert`'s rows `[start, stop)` of the fused tensor `name`: one per-expert tensor of the export."""

    name: str
    expert: int
    start: int
    stop: int

    def shape(self, fused_shape: Sequence[int]) -> tuple[int, ...]:
        return (self.stop - self.start, *fused_shape[2:])

    def index(self) -> tuple[int, slice]:
        return self.expert, slice(self.start, self.stop)


def split_fused(
    name: str, shape: Sequence[int], merges: Sequence[ExpertMerge], source: str | None = None
) -> dict[str, ExpertPart] | None:
    """`{per-expert name: ExpertPart}` that store the fused parameter `name` of `shape` as checkpoints do, in order
    (expert 0's parts, then expert 1's, ...), reading from the tensor `source` (default `name`); None if `name` is no
    fused expert parameter."""
    for merge in merges:
        names = merge.expert_names(name, shape[0]) if len(shape) >= 2 else None
        if names is None or shape[1] % len(merge.sources):
            continue
        rows = shape[1] // len(merge.sources)
        return {
            names[e][p]: ExpertPart(source or name, e, p * rows, (p + 1) * rows)
            for e in range(shape[0])
            for p in range(len(merge.sources))
        }
    return None
