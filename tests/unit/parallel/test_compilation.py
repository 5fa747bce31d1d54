"""The strategies' `compile` argument validated in process (`lightning_dpar.parallel.compilation`). Compiled training
through real Trainers on 2 gloo ranks is in `tests/launched/test_compile.py` (cases in `tests/workers/compile.py`)."""

from __future__ import annotations

import pytest
import torch

from lightning_dpar import FullyShardStrategy, ReplicateStrategy
from lightning_dpar.parallel.compilation import compile_options, compiled_autograd_compiler


def test_compile_options_of_each_kind_of_argument():
    assert compile_options(None) is None and compile_options(False) is None
    assert compile_options(True) == {}
    given = {"backend": "eager", "dynamic": False}
    assert compile_options(given) == given and compile_options(given) is not given  # a copy
    with pytest.raises(ValueError, match=r"unknown torch.compile options \['full_graph', 'modes'\]. Valid options: \["):
        compile_options({"modes": "x", "full_graph": True, "mode": "default"})
    with pytest.raises(TypeError, match=r"`compile=\['mode'\]` is invalid"):
        compile_options(["mode"])


def _breaks_the_graph(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x + 1


def test_the_backward_compiler_compiles_each_graph_whole_with_the_strategys_options():
    compiler = compiled_autograd_compiler({"backend": "eager", "fullgraph": False})
    linear = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiler(linear)(x), linear(x))

    def breaking() -> torch.fx.GraphModule:  # a new one each time: dynamo caches what it compiled per graph module
        graph = torch.fx.Graph()
        graph.output(graph.call_function(_breaks_the_graph, (graph.placeholder("x"),)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    with pytest.raises(torch._dynamo.exc.Unsupported):  # the backward graph is one graph: `fullgraph` wins
        compiler(breaking())(x)
    torch.testing.assert_close(torch.compile(breaking(), backend="eager")(x), x + 1)  # without it, a break is allowed


def test_compile_argument_validation():
    assert FullyShardStrategy(compile=True)._compile_options == {}
    assert FullyShardStrategy(compile={"mode": "max-autotune", "fullgraph": True})._compile_options == {
        "mode": "max-autotune",
        "fullgraph": True,
    }
    assert FullyShardStrategy()._compile_options is None
    with pytest.raises(ValueError, match=r"unknown torch.compile options \['modee'\]"):
        FullyShardStrategy(compile={"modee": "default"})
    with pytest.raises(TypeError, match="use False, True, or a dict"):
        FullyShardStrategy(compile="yes")
    with pytest.raises(ValueError, match="needs `compile=True`"):
        ReplicateStrategy(compiled_autograd=True)


def test_only_modules_that_run_eagerly_wait_for_their_collective():
    """`wait_before_compiled_units` hooks the modules whose output may reach a compiled unit's input as an
    `AsyncCollectiveTensor`: those that run eagerly, outside the compiled units and enclosing none (a model
    parallelised in its own `configure_model` has no plan saying which are tensor-parallel). Inside a compiled unit the
    style's hooks are traced with it. Its effect on training is tested in `tests/launched/test_compile.py` and
    `tests/launched/test_hf_models.py`."""
    import torch

    from lightning_dpar.parallel.parallelize import wait_before_compiled_units
    from tests.support.models import Net

    net = Net()
    before = {name: len(module._forward_hooks) for name, module in net.named_modules()}
    wait_before_compiled_units(net, ["layers.0", "layers.1"])
    added = {name for name, module in net.named_modules() if len(module._forward_hooks) > before[name]}
    assert added == {"inp", "out"}  # not the root nor `layers`, which enclose compiled units, nor what is inside one
    assert net(torch.randn(2, 5)).shape == (2, 5)  # plain tensors pass through unchanged
