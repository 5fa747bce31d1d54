"""The in-process sweep (issue 32): hypothesis draws layer shapes (non-square, odd, 1), depths, tensor-parallel
styles, a layout that runs on one real gloo rank, an optimizer (elementwise, Muon, a norm-scaled one written with
plain tensor ops), gradient accumulation and clipping; each draw trains a few steps through a real Trainer and must
end with the parameters of one process on the same global batches (fp32, atol 1e-5).

The draws are derandomized, so CI runs the same ones every time (`SWEEP_EXAMPLES` of them); a draw that ever fails
is kept below as a regular test. The multi-rank fixed set is `tests/launched/test_sweep.py`."""

from __future__ import annotations

import contextlib
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")

import torch.distributed as dist  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy  # noqa: E402
from tests.support.models import loader  # noqa: E402
from tests.support.sweep import (  # noqa: E402
    BLOCK_STYLES,
    CLIPS,
    MAX_DEPTH,
    MAX_DIM,
    OPTIMIZERS,
    Draw,
    SweepData,
    SweepModule,
    differences,
    initial_params,
    reference_train,
)
from tests.workers.common import BATCH, full_params, trainer_for  # noqa: E402

ATOL = 1e-5
#: Draws per run of the fast lane (each a Trainer run of 2-3 steps: 0.1-0.2 s measured at a load of 6 on 2 cores).
SWEEP_EXAMPLES = int(os.environ.get("DPAR_SWEEP_EXAMPLES", "15"))

#: The layouts a one-rank world runs for real (`tp1`: the 2D strategy applying the drawn plan on a TP mesh of 1).
LAYOUTS = {
    "replicate": lambda draw: ReplicateStrategy(),
    "fsdp": lambda draw: FullyShardStrategy(),
    "fsdp_checkpointed": lambda draw: FullyShardStrategy(activation_checkpointing=True),
    "tp1": lambda draw: FSDPTensorParallelStrategy(tensor_parallel_size=1, tp_plan=draw.tp_plan() or None),
}


@st.composite
def draws(draw) -> tuple[str, Draw]:
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    depth = draw(st.integers(1, MAX_DEPTH))
    sizes = st.integers(1, MAX_DIM)
    optimizer = draw(st.sampled_from(OPTIMIZERS))
    tp = layout == "tp1"
    return layout, Draw(
        in_dim=draw(sizes),
        dim=draw(sizes),
        hidden=tuple(draw(sizes) for _ in range(depth)),
        out_dim=draw(sizes),
        bias=optimizer != "muon" and draw(st.booleans()),  # Muon takes 2-D parameters only
        optimizer=optimizer,
        accumulate=draw(st.integers(1, 3)),
        clip=draw(st.sampled_from(CLIPS)),
        steps=draw(st.integers(2, 3)),
        block_styles=tuple(draw(st.sampled_from(BLOCK_STYLES)) for _ in range(depth)) if tp else (),
        split_inp=tp and draw(st.booleans()),
        split_out=tp and draw(st.booleans()),
        seed=draw(st.integers(0, 999)),
    )


@contextlib.contextmanager
def one_gloo_rank():
    """`gloo_world` (tests/conftest.py) per draw: hypothesis runs many draws in one test call."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_draw(layout: str, draw: Draw) -> dict:
    """Train the draw under the layout on one gloo rank; its difference to one process on the same batches."""
    data = SweepData(draw)
    with one_gloo_rank():
        trainer = trainer_for(
            LAYOUTS[layout](draw),
            max_steps=draw.steps,
            devices=1,
            accumulate_grad_batches=draw.accumulate,
            **draw.clip_kwargs(),
        )
        trainer.fit(SweepModule(draw), loader(data, BATCH))
        got = full_params(trainer)
        assert trainer.global_step == draw.steps
    want = reference_train(draw, data, 1, BATCH)
    return differences(got, want, initial_params(draw))


def assert_equals_one_process(layout: str, draw: Draw) -> None:
    result = run_draw(layout, draw)
    assert result["moved"] > 0, (layout, draw.name, result)  # the steps did something
    assert result["max_abs_diff"] < ATOL, (layout, draw.name, result)


@settings(
    max_examples=SWEEP_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same draws in CI and here
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(draws())
def test_a_drawn_run_equals_one_process(layout_and_draw):
    assert_equals_one_process(*layout_and_draw)


#: Draws the sweep once failed, kept as regular tests.
#: This Muon draw (3 accumulated batches, norm clipping) failed twice:
#: - against one process training each global batch whole: 2.0e-4 under every layout, and for Lightning's own
#:   single-device Trainer without this package too. Accumulating sums the gradient in another order than one
#:   concatenated batch, and Muon's bfloat16 Newton-Schulz magnifies the last-bit difference; the reference now
#:   accumulates as Lightning does (`tests.support.sweep.reference_train`): 0.0.
#: - then, under the FSDP layouts only, 2.0e-4 again when it ran after the drawn runs (not alone): a parameter of the
#:   model held a different but equal `DeviceMesh` object, and the gradient clipper grouped gradients by mesh object,
#:   so it summed the squared norms in another order (fixed in `lightning_dpar/optim/clipping.py`; unit test:
#:   `tests/unit/optim/test_clipping.py::test_equal_meshes_held_as_different_objects_group_together`). These tests run
#:   after the drawn ones, as they did then, in the full suite (one process); the fast lane's processes may split
#:   them, and the clipping test holds that fix whatever the order.
MUON_ACCUMULATED = Draw(
    in_dim=14, dim=13, hidden=(14, 5), out_dim=17, bias=False, optimizer="muon", accumulate=3, clip="norm", steps=2,
    seed=268,
)  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_muon_with_accumulation_equals_one_process_accumulating_alike(layout):
    assert_equals_one_process(layout, MUON_ACCUMULATED)
