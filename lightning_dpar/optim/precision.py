"""Trainer precision mapped onto the parallel wrappers.

`"bf16-mixed"` means bf16 compute, fp32 master weights and fp32 gradient reduction. Under `fully_shard` that is
FSDP2's `MixedPrecisionPolicy` (params are cast when all-gathered; no autocast on top, which would cast twice and
keep fp32 copies alive). The DDP-style `replicate` wrapper has no such policy, so there autocast does the job.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning_dpar.optim.clipping as clipping
from lightning_dpar.optim.nonfinite import NonFiniteGuard

__all__ = [
    "DparPrecision",
    "PrecisionName",
    "to_dpar_precision",
]

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed"}


class DparPrecision(Precision):
    """Precision plugin for the package's strategies; also owns mesh-aware gradient clipping."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = _ALIASES.get(str(precision), str(precision))
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"`precision={precision!r}` (Trainer or Fabric) is not supported by the lightning_dpar strategies. Use"
                f" one of {list(SUPPORTED_PRECISION)}; fp16 needs a sharded grad scaler, use 'bf16-mixed' instead."
            )
        self.precision: PrecisionName = precision  # type: ignore[assignment]
        #: Device type to autocast on (`autocast_on`), only when the wrapper cannot apply bf16-mixed itself
        #: (DDP-style replicate). `None`: the wrapper (FSDP2's MixedPrecisionPolicy) handles it.
        self._autocast_device_type: str | None = None
        self._clipper = clipping.GradientClipper()
        #: The strategy's non-finite guard (`optim.nonfinite`), whose flags gradient-norm clipping agrees on.
        self.nonfinite: NonFiniteGuard | None = None

    def mixed_precision_policy(self, root_unit: bool = False) -> MixedPrecisionPolicy:
        """Policy for a `fully_shard` unit. Root units return fp32 outputs so the loss is computed in fp32."""
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                output_dtype=torch.float32 if root_unit else None,
            )
        return MixedPrecisionPolicy()

    @property
    def true_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16-true" else None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.true_dtype) if self.true_dtype is not None else module

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        if self.true_dtype is None:
            yield
            return
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.true_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default_dtype)

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    def forward_context(self) -> Any:
        if self.precision == "bf16-mixed" and self._autocast_device_type is not None:
            return torch.autocast(device_type=self._autocast_device_type, dtype=torch.bfloat16)
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        if self.true_dtype is None:
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self.true_dtype) if torch.is_floating_point(t) else t
        )

    def convert_output(self, data: Any) -> Any:
        """Floating-point outputs of a forward run under autocast (bf16-mixed on a DDP-style replicate) in the
        default dtype, as Lightning's own mixed precision returns them: a loss computed outside the forward (in a
        Fabric loop) is then fp32, as under FSDP2, whose root unit returns fp32 (torch 2.11's `mse_loss` cannot
        even backpropagate a bf16 output against fp32 targets). Outputs of other precisions are left as they are."""
        if self.precision != "bf16-mixed" or self._autocast_device_type is None:
            return data
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def autocast_on(self, device_type: str) -> None:
        """Run `bf16-mixed` forwards under `torch.autocast` on `device_type`: for a data-parallel wrapper that does
        not apply mixed precision itself (DDP-style replicate)."""
        self._autocast_device_type = device_type

    def reduce_norms_across(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Gradient norms also sum over `group` (the pipeline stages), whose ranks hold different parameters; a rank
        without gradients takes part with zero, on `device`. Called once the model is parallelised, before any step
        (the new clipper has no cached layout to lose)."""
        self._clipper = clipping.GradientClipper(across=(group,), device=device)

    def clip_grad_by_norm(self, optimizer: Optimizable, clip_val: int | float) -> None:
        """With the non-finite guard, its flags are agreed on along the norm's reductions, and its verdict runs
        before any gradient is scaled."""
        guard = self.nonfinite
        step = guard.pending if guard is not None else None
        if guard is None or step is None or not step.deferred or step.decided:
            self.clip_norm(optimizer, clip_val)
            return
        self._clipper.clip_grad_norm_(
            self.main_params(optimizer), float(clip_val), fold=step.flags, before_scaling=guard.decide
        )

    def clip_norm(self, optimizer: Optimizable, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale `optimizer`'s gradients so their norm over every mesh is at most `max_norm`; returns the norm before
        clipping (Fabric's `clip_gradients` returns it, `lightning_dpar.fabric`)."""
        return self._clipper.clip_grad_norm_(self.main_params(optimizer), float(max_norm), float(norm_type))

    def clip_grad_by_value(self, optimizer: Optimizable, clip_val: int | float) -> None:
        self._clipper.clip_grad_value_(self.main_params(optimizer), float(clip_val))


def to_dpar_precision(plugin: Precision | None) -> DparPrecision | None:
    """Translate the plugin Lightning's accelerator connector picked from `Trainer(precision=...)`."""
    if plugin is None or isinstance(plugin, DparPrecision):
        return plugin
    if type(plugin) is Precision:
        return DparPrecision("32-true")
    return DparPrecision(getattr(plugin, "precision", type(plugin).__name__))
