"""The strategies' `compile` argument: validation of the `torch.compile` options, and the compiler of compiled
autograd. Which modules get compiled is planned in `lightning_dpar.plan.compile`.

Blocks are compiled in place with `nn.Module.compile`, never wrapped in `torch.compile(module)`: the wrapper would
insert an `_orig_mod.` prefix into every parameter name and checkpoint key, so compiled and eager runs could not
resume each other's checkpoints. `nn.Module.compile` compiles the module's `__call__` and keeps its names.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Union

import torch

__all__ = [
    "CompileSpec",
    "compile_options",
    "compiled_autograd_compiler",
]

#: `False` (eager), `True` (default `torch.compile` options) or a dict of `torch.compile` keyword arguments
#: (`backend`, `mode`, `fullgraph`, `dynamic`, `options`), as written in a YAML config.
CompileSpec = Union[bool, Mapping[str, Any]]


def compile_options(spec: CompileSpec | None) -> dict[str, Any] | None:
    """`torch.compile` keyword arguments for a `compile` argument; `None` means do not compile."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return {}
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"`compile={spec!r}` is invalid: use False, True, or a dict of torch.compile options such as"
            " {'mode': 'max-autotune', 'fullgraph': True}."
        )
    valid = sorted(name for name in inspect.signature(torch.compile).parameters if name != "model")
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ValueError(f"`compile` has unknown torch.compile options {unknown}. Valid options: {valid}.")
    return dict(spec)


def compiled_autograd_compiler(options: Mapping[str, Any]) -> Any:
    """The compiler compiled autograd hands each captured backward graph to: `torch.compile` with the strategy's
    options (one full graph per backward, so Inductor can bucket the gradient all-reduces)."""

    def compile_backward_graph(graph_module: torch.fx.GraphModule) -> Any:
        return torch.compile(graph_module, **{**options, "fullgraph": True})

    return compile_backward_graph
