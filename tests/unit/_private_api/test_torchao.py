"""torchao's private names (`lightning_dpar._private_api.torchao`): a torchao upgrade that moves one fails here
first."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_dpar._private_api.torchao import float8_linear_class

torchao_float8 = pytest.importorskip("torchao.float8")


def test_float8_linear_is_the_module_the_conversion_swaps_in():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    torchao_float8.convert_to_float8_training(model)
    cls = float8_linear_class()
    assert all(type(layer) is cls for layer in model)
    assert issubclass(cls, nn.Linear)
