"""float8 training as one step of the parallelisation (`STEP`, in `lightning_dpar.parallel.parallelize.STEPS` after
the pipeline split and before tensor parallelism, as torchtitan converts the model before it parallelises it): its
slice of the plan (`plan_float8`: the `nn.Linear` modules converted to torchao's `Float8Linear`, found once, with every
refusal before any collective) and how it is applied (`apply_float8`: torchao's `convert_to_float8_training` on
exactly those modules). Everything else outside this folder knows of it is its option (`float8=`, `float8_skip=`)
and its `ModulePlan` fields (`float8`, the converted modules' names; `float8_config`, torchao's config).

Tensor parallelism then shards the converted modules with the plan's own styles (torch's `ColwiseParallel` /
`RowwiseParallel`): a `Float8Linear` is an `nn.Linear`, and its float8 casts run on the DTensor weight and input,
with scales of the whole tensor or row. torchao's float8 styles (`Float8ColwiseParallel`, ...) all-gather
activations in float8 with tensorwise scales; torchtitan uses them for the tensorwise recipe only, and the
tensorwise recipe under tensor parallelism is refused here (not exact against one process; docs/efficiency.md)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lightning_dpar._private_api import float8_linear_class
from lightning_dpar.float8.config import Float8Options, fitted_to_device, torchao_float8
from lightning_dpar.helpers import is_under, show_names
from lightning_dpar.loss_parallel.step import output_layer_candidate
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.steps.contract import Applying, Planning, Step

__all__ = [
    "ADAPTER_NAMES",
    "FLOAT8_MULTIPLE",
    "STEP",
    "Float8Plan",
    "ModelFactsRead",
    "ModulePlanRead",
    "PlanOptionsRead",
    "apply_float8",
    "converted_modules",
    "convertible_linears",
    "layout_refusal",
    "plan_float8",
]

#: float8 matmuls (`torch._scaled_mm`) need both of a Linear's dimensions to be multiples of 16.
FLOAT8_MULTIPLE = 16
#: The names under which peft keeps a LoRA layer's adapters (`nn.ModuleDict`s of `nn.Linear`): adapters stay in high
#: precision (their rank is small, and float8's rounding would swamp their small updates); the frozen base layer is
#: converted like any Linear.
ADAPTER_NAMES = ("lora_A", "lora_B")


@runtime_checkable
class PlanOptionsRead(Protocol):
    """What the float8 step reads of the strategy's `PlanOptions`: its option and the strategy's name (refusals
    name the call)."""

    @property
    def float8(self) -> Float8Options | None: ...

    @property
    def strategy(self) -> str: ...


@runtime_checkable
class ModelFactsRead(Protocol):
    """What it reads of the model's facts (`ModelFacts`): whether the model was parallelised by its own
    `configure_model`, and the experts modules (refused inside)."""

    @property
    def adopted(self) -> bool: ...

    @property
    def experts(self) -> list[str]: ...


@runtime_checkable
class ModulePlanRead(Protocol):
    """What it reads of the plan (`ModulePlan`) when it applies it: its slice."""

    @property
    def float8(self) -> list[str]: ...

    @property
    def float8_config(self) -> Any: ...


@dataclass(frozen=True)
class Float8Plan:
    """The `nn.Linear` modules converted to float8 (in module order; empty: none) and torchao's config for them."""

    modules: list[str] = field(default_factory=list)
    config: Any = None


def plan_float8(
    module: nn.Module,
    dims: ParallelDims,
    options: Float8Options | None,
    strategy: str,
    *,
    adopted: bool = False,
    experts: Sequence[str] = (),
) -> Float8Plan:
    """The step's slice of the plan: every `nn.Linear` of `module` but those kept in high precision (the skip
    patterns, by default the output layer; a LoRA layer's adapters; and any whose dimensions, or their
    tensor-parallel shards, are not multiples of 16). Refused here, before any collective, each naming the value
    and the fix: the tensorwise recipe under tensor parallelism, pipeline and context parallelism (not proven
    exact), a model parallelised by its own `configure_model`, a model holding `Float8Linear` modules already, a
    Linear inside an experts module, and a skip pattern that matches no module."""
    if options is None:
        return Float8Plan()
    call = f"`{strategy}(float8={options.setting})`"
    _check_layout(call, options, dims, adopted)
    names = {fqn: child for fqn, child in module.named_modules() if fqn}
    already = [fqn for fqn, child in names.items() if isinstance(child, float8_linear_class())]
    if already:
        raise ValueError(
            f"{call}: {show_names(already)} are torchao `Float8Linear` modules already (converted before `fit`);"
            " the strategy converts the model itself, at its place in the parallelisation. Remove your own"
            " `convert_to_float8_training` call, or drop `float8=` to train the model as you converted it."
        )
    converted = convertible_linears(module, options.skip, dims.tensor_parallel, call)
    inside = [fqn for fqn in converted if is_under(fqn, experts)]
    if inside:
        raise ValueError(
            f"{call} would convert {show_names(inside)}, inside the experts modules {show_names(experts)}: float8"
            " for experts (torchao's grouped float8 matmuls) is not supported here. Keep them in high precision"
            f" with `float8_skip=[{', '.join(repr(f'{e}.*') for e in experts)}]`, or drop `float8=`."
        )
    return Float8Plan(converted, options.config)


def layout_refusal(tensorwise: bool, dims: ParallelDims) -> str | None:
    """Why float8 cannot train on the layout `dims` (`tensorwise`: the recipe scales tensor by tensor), with the fix,
    or None if it can: what `plan_float8` refuses, and the layouts the layout search leaves out under `float8=`."""
    if dims.tensor_parallel > 1 and tensorwise:
        return (
            f"with `tensor_parallel_size={dims.tensor_parallel}`: the tensorwise recipe's scales under"
            " tensor parallelism (torchao's float8 styles, as torchtitan applies them) are not exact against one"
            " process (measured: 5.8e-4 after 3 steps of a small MLP, where float8's noise floor is 3e-8;"
            " docs/efficiency.md), so it is refused."
            " Use `float8='rowwise'` (or 'rowwise_with_gw_hp') with tensor parallelism, or the tensorwise recipe"
            " with `tensor_parallel_size=1`."
        )
    for name, size in (
        ("pipeline_parallel_size", dims.pipeline),
        ("context_parallel_size", dims.context),
    ):
        if size > 1:
            return (
                f"with `{name}={size}` is not supported: float8 training is proven exact against one process"
                f" under FSDP and tensor parallelism only. Use `{name}=1` with float8, or drop `float8=`."
            )
    return None


def _check_layout(call: str, options: Float8Options, dims: ParallelDims, adopted: bool) -> None:
    tensorwise = options.config.cast_config_input.scaling_granularity.name == "TENSORWISE"
    refusal = layout_refusal(tensorwise, dims)
    if refusal is not None:
        raise ValueError(f"{call} {refusal}")
    if adopted:
        raise ValueError(
            f"{call}: the model was parallelised by its own `configure_model` (adopted as it is), and float8"
            " conversion must come before tensor parallelism. Convert it yourself in `configure_model` (torchao's"
            " `convert_to_float8_training` before `parallelize_module`) and drop `float8=`, or give a `tp_plan`"
            " and let the strategy parallelise it."
        )


def convertible_linears(
    module: nn.Module, skip: Sequence[str] | None, tensor_parallel: int = 1, call: str = "`float8_skip`"
) -> list[str]:
    """The `nn.Linear` modules of `module` float8 converts, in module order: all but those the skip patterns keep in
    high precision (`float8_skip=`; None: the output layer), a LoRA layer's adapters, and those whose dimensions, or
    their shards over `tensor_parallel` ranks, are not multiples of 16. No refusal but a skip pattern matching no
    module (named after `call`); `plan_float8` adds the others. The layout search prices these modules' matmuls."""
    names = {fqn: child for fqn, child in module.named_modules() if fqn}
    skipped = set(_skipped(call, module, names, None if skip is None else tuple(skip)))
    return [
        fqn
        for fqn, child in names.items()
        if type(child) is nn.Linear and fqn not in skipped and _fits(child, tensor_parallel) and not _is_adapter(fqn)
    ]


def _skipped(call: str, root: nn.Module, names: dict[str, nn.Module], skip: tuple[str, ...] | None) -> list[str]:
    """The modules kept in high precision by the skip patterns (and everything inside them); by default the output
    layer (a transformers model's output embeddings, else the last `nn.Linear`)."""
    if skip is None:
        output = output_layer_candidate(root)
        return [] if output is None else [output]
    matched = []
    for pattern in skip:
        hits = [fqn for fqn in names if fnmatch.fnmatchcase(fqn, pattern)]
        if not hits:
            raise ValueError(
                f"{call}: `float8_skip` pattern {pattern!r} matches no module. Module names look like"
                f" {show_names(names)}; patterns are fnmatch globs of whole names, relative to the LightningModule."
            )
        matched += hits
    return [fqn for fqn in names if is_under(fqn, matched)]


def _is_adapter(fqn: str) -> bool:
    return any(part in ADAPTER_NAMES for part in fqn.split("."))


def _fits(linear: nn.Module, tensor_parallel: int) -> bool:
    """Whether both dimensions are multiples of 16, and so is each tensor-parallel shard of either (the slice is
    made before tensor parallelism, which may split either)."""
    assert isinstance(linear, nn.Linear)
    for size in (linear.in_features, linear.out_features):
        if size % FLOAT8_MULTIPLE or (
            tensor_parallel > 1 and (size % tensor_parallel or (size // tensor_parallel) % FLOAT8_MULTIPLE)
        ):
            return False
    return True


def apply_float8(root: nn.Module, part: Float8Plan, device: torch.device) -> None:
    """Swap each of `part.modules` for torchao's `Float8Linear` (`convert_to_float8_training` with a filter naming
    exactly them), in place: parameter names and checkpoint keys are unchanged. The config is fitted to `device`
    (`fitted_to_device`: FSDP's float8 all-gather only on CUDA)."""
    if not part.modules:
        return
    float8 = torchao_float8("float8=")
    wanted = set(part.modules)
    float8.convert_to_float8_training(
        root, module_filter_fn=lambda module, fqn: fqn in wanted, config=fitted_to_device(part.config, device)
    )
    assert converted_modules(root) == part.modules, "the conversion converted the planned modules"


def converted_modules(root: nn.Module) -> list[str]:
    """The names of `root`'s torchao `Float8Linear` modules, in module order (none if torchao is not installed)."""
    try:
        cls = float8_linear_class()
    except ImportError:
        return []
    return [fqn for fqn, module in root.named_modules() if isinstance(module, cls)]


def _plan(planning: Planning) -> Mapping[str, Any]:
    """The Linear modules converted to float8 (none without `float8=`), every refusal before any collective."""
    options: PlanOptionsRead = planning.options
    facts: ModelFactsRead = planning.facts
    part = plan_float8(
        planning.module, planning.dims, options.float8, options.strategy, adopted=facts.adopted, experts=facts.experts
    )
    return {"float8": part.modules, "float8_config": part.config}


def _apply(root: nn.Module, plan: ModulePlanRead, applying: Applying) -> None:
    """torchao's `Float8Linear` swapped in for the planned modules, before tensor parallelism shards them."""
    apply_float8(root, Float8Plan(plan.float8, plan.float8_config), applying.meshes.device)


#: float8 training: after the pipeline split, before tensor parallelism.
STEP = Step("float8", _plan, _apply)
