"""torchmetrics' private names the package relies on: a `Metric`'s update count, cached result and last forward
value, which a pipeline's other ranks must adopt from the last stage. Checked on torchmetrics 1.9.0; each says why it
is needed."""

from __future__ import annotations

from typing import Any

__all__ = ["adopt_metric_state", "metric_step_value"]


def adopt_metric_state(metric: Any, states: dict[str, Any], update_count: int, step_value: Any = None) -> None:
    """Give a torchmetrics `Metric` the states of its copy on another rank (a pipeline's last stage, which updated
    it), and the value its last `forward` returned there (what Lightning logs for `on_step`). torchmetrics keeps the
    number of updates (`_update_count`, which `compute` checks), the cached result (`_computed`) and the last
    forward's value (`_forward_cache`) privately and has no public way to set them."""
    for name, value in states.items():
        setattr(metric, name, value)
    metric._update_count = update_count
    metric._computed = None
    metric._forward_cache = step_value


def metric_step_value(metric: Any) -> Any:
    """The value a torchmetrics `Metric`'s last `forward` returned, which Lightning logs for `on_step` (private
    `_forward_cache`; no public accessor)."""
    return metric._forward_cache
