"""Tensor-parallel styles by name: ONE registry for this package's names (`colwise`, `rowwise`,
`sequence_parallel`) and the names transformers writes in `config.base_model_tp_plan` and `model._tp_plan`
(`colwise_gather_output`, `embedding_rowwise`, ...), each mapped to a builder of the torch `ParallelStyle`; and the
parsing of a user's `tp_plan` (`{module-name pattern: style}`) against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = [
    "AUTO",
    "HF_STYLES",
    "STYLES",
    "STYLE_NAMES",
    "UNSUPPORTED_HF_STYLES",
    "NamedStyle",
    "PlanStyle",
    "StyleBuilder",
    "StyleSpec",
    "TPPlanSpec",
    "parse_style",
    "parse_tp_plan",
    "rowwise_style",
]

StyleSpec = Union[str, ParallelStyle]
#: `{module-name pattern: style}`, or `"auto"`: the plan of the transformers model the LightningModule holds.
TPPlanSpec = Union[Mapping[str, StyleSpec], str]
AUTO = "auto"

#: Builds a style for one module: a named style can depend on the module (row-wise on an `nn.Embedding` shards the
#: vocabulary and keeps the token ids whole). `None` means "leave this module unsharded".
StyleBuilder = Callable[[nn.Module], ParallelStyle | None]


def rowwise_style(module: nn.Module) -> ParallelStyle:
    """Row-wise: split a Linear's input features, or an Embedding's vocabulary rows with the token ids whole."""
    # An embedding's input is token ids, which cannot be split along a hidden dim: keep them whole (torchtitan's
    # layout for token embeddings); each rank looks up its vocabulary rows and the partial sums are all-reduced.
    return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()


def _replicate_with_grad_sum(module: nn.Module) -> SequenceParallel:
    # Per-head norms (Qwen3 / Gemma3 `q_norm`, `k_norm`) see only this rank's heads, on the second-to-last dim of
    # their input: replicated weights on a heads-sharded input; DTensor sums their partial gradients over the
    # tensor-parallel ranks, as transformers' `ReplicatedWithGradAllReduce` does by hand.
    return SequenceParallel(sequence_dim=-2, use_local_output=True)


#: Every style name -> builder of its torch style (`None`: keep the module whole on every rank).
STYLES: dict[str, StyleBuilder] = {
    "colwise": lambda module: ColwiseParallel(),
    "rowwise": rowwise_style,
    "sequence_parallel": lambda module: SequenceParallel(),
    "colwise_gather_output": lambda module: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda module: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda module: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda module: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda module: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda module: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "replicated_with_grad_allreduce": _replicate_with_grad_sum,
    "replicate": lambda module: None,
}
#: This package's own names.
STYLE_NAMES = frozenset({"colwise", "rowwise", "sequence_parallel"})
#: The names a transformers model's plan may use (`colwise` and `rowwise` mean the same in both; none of the
#: supported model families uses `sequence_parallel`, which transformers' plans do not accept here).
HF_STYLES = frozenset(STYLES) - {"sequence_parallel"}

#: transformers styles with no torch equivalent here (packed expert weights, expert parallelism, MLA projections).
UNSUPPORTED_HF_STYLES = (
    "packed_colwise",
    "packed_rowwise",
    "moe_tp_experts",
    "moe_identity_expert",
    "mla_kv_a_proj",
    "all_reduce",
    "local_params",
)


@dataclass(frozen=True)
class NamedStyle:
    """A style given by name (ours, or a `transformers` style name): built per module when the plan is resolved."""

    name: str
    build: StyleBuilder

    def __repr__(self) -> str:
        return repr(self.name)


PlanStyle = Union[NamedStyle, ParallelStyle]


def parse_style(pattern: str, spec: StyleSpec) -> PlanStyle:
    """A style from a name (`"colwise"`, `"rowwise"`, `"sequence_parallel"`, or a `transformers` style name such as
    `"colwise_gather_output"`) or a `ParallelStyle` instance, used as given."""
    if isinstance(spec, (ParallelStyle, NamedStyle)):
        return spec
    if isinstance(spec, str) and spec.lower() in STYLES:
        return NamedStyle(spec.lower(), STYLES[spec.lower()])
    raise ValueError(
        f"tp_plan[{pattern!r}] = {spec!r} is not a tensor-parallel style. Use one of {sorted(STYLES)} or a"
        " `torch.distributed.tensor.parallel.ParallelStyle` instance (in YAML: a `class_path` entry)."
    )


def parse_tp_plan(plan: TPPlanSpec | None) -> dict[str, PlanStyle] | None:
    """Validate a user plan's keys and styles; `None` stays `None` (no plan from this source)."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        if plan == AUTO:
            raise ValueError(f"tp_plan={AUTO!r} is resolved against the model; this function takes a mapping.")
        raise TypeError(f"`tp_plan` must map module-name patterns to styles, got {type(plan).__name__}: {plan!r}.")
    parsed = {}
    for pattern, spec in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"tp_plan key {pattern!r} must be a non-empty module-name pattern such as 'layers.*.fc1'.")
        parsed[pattern] = parse_style(pattern, spec)
    return parsed
