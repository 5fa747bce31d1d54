"""Hugging Face `transformers` tensor-parallel plans, as data: the style names transformers writes in
`config.base_model_tp_plan` and `model._tp_plan`, mapped to torch `ParallelStyle`s, and the plan of the
`transformers` model a LightningModule holds (`tp_plan="auto"`), with names prefixed by where that model sits. The
style names themselves are in the one registry, `lightning_dpar.plan.styles`.

transformers' attention reshapes with `-1` heads (`view(*input_shape, -1, head_dim)`), so column-wise q/k/v
projections give each rank `heads / tp` query heads and `kv_heads / tp` key/value heads with the same GQA ratio; the
plan resolution checks that the tensor-parallel size divides both head counts of the model's config.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_dpar._private_api import transformers_tp_plan_attribute
from lightning_dpar.helpers import class_name, transformers_models
from lightning_dpar.plan.selectors import fqn_matches, pattern_reaches
from lightning_dpar.plan.styles import HF_STYLES, UNSUPPORTED_HF_STYLES

__all__ = [
    "EXPERTS_STYLES",
    "check_style_supported",
    "model_tp_plan",
    "transformers_experts",
    "transformers_tp_plan",
]

#: The styles a transformers model's `base_model_ep_plan` gives its experts modules: `"ep_dispatch_experts"` in
#: transformers 5.24, `"moe_tp_experts"` in 5.17 (the GPU images' version; its EP plan also names the router,
#: `"ep_router"`, which is not an experts module). Checked on 5.17.0 and 5.24.0.
EXPERTS_STYLES = ("ep_dispatch_experts", "moe_tp_experts")


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """A transformers model's own plan, relative to the model: `model._tp_plan` (the whole model's, merged by
    `post_init`), else `config.base_model_tp_plan` under the base model's attribute."""
    plan = transformers_tp_plan_attribute(model)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{key}": style for key, style in base_plan.items()}
    return dict(base_plan)


def transformers_tp_plan(root: nn.Module, leave_out: Sequence[str] = ()) -> dict[str, str] | None:
    """The tensor-parallel plan of the transformers model(s) `root` holds, with names relative to `root`; `None` if
    it holds none or they have no plan. Left out: entries reaching into a `leave_out` module (experts that expert
    parallelism splits: the model's `base_model_ep_plan` covers them), and entries naming nothing in this model (a
    family's plan covers its variants: Qwen3-MoE's plan names the dense `mlp.gate_proj` of `mlp_only_layers` too).
    An unsupported style is an error naming it and the model (no collective has run yet: this is pure)."""
    plan: dict[str, str] = {}
    names = [name for name, _ in root.named_modules()] + [name for name, _ in root.named_parameters()]
    for fqn, model in transformers_models(root):
        for key, style in model_tp_plan(model).items():
            name = f"{fqn}.{key}" if fqn else key
            if pattern_reaches(name, leave_out) or not any(fqn_matches(name, held) for held in names):
                continue
            check_style_supported(style, key, class_name(model))
            plan[name] = style
    return plan or None


def transformers_experts(root: nn.Module) -> list[str] | None:
    """The experts modules the transformers model(s) in `root` mark in their `base_model_ep_plan` (style
    `ep_dispatch_experts`), as module-name patterns relative to `root`; `None` if no model has such a plan."""
    patterns: list[str] = []
    for fqn, model in transformers_models(root):
        plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        base = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        for key, style in plan.items():
            if style in EXPERTS_STYLES:
                patterns.append(f"{fqn}.{base}{key}" if fqn else f"{base}{key}")
    return patterns or None


def check_style_supported(style: object, key: str, model_name: str) -> None:
    if isinstance(style, str) and style.lower() in HF_STYLES:
        return
    reason = " (packed / expert-parallel weights)" if style in UNSUPPORTED_HF_STYLES else ""
    experts = (
        " For a Mixture-of-Experts model, set `expert_parallel_size` (the experts are then split between ranks and"
        " the plan's expert entries left out), or"
        if style in UNSUPPORTED_HF_STYLES
        else ""
    )
    raise ValueError(
        f"{model_name}'s tensor-parallel plan gives {key!r} the transformers style {style!r}, which lightning_dpar"
        f" does not support{reason}. Supported styles: {sorted(HF_STYLES)}.{experts} Pass your own `tp_plan`"
        " (module-name pattern -> style) to the strategy instead of 'auto'."
    )
