"""Forward-only passes through the stages (`lightning_dpar.pipeline.forward_relay`), both stages on this one gloo rank:
the last stage's output handed back, a stage's own error raised with its traceback. Stages on different ranks (the
error sent on to every rank as `PipelineStageError`) are in `tests/launched/test_pipeline.py`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_dpar.pipeline.forward_relay import ForwardRelay, PipelineStageError
from lightning_dpar.pipeline.split import PipelineSplit
from lightning_dpar.pipeline.stage import split_into_stages
from tests.support.models import ParityModule, RegressionData

#: `model.inp` and block 0 on stage 0, block 1 and the head on stage 1, both on this rank.
SPLIT = PipelineSplit(stages=(("model.inp", "model.layers.0"), ("model.layers.1", "model.out")), stage_to_rank=(0, 0))


class Evaluated(ParityModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if batch_idx == 13:  # only the stage holding the head runs this far
            raise ValueError(f"bad labels in batch {batch_idx}")
        return {"loss": F.mse_loss(out, y), "out": out}


def _relay(module: ParityModule) -> ForwardRelay:
    pipelined = split_into_stages(module, SPLIT, 0, torch.device("cpu"))
    pipelined.install_unit_hooks()
    pipelined.use_step(module.validation_step)
    return ForwardRelay(pipelined, dist.group.WORLD, torch.device("cpu"))


def test_the_last_stages_output_comes_back_through_finish(gloo_world):
    reference = Evaluated()
    relay = _relay(copy.deepcopy(reference))
    data = RegressionData(n=6)
    with torch.no_grad():
        output = relay.forward_only({"batch": (data.x, data.y), "step_args": (0,)}, finish=lambda out: out)
        want = reference.validation_step((data.x, data.y), 0)
    torch.testing.assert_close(output["out"], want["out"], rtol=0, atol=1e-6)
    assert relay.forward_only({"batch": (data.x, data.y), "step_args": (1,)}, finish=lambda out: "done") == "done"
    assert relay.from_last_stage({"a": 1}) == {"a": 1}


def test_a_stages_own_error_is_raised_as_itself(gloo_world):
    relay = _relay(Evaluated())
    data = RegressionData(n=4)
    with pytest.raises(ValueError, match="bad labels in batch 13") as raised, torch.no_grad():
        relay.forward_only({"batch": (data.x, data.y), "step_args": (13,)})
    assert not isinstance(raised.value, PipelineStageError)  # the rank that failed keeps its error and traceback
