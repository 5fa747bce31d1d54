"""Per-step work the strategies must not add over a hand-written FSDP2 loop (see docs/benchmarks.md, "Where the step
time goes"). In-process, one-rank gloo group: FSDP2's resharding decisions do not depend on the world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_dpar.parallel import parallelize
from lightning_dpar.plan.structure import data_parallel_roots


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Module(nn.Module):
    """LightningModule-shaped: one top-level child (the FSDP root) holding blocks and a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Net()


def _wrap(module: nn.Module, reshard_after_forward: bool | int) -> None:
    mesh = init_device_mesh("cpu", (1,))
    units = ["model.blocks.0", "model.blocks.1"]
    policy = lambda root: MixedPrecisionPolicy()  # noqa: E731
    parallelize.apply_fully_shard(module, mesh, units, policy, data_parallel_roots(module), reshard_after_forward)


def test_root_keeps_its_parameters_from_forward_to_backward(one_rank_group):
    """`reshard_after_forward=True` reshards the blocks, not the root: its parameters are needed again at once in
    backward, so resharding them would cost one more all-gather every step (as the plain loop does not)."""
    module = _Module()
    _wrap(module, reshard_after_forward=True)
    loss = module.model(torch.randn(3, 4)).sum()
    assert isinstance(module.model.blocks[0].weight, DTensor)  # a block: resharded after its forward
    assert not isinstance(module.model.head.weight, DTensor)  # the root's own head: still unsharded
    loss.backward()
    assert isinstance(module.model.head.weight, DTensor)  # resharded after backward, as always


def test_explicit_false_still_applies_to_every_unit(one_rank_group):
    module = _Module()
    _wrap(module, reshard_after_forward=False)
    module.model(torch.randn(3, 4)).sum()
    assert not isinstance(module.model.blocks[0].weight, DTensor)
    assert not isinstance(module.model.head.weight, DTensor)


def test_the_steps_are_in_torchtitans_order_and_context_parallel_comes_before_checkpointing():
    assert [step.name for step in parallelize.STEPS] == [
        "pipeline split",
        "tensor parallel",
        "expert parallel",
        "context parallel",
        "activation checkpointing",
        "compile",
        "data parallel",
        "materialise",
    ]
    assert [step.name for step in parallelize.STEPS if step.around_step is not None] == ["context parallel"]


def test_apply_plan_walks_every_step_and_the_data_parallel_step_reads_its_settings_from_the_plan(one_rank_group):
    """A one-rank `apply_plan` with no strategy: the wrapper and `reshard_after_forward` come from the plan."""
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.plan.module_plan import DataParallelSettings

    meshes = ParallelDims(1, 1, 1, 1).build_meshes(torch.device("cpu"), device_type="cpu")
    module = _Module()
    settings = DataParallelSettings("fully_shard", reshard_after_forward=False)
    plan = ModulePlan(
        {}, [], ["model.blocks.0", "model.blocks.1"], data_parallel_roots=["model"], data_parallel=settings
    )
    applied = parallelize.apply_plan(module, plan, meshes)
    assert applied.grad_sync_modules == [module.model]
    assert len(applied.fsdp_modules) == 3 and applied.pipeline is None and applied.context_parallel is None
    module.model(torch.randn(3, 4)).sum()
    assert not isinstance(module.model.blocks[0].weight, DTensor)  # `reshard_after_forward=False`, from the plan
    assert applied.step_contexts == ()  # no step of this plan does anything around a step


def test_around_a_step_the_steps_contexts_are_entered_in_order_and_left_in_reverse():
    from contextlib import contextmanager

    events = []

    def context(name):
        @contextmanager
        def around(training, args):
            events.append(f"enter {name} {training} {args}")
            yield
            events.append(f"exit {name}")

        return around

    applied = parallelize.AppliedPlan(None, nn.Linear(1, 1), [], [], step_contexts=(context("a"), context("b")))
    with applied.around_step(True, (1,)):
        events.append("step")
    assert events == ["enter a True (1,)", "enter b True (1,)", "step", "exit b", "exit a"]
    single = parallelize.AppliedPlan(None, nn.Linear(1, 1), [], [], step_contexts=(context("c"),))
    with single.around_step(False):
        pass
    assert events[-2:] == ["enter c False ()", "exit c"]


def test_apply_plan_replicates_when_the_plan_says_replicate(one_rank_group):
    from lightning_dpar._private_api import is_composable_replicated
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.plan.module_plan import DataParallelSettings

    meshes = ParallelDims(1, 1, 1, 1).build_meshes(torch.device("cpu"), device_type="cpu")
    module = _Module()
    plan = ModulePlan({}, [], [], data_parallel_roots=["model"], data_parallel=DataParallelSettings("replicate"))
    applied = parallelize.apply_plan(module, plan, meshes)
    assert applied.grad_sync_modules == [module.model] and is_composable_replicated(module.model)
    assert applied.fsdp_modules == []
