"""The strategies' `compile` argument validated in process (`lightning_dpar.parallel.compilation`). Compiled training
through real Trainers on 2 gloo ranks is in `tests/launched/test_compile.py` (cases in `tests/workers/compile.py`)."""

from __future__ import annotations

import pytest

from lightning_dpar import FullyShardStrategy, ReplicateStrategy


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
