"""How a trace of one training step (`lightning_dpar.estimates.activation_trace`) follows tensor parallelism on the
unsplit model, without a process group: each storage carries a flag, "split over the tensor-parallel ranks", which a
style's layouts set (a column-wise Linear's output, the local chunk of a `Replicate -> Shard` redistribution, a
reduce-scatter's output) and clear where the rank holds the whole tensor (a row-wise Linear's partial output, an
all-reduce or all-gather, which make new full-size tensors). The redistributions are traced as the new tensors they
are (a clone on the fake device), so an all-gathered input saved by a Linear counts whole, as DTensor keeps it.

The trace's recorder keeps the flags; this module reads and sets them through `Marks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_dpar._private_api import tree_leaves, tree_map

__all__ = ["Marks", "Redistribution", "hook_style"]


class Marks(Protocol):
    """Where a trace keeps each storage's split flag."""

    def mark(self, tensor: torch.Tensor, split: bool) -> None:
        """Flag `tensor`'s storage as split over the tensor-parallel ranks, or whole."""


class Redistribution:
    """A tensor-parallel style's layouts applied to the traced tensors: a redistribution that makes a new tensor is
    traced as a clone whose split flag is the target layout's."""

    def __init__(self, recorder: Marks) -> None:
        self.recorder = recorder

    def __call__(self, value: Any, source: Any, target: Any) -> Any:
        if not isinstance(value, torch.Tensor) or source is None or target is None or source == target:
            return value
        if isinstance(source, (Shard, Partial)) or isinstance(target, Shard):  # all-gather, all-reduce, chunk, ...
            new = value.clone()
            self.recorder.mark(new, isinstance(target, Shard))
            return new
        return value  # Replicate -> Replicate/Partial: the rank's tensor as it is

    def output(self, output: Any, split: bool) -> None:
        """The flag of what the module's own computation produced."""
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                self.recorder.mark(tensor, split)


def hook_style(module: nn.Module, style: ParallelStyle, redistribute: Redistribution) -> bool:
    """Hooks that trace `style` on `module`; False for a style the trace does not know."""

    def first_input(source: Any, target: Any) -> Callable:
        def hook(mod, args):
            return (redistribute(args[0], source, target), *args[1:]) if args else args

        return hook

    def output(split: bool, source: Any, target: Any) -> Callable:
        def hook(mod, args, out):
            redistribute.output(out, split)
            return tree_map(lambda t: redistribute(t, source, target), out)

        return hook

    if isinstance(style, ColwiseParallel):
        module.register_forward_pre_hook(first_input(style.input_layouts[0], Replicate()))
        module.register_forward_hook(output(True, Shard(-1), style.output_layouts[0]))
    elif isinstance(style, RowwiseParallel):
        wanted = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        module.register_forward_pre_hook(first_input(style.input_layouts[0], wanted))
        module.register_forward_hook(output(False, Partial(), style.output_layouts[0]))
    elif isinstance(style, SequenceParallel):
        pass  # it computes on the sequence shard it is given, whose flag the tensor carries already
    elif isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)):
        prepare_in = getattr(style, "prepare_module_input", style)
        prepare_out = getattr(style, "prepare_module_output", style)
        if isinstance(prepare_in, PrepareModuleInput):
            layouts = list(zip(prepare_in.input_layouts or (), prepare_in.desired_input_layouts or ()))
            kwarg_layouts = prepare_in.input_kwarg_layouts
            desired_kwargs = prepare_in.desired_input_kwarg_layouts

            def prepare(mod, args, kwargs):
                args = tuple(redistribute(a, *layouts[i]) if i < len(layouts) else a for i, a in enumerate(args))
                kwargs = {k: redistribute(v, kwarg_layouts.get(k), desired_kwargs.get(k)) for k, v in kwargs.items()}
                return args, kwargs

            module.register_forward_pre_hook(prepare, with_kwargs=True)
        if isinstance(prepare_out, PrepareModuleOutput):
            pairs = list(zip(prepare_out.output_layouts, prepare_out.desired_output_layouts))

            def prepare_output(mod, args, out):
                if isinstance(out, torch.Tensor):
                    return redistribute(out, *pairs[0])
                if isinstance(out, tuple):
                    return tuple(redistribute(o, *pairs[i]) if i < len(pairs) else o for i, o in enumerate(out))
                return out

            module.register_forward_hook(prepare_output)
    else:
        return False
    return True
