"""The strategies' `compile` argument validated in process (`lightning_dpar.compilation`). Compiled training through
real Trainers on 2 gloo ranks is in `tests/launched/test_compile.py` (cases in `tests/workers/compile.py`)."""

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
