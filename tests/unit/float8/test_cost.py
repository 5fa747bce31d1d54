"""float8's pricing for the layout search: the recipes and devices it prices, the layouts it leaves out, and the
converted matmuls run at the device's float8 rate."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_dpar.float8.cost import check_recipe, compute_seconds, converted_flops_per_token, layout_reason
from lightning_dpar.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Device:
    name: str
    matmul_flops: float
    float8_matmul_flops: float | None


FAST = Device("fast", 1e12, 2e12)
OLD = Device("old", 1e12, None)


def test_a_recipe_is_refused_unless_torchaos_and_on_a_device_with_float8_matmuls():
    check_recipe(None, OLD, {})
    check_recipe("rowwise", FAST, {})
    with pytest.raises(ValueError, match=r"`float8='fp4'` is not a float8 recipe: give one of \['tensorwise'"):
        check_recipe("fp4", FAST, {})
    with pytest.raises(ValueError, match=r"profile 'old', whose device has no float8 matmuls.*\(\['fast'\]\)"):
        check_recipe("rowwise", OLD, {"fast": FAST, "old": OLD})


def test_the_layouts_the_float8_step_refuses_are_left_out_with_its_reason():
    def dims(tp: int = 1, pp: int = 1) -> ParallelDims:
        return ParallelDims(world_size=4 * pp, replicate=1, shard=4 // tp, tensor_parallel=tp, pipeline=pp)

    assert layout_reason(None, dims(tp=2, pp=2)) is None
    assert layout_reason("rowwise", dims(tp=2)) is None
    assert layout_reason("tensorwise", dims()) is None
    assert layout_reason("tensorwise", dims(tp=2)).startswith("float8 with `tensor_parallel_size=2`: the tensorwise")
    assert layout_reason("rowwise", dims(pp=2)).startswith("float8 with `pipeline_parallel_size=2` is not supported")


def test_the_converted_matmuls_run_at_the_float8_rate_and_the_rest_at_the_plain_rate():
    assert converted_flops_per_token(1000, 1.5) == 6 * 1000 * 1.5
    assert compute_seconds(None, 3e12, 1e12, FAST) == 3.0
    assert compute_seconds("rowwise", 3e12, 1e12, FAST) == 2.0 + 0.5
