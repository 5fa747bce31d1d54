"""peft adapters (LoRA) under a tensor-parallel plan: the plan's entries reach the wrapped base layers, and each
adapter gets the layout that keeps training equal to one process.

`peft.get_peft_model` replaces every targeted `nn.Linear` with a `peft.tuners.lora.layer.Linear` that holds the
original layer as `base_layer` and computes `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`, and it moves
the whole model under `base_model.model.` of the `PeftModel`. A plan written for the base model (its own, from
`tp_plan="auto"`, or the user's) is adapted here, before it is resolved (`adapter_tp_plan`):

- a pattern that matches no module is tried with the peft prefix inserted (`net.model.layers.*.q_proj` ->
  `net.base_model.model.model.layers.*.q_proj`);
- an entry that reaches a LoRA layer (or its `base_layer`) goes to the `base_layer`, and the adapters get:

  ========================  ===========================  ==================================================
  base layer                 lora_A  [r, in]              lora_B  [out, r]
  ========================  ===========================  ==================================================
  column-wise (input whole)  replicated                   column-wise, output laid out as the base's
  row-wise (output whole)    row-wise (its partial sum    replicated
                             of r values all-reduced)
  ========================  ===========================  ==================================================

Why exact. Column-wise: `x` is whole on every tensor-parallel rank, so `lora_A(x)` is whole, and `lora_B`'s shard
of output features adds to the base's shard of the same features; backward, `lora_B`'s input gradient is summed
over the ranks by its style (as the base's is), so `lora_A` gets the whole gradient on every rank. Row-wise: rank
`i` holds the input features `x_i` and `lora_A`'s columns `A_i`; `x A^T = sum_i x_i A_i^T` is all-reduced by
`lora_A`'s style (r values per token), then `lora_B` maps it on every rank; the base's partial sum is all-reduced
once by its own style, the LoRA term once by `lora_A`'s, and neither is reduced twice or missed. `scaling` is a
scalar, so it commutes with both.

Refused, with the reason and the fix, before any collective: dropout on the adapter (`lora_dropout > 0`: each
tensor-parallel rank would draw its own mask, on a shard of the features or on a copy of the input, so the ranks'
copies of the adapter drift apart and the masks are not those of one process), LoRA variants (DoRA's magnitude
needs the whole weight's norm), adapters of other module types (embeddings, convolutions) and base styles with
sequence-sharded inputs or outputs (a replicated adapter on a shard of the tokens would need its gradient summed).

Pure and cheap (works on a meta model); peft is not imported: classes are recognised by their qualified names.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_dpar.helpers import class_name
from lightning_dpar.plan.selectors import fqn_matches
from lightning_dpar.plan.styles import NamedStyle, PlanStyle

__all__ = [
    "AdapterLayoutError",
    "adapter_styles",
    "adapter_tp_plan",
    "base_name_prefixes",
    "is_tuner_layer",
]

TUNER_LAYER = "peft.tuners.tuners_utils.BaseTunerLayer"
TUNER = "peft.tuners.tuners_utils.BaseTuner"
PEFT_MODEL = "peft.peft_model.PeftModel"
LORA_LINEAR = "peft.tuners.lora.layer.Linear"


class AdapterLayoutError(ValueError):
    """A tensor-parallel plan reaches a peft adapter whose layout cannot keep training equal to one process."""


def _is(module: nn.Module, qualified: str) -> bool:
    return any(class_name(cls) == qualified for cls in type(module).__mro__)


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether `module` is a peft tuner layer (it wraps a `base_layer` and holds adapters), checked by class name."""
    return _is(module, TUNER_LAYER)


def base_name_prefixes(root: nn.Module) -> list[tuple[str, str]]:
    """`(name before get_peft_model, name after)` of every model peft wrapped inside `root`: a `PeftModel` at `p`
    holds the model at `p.base_model.model`; a bare tuner (`LoraModel`) at `t` at `t.model`."""
    modules = dict(root.named_modules())
    prefixes = []
    for fqn, module in modules.items():
        if not _is(module, TUNER) or not isinstance(getattr(module, "model", None), nn.Module):
            continue
        parent, _, attribute = fqn.rpartition(".")
        under_peft_model = attribute == "base_model" and _is(modules[parent], PEFT_MODEL)
        prefixes.append((parent if under_peft_model else fqn, f"{fqn}.model" if fqn else "model"))
    return prefixes


def _with_prefix(pattern: str, before: str, after: str) -> str | None:
    """`pattern` with the leading name `before` replaced by `after`; `None` if it does not start with `before`."""
    if not before:
        return f"{after}.{pattern}"
    head = before.split(".")
    atoms = pattern.split(".")
    if len(atoms) <= len(head) or atoms[: len(head)] != head:
        return None
    return ".".join([after, *atoms[len(head) :]])


def _for_wrapped_names(root: nn.Module, pattern: str, names: list[str], prefixes: list[tuple[str, str]]) -> str:
    """`pattern`, or, when it matches no module, its base-model name moved under the peft wrapper that matches."""
    if any(fqn_matches(pattern, fqn) for fqn in names):
        return pattern
    for before, after in prefixes:
        moved = _with_prefix(pattern, before, after)
        if moved is not None and any(fqn_matches(moved, fqn) for fqn in names):
            return moved
    return pattern  # matches nothing: `resolve_tp_plan` says so, with examples of the names


def _tuner_of(fqn: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The tuner layer an entry at `fqn` is about: the module itself, or the one whose `base_layer` it is."""
    if is_tuner_layer(modules[fqn]):
        return fqn
    parent, _, attribute = fqn.rpartition(".")
    if attribute == "base_layer" and parent in modules and is_tuner_layer(modules[parent]):
        return parent
    return None


def adapter_tp_plan(root: nn.Module, plan: Mapping[str, PlanStyle]) -> dict[str, PlanStyle]:
    """`plan` for a model with peft adapters: base-model names moved under the wrapper, entries on LoRA layers moved
    to their `base_layer`, and the adapters' own entries added (see the module docstring). Unchanged for a model
    without peft. Entries the plan gives an adapter module itself are kept as given."""
    modules = dict(root.named_modules())
    prefixes = base_name_prefixes(root)
    if not prefixes and not any(is_tuner_layer(m) for m in modules.values()):
        return dict(plan)
    names = [fqn for fqn in modules if fqn]
    adapted: dict[str, PlanStyle] = {}
    tuners: dict[str, PlanStyle] = {}  # tuner layer -> the style its base layer gets
    for pattern, spec in plan.items():
        pattern = _for_wrapped_names(root, pattern, names, prefixes)
        hits = [fqn for fqn in names if fqn_matches(pattern, fqn)]
        reached = {fqn: _tuner_of(fqn, modules) for fqn in hits}
        if not any(reached.values()):
            adapted[pattern] = spec
            continue
        for fqn, tuner in reached.items():
            target = fqn if tuner is None else f"{tuner}.base_layer"
            if target in adapted:
                raise ValueError(
                    f"Module {target!r} is reached by tp_plan pattern {pattern!r} and by another pattern (directly or"
                    " through its peft wrapper); make the patterns disjoint."
                )
            adapted[target] = spec
            if tuner is not None:
                tuners[tuner] = spec
    for tuner, spec in tuners.items():
        base = modules[f"{tuner}.base_layer"]
        style = spec.build(base) if isinstance(spec, NamedStyle) else spec
        if style is None:
            continue
        for fqn, adapter_style in adapter_styles(tuner, modules[tuner], style).items():
            if not any(fqn_matches(pattern, fqn) for pattern in adapted):
                adapted[fqn] = adapter_style
    return adapted


def adapter_styles(fqn: str, layer: nn.Module, base_style: ParallelStyle) -> dict[str, ParallelStyle]:
    """The styles of the adapter modules of the tuner layer `layer` at `fqn` whose base layer gets `base_style`:
    `{adapter module name: style}`; an adapter module left out stays replicated. Raises `AdapterLayoutError` for
    what cannot be exact (see the module docstring)."""
    where = f"tp_plan gives the base layer of {fqn!r} {type(base_style).__name__}"
    if not _is(layer, LORA_LINEAR) or not isinstance(layer.get_base_layer(), nn.Linear):
        raise AdapterLayoutError(
            f"{where}, but {fqn!r} is a {class_name(layer)} wrapping a {class_name(layer.get_base_layer())}: adapters"
            f" under tensor parallelism are laid out for LoRA on Linear layers ({LORA_LINEAR}) only. Leave {fqn!r} out"
            " of the tp_plan (or give it 'replicate'), or leave it out of the adapter's `target_modules`."
        )
    styles: dict[str, ParallelStyle] = {}
    for adapter in layer.lora_A:
        if adapter in getattr(layer, "lora_variant", {}):
            raise AdapterLayoutError(
                f"{where}, and its adapter {adapter!r} is a LoRA variant"
                f" ({class_name(layer.lora_variant[adapter])}, e.g. DoRA), whose weight norm needs the whole weight"
                " on every rank. Use plain LoRA (`use_dora=False`), or leave the module out of the tp_plan."
            )
        dropout = layer.lora_dropout[adapter]
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise AdapterLayoutError(
                f"{where}, and its adapter {adapter!r} has `lora_dropout={dropout.p}`: each tensor-parallel rank"
                " would draw its own dropout mask, on its shard of the input features or on its copy of the input,"
                " so the ranks' copies of the adapter would drift apart. Use `LoraConfig(lora_dropout=0.0)` with"
                " tensor parallelism, or train without it (dpar_fsdp / dpar_replicate)."
            )
        styles.update(_lora_styles(fqn, adapter, base_style, where))
    return styles


def _lora_styles(fqn: str, adapter: str, base: ParallelStyle, where: str) -> dict[str, ParallelStyle]:
    if type(base) is ColwiseParallel:
        if base.input_layouts != (Replicate(),):
            raise AdapterLayoutError(
                f"{where} with input layout {base.input_layouts[0]}: the replicated lora_A would see a shard of the"
                " tokens and need its gradient summed over the tensor-parallel ranks. Give the base layer a"
                " column-wise style with a whole input ('colwise'), or leave it out of the tp_plan."
            )
        return {
            f"{fqn}.lora_B.{adapter}": ColwiseParallel(
                input_layouts=Replicate(), output_layouts=base.output_layouts[0], use_local_output=base.use_local_output
            )
        }
    if type(base) is RowwiseParallel:
        if base.output_layouts != (Replicate(),) or not base.use_local_output:
            raise AdapterLayoutError(
                f"{where} with output layout {base.output_layouts[0]}: the replicated lora_B needs the whole output"
                " as a plain tensor. Give the base layer a row-wise style with a replicated output ('rowwise'), or"
                " leave it out of the tp_plan."
            )
        if base.input_layouts not in ((Shard(-1),), (Replicate(),)):
            raise AdapterLayoutError(
                f"{where} with input layout {base.input_layouts[0]}; lora_A can follow an input sharded on its last"
                " dim or whole only. Use 'rowwise' or 'rowwise_split_input', or leave it out of the tp_plan."
            )
        return {f"{fqn}.lora_A.{adapter}": RowwiseParallel(input_layouts=base.input_layouts[0])}
    raise AdapterLayoutError(
        f"{where}; adapters are laid out for ColwiseParallel and RowwiseParallel base layers only. Give the base layer"
        " 'colwise' or 'rowwise', or leave it out of the tp_plan."
    )
