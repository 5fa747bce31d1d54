"""The pipeline split, schedules, settings and boundary values as pure logic, in one process (no process group):
what `lightning_dpar.pipeline` decides before any collective, and the messages it gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.pipeline.config import PipelineConfig
from lightning_dpar.pipeline.log_relay import LogRecorder
from lightning_dpar.pipeline.schedule import SCHEDULES, schedule_spec
from lightning_dpar.pipeline.split import pipeline_units, resolve_split, stage_ranks
from lightning_dpar.pipeline.values import describe, fabricate, rebuild, tensors
from lightning_dpar.plan import ModulePlan, local_plan, repeated_blocks
from tests.support.models import Net, ParityModule


class LitGPTLike(nn.Module):
    """LitGPT's layout: `transformer = ModuleDict(wte, h=ModuleList, ln_f)` and `lm_head` after it."""

    def __init__(self, layers: int = 5) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(10, 4),
                "h": nn.ModuleList(nn.Linear(4, 4) for _ in range(layers)),
                "ln_f": nn.LayerNorm(4),
            }
        )
        self.rope = nn.Identity()  # no parameters: runs on every stage, never a unit
        self.lm_head = nn.Linear(4, 10)


def split(module, stages=2, spec="auto", per_rank=1, placement="loop"):
    return resolve_split(module, repeated_blocks(module), spec, stages // per_rank, per_rank, placement)


def test_units_are_blocks_and_the_modules_with_parameters_around_them_in_registration_order():
    module = LitGPTLike()
    units = pipeline_units(module, repeated_blocks(module))
    assert units == ["transformer.wte", *(f"transformer.h.{i}" for i in range(5)), "transformer.ln_f", "lm_head"]


def test_a_model_registering_its_head_first_gives_the_order_its_forward_calls():
    module = LitGPTLike(layers=4)
    module.lm_head = module._modules.pop("lm_head")  # re-registered last: move it first, as LitGPT registers it
    module._modules = {"lm_head": module.lm_head, **module._modules}
    assert split(module).stages[0][0] == "lm_head"  # registration order: wrong for a head
    ordered = resolve_split(module, repeated_blocks(module), "auto", 2, 1, "loop", ["transformer", "lm_head"])
    assert ordered.stages[0][0] == "transformer.wte" and ordered.stages[-1][-2:] == ("transformer.ln_f", "lm_head")
    with pytest.raises(ValueError, match=r"`pipeline_call_order=\['transformer'\]` leaves out \['lm_head'\]"):
        resolve_split(module, repeated_blocks(module), "auto", 2, 1, "loop", ["transformer"])
    with pytest.raises(
        ValueError, match=r"names \['head'\], which are not modules of tests.unit.pipeline.test_split.LitGPTLike"
    ):
        resolve_split(module, repeated_blocks(module), "auto", 2, 1, "loop", ["transformer", "head"])


def test_auto_split_spreads_blocks_evenly_with_embedding_first_and_head_last():
    stages = split(LitGPTLike(layers=4), stages=2).stages
    assert stages == (
        ("transformer.wte", "transformer.h.0", "transformer.h.1"),
        ("transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"),
    )


def test_uneven_auto_split_gives_the_remainder_to_the_middle_stages():
    # 6 blocks over 4 stages: the first and last also hold the embedding and the head, so they get one block.
    stages = split(LitGPTLike(layers=6), stages=4).stages
    blocks_per_stage = [sum(".h." in unit for unit in stage) for stage in stages]
    assert blocks_per_stage == [1, 2, 2, 1]
    # 3 blocks over 2 stages: a tie, the first stage takes the extra block.
    assert [len(stage) for stage in split(Net(depth=3), stages=2).stages] == [3, 2]


def test_explicit_split_points_start_stages():
    result = split(Net(depth=4), stages=3, spec=["layers.1", "out"])
    assert result.stages == (("inp", "layers.0"), ("layers.1", "layers.2", "layers.3"), ("out",))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["layers.9"], "'layers.9' names no module"),
        (["layers.0.fc1"], "'layers.0.fc1' is a module but not a unit"),
        (["layers.1", "layers.0"], "leave stage 1 empty"),
        (["layers.1", "layers.1"], "leave stage 1 empty"),
        (["layers.1"], "names 1 split points, but 3 stages need 2"),
    ],
)
def test_bad_split_points_are_named(spec, message):
    with pytest.raises(ValueError) as error:
        split(Net(depth=4), stages=3, spec=spec)
    assert message in str(error.value)


def test_more_stages_than_blocks_is_an_error_naming_both():
    message = r"4 pipeline stages need at least 4 blocks, but tests.support.models.Net has 2"
    with pytest.raises(ValueError, match=message):
        split(Net(depth=2), stages=4)


def test_a_model_without_repeated_blocks_cannot_be_split():
    with pytest.raises(ValueError, match=r"no `nn\.ModuleList`"):
        resolve_split(nn.Sequential(nn.Linear(2, 2)), [], "auto", 2, 1, "loop")


def test_parameters_shared_across_stages_are_refused():
    module = LitGPTLike(layers=2)
    module.lm_head.weight = module.transformer.wte.weight  # tied input and output embeddings
    with pytest.raises(ValueError, match=r"'transformer.wte.weight' \(pipeline stage 0\) is the same tensor as"):
        split(module, stages=2)


def test_a_block_shared_by_the_layers_of_one_stage_is_refused():
    module = ParityModule(depth=4)
    module.model.layers[1].fc1 = module.model.layers[0].fc1  # cross-layer sharing, both layers on stage 0
    with pytest.raises(ValueError, match=r"units 'model.layers.0' and 'model.layers.1' of pipeline stage 0 share it"):
        split(module, stages=2)


def test_parameters_on_a_module_holding_blocks_belong_to_no_stage():
    module = ParityModule()
    module.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"holds parameters of its own \(\['scale'\]\)"):
        split(module, stages=2)


def test_loop_and_v_placements():
    assert stage_ranks(2, 2, "loop") == (0, 1, 0, 1)
    assert stage_ranks(4, 1, "loop") == (0, 1, 2, 3)
    assert stage_ranks(2, 2, "v") == (0, 1, 1, 0)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_ranks(2, 3, "v")
    result = split(Net(depth=4), stages=4, per_rank=2, placement="v")
    assert result.stages_of_rank(0) == [0, 3] and result.units_of_rank(1) == ["layers.1", "layers.2"]


def test_schedules_by_name_and_their_rules():
    assert {spec.name for spec in SCHEDULES.values()} >= {"GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"}
    assert schedule_spec("gpipe").name == "GPipe"  # case-insensitive
    with pytest.raises(ValueError, match=r"`pipeline_schedule='2F2B'` is not a pipeline schedule. Choose one of"):
        schedule_spec("2F2B")
    with pytest.raises(ValueError, match=r"needs at least as many microbatches as stages: got .*=2.* for 4 stages"):
        schedule_spec("1F1B").check(2, 1, 4)
    schedule_spec("GPipe").check(1, 1, 4)  # any number
    with pytest.raises(ValueError, match="runs one stage per rank"):
        schedule_spec("GPipe").check(4, 2, 2)
    with pytest.raises(ValueError, match=r"not a multiple of its 2 rounds"):
        schedule_spec("Interleaved1F1B").check(5, 2, 2)
    with pytest.raises(ValueError, match="exactly 2 stages per rank in a V"):
        schedule_spec("ZBVZeroBubble").check(8, 1, 2)


def test_settings_are_checked_when_the_strategy_is_built():
    assert PipelineConfig.of("1F1B", None, 1, None).num_microbatches(4) == 4  # one per stage by default
    assert PipelineConfig.of("ZBVZeroBubble", None, 2, "auto").num_microbatches(2) == 4
    with pytest.raises(ValueError, match=r"`pipeline_microbatches=0` is invalid"):
        PipelineConfig.of("GPipe", 0, 1, "auto")
    with pytest.raises(ValueError, match=r"`pipeline_split='even'` is invalid"):
        PipelineConfig.of("GPipe", None, 1, "even")
    with pytest.raises(ValueError, match=r"`pipeline_split=\[3\]` is invalid"):
        PipelineConfig.of("GPipe", None, 1, [3])


def test_mesh_sizes_with_a_pipeline_dim():
    dims = ParallelDims.resolve(world_size=8, devices_per_node=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (dims.pipeline, dims.replicate, dims.shard, dims.tensor_parallel, dims.data_parallel) == (2, 1, 2, 2, 2)
    assert dims.describe() == "world=8 = pipeline 2 x replicate 1 x shard 2 x tensor_parallel 2"
    with pytest.raises(ValueError, match=r"`pipeline_parallel_size=3` does not divide the world size 8"):
        ParallelDims.resolve(world_size=8, devices_per_node=8, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"does not divide the ranks per stage 4 \(world size 8 / pipeline"):
        ParallelDims.resolve(world_size=8, devices_per_node=8, tensor_parallel_size=3, pipeline_parallel_size=2)


def test_each_rank_plans_only_its_own_stages_modules():
    module = ParityModule(depth=4)
    whole = ModulePlan(
        tensor_parallel={"model.layers.0.fc1": object(), "model.layers.3.fc1": object()},
        activation_checkpointing=["model.layers.0", "model.layers.3"],
        shard_units=["model.layers.0", "model.layers.3"],
        compile_units=["model.layers.0", "model.layers.3"],
    )
    pipeline = split(module, stages=2)
    first, second = local_plan(whole, pipeline, 0), local_plan(whole, pipeline, 1)
    assert list(first.tensor_parallel) == ["model.layers.0.fc1"] and list(second.tensor_parallel) == [
        "model.layers.3.fc1"
    ]
    assert first.activation_checkpointing == first.compile_units == ["model.layers.0"]
    assert first.shard_units == ["model.inp", "model.layers.0", "model.layers.1"]  # every unit of the stage
    assert second.shard_units == ["model.layers.2", "model.layers.3", "model.out"]


def test_boundary_values_round_trip_and_stand_ins_have_their_shapes():
    value = (torch.ones(2, 3), None, [torch.zeros(4, dtype=torch.bfloat16), 7])
    spec = describe(value, "unit 'x'")
    rebuilt = rebuild(spec, iter(list(tensors(value))))
    assert rebuilt[1] is None and rebuilt[2][1] == 7 and torch.equal(rebuilt[0], value[0])
    stand_in = fabricate(spec, torch.device("cpu"))
    assert stand_in[0].shape == (2, 3) and stand_in[2][0].dtype == torch.bfloat16 and not stand_in[0].any()
    with pytest.raises(TypeError, match=r"unit 'x' returned a dict; a module at a pipeline stage boundary"):
        describe({"hidden": torch.ones(1)}, "unit 'x'")


def test_logged_values_are_averaged_over_microbatches():
    recorder = LogRecorder()
    recorder.log("loss", torch.tensor(1.0), sync_dist=True)
    recorder.log("acc", 0.5)
    recorder.log("loss", torch.tensor(3.0), sync_dist=True)
    averaged = {name: (value.item(), options) for name, value, options in recorder.reduced()}
    assert averaged == {"loss": (2.0, {"sync_dist": True}), "acc": (0.5, {})}
