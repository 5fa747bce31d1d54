"""The model's facts, found once before any step plans (`lightning_dpar.parallel.facts`)."""

from __future__ import annotations

from lightning_dpar.activation_checkpointing.step import ActivationCheckpointingPlan
from lightning_dpar.parallel.facts import model_facts
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import PlanOptions
from tests.unit.parallel.test_data_parallel import LightningShaped

BLOCKS = ["model.blocks.0", "model.blocks.1"]


def test_the_facts_several_steps_read_are_found_once():
    options = PlanOptions("FullyShardStrategy", shards=True, activation_checkpointing=True)
    facts = model_facts(LightningShaped(), ParallelDims(2, 1, 2, 1), options)
    assert not facts.adopted and not facts.adopted_sharded
    assert facts.blocks == BLOCKS and facts.shard_units == BLOCKS and facts.roots == ["model"]
    assert facts.tied == [] and facts.experts == []
    assert facts.checkpointing == ActivationCheckpointingPlan(BLOCKS, "full")


def test_under_pipelining_there_are_no_top_level_units():
    options = PlanOptions("FullyShardStrategy", shards=True)
    dims = ParallelDims.resolve(world_size=2, devices_per_node=2, pipeline_parallel_size=2)
    assert model_facts(LightningShaped(), dims, options).roots == []


def test_a_model_that_applied_fully_shard_itself_is_adopted_with_no_facts_for_the_steps_to_add(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = LightningShaped()
    fully_shard(module.model, mesh=init_device_mesh("cpu", (1,)))
    options = PlanOptions("FSDPTensorParallelStrategy", shards=True, adopts_parallelized=True)
    facts = model_facts(module, ParallelDims(1, 1, 1, 1), options)
    assert facts.adopted and facts.adopted_sharded and facts.roots == []  # the wrapper adds no units of its own
    assert facts.experts == [] and facts.checkpointing == ActivationCheckpointingPlan()
