"""The sweep's fixed multi-rank set (issue 32): draws made once from a seed (`tests.support.sweep.multi_rank_draws`:
layer shapes, tensor-parallel styles, optimizer, accumulation, clipping), each trained through a real Trainer under
FSDP, DDP (`ReplicateStrategy`), TP 2, DDP x TP 2 and PP 2 on 2 gloo ranks, and under FSDP, HSDP 2 x 2, TP 2 x FSDP 2,
DDP, PP 2 x FSDP 2 and PP 2 x TP 2 on 4, in one launch per world size (cases in `tests/workers/sweep.py`). Each draw
ends with the parameters of one process on the same global batches (fp32, atol 1e-5), or, where tensor parallelism
cannot split a drawn size, is refused on every rank before the first step with an error naming the size and module.

Muon is drawn only where the layout sums gradients as Lightning's DDP does, bit for bit (FSDP and DDP on 2 ranks),
and compared with Lightning's DDP: its bfloat16 Newton-Schulz turns a last-bit gradient difference into a visible
one, and with accumulated batches even a hand-written DDP loop ends 3.1e-4 from one process (`run_draw`). Muon on
every layout and matrix shape is checked against torch's Muon on the same gradients in
`tests/launched/test_optimizers.py`. The in-process draws are `tests/unit/test_sweep.py`.
"""

from __future__ import annotations

import pytest

from tests.conftest import LaunchResults, run_workers
from tests.support.sweep import TP_LAYOUTS, multi_rank_draws
from tests.workers.sweep import PER_LAYOUT, SEED, case_name

ATOL = 1e-5

DRAWS = {world: multi_rank_draws(world, PER_LAYOUT[world], SEED) for world in PER_LAYOUT}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, LaunchResults]:
    return {}


def _results(launches, tmp_path_factory, world: int) -> LaunchResults:
    if world not in launches:
        launches[world] = run_workers(world, "sweep", tmp_path_factory.mktemp(f"sweep{world}"))
    return launches[world]


def _expected_refusal(draw) -> list[tuple[str, str, int]]:
    return [split for split in draw.tp_splits() if split[2] % 2]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "layout", "draw"),
    [(world, layout, draw) for world, draws in DRAWS.items() for layout, draw in draws],
    ids=lambda value: value.name if hasattr(value, "name") else str(value),
)
def test_a_seeded_draw_equals_one_process_or_is_refused_by_name(launches, tmp_path_factory, world, layout, draw):
    result = _results(launches, tmp_path_factory, world)[case_name(layout, draw)]
    undividable = _expected_refusal(draw) if layout in TP_LAYOUTS else []
    if undividable:
        errors = result["refused"]
        assert len({e["message"] for e in errors}) == 1, errors  # every rank, the same message, nobody hung
        error = errors[0]
        assert error["type"] == "TensorParallelSizeError" and error["global_step"] == 0, error
        message = error["message"]
        assert "`tensor_parallel_size=2`" in message, message
        assert any(f"{attribute}={size} of module {module!r}" in message for module, attribute, size in undividable)
        return
    assert "refused" not in result, result
    assert result["global_step"] == draw.steps
    assert result["moved"] > 0, result
    assert result["max_abs_diff"] < ATOL, result
