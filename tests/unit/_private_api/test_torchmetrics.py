"""torchmetrics' private state (`lightning_dpar._private_api.torchmetrics`) as a pipeline's other ranks adopt it: a
torchmetrics upgrade that renames it fails here first."""

from __future__ import annotations

import torch
from torchmetrics.aggregation import MeanMetric

from lightning_dpar._private_api.torchmetrics import adopt_metric_state, metric_step_value


def test_a_metric_adopts_another_copys_state_and_last_step_value():
    last_stage = MeanMetric()
    assert float(last_stage(torch.tensor([1.0, 3.0]))) == 2.0  # `forward`: the step value
    assert float(last_stage(torch.tensor([8.0]))) == 8.0
    other = MeanMetric()
    other.update(torch.tensor(100.0))
    assert float(other.compute()) == 100.0  # cached: adopting must drop it
    states = {name: getattr(last_stage, name).clone() for name in last_stage._defaults}
    adopt_metric_state(other, states, update_count=2, step_value=metric_step_value(last_stage))
    assert float(other.compute()) == 4.0  # (1 + 3 + 8) / 3
    assert float(metric_step_value(other)) == 8.0
    assert other.update_count == 2  # the public read of the count `compute` checks
